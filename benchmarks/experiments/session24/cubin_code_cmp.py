"""Session 24: do two cubins hold the same machine code? Compares the code (.text.*), constant
(.nv.constant*), shared-memory (.nv.shared*) and info (.nv.info*) sections of two kernel.cubin
files (sha1 of each section's bytes, from `readelf -S`); the rest of a cubin (symbol and string
tables, notes) may differ between builds of the same code. NOTES 30b used it on kernels built
from two trees into two kernel caches.

usage: cubin_code_cmp.py A/kernel.cubin B/kernel.cubin
"""
import hashlib
import subprocess
import sys

PREFIXES = (".text", ".nv.shared", ".nv.constant", ".nv.info")


def sections(path: str) -> dict:
    out = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True, check=True).stdout
    data = open(path, "rb").read()
    res = {}
    for line in out.splitlines():
        line = line.strip()
        if not line.startswith("["):
            continue
        parts = line.split("]", 1)[1].split()
        if len(parts) < 6:
            continue
        name, typ = parts[0], parts[1]
        if name.startswith(PREFIXES):
            off, size = int(parts[3], 16), int(parts[4], 16)
            blob = b"" if typ == "NOBITS" else data[off:off + size]
            res[name] = (size, hashlib.sha1(blob).hexdigest())
    return res


def main() -> int:
    a, b = sections(sys.argv[1]), sections(sys.argv[2])
    diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    for k in diff:
        print("DIFF", k, a.get(k), b.get(k))
    texts = [k for k in a if k.startswith(".text")]
    print(f"code sections: {len(texts)}, bytes {[a[k][0] for k in texts]}: {'DIFFERENT' if diff else 'IDENTICAL'}")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
