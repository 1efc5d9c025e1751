"""The torch operator library (mixgemm.jit.torch_ops) without a GPU: its source compiles against
the installed torch's headers, its cache key follows the torch it builds against, its launches
agree with the Python kernels' (block sizes, argument counts, the operators' schemas), and the
plan cache's link to it does nothing until it is attached (and never with
MIXGEMM_TORCH_OPS=python), then hands each loaded kernel over once (and says which it holds, for
the eager paths), and each MoE plan once until the memory of one of its weights is freed."""
from __future__ import annotations

import gc
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mixgemm.dispatch import plans
from mixgemm.jit import build, torch_ops
from mixgemm.jit.toolchain import include_flags
from mixgemm.moe import layer as moe_layer  # noqa: F401  (registers mixgemm::fused_moe and fused_moe_py)
from mixgemm.ops import norm, rotary


def test_source_compiles_against_the_installed_torch(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc")
    flags = [f for f in torch_ops.build_flags() if f.startswith(("-std=", "-D", "-I"))]
    root = Path(torch.__file__).resolve().parent / "include"
    if not (root / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():   # a CPU wheel omits it
        flags.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    cmd = [nvcc, *flags, "-Xcompiler=-fPIC", "-c", *include_flags(), str(torch_ops.SOURCE), "-o",
           str(tmp_path / "torch_ops.o")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "torch_ops.o").stat().st_size > 0


def test_flags_and_key_follow_the_torch():
    flags = torch_ops.build_flags()
    root = Path(torch.__file__).resolve().parent
    assert f"-I{root / 'include'}" in flags and "-lc10_cuda" in flags
    assert f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}" in flags
    assert sum(f.startswith("-std=") for f in flags) == 1
    tc = build.toolchain()
    source = torch_ops.SOURCE.read_text()
    key = build.host_library_key("torch_ops", source, tc, flags, torch_ops.key_extra())
    assert key == build.host_library_key("torch_ops", source, tc, flags, torch_ops.key_extra())
    other = dict(torch_ops.key_extra(), torch="0.0.0")
    assert build.host_library_key("torch_ops", source, tc, flags, other) != key
    assert build.host_library_key("torch_ops", source, tc, flags[:-1], torch_ops.key_extra()) != key


def test_key_structure_matches_the_source():
    """OpKey mirrors MixgemmOpKey field by field (names and order)."""
    text = torch_ops.SOURCE.read_text()
    body = text[text.index("struct MixgemmOpKey {"):]
    body = body[:body.index("};")]
    fields = re.findall(r"^\s*(?:u?int(?:32|64)_t)\s+(\w+);", body, re.M)
    assert fields == [name for name, _ in torch_ops.OpKey._fields_]
    assert f"#define MIXGEMM_TORCH_OPS_VERSION {torch_ops.TORCH_OPS_VERSION}" in text


def test_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv(torch_ops.TORCH_OPS_ENV, "Compiled ")
    assert torch_ops.mode() == "compiled"
    monkeypatch.setenv(torch_ops.TORCH_OPS_ENV, "cpp")
    with pytest.raises(ValueError, match="MIXGEMM_TORCH_OPS must be auto, compiled or python"):
        torch_ops.mode()


def test_python_mode_never_builds(monkeypatch):
    monkeypatch.setenv(torch_ops.TORCH_OPS_ENV, "python")
    link = plans.OperatorLibrary()

    def fail():
        raise AssertionError("built")

    monkeypatch.setattr(torch_ops, "load", fail)
    assert link.attach() is None
    assert link.attach() is None and link.lib is None


def test_unattached_link_does_nothing():
    link = plans.OperatorLibrary()
    link.clear_plans()
    link.clear_moe()
    assert link.moe_plan_count() == 0
    link.set_arena(torch_ops.WORKSPACE_ARENA, 0, 0, 1 << 20, 1 << 16)


def test_no_cuda_torch_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: False)
    from mixgemm.errors import BuildError

    with pytest.raises(BuildError, match="^the torch operator library cannot be built: this torch has no CUDA$"):
        torch_ops.load()


def test_row_kernels_launch_as_python_does():
    """The C++ kernels launch the norm and rope kernels with the Python kernels' block sizes and
    as many arguments as the Python launches pass."""
    text = torch_ops.SOURCE.read_text()
    assert f"constexpr unsigned kNormThreads = {norm._THREADS};" in text
    assert f"constexpr unsigned kRopeThreads = {rotary._THREADS};" in text
    assert f"void* argv[{len(norm._ARG_TYPES)}] = {{&x," in text
    assert f"void* argv[{len(rotary._ARG_TYPES)}] = {{&qkv_ptr," in text


@pytest.mark.parametrize("name,fallback", [("gemm", "gemm_py"), ("rms_norm", "rms_norm_py"),
                                           ("add_rms_norm", "add_rms_norm_py"),
                                           ("rotary_kv_cache", "rotary_kv_cache_py"),
                                           ("fused_moe", "fused_moe_py")])
def test_each_cuda_kernel_has_a_python_fallback_of_its_schema(name, fallback):
    """Every operator the library implements falls back to an operator of the same schema (the C++
    kernel calls it with its own arguments)."""
    text = torch_ops.SOURCE.read_text()
    assert f'm.impl("{name}", ' in text and f'"mixgemm::{fallback}"' in text
    schema = str(getattr(torch.ops.mixgemm, name).default._schema)
    assert str(getattr(torch.ops.mixgemm, fallback).default._schema) == schema.replace(
        f"mixgemm::{name}(", f"mixgemm::{fallback}(", 1)


def test_rotary_schema_is_the_cpp_kernels():
    """The schema torch infers for mixgemm::rotary_kv_cache, which rotary_kv_cache_cuda's signature
    follows (its SymInts as int64_t)."""
    assert str(torch.ops.mixgemm.rotary_kv_cache.default._schema) == (
        "mixgemm::rotary_kv_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor(a3!) k_cache, Tensor(a4!) v_cache, "
        "Tensor? positions, SymInt pos0, SymInt heads, SymInt kv_heads) -> Tensor")
    text = torch_ops.SOURCE.read_text()
    signature = re.search(r"at::Tensor rotary_kv_cache_cuda\(([^)]*)\)", text).group(1)
    assert re.sub(r"\s+", " ", signature) == (
        "at::Tensor const& qkv, at::Tensor const& cos, at::Tensor const& sin, at::Tensor& k_cache, "
        "at::Tensor& v_cache, std::optional<at::Tensor> const& positions, int64_t pos0, int64_t heads, "
        "int64_t kv_heads")


def test_loaded_kernels_are_handed_over_once(monkeypatch):
    """put_norm / put_rope hand each kernel over once per (kind, dtype, device), and nothing of a
    dtype the library has no code for."""
    calls = []

    class Lib:
        def put_norm(self, *args):
            calls.append(("norm", *args))

        def put_rope(self, *args):
            calls.append(("rope", *args))

    monkeypatch.setattr(plans.launcher, "entry_points", lambda: SimpleNamespace(launch_kernel_ex=77))
    link = plans.OperatorLibrary()

    def kernel(spec, index, function):
        return SimpleNamespace(spec=spec, device=torch.device("cuda", index), function=function)

    rope = rotary.rope_spec(torch.bfloat16)
    link.put_rope(kernel(rope, 0, 5), torch.bfloat16)   # not attached: nothing
    assert calls == []
    link.lib = Lib()
    for _ in range(2):
        link.put_rope(kernel(rope, 0, 5), torch.bfloat16)
        link.put_rope(kernel(rope, 1, 6), torch.bfloat16)
        link.put_rope(kernel(rotary.rope_spec(torch.float16), 0, 7), torch.float16)
        link.put_norm(kernel(norm.norm_spec(torch.bfloat16, True), 0, 8), True, torch.bfloat16)
    link.put_rope(kernel(rope, 0, 9), torch.float32)
    assert calls == [("rope", torch.bfloat16, 0, 5, True, 77), ("rope", torch.bfloat16, 1, 6, True, 77),
                     ("rope", torch.float16, 0, 7, True, 77), ("norm", True, torch.bfloat16, 0, 8, True, 77)]


def test_holds_says_which_kernels_were_handed_over(monkeypatch):
    """holds_norm / holds_rope (the eager paths' query) are true for a tensor of the dtype and
    CUDA device of a kernel handed over, false for any other, for CPU tensors, and always while
    the library is not attached (MIXGEMM_TORCH_OPS=python: never attached)."""
    monkeypatch.setattr(plans.launcher, "entry_points", lambda: SimpleNamespace(launch_kernel_ex=77))
    monkeypatch.setenv(torch_ops.TORCH_OPS_ENV, "python")
    link = plans.OperatorLibrary()
    assert link.attach() is None

    def kernel(spec, index):
        return SimpleNamespace(spec=spec, device=torch.device("cuda", index), function=1)

    with FakeTensorMode():   # (CUDA tensors without a GPU)
        bf16 = [torch.empty(2, 64, dtype=torch.bfloat16, device=f"cuda:{i}") for i in (0, 1)]
        fp16 = torch.empty(2, 64, dtype=torch.float16, device="cuda:0")
    cpu = torch.empty(2, 64, dtype=torch.bfloat16)
    link.put_norm(kernel(norm.norm_spec(torch.bfloat16, True), 0), True, torch.bfloat16)
    link.put_rope(kernel(rotary.rope_spec(torch.bfloat16), 0), torch.bfloat16)
    assert not any(link.holds_norm(t, r) for t in (*bf16, fp16, cpu) for r in (False, True))
    assert not any(link.holds_rope(t) for t in (*bf16, fp16, cpu))
    link.lib = SimpleNamespace(put_norm=lambda *a: None, put_rope=lambda *a: None)   # attached
    link.put_norm(kernel(norm.norm_spec(torch.bfloat16, True), 0), True, torch.bfloat16)
    link.put_rope(kernel(rotary.rope_spec(torch.bfloat16), 1), torch.bfloat16)
    assert link.holds_norm(bf16[0], True)
    assert not (link.holds_norm(bf16[0], False) or link.holds_norm(bf16[1], True) or link.holds_norm(fp16, True)
                or link.holds_norm(cpu, True))
    assert link.holds_rope(bf16[1])
    assert not (link.holds_rope(bf16[0]) or link.holds_rope(fp16) or link.holds_rope(cpu))


def test_fused_moe_schema_is_the_cpp_kernels():
    """The schema torch infers for mixgemm::fused_moe, which fused_moe_cuda's signature follows (its
    optional tensors as std::optional<at::Tensor>, its str as c10::string_view, its SymInts as
    int64_t)."""
    assert str(torch.ops.mixgemm.fused_moe.default._schema) == (
        "mixgemm::fused_moe(Tensor x, Tensor w13_qdata, Tensor w13_scales, Tensor? w13_zeros, Tensor w2_qdata, "
        "Tensor w2_scales, Tensor? w2_zeros, str weight_type, SymInt w13_group_size, SymInt w2_group_size, "
        "SymInt hidden, SymInt intermediate, Tensor topk_weights, Tensor topk_ids) -> Tensor")
    text = torch_ops.SOURCE.read_text()
    signature = re.search(r"at::Tensor fused_moe_cuda\(([^)]*)\)", text).group(1)
    assert re.sub(r"\s+", " ", signature) == (
        "at::Tensor const& x, at::Tensor const& w13_qdata, at::Tensor const& w13_scales, "
        "std::optional<at::Tensor> const& w13_zeros, at::Tensor const& w2_qdata, at::Tensor const& w2_scales, "
        "std::optional<at::Tensor> const& w2_zeros, c10::string_view weight_type, int64_t w13_group_size, "
        "int64_t w2_group_size, int64_t hidden, int64_t intermediate, at::Tensor const& topk_weights, "
        "at::Tensor const& topk_ids")


def test_combine_launch_passes_the_kernels_arguments():
    """The C++ kernel passes the combine kernel as many arguments as its entry point takes."""
    header = Path(__file__).resolve().parents[2] / "cutlass_ext" / "mixgemm" / "moe_route_kernel.hpp"
    text = header.read_text()
    entry = text[text.index("#define MIXGEMM_MOE_COMBINE_ENTRY"):]
    params = entry[entry.index("NAME(") + 5:entry.index(")", entry.index("NAME("))]
    assert f"void* argv_combine[{params.count(',') + 1}] = {{&y_ptr," in torch_ops.SOURCE.read_text()


def _source_fields(struct: str) -> list[str]:
    text = torch_ops.SOURCE.read_text()
    body = text[text.index(f"struct {struct} {{"):]
    body = body[:body.index("};")]
    return re.findall(r"^\s*(?:u?int(?:32|64)_t|mixgemm::abi::GemmArgs|MixgemmMoeGemm)\s+(\w+)(?:\[\d+\])?;", body,
                      re.M)


@pytest.mark.parametrize("struct,mirror", [("MixgemmMoeKey", torch_ops.MoeKey), ("MixgemmMoeGemm", torch_ops.MoeGemm),
                                           ("MixgemmMoePlan", torch_ops.MoePlan)])
def test_moe_structures_match_the_source(struct, mirror):
    """MoeKey, MoeGemm and MoePlan mirror the source's structures field by field (the loaded
    library's sizes are checked against them too)."""
    assert _source_fields(struct) == [name for name, _ in mirror._fields_]


class _StubOps:
    """TorchOps' MoE methods without the library: what it is handed, by key."""

    moe_key = torch_ops.TorchOps.moe_key

    def __init__(self):
        from mixgemm.dtypes import WeightType

        self.weight_types = tuple(wt.value for wt in WeightType)
        self.held: dict[tuple, torch_ops.MoePlan] = {}
        self.puts = 0

    def put_moe(self, key, plan):
        self.puts += 1
        self.held[key.astuple()] = torch_ops.MoePlan.from_buffer_copy(plan)

    def drop_moe(self, key):
        return self.held.pop(key.astuple(), None) is not None

    def clear_moe(self):
        self.held.clear()


def _moe_key(lib, tensors, rows=2):
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    return lib.moe_key(w13=tuple(ptr(t) for t in tensors[:3]), w2=tuple(ptr(t) for t in tensors[3:]), hidden=128,
                       intermediate=64, w13_group_size=64, w2_group_size=64, num_experts=4, rows=rows, topk=2,
                       weight_type="u4", dtype=torch.bfloat16, ids_bytes=8, weights_dtype=torch.float32, device=0,
                       capturing=False)


def test_moe_plans_are_handed_over_once_and_leave_with_their_weights(monkeypatch):
    monkeypatch.setattr(plans.launcher, "entry_points", lambda: SimpleNamespace(launch_kernel_ex=0xE0))
    link, lib = plans.OperatorLibrary(), _StubOps()
    link.put_moe(_moe_key(lib, [torch.zeros(4)] * 6), torch_ops.MoePlan(), ())   # unattached: nothing
    assert link.moe_plan_count() == 0 and lib.puts == 0
    link.lib = lib
    tensors = [torch.zeros(64, dtype=torch.uint8), torch.zeros(8), torch.zeros(8), torch.zeros(64, dtype=torch.uint8),
               torch.zeros(8), None]
    key = _moe_key(lib, tensors)
    assert key.weight_type == lib.weight_types.index("u4") and key.weights_dtype == 2 and key.w2_zeros == 0
    link.put_moe(key, torch_ops.MoePlan(), tuple(tensors))
    link.put_moe(_moe_key(lib, tensors), torch_ops.MoePlan(), tuple(tensors))   # the same key: once
    assert lib.puts == 1 and link.holds_moe(key) and link.moe_plan_count() == 1
    assert lib.held[key.astuple()].launch_kernel_ex == 0xE0
    # another tensor object over the same memory does not keep or drop it; freeing the memory does
    view = tensors[1].view(2, 4)
    del view
    gc.collect()
    assert link.moe_plan_count() == 1
    keep = tensors[4][2:]           # w2's scales' memory outlives the tensor object
    tensors[4] = None
    gc.collect()
    assert link.moe_plan_count() == 1 and key.astuple() in lib.held
    del keep
    gc.collect()
    assert link.moe_plan_count() == 0 and lib.held == {} and not link.holds_moe(key)
    # clear_moe drops every plan
    other = [torch.zeros(64, dtype=torch.uint8), torch.zeros(8), None] * 2
    for rows in (2, 4):
        link.put_moe(_moe_key(lib, other, rows), torch_ops.MoePlan(), tuple(other))
    assert link.moe_plan_count() == 2 and len(lib.held) == 2
    link.clear_moe()
    assert link.moe_plan_count() == 0 and lib.held == {}
    del other
    gc.collect()   # (the finalizers of cleared plans find nothing to drop)
    assert lib.held == {}
