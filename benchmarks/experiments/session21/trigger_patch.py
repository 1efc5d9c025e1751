"""Experiment patch (NOTES 27d): routed grouped launches let the next launch start right after their grid wait.
usage: trigger_patch.py ROOT (a copy of the tree; ab_trees.sh makes one)
"""
import sys
p = sys.argv[1] + "/cutlass_ext/mixgemm/grouped_decode_kernel.hpp"
s = open(p).read()
old = "  decode::wait_previous_grid();   // the offsets (or the ids) may come from the kernel before this one\n"
assert old in s
s = s.replace(old, old + "  if (is_routed) decode::launch_next_grid();   // (experiment: early trigger)\n")
open(p, "w").write(s)
print("patched", p)
