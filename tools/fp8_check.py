"""Time the e4m3-activation GEMM (``mixgemm.gemm(..., act_format="fp8")``) against cuBLAS bf16
and ``torch._scaled_mm`` e4m3 x e4m3 (GPU), each result checked against float64.

    python tools/fp8_check.py [OUT.json] [--shapes 4096x4096,4096x14336] [--m 256,1024,4096]
        [--weights u4] [--group 128] [--iters 100] [--eager] [--tiles] [--splits 1,2,4,8]
    python tools/fp8_check.py --list             the kernels this tool and tests/ops/test_gpu_fp8.py launch
    python tools/fp8_check.py --build [-j 14]    build them into mixgemm's kernel cache (no GPU needed)

Per layer shape (N x K) and token count M, in one process on the same inputs, medians of
``--iters`` runs with the L2 flushed before each (mixgemm.bench.time_cuda), every run a CUDA graph
replay unless ``--eager``:

* ``cublas``: ``F.linear(x, W)``, W the bf16 dequantized weight (the baseline of the speedups);
* ``scaled_mm``: ``torch._scaled_mm`` of e4m3 x and an e4m3 copy of W with per-row scales on both
  (the W8A8-FP8 GEMM; its quantization of x is not timed);
* ``mixgemm-<wt>``: mixgemm's bf16-activation path (``mixgemm.gemm(x, w)``);
* ``mixgemm-<wt>-fp8``: ``mixgemm.gemm(x, w, act_format="fp8")``: the quantizer and the e4m3 GEMM;
* ``mixgemm-<wt>-fp8-gemm``: the e4m3 GEMM alone on pre-quantized x (``gemm_quantized``), with the
  token tile and split-K factor that :func:`mixgemm.dispatch.heuristic.fp8_launch` picks;
* with ``--tiles``, ``mixgemm-<wt>-fp8-gemm@t<T>s<S>`` for every token tile T
  (:data:`mixgemm.jit.catalog.FP8_TOKEN_TILES`) and split factor S of ``--splits`` (S = 1: the
  persistent kernel; more: the stream-K one), and for
  gate/up-sized layers (N >= 16384) the gated (swiglu) kernel's ``mixgemm-<wt>-fp8-swiglu@t<T>s<S>``:
  what ``fp8_launch`` was fitted to (docs/fp8.md, "Token tiles and split-K").

Each row's ``err`` is ||y - ref|| / ||ref|| against float64 on the exact operands of that
implementation's own inputs (the e4m3 rows against their e4m3-rounded x).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


#: --tiles times the gated (swiglu) kernels too on layers of at least this many rows (gate/up)
_GATED_ROWS = 16384


def _specs(weights, shapes, ms, group):
    """The kernels the timed rows and tests/ops/test_gpu_fp8.py launch."""
    import mixgemm
    from mixgemm.dispatch import heuristic
    from mixgemm.dtypes import ActType, WeightType
    from mixgemm.jit.specs import QuantFp8Spec
    from mixgemm.ops import fp8

    specs = {}
    for act in ActType:
        specs[QuantFp8Spec(act).name] = QuantFp8Spec(act)
    for wt in ("u4", "s4", "u2", "s2"):                                # tests/ops/test_gpu_fp8.py
        specs.update((s.name, s) for s in fp8.fp8_gemm_specs(ActType.BF16, WeightType(wt)))
    for wt in ("u4", "s2"):
        specs.update((s.name, s) for s in fp8.fp8_gemm_specs(ActType.FP16, WeightType(wt)))
    for act in ActType:                                                # the gated (swiglu) test
        for wt in ("u4", "s4", "u2", "s2"):
            specs.update((s.name, s) for s in fp8.fp8_gemm_specs(act, WeightType(wt), "swiglu"))
    for wt in weights:                                                 # the timed rows
        wtype = WeightType(wt)
        for n, k in shapes:
            qw = mixgemm.quantize(torch.zeros(n, k), wtype.bits, group, symmetric=wtype.signed, dtype=torch.bfloat16)
            packed = mixgemm.prepack(qw)
            for m in ms:   # (the e4m3 rows' kernels, every token tile and the gated ones, are listed above)
                s = heuristic.select_spec(m, packed, None, 132)
                specs[s.name] = s
    return [specs[k] for k in sorted(specs)]


def _graphed(fn):
    """``fn`` captured in a CUDA graph (after a warm-up call), as a replay function."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def _rowwise_e4m3(t: torch.Tensor):
    """``t`` [R, C] as e4m3 with one float32 scale per row (amax / 448)."""
    amax = t.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    s = amax / 448.0
    return (t.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", help="JSON file for the rows")
    ap.add_argument("--shapes", default="4096x4096,4096x14336", help="layer shapes NxK (comma list)")
    ap.add_argument("--m", default="256,1024,4096", help="token counts (comma list)")
    ap.add_argument("--weights", default="u4", help="weight types (comma list of u4, s4, u2, s2)")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA graph replays")
    ap.add_argument("--tiles", action="store_true",
                    help="also time the e4m3 GEMM at every token tile and split factor of --splits")
    ap.add_argument("--splits", default="1", help="split-K factors for --tiles (comma list)")
    ap.add_argument("--list", action="store_true", help="print the kernels' names and exit")
    ap.add_argument("--build", action="store_true", help="build the kernels and exit (no GPU needed)")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="parallel nvcc builds for --build")
    a = ap.parse_args(argv)

    from mixgemm import bench

    shapes = bench.parse_shapes(a.shapes)
    ms = bench.parse_int_list(a.m)
    weights = [w for w in a.weights.split(",") if w]
    splits = bench.parse_int_list(a.splits)
    if a.list or a.build:
        specs = _specs(weights, shapes, ms, a.group)
        if a.list:
            print("\n".join(s.name for s in specs))
            return 0
        from mixgemm.jit import build

        build.build_many(specs, jobs=a.jobs, progress=True)
        print(f"{len(specs)} kernels built or cached")
        return 0

    import mixgemm
    from mixgemm.dtypes import WeightType
    from mixgemm.jit.catalog import FP8_TOKEN_TILES
    from mixgemm.ops import fp8

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)):
        print("fp8_check: needs an sm_90 (Hopper) GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    flush = bench.flush_size(torch.cuda.get_device_properties(dev).L2_cache_size)
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for n, k in shapes:
        w = torch.randn(n, k, device=dev, generator=gen) * 0.02
        w8, sw = _rowwise_e4m3(w.to(torch.bfloat16))
        for wt in weights:
            wtype = WeightType(wt)
            qw = mixgemm.quantize(w, wtype.bits, a.group, symmetric=wtype.signed, dtype=torch.bfloat16)
            packed = mixgemm.prepack(qw)
            deq = mixgemm.dequantize_reference(qw)                    # bf16, for cuBLAS and the bf16 path
            g = qw.group_size
            z = 0.0 if qw.zeros is None else qw.zeros.double().repeat_interleave(g, dim=1)
            w64 = (qw.qweight.double() - z) * qw.scales.double().repeat_interleave(g, dim=1)
            for m in ms:
                x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
                xq, xs = fp8.quantize_fp8(x)
                x8, sx = _rowwise_e4m3(x)
                ref_exact = x.double() @ deq.double().t()
                ref_fp8 = fp8.dequantize_fp8(xq, xs, torch.float64) @ w64.t()
                ref_scaled = (x8.double() * sx.double()) @ (w8.double() * sw.double()).t()
                impls = {
                    "cublas": (lambda: torch.nn.functional.linear(x, deq), ref_exact),
                    "scaled_mm": (lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw.t().contiguous(),
                                                           out_dtype=torch.bfloat16), ref_scaled),
                    f"mixgemm-{wt}": (lambda: mixgemm.gemm(x, packed), ref_exact),
                    f"mixgemm-{wt}-fp8": (lambda: mixgemm.gemm(x, packed, act_format="fp8"), ref_fp8),
                    f"mixgemm-{wt}-fp8-gemm": (lambda: fp8.gemm_quantized(xq, xs, packed), ref_fp8),
                }
                for t in FP8_TOKEN_TILES if a.tiles else ():
                    for sp in splits:   # (whole tiles on the persistent kernel, splits on the stream-K one)
                        spec = fp8.fp8_gemm_spec(packed.act_type, wtype, None, t, sp)
                        gated = fp8.fp8_gemm_spec(packed.act_type, wtype, "swiglu", t, sp)
                        impls[f"mixgemm-{wt}-fp8-gemm@t{t}s{sp}"] = (
                            lambda spec=spec, sp=sp: fp8.gemm_quantized(xq, xs, packed, spec=spec, splits=sp), ref_fp8)
                        if n >= _GATED_ROWS:
                            impls[f"mixgemm-{wt}-fp8-swiglu@t{t}s{sp}"] = (
                                lambda spec=gated, sp=sp: fp8.gemm_quantized(xq, xs, packed, activation="swiglu",
                                                                              spec=spec, splits=sp), None)
                point = {}
                for name, (fn, ref) in impls.items():
                    try:
                        err = None if ref is None else _rel(fn(), ref)
                        run = fn if a.eager else _graphed(fn)
                        t = bench.time_cuda(run, a.iters, a.warmup, flush).median_us
                    except Exception as e:   # a peer this torch cannot run: reported, not fatal
                        print(f"  {name} {n}x{k} M={m}: {type(e).__name__}: {e}", file=sys.stderr)
                        continue
                    point[name] = t
                    rows.append({"impl": name, "n": n, "k": k, "m": m, "group": a.group, "us": t,
                                 "tflops": bench.tflops(m, n, k, t), "err": err, "graphs": not a.eager})
                cub, smm = point.get("cublas"), point.get("scaled_mm")
                line = [f"{n}x{k} M={m:<5}"]
                for name, t in point.items():
                    extra = f" {cub / t:.2f}x cuBLAS" if cub and name != "cublas" else ""
                    if smm and name.endswith(("-fp8", "-fp8-gemm")):
                        extra += f" {smm / t:.2f}x scaled_mm"
                    line.append(f"{name} {t:.1f} us{extra}")
                print(" | ".join(line), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
