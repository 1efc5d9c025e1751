"""Experiment patch: the grouped decode kernel without its group-32 instantiation of run()."""
import sys
p = sys.argv[1] + "/cutlass_ext/mixgemm/grouped_decode_kernel.hpp"
s = open(p).read()
old = """      if (gp.base.group_shift == 5) {
        decode::run<Cfg, A, true, true>(tile, smem, nullptr, x_rows, y_rows);
      } else {
        decode::run<Cfg, A, false, true>(tile, smem, nullptr, x_rows, y_rows);
      }"""
assert old in s
s = s.replace(old, """      decode::run<Cfg, A, false, true>(tile, smem, nullptr, x_rows, y_rows);""")
open(p, "w").write(s)
print("patched", p)
