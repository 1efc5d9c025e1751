import csv, sys, collections
for f in sys.argv[1:]:
    rows = list(csv.reader(open(f)))
    hdr = rows[1]; data = rows[2:]
    idx = {h: i for i, h in enumerate(hdr)}
    cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    tot = collections.Counter()
    for r in data:
        for c in cols:
            try: tot[c] += float(r[idx[c]] or 0)
            except ValueError: pass
    s = sum(tot.values())
    print(f.split("ncu-")[1][:30], "samples", int(s), " ".join(f"{c[6:]}={100*v/s:.1f}" for c, v in tot.most_common(9)))
    # top instructions by samples
    samp = idx["Warp Stall Sampling (All Samples)"]
    top = sorted(data, key=lambda r: -float(r[samp] or 0))[:12]
    for r in top:
        st = max(cols, key=lambda c: float(r[idx[c]] or 0))
        print("   ", r[0], r[1][:60].ljust(60), r[samp], st[6:])
