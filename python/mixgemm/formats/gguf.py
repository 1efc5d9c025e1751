r"""GGUF files (llama.cpp's format): :func:`from_gguf`, and the names of Hugging Face Llama
models (:func:`gguf_name_to_hf`, :func:`undo_llama_rope_permutation`).

The file is read with the ``gguf`` package (``GGUFReader``, by ggml-org; ``pip install
'mixgemm[gguf]'``), imported on first use. Three of GGUF's block types are imported without
re-quantizing; each block holds 32 consecutive elements of a row (K), little endian::

    Q8_0   2 + 32 bytes   fp16 d, 32 x int8 q               w = q * d
    Q4_0   2 + 16 bytes   fp16 d, 32 x 4-bit q              w = (q - 8) * d
    Q4_1   4 + 16 bytes   fp16 d, fp16 m, 32 x 4-bit q      w = q * d + m

(4-bit codes: byte ``j`` of the 16 holds element ``j`` in its low nibble and element
``j + 16`` in its high nibble.) As mixgemm weights, group size 32:

* Q8_0: symmetric int8 (``s8``), scale ``d``.
* Q4_0: symmetric int4 (``s4``), codes ``q - 8``, scale ``d``. llama.cpp's quantizer writes
  ``d = max / -8``, so about half of the scales are negative; the kernels only multiply by them.
* Q4_1: asymmetric ``u4`` with an integer zero point and a float32 offset per (row, group)
  (:attr:`~mixgemm.weights.types.QuantizedWeight.zero_offsets`, the fractional-zero path of
  :func:`~mixgemm.formats.from_hqq`): ``z = clamp(round(-m / d), 0, 15)`` and ``o = m + z * d``
  (computed in float64 with the fp16 ``d``, then float32), so that ``q * d + m = (q - z) * d +
  o`` exactly and ``|o| <= |d| / 2`` unless ``z`` was clamped. The kernels compute ``(q - z) *
  s`` and :func:`mixgemm.gemm` adds ``x_groupsum @ o`` after them. A layer whose offsets are all
  0 has no offsets (and is symmetric if every ``z`` is 8).

Other types are refused (:class:`UnsupportedLayerError`, naming the tensor and its type), the
K-quants (Q4_K, Q6_K, ...) included, unless the tensor is selected by ``dense``: it is then
dequantized by the ``gguf`` package. Non-quantized tensors (F32, F16, BF16, F64 and the
integer types: norms, biases) pass through as plain tensors of their own dtype.

Accuracy (``w``: GGUF's value, exact; the ``gguf`` package computes it in float32)
------------------------------------------------------------------------------------
With ``dtype=torch.float16`` (the default), :func:`mixgemm.dequantize_reference` of a Q8_0 or
Q4_0 weight equals the ``gguf`` package's ``dequantize`` rounded to fp16 **bit for bit**: ``q *
d`` is exact in float32 (at most 8 + 11 significant bits), and both round it to fp16 once.

Q4_1 cannot be bit-exact on this path: the kernels round ``(q - z) * d`` to fp16 before the
offset is added, and ``q * d + m`` is rounded only once by GGUF. The weight the GEMM computes
with, ``fl16((q - z) * d) + o`` (float32), is within ``2^-11 |(q - z) * d| + 2^-25`` of ``w``;
:func:`mixgemm.dequantize_reference` (which rounds that sum to fp16 once more) is within::

    |w_mixgemm - w| <= 2^-11 (1 + 2^-10) (|w| + |(q - z) d|) + 2^-23            (fp16)

that is one fp16 rounding of ``w`` plus one of ``(q - z) * d`` (``~ |w| + |d|/2`` when ``z``
is not clamped); where it differs from GGUF's value rounded to fp16, it is by one unit in the
last place of ``w`` but for values much smaller than ``d``.

With ``dtype=torch.bfloat16`` the fp16 scales are rounded to bf16 (8 significant bits) first::

    Q8_0, Q4_0:  |w_mixgemm - w| <= (2^-7 + 2^-16) |w|                            (bf16)
    Q4_1:        |w_mixgemm - w| <= 2^-8 (1 + 2^-14) |w| + 2^-7 (1 + 2^-6) |(q - z) d|

(for Q4_1 the offset keeps the exact fp16 ``d``, so the error of the rounded scale scales
with ``q - z``, not with ``q``). These bounds hold while nothing overflows, and for Q4_1 while
``o`` is exact in float32, which it is unless ``z`` clamps at 15 with ``|m| >= 2^13 |d|``. The
tests check every bound element-wise against the ``gguf`` package's own dequantization.

Names and shapes
----------------
GGUF lists a tensor's dimensions innermost first (``ne[0]`` is the row length K); the tensors
returned here have the usual order (a weight is ``[N, K]``, nn.Linear's ``[out, in]``). Names
stay GGUF's (``blk.0.attn_q.weight``) unless ``hf_names=True``: then Llama files get Hugging
Face's names (:func:`gguf_name_to_hf`), and the rows of ``q_proj`` / ``k_proj`` are put back
in Hugging Face's order: llama.cpp's converter permutes them for its rope layout
(:func:`undo_llama_rope_permutation`).
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import TYPE_CHECKING, Any, Dict, Optional, Pattern, Tuple, Union

import numpy as np
import torch

from ..errors import FormatError, UnsupportedLayerError
from ..weights.layout import ATOM_K, ATOM_N
from ..weights.types import QuantizedWeight
from .common import DTypeLike, finalize_layer, layer_dtype

if TYPE_CHECKING:  # pragma: no cover
    import gguf as _gguf_module

__all__ = ["GGUF_TYPES", "from_gguf", "gguf_name_to_hf", "undo_llama_rope_permutation",
           "EMBEDDING_TENSORS"]

#: The GGUF block types :func:`from_gguf` imports as quantized weights.
GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1")
#: GGUF's token embedding table (``re.search``): quantized in most files, but an embedding
#: lookup needs a dense table; ``mixgemm prepack --from gguf`` writes it dense by default.
EMBEDDING_TENSORS = r"^token_embd\.weight$"

_BLOCK = 32                       # elements per block of Q8_0, Q4_0 and Q4_1
#: bytes per block and offsets of its parts: (block bytes, offset of m or None, offset of q)
_LAYOUT = {"Q8_0": (34, None, 2), "Q4_0": (18, None, 2), "Q4_1": (20, 2, 4)}
_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F64": torch.float64, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
          "I64": torch.int64}
_MAGIC = b"GGUF"


def _import_gguf() -> "_gguf_module":
    try:
        import gguf   # deferred: optional dependency (mixgemm[gguf])
    except ImportError as e:
        raise ImportError(f"reading GGUF files needs the 'gguf' package (by ggml-org): "
                          f"pip install 'mixgemm[gguf]' (or pip install gguf); {e}") from None
    return gguf


def layer_error(name: str, msg: str, cls: type = FormatError) -> FormatError:
    return cls(f"GGUF tensor {name!r}: {msg}")


# ------------------------------------------------------------------------------ blocks


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian fp16 at byte ``offset`` of each block: ``[..., bytes]`` -> ``[...]``."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., 16]`` bytes -> ``[..., 32]`` codes: low nibbles are elements 0..15, high 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _import_blocks(name: str, kind: str, raw: torch.Tensor, n: int, k: int, act: torch.dtype,
                   symmetric: Optional[bool]) -> QuantizedWeight:
    """One quantized 2-D tensor: ``raw`` uint8 ``[N, K/32 * block bytes]`` -> QuantizedWeight."""
    size, m_at, q_at = _LAYOUT[kind]
    g = k // _BLOCK
    blocks = raw.reshape(n, g, size)
    d = _f16(blocks, 0)                                          # [N, G]
    if kind == "Q8_0":
        q = blocks[..., q_at:].contiguous().view(torch.int8).reshape(n, k)
        q_u = (q.to(torch.int16) + 128).to(torch.uint8)          # finalize_layer's unsigned codes
        return finalize_layer(name, q_u, None, d, bits=8, group_size=_BLOCK, symmetric=symmetric,
                         act=act)
    q_u = _nibbles(blocks[..., q_at:]).reshape(n, k)
    if kind == "Q4_0":                                           # zero point 8 = symmetric
        return finalize_layer(name, q_u, None, d, bits=4, group_size=_BLOCK, symmetric=symmetric,
                         act=act)
    # Q4_1: w = q*d + m = (q - z)*d + o, integer z near -m/d, o = m + z*d
    m = _f16(blocks, m_at)
    if not bool(torch.isfinite(m).all()):
        raise layer_error(name, "the Q4_1 block minimums (m) are not all finite")
    d64, m64 = d.double(), m.double()
    ratio = torch.where(d64 != 0, -m64 / torch.where(d64 != 0, d64, 1.0), 0.0)
    z = ratio.round().clamp(0, 15)
    o64 = m64 + z * d64
    if symmetric and bool((o64 != 0).any()):
        raise layer_error(name, "symmetric=True, but the Q4_1 minimums are not -8 * d")
    has_offsets = bool((o64 != 0).any())
    qw = finalize_layer(name, q_u, z.to(torch.int16), d, bits=4, group_size=_BLOCK,
                   symmetric=False if has_offsets else symmetric, act=act)
    if has_offsets:
        qw = dataclasses.replace(qw, zero_offsets=o64.float().contiguous())
    return qw


# ------------------------------------------------------------------------------- names

#: GGUF's per-block tensor names -> Hugging Face Llama's (``blk.N.<key>``).
_HF_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: GGUF's top-level tensor names -> Hugging Face Llama's.
_HF_LLAMA_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
#: GGUF tensors with no Hugging Face counterpart: Llama 3.1's ``rope_freqs`` (transformers
#: computes the frequencies from ``config.rope_scaling``).
_HF_LLAMA_SKIP = ("rope_freqs.weight",)
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_TOP = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def gguf_name_to_hf(name: str) -> str:
    """The Hugging Face (transformers ``LlamaForCausalLM``) name of a GGUF Llama tensor.

    ``token_embd`` -> ``model.embed_tokens``, ``output_norm`` -> ``model.norm``, ``output`` ->
    ``lm_head``, and in block ``N`` (``blk.N.``): ``attn_norm`` -> ``input_layernorm``,
    ``attn_q/k/v`` -> ``self_attn.q_proj/k_proj/v_proj``, ``attn_output`` ->
    ``self_attn.o_proj``, ``ffn_norm`` -> ``post_attention_layernorm``, ``ffn_gate/up/down`` ->
    ``mlp.gate_proj/up_proj/down_proj``, all under ``model.layers.N.``; the ``.weight`` /
    ``.bias`` suffix is kept. E.g. ``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``.

    The names only: the rows of ``attn_q`` and ``attn_k`` also need
    :func:`undo_llama_rope_permutation` (``from_gguf(..., hf_names=True)`` does both).

    Raises
    ------
    KeyError
        A name that is not one of these (other architectures, MoE experts, ``rope_freqs``).
    """
    m = _BLK.match(name)
    if m and m.group(2) in _HF_LLAMA_BLOCK:
        return f"model.layers.{m.group(1)}.{_HF_LLAMA_BLOCK[m.group(2)]}.{m.group(3)}"
    m = _TOP.match(name)
    if m and m.group(1) in _HF_LLAMA_TOP:
        return f"{_HF_LLAMA_TOP[m.group(1)]}.{m.group(2)}"
    raise KeyError(f"{name!r} is not a GGUF Llama tensor name mixgemm maps to Hugging Face")


Weight = Union[QuantizedWeight, torch.Tensor]


def undo_llama_rope_permutation(weight: Weight, num_heads: int) -> Weight:
    """Put the rows of a GGUF Llama ``attn_q`` / ``attn_k`` weight (or bias) back in Hugging
    Face's order.

    llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders the
    rows of each head from Hugging Face's rotate-half layout (the first half of the head's
    dimensions, then the second) to interleaved pairs: HF row ``h*D + i`` (``i < D/2``) is
    stored at ``h*D + 2i``, and HF row ``h*D + D/2 + i`` at ``h*D + 2i + 1`` (``D`` =
    rows / ``num_heads``). This is the inverse.

    Parameters
    ----------
    weight : QuantizedWeight or torch.Tensor
        ``[N, ...]`` rows first: a dense weight ``[N, K]``, a bias ``[N]``, or a
        :class:`~mixgemm.weights.types.QuantizedWeight` (its codes, scales, zeros and offsets are
        permuted together: rows are independent).
    num_heads : int
        ``llama.attention.head_count`` for ``attn_q``, ``llama.attention.head_count_kv`` for
        ``attn_k``.

    Returns
    -------
    QuantizedWeight or torch.Tensor
        The same kind of object with its rows reordered.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    rows = weight.n if isinstance(weight, QuantizedWeight) else weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of an even size")
    d = rows // num_heads
    # stored row h*D + 2i + j  holds  HF row h*D + j*D/2 + i
    order = torch.arange(rows).view(num_heads, d // 2, 2).transpose(1, 2).reshape(rows)

    def rows_of(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.index_select(0, order.to(t.device)).contiguous()

    if isinstance(weight, QuantizedWeight):
        return dataclasses.replace(weight, qweight=rows_of(weight.qweight),
                                   scales=rows_of(weight.scales), zeros=rows_of(weight.zeros),
                                   zero_offsets=rows_of(weight.zero_offsets))
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a QuantizedWeight or a torch.Tensor, got "
                        f"{type(weight).__name__}")
    return rows_of(weight)


# -------------------------------------------------------------------------------- file


def _field(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - an unreadable value is treated as missing
        return None


def _open(path: str) -> Any:
    gguf = _import_gguf()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != _MAGIC:
        raise FormatError(f"{path}: not a GGUF file (it starts with {head!r}, not {_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader fails in its own ways on truncated or corrupt files
        raise FormatError(f"{path}: not a readable GGUF file (truncated or corrupt? "
                          f"{type(e).__name__}: {e})") from None
    if reader.byte_order != "I":
        raise UnsupportedLayerError(f"{path}: a big-endian GGUF file; mixgemm reads "
                                    f"little-endian ones")
    return reader


def _as_pattern(dense: Union[str, Pattern[str], None]) -> Optional[Pattern[str]]:
    if dense is None or isinstance(dense, re.Pattern):
        return dense
    if isinstance(dense, str):
        return re.compile(dense)
    raise TypeError(f"dense must be a regular expression (str or re.Pattern) or None, got "
                    f"{type(dense).__name__}")


def from_gguf(path: Union[str, os.PathLike], dtype: DTypeLike = None, *,
              dense: Union[str, Pattern[str], None] = None, hf_names: bool = False,
              symmetric: Optional[bool] = None, progress: bool = False
              ) -> Dict[str, Union[QuantizedWeight, torch.Tensor]]:
    """Read every tensor of a GGUF file: the Q8_0 / Q4_0 / Q4_1 ones as mixgemm weights.

    The block formats, how they map to mixgemm and the accuracy (bit-exact for Q8_0 and Q4_0
    with fp16; bounds for Q4_1 and for bf16) are in the :mod:`mixgemm.formats.gguf` docstring.

    Parameters
    ----------
    path : str or os.PathLike
        A ``.gguf`` file (one file; split ``-00001-of-0000N.gguf`` files are read one by one).
    dtype : torch.dtype or str, optional
        Activation dtype (bf16 or fp16) of the weights' scales and zeros, and of the
        ``dense`` tensors; default fp16, the dtype GGUF stores its scales in (the bit-exact
        choice).
    dense : str or re.Pattern, optional
        Quantized tensors whose GGUF name matches (``re.search``) are dequantized by the
        ``gguf`` package (whatever their type, K-quants included) and returned as plain
        ``dtype`` tensors (GGUF's float32 value rounded once) instead of mixgemm weights: an
        embedding table, or a tensor whose shape or type the kernels do not take. E.g.
        :data:`EMBEDDING_TENSORS`. Default: none.
    hf_names : bool
        Llama files only: return Hugging Face names (:func:`gguf_name_to_hf`), with the rows of
        ``q_proj`` / ``k_proj`` in Hugging Face's order (:func:`undo_llama_rope_permutation`,
        with the file's ``llama.attention.head_count`` / ``head_count_kv``); ``rope_freqs`` is
        left out. Default: GGUF's names, rows as stored.
    symmetric : bool, optional
        As for the other importers: ``None`` picks the natural form (Q8_0 and Q4_0
        symmetric, Q4_1 asymmetric); ``False`` gives Q8_0 / Q4_0 zero points of ``2^(b-1)``;
        ``True`` refuses Q4_1 tensors whose minimums are not ``-8 * d``.
    progress : bool
        Show a progress bar over the tensors.

    Returns
    -------
    dict
        In the file's order, name -> :class:`~mixgemm.weights.types.QuantizedWeight` ``[N, K]``
        (group size 32; ``int8`` codes for Q8_0 and Q4_0, ``uint8`` with zeros and float32
        ``zero_offsets`` for Q4_1) or -> ``torch.Tensor`` (non-quantized tensors unchanged, in
        their own dtype and shape; ``dense`` ones in ``dtype``). :func:`mixgemm.prepack` packs
        each weight for the kernels.

    Raises
    ------
    ImportError
        The ``gguf`` package is not installed.
    FileNotFoundError
        ``path`` does not exist.
    FormatError
        Not a GGUF file, a truncated or corrupt one, non-finite scales; ``hf_names`` for a
        file that is not a Llama model, or with an unknown tensor name.
    UnsupportedLayerError
        (a ``FormatError``) A quantized tensor of another type (K-quants, Q5_0, ...), not
        2-D, or of a shape the kernels do not take (N % 16, K % 64), unless ``dense`` selects
        it; a big-endian file.
    """
    from tqdm import tqdm   # deferred: loaded only when a progress bar is shown

    path = os.fspath(path)
    act = layer_dtype("<gguf>", torch.float16 if dtype is None else dtype, torch.float16)
    pattern = _as_pattern(dense)
    if not isinstance(hf_names, bool):
        raise TypeError(f"hf_names must be a bool, got {type(hf_names).__name__}")
    gguf = _import_gguf()
    reader = _open(path)
    heads: Tuple[Optional[int], Optional[int]] = (None, None)
    if hf_names:
        arch = _field(reader, "general.architecture")
        if arch != "llama":
            raise FormatError(f"{path}: hf_names=True maps Llama files, but this one's "
                              f"general.architecture is {arch!r}")
        heads = (_field(reader, "llama.attention.head_count"),
                 _field(reader, "llama.attention.head_count_kv"))
        if heads[1] is None:
            heads = (heads[0], heads[0])
        if not all(isinstance(h, int) and h > 0 for h in heads):
            raise FormatError(f"{path}: llama.attention.head_count(_kv) missing or invalid "
                              f"({heads}); cannot undo the rope permutation of attn_q/attn_k")

    out: Dict[str, Union[QuantizedWeight, torch.Tensor]] = {}
    for t in tqdm(reader.tensors, desc="read gguf", unit="tensor", disable=not progress or None):
        name, kind = t.name, t.tensor_type.name
        value = _read_tensor(gguf, path, t, kind, act, pattern, symmetric)
        if hf_names:
            if name in _HF_LLAMA_SKIP:
                continue
            try:
                hf = gguf_name_to_hf(name)
            except KeyError as e:
                raise layer_error(name, f"no Hugging Face Llama name for it ({e.args[0]})") from None
            if ".attn_q." in name:
                value = undo_llama_rope_permutation(value, heads[0])
            elif ".attn_k." in name:
                value = undo_llama_rope_permutation(value, heads[1])
            name = hf
        out[name] = value
    del reader   # closes the memory map
    return out


def _read_tensor(gguf: Any, path: str, t: Any, kind: str, act: torch.dtype,
                 pattern: Optional[Pattern[str]], symmetric: Optional[bool]
                 ) -> Union[QuantizedWeight, torch.Tensor]:
    name = t.name
    shape = [int(v) for v in reversed(t.shape.tolist())]     # GGUF lists ne[0] (K) first
    data = t.data
    if data.nbytes != int(t.n_bytes):
        raise FormatError(f"{path}: tensor {name!r} is cut short ({data.nbytes} of "
                          f"{int(t.n_bytes)} bytes): the file is truncated")
    if kind in _PLAIN:
        if kind == "BF16":   # the reader hands BF16 out as raw bytes
            return torch.from_numpy(np.array(data)).view(torch.bfloat16).reshape(shape)
        return torch.from_numpy(np.array(data)).reshape(shape)
    if pattern is not None and pattern.search(name):
        try:
            values = gguf.quants.dequantize(np.asarray(data), t.tensor_type)
        except NotImplementedError:
            raise layer_error(name, f"the gguf package cannot dequantize type {kind}",
                       UnsupportedLayerError) from None
        return torch.from_numpy(np.ascontiguousarray(values)).reshape(shape).to(act)
    hint = " (or pass dense= to dequantize it instead)"
    if kind not in _LAYOUT:
        family = " (K-quants are not supported)" if kind.endswith(("_K", "_K_S", "_K_M")) \
            else ""
        raise layer_error(name, f"type {kind} is not supported: mixgemm imports "
                         f"{', '.join(GGUF_TYPES)}{family}{hint}", UnsupportedLayerError)
    if len(shape) != 2:
        raise layer_error(name, f"a {kind} tensor of shape {shape}: mixgemm imports 2-D weights "
                         f"[N, K]{hint}", UnsupportedLayerError)
    n, k = shape
    if n <= 0 or k <= 0 or n % ATOM_N or k % ATOM_K:
        raise layer_error(name, f"{kind} [N={n}, K={k}]: mixgemm's kernels need N (out_features) % "
                         f"{ATOM_N} == 0 and K (in_features) % {ATOM_K} == 0{hint}",
                   UnsupportedLayerError)
    raw = torch.from_numpy(np.array(data)).reshape(n, -1)
    return _import_blocks(name, kind, raw, n, k, act, symmetric)
