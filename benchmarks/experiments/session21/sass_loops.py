import re, sys, collections
def parse(path):
    ins = []
    for line in open(path):
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    return ins
def loops(ins):
    out = []
    for a, t in ins:
        m = re.search(r"BRA(?:\.\S+)?\s+(?:!?U?P\d,\s*)?`?\(?\.L_x_(\d+)", t)
        m2 = re.search(r"BRA.*?0x([0-9a-f]+)", t)
        if m2:
            tgt = int(m2.group(1), 16)
            if tgt < a:
                out.append((tgt, a))
    return out
for path in sys.argv[1:]:
    ins = parse(path)
    addr = {a: i for i, (a, _) in enumerate(ins)}
    print(path.split('/')[-1], "instructions", len(ins))
    for lo, hi in sorted(set(loops(ins))):
        body = [t for a, t in ins if lo <= a <= hi]
        ops = collections.Counter(t.split()[0].split('.')[0] if not t.startswith('@') else t.split()[1].split('.')[0] for t in body)
        if ops['HMMA'] == 0: continue
        print(f"  loop {lo:#x}-{hi:#x} n={len(body)} HMMA={ops['HMMA']} LDSM={ops['LDSM']} LDS={ops['LDS']} LOP3={ops['LOP3']} PRMT={ops['PRMT']} HFMA2={ops['HFMA2']} BAR/SYNC={ops['SYNCS']+ops['BAR']} align={lo%128}")
