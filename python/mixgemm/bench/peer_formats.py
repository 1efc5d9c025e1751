"""mixgemm's quantized weight in the peers' conventions, for ``mixgemm bench``'s peers
(:mod:`.peers`) and the decoder variants (:mod:`.variants`, :mod:`.moe_run`): PyTorch's tinygemm
int4 kernel (its packed layout, its ``scale_and_zeros`` and zero-point convention, the matmul
call, the weight it dequantizes to), gemlite's dequantized weight, and the W8A8-FP8 GEMM
(``torch._scaled_mm`` of e4m3 activations and an e4m3 weight, per-row scales on both).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops.fp8 import E4M3_MAX, k_permutation
from ..weights.types import QuantizedWeight

class ImplUnavailable(Exception):
    """An implementation cannot run this configuration (dtype, group size, shape); the
    message says why and is reported in place of its numbers."""


#: torch_int4 packs this many 16-wide k-tiles together (gpt-fast's and torchao's choice).
TORCH_INT4_INNER_K_TILES = 8
#: Group sizes tinygemm supports.
TORCH_INT4_GROUP_SIZES = (32, 64, 128, 256)


def torch_int4_params(q: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert mixgemm's asymmetric 4-bit weight to tinygemm's inputs.

    mixgemm: ``w = (q - z) * s`` with ``q, z`` in ``[0, 15]``. tinygemm: ``w = (q - 8) * s + zf``,
    so ``zf = (8 - z) * s`` (rounded once to the scales' dtype).

    Parameters
    ----------
    q : torch.Tensor
        uint8 codes ``[N, K]`` in ``[0, 15]``.
    scales, zeros : torch.Tensor
        ``[N, K/g]``, bf16 (zeros integer-valued).

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``packed`` uint8 ``[N, K/2]`` (element ``2i`` in the high nibble of byte ``i``, the
        input ``aten._convert_weight_to_int4pack`` takes since PyTorch 2.5) and
        ``scale_and_zeros`` ``[K/g, N, 2]`` (``[..., 0]`` scale, ``[..., 1]`` zero).
    """
    if q.shape[1] % 2:
        raise ValueError(f"K={q.shape[1]} must be even for int4 packing")
    qi = q.to(torch.uint8)
    packed = ((qi[:, ::2] << 4) | qi[:, 1::2]).contiguous()
    zero_f = ((8.0 - zeros.double()) * scales.double()).to(scales.dtype)
    scale_and_zeros = torch.stack([scales, zero_f], dim=-1).transpose(0, 1).contiguous()
    return packed, scale_and_zeros


def torch_int4_dequant(q: torch.Tensor, scale_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """tinygemm's weight: ``fl((q - 8) * scale + zero)`` (one rounding, as its bf16 ``fma``),
    from the codes ``q [N, K]`` and ``scale_and_zeros [K/g, N, 2]``; ``[N, K]`` in the scales'
    dtype."""
    s = scale_and_zeros[..., 0].t().double().repeat_interleave(group_size, dim=1)
    z = scale_and_zeros[..., 1].t().double().repeat_interleave(group_size, dim=1)
    return ((q.double() - 8.0) * s + z).to(scale_and_zeros.dtype)


def torch_int4_pack(qw: QuantizedWeight, inner_k_tiles: int = TORCH_INT4_INNER_K_TILES
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """tinygemm's weight from mixgemm's asymmetric 4-bit ``qw``: ``(packed, scale_and_zeros)``
    for ``aten._weight_int4pack_mm`` (CUDA tensors), or for ``aten._weight_int4pack_mm_for_cpu``
    (CPU tensors). ``packed`` holds ``N*K/2`` bytes in either layout.

    Raises
    ------
    ImplUnavailable
        ``qw`` is not asymmetric 4-bit, or PyTorch cannot pack it (its message says why).
    """
    if qw.bits != 4 or qw.symmetric:
        raise ImplUnavailable(f"tinygemm takes asymmetric 4-bit weights, not {qw.weight_type.value}")
    packed_u8, sz = torch_int4_params(qw.qweight, qw.scales, qw.zeros)
    if qw.qweight.device.type == "cpu":
        op = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
        if op is None:
            raise ImplUnavailable(f"this PyTorch ({torch.__version__}) has no CPU int4 kernel")
        return op(qw.qweight.to(torch.int32).contiguous(), inner_k_tiles), sz
    try:  # PyTorch >= 2.5: uint8 [N, K/2]
        packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, inner_k_tiles)
    except RuntimeError as first:
        try:  # older PyTorch: int32 [N, K] codes
            packed = torch.ops.aten._convert_weight_to_int4pack(
                qw.qweight.to(torch.int32).contiguous(), inner_k_tiles)
        except RuntimeError:
            raise ImplUnavailable(f"aten._convert_weight_to_int4pack failed: {first}") from None
    return packed, sz


def torch_int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int,
                  scale_and_zeros: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ W^T`` through tinygemm (``aten._weight_int4pack_mm``, or its CPU twin for
    CPU tensors), for a weight from :func:`torch_int4_pack`."""
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scale_and_zeros)
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scale_and_zeros)


def gemlite_dequant(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    mode: int, dtype: torch.dtype) -> torch.Tensor:
    """gemlite's weight from its own parameters, as its Triton ``dequantize`` computes it.

    Parameters
    ----------
    q : torch.Tensor
        Codes ``[N, K]`` (unsigned).
    scales, zeros : torch.Tensor
        ``[N, K/g]``: gemlite's stored ``scales`` and ``zeros``, transposed back.
    group_size : int
        K elements per group.
    mode : int
        gemlite's ``W_group_mode``: 4 (``fma(q, s, zeros)``, its default for asymmetric groups,
        with ``zeros = -z*s``) or 3 (``(q - zeros) * s``).
    dtype : torch.dtype
        The activation dtype (one final rounding).
    """
    s = scales.double().repeat_interleave(group_size, dim=1)
    z = zeros.double().repeat_interleave(group_size, dim=1)
    if mode == 4:
        return (q.double() * s + z).to(dtype)
    if mode == 3:
        return (q.double() - z).to(dtype).double().mul(s).to(dtype)
    raise ValueError(f"unsupported gemlite W_group_mode {mode} (expected 3 or 4)")


# ---------------------------------------------------------------------------------------------
# torch._scaled_mm: the W8A8-FP8 GEMM
# ---------------------------------------------------------------------------------------------
def scaled_mm_problem() -> Optional[str]:
    """Why ``torch._scaled_mm`` e4m3 x e4m3 cannot run here (no float8 dtype, no ``_scaled_mm``,
    a GPU below sm_89), or None. Without a GPU it is None when this PyTorch has both (its CPU
    kernel serves the tests)."""
    if not hasattr(torch, "float8_e4m3fn"):
        return f"this PyTorch ({torch.__version__}) has no torch.float8_e4m3fn dtype"
    if not hasattr(torch, "_scaled_mm"):
        return f"this PyTorch ({torch.__version__}) has no torch._scaled_mm"
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        if cap < (8, 9):
            return f"torch._scaled_mm's e4m3 GEMM needs an sm_89+ GPU, this one is sm_{cap[0]}{cap[1]}"
    return None


def e4m3_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [R, C]`` as e4m3 codes with one float32 scale per row, as a W8A8-FP8 checkpoint holds
    its weight (and as the per-token quantizer, :func:`mixgemm.ops.quantize_fp8_reference`, rounds
    each token): ``s = amax / 448`` (1 for a row of zeros), ``q = e4m3(clamp(w / s, -448, 448))``,
    in float32, rounded to nearest even.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``torch.float8_e4m3fn [R, C]`` in the natural column order, float32 ``[R]``: ``q * s``
        approximates ``w``.
    """
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    # a tensor divisor, as quantize_fp8_reference's (the correctly rounded quotient on every device)
    s = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    return (wf / s.unsqueeze(1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


def scaled_mm_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight of the W8A8-FP8 GEMM from ``w [N, K]`` (the checkpoint's bf16 weight):
    :func:`e4m3_rows`, and its columns in the order in which :func:`mixgemm.ops.quantize_fp8`
    writes a token (:func:`mixgemm.ops.fp8.k_permutation`, inside every block of 32), so that the
    activations that quantizer gives multiply it as they are (a permutation of the sum over K;
    the product is the same).

    Returns
    -------
    (torch.Tensor, torch.Tensor, torch.Tensor)
        ``codes`` (natural order, for the reference), ``gemm_codes`` (the quantizer's order,
        contiguous ``[N, K]``: ``gemm_codes.t()`` is the column-major operand ``_scaled_mm``
        takes), float32 ``scales [N]``.
    """
    codes, scales = e4m3_rows(w)
    perm = k_permutation(w.shape[1], w.device)
    return codes, codes.index_select(1, perm).contiguous(), scales


def scaled_mm(xq: torch.Tensor, x_scales: torch.Tensor, gemm_codes: torch.Tensor, w_scales: torch.Tensor,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``torch._scaled_mm`` of ``xq [M, K]`` (e4m3, row-major) and ``gemm_codes [N, K]`` (e4m3,
    read as the column-major ``[K, N]``) with the row-wise scales ``x_scales [M]`` and
    ``w_scales [N]`` (float32): ``(xq * x_scales) @ (gemm_codes * w_scales)^T`` in ``out_dtype``
    ([M, N]). The float32 scales are applied to the float32 accumulator (CUDA; CPU: PyTorch's
    CPU kernel)."""
    return torch._scaled_mm(xq, gemm_codes.t(), scale_a=x_scales.reshape(-1, 1), scale_b=w_scales.reshape(1, -1),
                            out_dtype=out_dtype)
