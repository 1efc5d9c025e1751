"""Build, in parallel, the kernels that the compiled-mode GPU tests and the generate() bench launch.

Run it on the GPU machine before ``pytest -m gpu tests/ops/test_gpu_compile.py`` or
``mixgemm bench --generate``: it compiles every kernel those runs can select (one nvcc job per
kernel, ``-j`` at a time) into mixgemm's kernel cache, so that no test or timed region waits for
a compile::

    python tools/prebuild_gpu_suite.py -j 16 [--presets llama3-8b] [--types u4,u2,s8]

The layer shapes come from the bench presets (:data:`mixgemm.bench.PRESETS`: fused q/k/v, o,
fused gate/up with swiglu, down) and from the test modules' own shapes; ``--all-u4`` adds every
bf16 u4 kernel of the catalogue (what the older GPU tests of single layers use), and
``--from-tests`` every kernel spec a GPU test is parametrized with (the whole catalogue, and the
test-only kernels outside it): with it, the whole GPU suite (``tools/gpu_suite.py``) waits for no
compile.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time


class _SpecGatherer:
    """A pytest plugin that keeps the kernel specs among the collected tests' parameters."""

    def __init__(self, kinds: tuple):
        self.kinds = kinds
        self.specs: dict = {}

    def pytest_collection_modifyitems(self, items):
        for item in items:
            callspec = getattr(item, "callspec", None)
            for value in (callspec.params.values() if callspec is not None else ()):
                if isinstance(value, self.kinds):
                    self.specs[value.name] = value


def specs_of_tests(paths=("tests",)) -> list:
    """The kernel specs that the GPU tests under ``paths`` are parametrized with."""
    import typing

    import pytest   # (a test dependency: only this option needs it)
    from mixgemm.jit.specs import KernelSpec

    gather = _SpecGatherer(typing.get_args(KernelSpec))
    with contextlib.redirect_stdout(io.StringIO()) as listing:
        rc = pytest.main(["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", *paths], plugins=[gather])
    if rc not in (0, 5):
        raise SystemExit(f"collecting the GPU tests failed (pytest exit status {rc}):\n{listing.getvalue()[-2000:]}")
    return list(gather.specs.values())


def main(argv=None) -> int:
    from mixgemm.jit import build
    from mixgemm.bench import PRESETS
    from mixgemm.ops.norm import norm_spec
    from mixgemm.aot.prebuild import ExpertsUse, WeightUse, specs_for
    from mixgemm.ops.rotary import rope_spec
    from mixgemm.jit.specs import Activation
    from mixgemm.dtypes import ActType, WeightType

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-j", "--jobs", type=int, default=None)
    p.add_argument("--presets", default="llama3-8b", help="bench presets whose layers to build for (comma list)")
    p.add_argument("--types", default="u4", help="weight types of the presets' layers (comma list)")
    p.add_argument("--all-u4", action="store_true", help="also every bf16 u4 kernel of the catalogue")
    p.add_argument("--from-tests", action="store_true",
                   help="also every kernel spec that a GPU test is parametrized with (collected, not run): "
                        "the test-only ones outside the catalogue, such as test_gpu_gemm's k-sliced decode kernels")
    p.add_argument("--list", action="store_true", help="print the kernel names only")
    args = p.parse_args(argv)

    bf16 = ActType.BF16
    uses: list = []
    for name in filter(None, args.presets.split(",")):
        preset = PRESETS[name]
        h, i, d = preset.hidden, preset.intermediate, preset.head_dim
        qkv = (preset.heads + 2 * preset.kv_heads) * d
        for t in filter(None, args.types.split(",")):
            wt = WeightType(t)
            uses += [WeightUse(qkv, h, wt, bf16), WeightUse(preset.heads * d, h, wt, bf16) if preset.heads * d != h
                     else WeightUse(h, h, wt, bf16),
                     WeightUse(h, preset.heads * d, wt, bf16), WeightUse(2 * i, h, wt, bf16, Activation.SWIGLU),
                     WeightUse(h, i, wt, bf16)]
    # tests/ops/test_gpu_compile.py: the mixed-op module, the 1024-wide LLaMA and the tiny models
    u4, u2, s8 = WeightType.U4, WeightType.U2, WeightType.S8
    uses += [WeightUse(1536, 1024, u4, bf16), WeightUse(4096, 1024, u2, bf16, Activation.SWIGLU),
             WeightUse(1024, 2048, s8, bf16), WeightUse(1024, 1024, u4, bf16),
             WeightUse(5632, 1024, u4, bf16, Activation.SWIGLU), WeightUse(1024, 2816, u4, bf16),
             WeightUse(256, 128, u4, bf16), WeightUse(128, 128, u4, bf16),
             WeightUse(512, 128, u4, bf16, Activation.SWIGLU), WeightUse(128, 256, u4, bf16)]
    # tests/ops/test_gpu_torch_ops.py: 1024x1024 layers of each width and a 512x1024 one
    uses += [WeightUse(1024, 1024, u2, bf16), WeightUse(512, 1024, u4, bf16)]
    # tests/moe/test_gpu_moe_torch_ops.py: 16 experts [1024, 512] of u4, u2 and s4
    s4 = WeightType.S4
    uses += [ExpertsUse(16, 1024, 512, wt, bf16) for wt in (u4, u2, s4)]
    uses += [ExpertsUse(8, 1024, 2048, u4, bf16), ExpertsUse(16, 4096, 1024, u4, bf16)]
    specs = {s.name: s for s in specs_for(uses)}
    for s in (norm_spec(bf16.torch_dtype, False), norm_spec(bf16.torch_dtype, True), rope_spec(bf16.torch_dtype)):
        specs[s.name] = s
    if args.all_u4:
        from mixgemm.jit.catalog import default_specs

        specs.update((s.name, s) for s in default_specs([bf16], [WeightType.U4]))
    if args.from_tests:
        specs.update((s.name, s) for s in specs_of_tests())
    specs = [specs[k] for k in sorted(specs)]
    if args.list:
        print("\n".join(s.name for s in specs))
        return 0
    t0 = time.time()
    build.build_many(specs, jobs=args.jobs, progress=True)
    print(f"{len(specs)} kernels built or cached in {time.time() - t0:.0f} s")
    from mixgemm.jit import launcher, torch_ops

    print(f"compiled launcher: {launcher.build_compiled()}")
    if not torch_ops.available():
        t0 = time.time()
        print(f"torch operator library: {torch_ops.build()} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
