"""Compare the kernel sections (.text, .nv.info, shared, constant bank 0) of two cubins, byte for byte.
usage: elf_text.py A.cubin B.cubin
"""
import struct, sys
def sections(path):
    d = open(path, 'rb').read()
    shoff, = struct.unpack_from('<Q', d, 0x28); shentsize, shnum, shstrndx = struct.unpack_from('<HHH', d, 0x3A)
    hdrs = [struct.unpack_from('<IIQQQQIIQQ', d, shoff + i * shentsize) for i in range(shnum)]
    stro = hdrs[shstrndx][4]
    def name(o): e = d.index(b'\0', stro + o); return d[stro + o:e].decode()
    return {name(h[0]): d[h[4]:h[4] + h[5]] for h in hdrs}
def main():
    a, b = sections(sys.argv[1]), sections(sys.argv[2])
    for k in sorted(a):
        if k.startswith(('.text', '.nv.info', '.nv.shared', '.nv.constant0')):
            print(k[:60], len(a[k]), len(b.get(k, b'')), 'SAME' if a[k] == b.get(k) else 'DIFF')


if __name__ == "__main__":
    main()
