"""What the decode step would gain if its two RMSNorm launches per layer cost nothing: the upper
bound of fusing the norm (and its residual add) into the next GEMM's prologue (NOTES 33f).

usage: norm_free_step.py {kept,free} OUT.json [bench --model options...]
  kept: bench --model as it is; free: the stack's rms_norm replaced by a function that launches
  nothing (returns x, and the residual unchanged), so the step's outputs are wrong and only its
  time means anything.
"""
import sys

from mixgemm.bench import decoder


def _free(x, weight, eps, residual=None):
    return x if residual is None else (x, residual)


def main() -> int:
    mode, out, *rest = sys.argv[1:]
    if mode == "free":
        decoder.rms_norm = _free
    elif mode != "kept":
        raise SystemExit(f"mode must be kept or free, got {mode!r}")
    from mixgemm.cli import main as cli_main   # an experiment script, not the package
    return cli_main(["bench", *rest, "--json", out, "--model-max-error", "1e9"])


if __name__ == "__main__":
    sys.exit(main())
