"""The errors mixgemm raises on purpose, in one small module that every other module (and the
command line) can import without pulling in anything else.

Every class derives from :class:`MixgemmError` and from the builtin exception a caller would
expect for that kind of problem (``ValueError`` for bad input, ``RuntimeError`` for a failed
build or driver call), so ``except ValueError`` keeps working where it did.

The command line (:mod:`mixgemm.cli.main`) prints a :class:`MixgemmError` as one line on stderr and
exits with status 1 (2 for a :class:`UsageError`); any other exception is a bug and gets a
traceback only with ``--debug``.
"""
from __future__ import annotations

__all__ = ["MixgemmError", "UserError", "CliError", "UsageError", "BuildError", "CudaError", "KernelError",
           "MixgemmFormatError", "FormatError", "UnsupportedLayerError", "CheckpointError", "BenchError",
           "OutputPathError", "OverflowQuantizeError"]


class MixgemmError(Exception):
    """Base class of every error mixgemm raises on purpose."""


class UserError(MixgemmError):
    """A user-facing error of a command (bad option, missing file, no GPU): the command line
    prints ``mixgemm <command>: error: <message>`` on stderr and exits with status 1."""


#: The name the command line's runners have always raised.
CliError = UserError


class UsageError(UserError):
    """Options that do not go together, found after parsing (argparse finds the rest): the
    command line prints it like a :class:`UserError` and exits with status 2, as for any usage
    error."""


class BenchError(UserError):
    """A user-facing error of the benchmark (bad options, no GPU)."""


class OutputPathError(MixgemmError, OSError):
    """A path that a writer refuses before any work (:func:`mixgemm.utils.atomic.check_target`): an empty
    one, one ending in ``/``, one in a missing directory, a directory, an existing thing that is not
    a regular file (a device node, a FIFO, a socket), or an existing file without ``--force``."""


class BuildError(MixgemmError, RuntimeError):
    """nvcc failed, no usable nvcc was found, or a kernel's source is incomplete."""


class CudaError(MixgemmError, RuntimeError):
    """A CUDA driver call failed."""


class KernelError(MixgemmError, ValueError):
    """A kernel refused its arguments (the host helper's check said no), or a helper library
    does not match the runtime."""


class MixgemmFormatError(MixgemmError, ValueError):
    """A file cannot be read as a (mixgemm) safetensors file: missing, corrupt, truncated,
    inconsistent, or written by a newer mixgemm."""


class CheckpointError(MixgemmFormatError):
    """A model checkpoint directory that cannot be loaded as it stands: a shard that is missing
    or not valid safetensors, a tensor the model needs that is missing, one it does not know, a
    shape or quantization config that disagrees with the model's config."""


class FormatError(MixgemmError, ValueError):
    """Tensors that do not form a valid layer of the named format, or a layer the kernels
    cannot run (N % 16, K % 64, group size). The message names the layer."""


class UnsupportedLayerError(FormatError, NotImplementedError):
    """A valid layer of the source format that mixgemm cannot represent (for example HQQ's
    ``axis=0``, or 3-bit codes)."""


class OverflowQuantizeError(MixgemmError, ValueError):
    """The scales or the dequantized values of a weight would overflow the activation dtype
    (fp16 past 65504; bf16 only for weights near float32's range). ``what`` names the values
    ("scales", "dequantized weights"), ``act`` is the torch dtype, ``peak`` the largest ``|w|``:
    a caller (the command line) can give the remedy in its own words."""

    def __init__(self, what: str, act, peak: float, hint: str):
        super().__init__(f"the {what} overflow {act} (|w| up to {peak:.6g}); {hint}")
        self.what, self.act, self.peak = what, act, peak


class ShardError(MixgemmError, ValueError):
    """A tensor-parallel split that a layer or model cannot take: heads or features that do not
    divide by ``tp_size``, a shard that would cut a 16-row or 64-column atom or a group, an
    act-order layer split along K. The message names the layer or the config field."""
