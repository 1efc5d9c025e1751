import struct, sys
def sections(path):
    d = open(path, 'rb').read()
    shoff, = struct.unpack_from('<Q', d, 0x28); shentsize, shnum, shstrndx = struct.unpack_from('<HHH', d, 0x3A)
    hdrs = [struct.unpack_from('<IIQQQQIIQQ', d, shoff + i * shentsize) for i in range(shnum)]
    stro = hdrs[shstrndx][4]
    def name(o): e = d.index(b'\0', stro + o); return d[stro + o:e].decode()
    return {name(h[0]): d[h[4]:h[4] + h[5]] for h in hdrs}
a, b = sections(sys.argv[1]), sections(sys.argv[2])
for k in sorted(a):
    if k.startswith('.text') or k.startswith('.nv.info') or k.startswith('.nv.shared') or k.startswith('.nv.constant0'):
        print(k[:60], len(a[k]), len(b.get(k, b'')), 'SAME' if a[k] == b.get(k) else 'DIFF')
