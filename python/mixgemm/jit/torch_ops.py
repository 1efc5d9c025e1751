"""The torch operator library: the CUDA kernels of ``mixgemm::gemm``, ``mixgemm::rms_norm``,
``mixgemm::add_rms_norm``, ``mixgemm::rotary_kv_cache``, ``mixgemm::fused_moe`` and
``mixgemm::decode_layer`` in C++ (``csrc/torch_ops.cpp``).

torch.compile's default mode calls ``torch.ops.mixgemm.gemm`` through the dispatcher on every
step; with a Python kernel that is a round trip back into Python per GEMM, more host time than
the launch. This library registers a C++ kernel at the operator's CUDA key that runs the cached
launch plans that Python made (:mod:`mixgemm.dispatch.plans` hands each one over, and drops it
with its weight) through the compiled launcher, and hands every other call to the Python kernel
(the operator ``mixgemm::gemm_py``), which validates, raises the errors and makes the plans. The
RMSNorm operators likewise launch the norm kernels Python loaded, and hand the rest to
``mixgemm::rms_norm_py`` / ``add_rms_norm_py``; ``mixgemm::rotary_kv_cache`` launches the rotary /
KV-cache kernel Python loaded, and hands the rest to ``mixgemm::rotary_kv_cache_py``;
``mixgemm::fused_moe`` launches the MoE plans that :mod:`mixgemm.moe.layer` hands over for its
routed decode plan (two routed grouped decode launches and the combine kernel), and hands the
rest to ``mixgemm::fused_moe_py``; ``mixgemm::decode_layer`` calls those kernels for a decoder
layer's step in order (:mod:`mixgemm.ops.layer`).

It is built once per machine and torch version, like the launcher, with nvcc against the
installed torch's headers and libraries (``<cache>/host/torch_ops-<key>/``), and loaded with
``torch.ops.load_library``. :class:`TorchOps` wraps its C functions; the process's instance, and
when it is loaded, belong to :mod:`mixgemm.dispatch.plans`.

``MIXGEMM_TORCH_OPS``: ``auto`` (default: the C++ kernel where it builds, else the Python kernel
with a warning), ``compiled`` (fail if it cannot be built) or ``python`` (never build it).
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Iterable, Sequence

import torch

from ..errors import BuildError
from .build import HOST_LIBRARY_FLAGS, load_host_library
from .driver import GemmArgs
from .launcher import LAUNCHER_VERSION, LaunchPlanStruct

SOURCE = Path(__file__).resolve().parent / "csrc" / "torch_ops.cpp"
#: csrc/torch_ops.cpp's MIXGEMM_TORCH_OPS_VERSION: the structures below mirror that version's
TORCH_OPS_VERSION = 5
TORCH_OPS_ENV = "MIXGEMM_TORCH_OPS"
NAME = "torch_ops"

#: MixgemmOpKey's dtype codes
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
#: MixgemmMoeKey's codes of the top-k weights' dtype
WEIGHTS_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
#: the buffer kinds of mixgemm_ops_set_arena
WORKSPACE_ARENA, LOCK_ARENA = 0, 1


class OpKey(ctypes.Structure):
    """``MixgemmOpKey``: what decides a launch (csrc/torch_ops.cpp)."""

    _fields_ = [
        ("qdata", ctypes.c_uint64),
        ("scales", ctypes.c_uint64),
        ("zeros", ctypes.c_uint64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("group_size", ctypes.c_int64),
        ("weight_type", ctypes.c_int32),
        ("activation", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("bucket", ctypes.c_int32),
        ("capturing", ctypes.c_int32),
    ]

    def astuple(self) -> tuple:
        return tuple(getattr(self, name) for name, _ in self._fields_)


class MoeKey(ctypes.Structure):
    """``MixgemmMoeKey``: what decides the launches of a MoE plan (csrc/torch_ops.cpp)."""

    _fields_ = [
        ("w13_qdata", ctypes.c_uint64),
        ("w13_scales", ctypes.c_uint64),
        ("w13_zeros", ctypes.c_uint64),
        ("w2_qdata", ctypes.c_uint64),
        ("w2_scales", ctypes.c_uint64),
        ("w2_zeros", ctypes.c_uint64),
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("w13_group_size", ctypes.c_int64),
        ("w2_group_size", ctypes.c_int64),
        ("num_experts", ctypes.c_int64),
        ("rows", ctypes.c_int32),
        ("topk", ctypes.c_int32),
        ("weight_type", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("ids_bytes", ctypes.c_int32),
        ("weights_dtype", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("capturing", ctypes.c_int32),
    ]

    def astuple(self) -> tuple:
        return tuple(getattr(self, name) for name, _ in self._fields_)


class MoeGemm(ctypes.Structure):
    """``MixgemmMoeGemm``: one routed grouped decode launch of a MoE plan (csrc/torch_ops.cpp)."""

    _fields_ = [
        ("function", ctypes.c_uint64),
        ("prepare", ctypes.c_uint64),
        ("programmatic", ctypes.c_int32),
        ("params_size", ctypes.c_uint32),
        ("x_by_token", ctypes.c_int32),
        ("y_by_assignment", ctypes.c_int32),
        ("n_out", ctypes.c_int64),
        ("qdata_sizes", ctypes.c_int64 * 4),
        ("scales_sizes", ctypes.c_int64 * 3),
        ("args", GemmArgs),
    ]


class MoePlan(ctypes.Structure):
    """``MixgemmMoePlan``: the launches of the routed decode plan of ``mixgemm::fused_moe``:
    gate/up, down and the combine kernel (csrc/torch_ops.cpp)."""

    _fields_ = [
        ("gate_up", MoeGemm),
        ("down", MoeGemm),
        ("combine", ctypes.c_uint64),
        ("launch_kernel_ex", ctypes.c_uint64),
        ("combine_programmatic", ctypes.c_int32),
        ("combine_threads", ctypes.c_int32),
        ("combine_weights", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


def mode() -> str:
    value = os.environ.get(TORCH_OPS_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "compiled", "python"):
        raise ValueError(f"{TORCH_OPS_ENV} must be auto, compiled or python, got {value!r}")
    return value


def available() -> str:
    """Why this torch cannot take the C++ kernel ("" where it can)."""
    if not torch.cuda._is_compiled():
        return "this torch has no CUDA"
    lib = Path(torch.__file__).resolve().parent / "lib"
    if not any(lib.glob("libc10_cuda.*")):
        return f"no libc10_cuda in {lib}"
    return ""


def build_flags() -> tuple[str, ...]:
    """nvcc's flags for the library: the host library flags, the C++ standard torch's headers
    need, and the installed torch's include and library folders."""
    root = Path(torch.__file__).resolve().parent
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    std = "-std=c++20" if version >= (2, 10) else "-std=c++17"
    flags = [f for f in HOST_LIBRARY_FLAGS if not f.startswith("-std=")]
    return (std, *flags,
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-L{root / 'lib'}", f"-Xlinker=-rpath,{root / 'lib'}", "-lc10", "-lc10_cuda", "-ltorch_cpu")


def key_extra() -> dict:
    """What the library depends on besides its source and flags: the torch it compiles against."""
    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda or "",
            "torch_git": getattr(torch.version, "git_version", "")}


def build() -> Path:
    """Build the library into the cache (if it is not there yet); its path."""
    return load_host_library(NAME, SOURCE.read_text(), lambda path: path, build_flags(), key_extra())


def load() -> "TorchOps":
    """Build (once per machine and torch) and load the library: from here on, CUDA calls of
    ``torch.ops.mixgemm.gemm`` reach its kernel. The operators must be defined first."""
    why = available()
    if why:
        raise BuildError(f"the torch operator library cannot be built: {why}")
    return load_host_library(NAME, SOURCE.read_text(), TorchOps, build_flags(), key_extra())


class TorchOps:
    """The loaded library's C functions (csrc/torch_ops.cpp). :meth:`init` first."""

    def __init__(self, path: Path):
        self.path = Path(path)
        torch.ops.load_library(str(self.path))   # registers the kernel with the dispatcher
        lib = ctypes.CDLL(str(self.path))
        for name in ("mixgemm_ops_version", "mixgemm_ops_launcher_version", "mixgemm_ops_drop",
                     "mixgemm_ops_drop_moe"):
            getattr(lib, name).restype = ctypes.c_int32
        for name in ("mixgemm_ops_plan_size", "mixgemm_ops_key_size", "mixgemm_ops_moe_key_size",
                     "mixgemm_ops_moe_plan_size"):
            getattr(lib, name).restype = ctypes.c_uint32
        for name in ("mixgemm_ops_plan_count", "mixgemm_ops_hits", "mixgemm_ops_fallbacks",
                     "mixgemm_ops_moe_plan_count", "mixgemm_ops_layers"):
            getattr(lib, name).restype = ctypes.c_uint64
        got = (lib.mixgemm_ops_version(), lib.mixgemm_ops_launcher_version(), lib.mixgemm_ops_plan_size(),
               lib.mixgemm_ops_key_size(), lib.mixgemm_ops_moe_key_size(), lib.mixgemm_ops_moe_plan_size())
        want = (TORCH_OPS_VERSION, LAUNCHER_VERSION, ctypes.sizeof(LaunchPlanStruct), ctypes.sizeof(OpKey),
                ctypes.sizeof(MoeKey), ctypes.sizeof(MoePlan))
        if got != want:
            raise BuildError(f"{path}: torch operator library (version, launcher version, plan size, key size, "
                             f"MoE key size, MoE plan size) {got} != {want} expected")
        lib.mixgemm_ops_init.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int32),
                                         ctypes.c_int32, ctypes.c_char_p, ctypes.c_char_p]
        lib.mixgemm_ops_put.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int32]
        lib.mixgemm_ops_drop.argtypes = [ctypes.c_void_p]
        lib.mixgemm_ops_set_arena.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_uint64, ctypes.c_uint64,
                                              ctypes.c_uint64]
        lib.mixgemm_ops_put_norm.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_uint64,
                                             ctypes.c_int32, ctypes.c_uint64]
        lib.mixgemm_ops_put_rope.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int32,
                                             ctypes.c_uint64]
        lib.mixgemm_ops_put_moe.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.mixgemm_ops_drop_moe.argtypes = [ctypes.c_void_p]
        self.lib = lib
        self.weight_types: tuple[str, ...] = ()
        self.activations: tuple[str, ...] = ()

    def init(self, launch: int, stream_is_capturing: int, buckets: Sequence[int], weight_types: Iterable[str],
             activations: Iterable[str]) -> None:
        """Hand over the launcher's ``mixgemm_launch``, the driver's ``cuStreamIsCapturing``, the
        token-bucket table (M -> bucket) and the names the operator's string arguments take
        (their indices are the key's codes). Forgets every plan and buffer."""
        self.weight_types, self.activations = tuple(weight_types), tuple(activations)
        table = (ctypes.c_int32 * len(buckets))(*buckets)
        self.lib.mixgemm_ops_init(launch, stream_is_capturing, table, len(buckets),
                                  _names(self.weight_types), _names(self.activations))

    def key(self, *, qdata: int, scales: int, zeros: int, n: int, k: int, group_size: int, weight_type: str,
            activation: str, dtype: torch.dtype, device: int, bucket: int, capturing: bool) -> OpKey:
        return OpKey(qdata, scales, zeros, n, k, group_size, self.weight_types.index(weight_type),
                     self.activations.index(activation), DTYPE_CODES[dtype], device, bucket, int(capturing))

    def put(self, key: OpKey, plan: LaunchPlanStruct, n_out: int, bias_len: int, uses_locks: bool) -> None:
        self.lib.mixgemm_ops_put(ctypes.byref(key), ctypes.byref(plan), n_out, bias_len, int(uses_locks))

    def drop(self, key: OpKey) -> bool:
        return bool(self.lib.mixgemm_ops_drop(ctypes.byref(key)))

    def clear_plans(self) -> None:
        self.lib.mixgemm_ops_clear_plans()

    def set_arena(self, kind: int, device: int, stream: int, ptr: int, nbytes: int) -> None:
        self.lib.mixgemm_ops_set_arena(kind, device, stream, ptr, nbytes)

    def clear_arenas(self) -> None:
        self.lib.mixgemm_ops_clear_arenas()

    def put_norm(self, residual: bool, dtype: torch.dtype, device: int, function: int, programmatic: bool,
                 launch_kernel_ex: int) -> None:
        """Hand over a loaded norm kernel (``function``: its CUfunction) for rows of ``dtype``,
        with the residual add or not, on ``device``."""
        self.lib.mixgemm_ops_put_norm(int(residual), DTYPE_CODES[dtype], device, function, int(programmatic),
                                      launch_kernel_ex)

    def clear_norms(self) -> None:
        self.lib.mixgemm_ops_clear_norms()

    def put_rope(self, dtype: torch.dtype, device: int, function: int, programmatic: bool,
                 launch_kernel_ex: int) -> None:
        """Hand over a loaded rotary / KV-cache kernel (``function``: its CUfunction) for a qkv of
        ``dtype`` on ``device``."""
        self.lib.mixgemm_ops_put_rope(DTYPE_CODES[dtype], device, function, int(programmatic), launch_kernel_ex)

    def clear_ropes(self) -> None:
        self.lib.mixgemm_ops_clear_ropes()

    def moe_key(self, *, w13: tuple, w2: tuple, hidden: int, intermediate: int, w13_group_size: int,
                w2_group_size: int, num_experts: int, rows: int, topk: int, weight_type: str, dtype: torch.dtype,
                ids_bytes: int, weights_dtype: torch.dtype, device: int, capturing: bool) -> MoeKey:
        """The key of a MoE plan. ``w13`` / ``w2``: the data pointers of each weight's ``qdata``,
        ``scales`` and ``zeros`` (0: symmetric); ``dtype``: x's; ``weights_dtype``: the top-k
        weights' (a key of :data:`WEIGHTS_DTYPE_CODES`)."""
        return MoeKey(*w13, *w2, hidden, intermediate, w13_group_size, w2_group_size, num_experts, rows, topk,
                      self.weight_types.index(weight_type), DTYPE_CODES[dtype], ids_bytes,
                      WEIGHTS_DTYPE_CODES[weights_dtype], device, int(capturing))

    def put_moe(self, key: MoeKey, plan: MoePlan) -> None:
        """Hand over a MoE plan (the library keeps a copy), replacing any of the same key."""
        self.lib.mixgemm_ops_put_moe(ctypes.byref(key), ctypes.byref(plan))

    def drop_moe(self, key: MoeKey) -> bool:
        return bool(self.lib.mixgemm_ops_drop_moe(ctypes.byref(key)))

    def clear_moe(self) -> None:
        self.lib.mixgemm_ops_clear_moe()

    def plan_count(self) -> int:
        return int(self.lib.mixgemm_ops_plan_count())

    def moe_plan_count(self) -> int:
        """The MoE plans held."""
        return int(self.lib.mixgemm_ops_moe_plan_count())

    def counters(self) -> tuple[int, int]:
        """(calls launched by the C++ kernel, calls it handed to the Python kernel), process-wide."""
        return int(self.lib.mixgemm_ops_hits()), int(self.lib.mixgemm_ops_fallbacks())

    def layer_calls(self) -> int:
        """``mixgemm::decode_layer`` calls its C++ kernel took, process-wide."""
        return int(self.lib.mixgemm_ops_layers())


def _names(names: Sequence[str]) -> bytes:
    return b"".join(n.encode() + b"\0" for n in names) + b"\0"
