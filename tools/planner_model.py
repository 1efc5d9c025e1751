"""The decode kernels' split-K planner (cutlass_ext/mixgemm/decode_plan.hpp ``Host::plan``) in
Python, and the fit of its cost model to the committed split sweeps (docs/dispatch.md).

* `previous_plan` is the planner before the cost model (a max of a warp's chain, the bytes and the
  issue, in units of a warp's atom step); its picks agree with the C++ helper's on every swept point
  whose pick was among the swept factors. The split tables' entries marked ``"planner"`` hold its
  picks (tools/freeze_tuning_tables.py).
* `cost` is the model that replaced it: waves x (start + atom x the atoms on a warp's chain) + the
  split reduction + a cost per CTA on the busiest SM; its constants come from `fit` (least squares
  on log time over every swept factor, Nelder-Mead, with waves of the busiest SM's resident CTAs),
  and `regret` scores a model by the measured time of its pick over the best measured factor (ties
  go to fewer splits, as in the C++). The committed model counts waves of the CTAs the GPU holds at
  once by cluster size (`CLUSTER_CTAS`) with the same constants.

    python tools/planner_model.py check   # the committed constants' regret on every sweep (CPU, ~1 s)
    python tools/planner_model.py fit     # refit on the H100 sweeps, leave-one-shape-out (needs scipy)
"""
from __future__ import annotations

import collections
import json
import math
import os
import sys

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "results")
SMS = 132
FACTORS = (1, 2, 3, 4, 6, 8, 12, 16)     # the sweep's factors: the new planner's candidates
#: the committed constants (decode_plan.hpp): start, atom, tile, reduce per 8 tokens, per split,
#: bytes (TB/s, drops out of the choice), per CTA on the busiest SM; us
COMMITTED = (1.05, 0.147, 0.5, 0.95, 0.62, 3490.0, 0.35)


class Cfg:
    """The decode kernel config of the heuristic for M (mixgemm.jit.catalog.TILE_CONFIGS dec8 / dec16 / dec32)
    and code."""

    def __init__(self, m: int, weight: str):
        self.bits = {"u4": 4, "u2": 2, "s8": 8}[weight]
        self.signed = weight == "s8"
        if m <= 8:
            self.ntiles, self.xst, self.ks = 1, 0, (8 if self.bits == 8 else 1)
        elif m <= 16:
            self.ntiles, self.xst, self.ks = 2, 4, 1
        else:   # dec32: x resident
            self.ntiles, self.xst, self.ks = 4, 0, 1
        self.tokens, self.warps, self.stages = 8 * self.ntiles, 8, 4
        self.stage = max(1024, 128 * self.bits)
        self.stripes = self.warps // self.ks
        self.rows = 16 * self.stripes
        self.atom = 128 * self.bits
        self.xring = self.xst > 0
        self.xchunk = max(self.stage // self.atom, 2) * self.tokens * 128
        self.fold = self.bits != 8 and not self.xring
        self.ringreg = max(self.warps * self.stages * self.stage, 32 * self.warps * self.ntiles * 16)
        self.barriers = self.warps * self.stages + 2 + (2 * self.xst if self.xring else 0)
        self.haszero = not self.signed

    def carve(self, xrows, aps, groups, segments):   # Config::carve(...).total
        grp_row = self.rows * 2
        align = 1 if grp_row >= 128 else 128 // grp_row
        copies = (groups + 255) // 256
        box = 0 if copies == 0 else ((groups + copies - 1) // copies + align - 1) // align * align
        gb = (copies * box * self.rows * 2 + 127) // 128 * 128
        if self.xring:
            x = (self.ringreg + 1023) // 1024 * 1024
            sc = x + self.xst * self.xchunk
        else:
            sc = (self.ringreg + xrows * (aps * 128 + 16) + 127) // 128 * 128
        xs = (sc + gb + (gb if self.haszero else 0) + 15) // 16 * 16
        return xs + (self.ks * segments * self.tokens * 4 if self.fold else 0) + 8 * self.barriers + 16


def _groups_in(a0, a1, gs):
    return 0 if a0 >= a1 else (((a1 * 64 - 1) >> gs) + 1) - ((a0 * 64) >> gs)


def _max_groups(ka, aps, gs):
    return max(_groups_in(k0, min(k0 + aps, ka), gs) for k0 in range(0, ka, aps))


def _max_segments(c, ka, aps, gs):
    w = 0
    for k0 in range(0, ka, aps):
        na = aps if k0 + aps < ka else ka - k0
        per = (na + c.ks - 1) // c.ks
        for s in range(c.ks):
            a0 = min(s * per, na)
            w = max(w, _groups_in(k0 + a0, k0 + min(a0 + per, na), gs))
    return w


def candidates(c, m, n, k, factors, g=128):
    ka, gs = k // 64, int(math.log2(g))
    rb = (n // 16 + c.stripes - 1) // c.stripes
    out = []
    for s in factors:
        if s > ka:
            break
        aps = (ka + s - 1) // s
        se = (ka + aps - 1) // aps
        groups = _max_groups(ka, aps, gs)
        seg = 0 if not c.fold else (groups if c.ks == 1 else _max_segments(c, ka, aps, gs))
        smem = c.carve(min(m, c.tokens), aps, groups, seg)
        if smem <= 227 * 1024:
            out.append(dict(s=s, se=se, aps=aps, smem=smem, rb=rb, ka=ka))
    return out


def previous_plan(m, w, n, k):
    """The split factor of the planner before the cost model."""
    c = Cfg(m, w)
    tokens = min(m, c.tokens)
    issue_milli = 4 * (60 + 10 * c.bits) * (c.ntiles + 3) // 4
    best = None
    for cd in candidates(c, m, n, k, range(1, 65)):
        if cd["se"] != cd["s"]:
            continue
        total = (n // 16) * cd["ka"] * c.atom
        res = min((228 * 1024) // (cd["smem"] + 1024), 3)
        apw = (cd["aps"] + c.ks - 1) // c.ks
        se = cd["se"]
        red = (2 if c.ks > 1 else 0) + (0 if se == 1 else tokens if se <= 8 else tokens + 16)
        per_sm = (cd["rb"] * se + SMS - 1) // SMS
        chain = (per_sm + res - 1) // res * (8 * apw + 16 + red)
        cost = max(chain, (total // SMS) // 1100, per_sm * c.warps * apw * issue_milli // 1000)
        if best is None or cost < best[0]:
            best = (cost, se)
    return best[1]


#: CTAs an H100 runs at once by CTAs per SM (1-4) and cluster size (1-8): cuOccupancyMaxActiveClusters
#: x the size, 8-token decode kernel (decode_plan.hpp kClusterCtas; docs/dispatch.md)
CLUSTER_CTAS = ((132, 132, 117, 120, 110, 102, 105, 120), (264, 264, 237, 248, 235, 234, 224, 240),
                (396, 396, 372, 368, 345, 372, 329, 360), (528, 528, 489, 496, 470, 474, 483, 496))


def features(c, m, n, k, cd, clusters=True):
    res = min((228 * 1024) // (cd["smem"] + 1024), 3)
    se = cd["se"]
    ctas = cd["rb"] * se
    per_sm = math.ceil(ctas / SMS)
    at_once = CLUSTER_CTAS[res - 1][se - 1] if se <= 8 else res * SMS
    waves = math.ceil(ctas / at_once) if clusters else math.ceil(per_sm / res)
    return dict(waves=waves, apw=math.ceil(cd["aps"] / c.ks), per_sm=per_sm, se=se,
                tok=min(m, c.tokens), nt=c.ntiles,
                bytes=(n // 16) * cd["ka"] * c.atom + (2 if c.haszero else 1) * (k // 128) * n * 2)


def cost(p, f):
    start, atom, tile, red, split, bw, cta = p
    a = atom * (1 + tile * (f["nt"] - 1))
    reduce = (f["se"] > 1) * (red * f["tok"] / 8 + split * f["se"])
    return f["waves"] * (start + a * f["apw"]) + reduce + f["bytes"] / (bw * 1e3) + cta * f["per_sm"]


def load(*names):
    """{(m, weight, n, k): {splits: us}} from sweep files (16-token points of the x-ring kernel only)."""
    g = collections.defaultdict(dict)
    for name in names:
        for r in json.load(open(os.path.join(RESULTS, name))):
            if r["m"] == 16 and "_x4_" not in r["kernel"]:
                continue
            g[(r["m"], r["weight"], r["n"], r["k"])][r["splits"]] = r["us"]
    return g


def points(g, clusters=True):
    out = []
    for key, v in sorted(g.items()):
        m, w, n, k = key
        c = Cfg(m, w)
        for cd in candidates(c, m, n, k, FACTORS):
            if cd["s"] in v:
                out.append((features(c, m, n, k, cd, clusters), v[cd["s"]], key, cd["s"]))
    return out


def regret(p, pts):
    """{key: (time of the model's pick / best time, pick)}; ties go to fewer splits."""
    by = collections.defaultdict(list)
    for f, us, key, s in pts:
        by[key].append((cost(p, f), s, us))
    return {key: (min(l)[2] / min(u for _, _, u in l), min(l)[1]) for key, l in by.items()}


def fit(pts, p0=COMMITTED):
    from scipy.optimize import minimize

    def loss(p):
        return 1e9 if min(p) < 0 else sum((math.log(cost(p, f) + 3) - math.log(us)) ** 2 for f, us, _, _ in pts)

    best = None
    for t in range(3):
        x0 = np.array(p0) * (np.exp(np.random.default_rng(t).normal(0, 0.4, len(p0))) if t else 1)
        r = minimize(loss, x0, method="Nelder-Mead", options=dict(maxiter=6000, maxfev=6000))
        best = r if best is None or r.fun < best.fun else best
    return best.x


def gmean(v):
    return math.exp(sum(map(math.log, v)) / len(v))


#: the sweeps the constants were fitted to (the 16 preset layers, M = 1 and 16), the 18 layers of other
#: models they were not, and the H200 presets (benchmarks/results/<gpu>/; benchmarks/README.md)
H100 = ("nvidia-h100-80gb-hbm3/sweep-decode-presets.json", "nvidia-h100-80gb-hbm3/sweep-decode-presets-m16.json")
HELD = ("nvidia-h100-80gb-hbm3/sweep-decode-held-out.json",)
H200 = ("nvidia-h200/sweep-decode-presets-m16.json",)


def sweeps():
    """{name: {(m, weight, n, k): {splits: us}}} of the committed sweeps `check` scores."""
    return {"H100 presets": load(*H100), "H100 held-out shapes": load(*HELD), "H200 presets (M=16)": load(*H200)}


def scores(sets=None):
    """{name: dict(points, committed=(geomean, max), previous=(geomean, max))}: the measured time of
    each planner's pick over the best measured factor, on every committed sweep. (The previous
    planner may pick a factor the sweep did not time: then its own pick's time, splits=0, where the
    sweep ran it; the held-out sweep timed its picks as forced factors.)"""
    out = {}
    for name, g in (sets or sweeps()).items():
        new = [r for r, _ in regret(COMMITTED, points(g)).values()]
        old = []
        for key, v in g.items():
            t = v.get(previous_plan(*key), v.get(0) if "held" not in name else None)
            if t is not None:
                old.append(t / min(u for s, u in v.items() if s))
        out[name] = dict(points=len(new), committed=(gmean(new), max(new)), previous=(gmean(old), max(old)))
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    what = argv[0] if argv else "check"
    if what not in ("check", "fit"):
        print(__doc__)
        return 2
    sets = sweeps()
    if what == "fit":
        g = sets["H100 presets"]
        pts = points(g, clusters=False)   # (as the constants were fitted)
        p = fit(pts)
        print("fitted", np.round(p, 3).tolist())
        cv = []
        for shape in sorted({(k[2], k[3]) for k in g}):
            q = fit([x for x in pts if (x[2][2], x[2][3]) != shape])
            cv += [r for r, _ in regret(q, [x for x in pts if (x[2][2], x[2][3]) == shape]).values()]
        print(f"leave-one-shape-out: {gmean(cv):.3f} (max {max(cv):.2f})")
    for name, s in scores(sets).items():
        (ng, nm), (og, om) = s["committed"], s["previous"]
        print(f"{name}: planner {ng:.3f} (max {nm:.2f}), previous planner {og:.3f} (max {om:.2f}), {s['points']} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
