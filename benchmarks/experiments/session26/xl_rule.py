"""Above 512 tokens: "xl" (128x256 stream-K) against "xlp" (128x256 persistent, 2x1 clusters),
the fit of mixgemm.heuristic.xl_evens_waves (benchmarks/NOTES.md 32a).

Reads the one-launch graph timings of session 26 (midm.py, H100) and, for overhead factors f,
the total time of the rule's picks against "xlp" everywhere and the best of the two per point,
and the points where the pick is more than 2% slower than the better kernel.

    python xl_rule.py [DATA_DIR]
"""
import json
import statistics as st
import sys
from pathlib import Path

from mixgemm.heuristic import xl_evens_waves
import mixgemm.heuristic as h

data = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parents[1] / "nvidia-h100-80gb-hbm3")
times: dict = {}
for name in ("s26-xl-xlp-small.json", "s26-xl-xlp-large.json", "s26-m1024-xl.json", "s26-m1024-other.json"):
    for r in json.loads((data / name).read_text())["rows"]:
        if "us" not in r or r["splits"] != 0:
            continue
        impl = r["impl"]
        label = ("xlp" if "t128x256x64_c2_coop_persistent" in impl
                 else "xl" if "t128x256x64_coop_streamk" in impl else None)
        if label:
            times.setdefault((r["n"], r["k"], r["m"]), {}).setdefault(label, []).append(r["us"])
points = {key: {lab: st.median(v) for lab, v in t.items()} for key, t in times.items() if len(t) == 2 and key[2] > 512}
for f in (1.0, 1.05, 1.1, 1.15, 1.2):
    h._XL_STREAMK_OVERHEAD = f
    picked = {key: t["xl" if xl_evens_waves(key[2], key[0], key[1], 132) else "xlp"] for key, t in points.items()}
    worse = [(key, round(picked[key], 1), round(min(t.values()), 1)) for key, t in sorted(points.items())
             if picked[key] > 1.02 * min(t.values())]
    print(f"f={f}: {len(points)} points, xlp everywhere {sum(t['xlp'] for t in points.values()):.0f} us, "
          f"the rule {sum(picked.values()):.0f}, the best {sum(min(t.values()) for t in points.values()):.0f}; "
          f"{len(worse)} picks >2% off: {worse}")
