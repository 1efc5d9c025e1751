"""compressed-tensors integer-weight layers: :func:`from_compressed_tensors` (``format="pack-quantized"``,
and the unpacked int8 codes of ``"int-quantized"``; weights alone, or with e4m3 input activations:
:func:`activation_scheme`), and the format's rules: its ``quantization_config``
(:func:`parse_config`), a layer of a state dict (:func:`import_tensors`), its own dequantization
formula (:func:`dequantize`) and a layer from safetensors headers (:func:`header_layer`)."""
from __future__ import annotations

import math
import re
import warnings
from typing import Callable, List, Mapping, Optional, Tuple, Union

import torch

from ..dtypes import WeightType
from ..errors import CheckpointError, FormatError, UnsupportedLayerError, UserError
from .common import (shard_imported, WORD_BITS, DTypeLike, ImportedLayer, apply_groups, check_bits,
                     check_kernel_shape, check_tensor, dequant_groups, layer_error, finalize_layer, layer_dtype,
                     required_tensor, resolve_group_size, resolve_groups, tensor_key, unpack_stream, unpack_words)
from .registry import Format
from .rules import (HeaderLayer, LayerScheme, QuantizationConfig, Rule, SkipLayer, config_int, header_group,
                    header_shape, kernel_bits)

#: The widths that compressed-tensors <= 0.17 packed with spare bits (``32 // bits`` codes per
#: int32 word, the rest zero) and later versions pack densely (codes straddle words).
PADDED_WIDTHS = (3, 5, 6, 7)


def packed_words(count: int, bits: int) -> dict:
    """The int32 words that hold ``count`` codes of ``bits`` bits in each of compressed-tensors'
    layouts: ``{"dense": ceil(count * bits / 32), "padded": ceil(count / (32 // bits))}`` (the
    two are the same layout for 1, 2, 4 and 8 bits)."""
    return {"dense": -(-count * bits // WORD_BITS), "padded": -(-count // (WORD_BITS // bits))}


def packings(words: torch.Tensor, count: int, bits: Optional[int] = None, dim: int = 1) -> set:
    """The ``(bits, layout)`` pairs that int32 ``words`` (``count`` codes along ``dim``) can be:
    the word count fits the layout (:func:`packed_words`), and a padded layout leaves its spare
    bits zero in every word (how 8-bit codes, dense, are told from 7-bit ones, padded, when both
    take K / 4 words). ``bits`` restricts the widths. For 1, 2, 4 and 8 bits the two layouts are
    one, reported as ``"dense"``."""
    n_words = words.shape[dim]
    out = set()
    for b in ([bits] if bits is not None else range(1, 9)):
        need = packed_words(count, b)
        if need["dense"] == n_words:
            out.add((b, "dense"))
        if need["padded"] == n_words and WORD_BITS % b:
            spare = WORD_BITS - (WORD_BITS // b) * b
            if not bool(((words.to(torch.int64) >> (WORD_BITS - spare)) & ((1 << spare) - 1)).any()):
                out.add((b, "padded"))
    return out


def _packed_bits(name: str, packed: torch.Tensor, k: int, bits: Optional[int]) -> int:
    """The bits of ``weight_packed`` holding K codes per row, dense or padded (:func:`packings`):
    checked against ``bits`` when given, else inferred; a FormatError when the words fit no
    width, or several."""
    shape, words = list(packed.shape), packed.shape[1]
    if bits is not None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise layer_error(name, f"bits must be an integer from 1 to 8, got {bits!r}")
        need = packed_words(k, bits)
        if words not in need.values():
            layouts = (f"{need['dense']}" if need["dense"] == need["padded"] else
                       f"{need['dense']} (dense) or {need['padded']} (padded, compressed-tensors <= 0.17)")
            raise layer_error(name, f"bits={bits} does not match weight_packed {shape} for K={k}: need {layouts} "
                             f"int32 words per row")
        return bits
    fits = sorted({b for b, _ in packings(packed, k)})
    if len(fits) != 1:
        what = "no width" if not fits else f"several widths ({fits})"
        raise layer_error(name, f"weight_packed {shape} holds K={k} codes of {what}; pass bits (the config's num_bits)")
    return fits[0]


#: The activation schemes :func:`from_compressed_tensors` takes (``activations=``): e4m3 input
#: activations with a scale per token computed at run time, or with one static scale per layer.
ACTIVATION_SCHEMES = ("fp8-token", "fp8-tensor")


def activation_scheme(input_activations: Mapping) -> str:
    """mixgemm's name for a compressed-tensors ``input_activations`` config, if mixgemm's e4m3
    path computes it.

    Parameters
    ----------
    input_activations : Mapping
        A config group's ``input_activations`` (as in ``config.json``, or a ``QuantizationArgs``'s
        ``model_dump()``).

    Returns
    -------
    str
        ``"fp8-token"`` for ``{type: "float", num_bits: 8, strategy: "token", dynamic: true}``
        (a scale per token, ``amax / 448``), ``"fp8-tensor"`` for ``{type: "float", num_bits: 8,
        strategy: "tensor", dynamic: false}`` (each layer's ``input_scale``); both symmetric,
        without a ``scale_dtype``.

    Raises
    ------
    ValueError
        Any other scheme (integer or 4-bit activations, groups, dynamic per-tensor scales,
        asymmetric, rounded scales), naming what it is.
    """
    if not isinstance(input_activations, Mapping):
        raise TypeError(f"input_activations must be a mapping (a config group's), got "
                        f"{type(input_activations).__name__}")
    a = input_activations
    kind, bits = str(a.get("type", "int")), a.get("num_bits", 8)
    group = a.get("group_size")
    strategy = str(a.get("strategy") or ("tensor" if group is None else "group" if group > 0 else "channel"))
    dynamic = a.get("dynamic", False)
    what = (f"{kind} {bits}-bit input activations, strategy {strategy!r}, "
            f"{'dynamic' if dynamic is True else 'static' if dynamic is False else f'dynamic={dynamic!r}'}")
    if kind != "float" or bits != 8:
        raise ValueError(f"{what}: mixgemm's e4m3 activations are float 8-bit ones")
    if not a.get("symmetric", True):
        raise ValueError(f"{what}, asymmetric: mixgemm's e4m3 activations are symmetric")
    if a.get("scale_dtype") is not None:
        raise ValueError(f"{what}, scales rounded to {a.get('scale_dtype')}: mixgemm's activation scales are "
                         f"float32")
    if strategy == "token" and dynamic is True:
        return "fp8-token"
    if strategy == "tensor" and dynamic is False:
        return "fp8-tensor"
    raise ValueError(f"{what}: mixgemm's e4m3 activations take a scale per token (strategy 'token', dynamic) or "
                     f"one static scale per layer (strategy 'tensor', not dynamic)")


def _int_codes(name: str, codes: torch.Tensor, weight_shape, bits: Optional[int]) -> Tuple[torch.Tensor, int]:
    """The unsigned codes ``q + 2^(b-1)`` (uint8 ``[N, K]``) of an ``"int-quantized"`` layer's int8
    ``weight`` (signed codes, unpacked), and ``bits``, which the config must give."""
    n, k = codes.shape
    if weight_shape is not None:
        shape = [int(v) for v in (weight_shape.flatten().tolist()
                                  if isinstance(weight_shape, torch.Tensor) else weight_shape)]
        if shape != [n, k]:
            raise layer_error(name, f"weight_shape {shape} does not match the int8 codes {[n, k]}")
    if bits is None:
        raise layer_error(name, "an int-quantized layer's int8 codes do not say their width: pass bits (the "
                          "config's num_bits)")
    check_bits(name, bits, "compressed-tensors")
    check_kernel_shape(name, n, k)
    offset = 1 << (bits - 1)
    lo, hi = int(codes.min()), int(codes.max())
    if lo < -offset or hi > offset - 1:
        raise layer_error(name, f"int8 codes in [{lo}, {hi}] are not {bits}-bit ones ([{-offset}, {offset - 1}])")
    return (codes.to(torch.int16) + offset).to(torch.uint8), bits


def _input_quantization(name: str, activations: Optional[str], input_scale, bits: int):
    """``(act_format, input_scale)`` of an imported layer: ``("bf16", None)``, ``("fp8", None)``
    (per token) or ``("fp8", scale)`` (static: float32, 0-d, checked positive and finite)."""
    if activations is None:
        if input_scale is not None:
            raise layer_error(name, "input_scale is given, but activations is None: pass activations='fp8-tensor'")
        return "bf16", None
    if activations not in ACTIVATION_SCHEMES:
        raise ValueError(f"activations must be None or one of {ACTIVATION_SCHEMES}, got {activations!r}")
    if bits not in (4, 2):
        raise layer_error(name, f"e4m3 activations need 4- or 2-bit weights (their codes are exact in e4m3); this "
                          f"layer is {bits}-bit: import it with activations=None (bf16/fp16 activations)",
                          UnsupportedLayerError)
    if activations == "fp8-token":
        if input_scale is not None:
            raise layer_error(name, "an input_scale is given, but the activations are quantized per token (dynamic)")
        return "fp8", None
    if input_scale is None:
        raise layer_error(name, "static per-tensor e4m3 activations need the layer's input_scale")
    check_tensor(name, "input_scale", input_scale, floating=True)
    if input_scale.numel() != 1:
        raise layer_error(name, f"input_scale must hold one value (per tensor), got shape {list(input_scale.shape)}")
    v = float(input_scale.double())
    if not (math.isfinite(v) and v > 0):
        raise layer_error(name, f"input_scale must be positive and finite, got {v!r}")
    return "fp8", input_scale.detach().reshape(()).to(torch.float32).clone()   # exact from bf16 / fp16


def from_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                            weight_shape: Optional[Union[torch.Tensor, Tuple[int, int]]] = None,
                            weight_zero_point: Optional[torch.Tensor] = None,
                            weight_g_idx: Optional[torch.Tensor] = None, *,
                            bits: Optional[int] = None, group_size: Optional[int] = None,
                            dtype: DTypeLike = None, symmetric: Optional[bool] = None,
                            name: str = "<compressed-tensors>", tp_rank: int = 0, tp_size: int = 1,
                            tp_dim: int = 0, activations: Optional[str] = None,
                            input_scale: Optional[torch.Tensor] = None) -> ImportedLayer:
    """Convert a compressed-tensors ``format="pack-quantized"`` (or ``"int-quantized"``) layer
    (int, "group" or "channel" strategy), with its e4m3 input activations if it has them.

    compressed-tensors stores signed codes ``q`` (and zero points ``z``) in
    ``[-2^(b-1), 2^(b-1)-1]`` and dequantizes (``_dequantize``)::

        w[n, k] = (q[n, k].to(s.dtype) - z[n, g].to(s.dtype)) * s[n, g]   (z = 0 if symmetric)

    with ``g = k // group_size`` (``g = g_idx[k]`` for ``actorder="group"`` layers). mixgemm
    stores ``q + 2^(b-1)`` and ``z + 2^(b-1)`` (the same difference) when asymmetric, ``q``
    when symmetric.

    Bit-exact with this formula when ``dtype`` is the scales' dtype (the default); with
    another ``dtype``, within the bound given under "Bit-exactness" in the module docstring.

    Parameters
    ----------
    weight_packed : torch.Tensor
        int32 ``[N, K * bits / 32]`` (``pack_to_int32``): code ``i`` of a row (offset to
        unsigned, ``q + 2^(b-1)``) at bit ``i * bits`` of the row's little-endian bit stream,
        i.e. code ``j`` of word ``c`` is element ``c * 32/bits + j`` at bits ``bits*j ..``.
        A 3, 5, 6 or 7-bit layer (which mixgemm cannot represent: UnsupportedLayerError) is
        recognised in both of compressed-tensors' layouts, told apart by the word count
        (:func:`packed_words`): dense (0.18 on) or padded (up to 0.17). Or the int8 ``weight``
        ``[N, K]`` of an ``"int-quantized"`` layer (``NaiveQuantizationCompressor``: the signed
        codes unpacked, the format compressed-tensors infers for integer weights with quantized
        input activations); ``bits`` is then required.
    weight_scale : torch.Tensor
        ``[N, G]`` ("group") or ``[N, 1]`` ("channel"), floating point.
    weight_shape : torch.Tensor or tuple, optional
        ``[N, K]`` (int tensor of 2 elements); required unless ``bits`` is given.
    weight_zero_point : torch.Tensor, optional
        Asymmetric layers only: int32 ``[N * bits / 32, G]`` packed along N the same way
        (``pack_to_int32(zp, bits, packed_dim=0)``, current compressed-tensors), or the
        unpacked signed values ``[N, G]`` (integer-valued, any dtype).
    weight_g_idx : torch.Tensor, optional
        Integer ``[K]`` (``actorder="group"``); ignored when it contains ``-1`` (the
        "no act-order" placeholder).
    bits : int, optional
        ``num_bits`` (8, 4 or 2); inferred from the shapes when ``None``, checked otherwise.
    group_size, dtype, symmetric, name, tp_rank, tp_size, tp_dim
        As for :func:`from_gptq` (``symmetric=None``: symmetric iff there is no zero point
        or every zero point is 0).
    activations : {None, "fp8-token", "fp8-tensor"}
        The layer's input quantization (:func:`activation_scheme` of its config group's
        ``input_activations``): None, the weights alone; ``"fp8-token"``, e4m3 activations
        with a scale per token; ``"fp8-tensor"``, e4m3 activations with the static
        ``input_scale``. Either fp8 scheme needs 4- or 2-bit weights.
    input_scale : torch.Tensor, optional
        ``"fp8-tensor"`` only, and required there: the layer's ``input_scale`` (one value,
        any floating dtype, positive and finite), kept as float32 (exact).

    Returns
    -------
    ImportedLayer
        ``qweight`` ``[N, K]``; ``perm`` for act-order layers (see the module docstring);
        ``act_format`` ``"fp8"`` and ``input_scale`` (None per token) when ``activations`` is
        given. The activations the layer then computes with are
        ``e4m3(clamp(x / s, -448, 448)) * s``, ``s`` the token's ``amax / 448`` or
        ``input_scale``, in float32: compressed-tensors' own ``quantize`` of the same x and
        scale, bit for bit (docs/fp8.md).

    Raises
    ------
    FormatError
        Inconsistent shapes/dtypes or ``bits``, zero points out of range; N % 16, K % 64 or
        the group size unsupported.
        An ``input_scale`` with ``activations`` other than ``"fp8-tensor"``, or none with it;
        one that is not one positive finite value.
    UnsupportedLayerError
        Other bit widths (3, 5, 6, 7: in either layout); the "tensor" strategy (a scalar scale);
        e4m3 activations with 8-bit weights.
    """
    check_tensor(name, "weight_packed", weight_packed, 2, (torch.int32, torch.int8))
    check_tensor(name, "weight_scale", weight_scale, floating=True)
    n, words = weight_packed.shape
    codes = None
    if weight_packed.dtype == torch.int8:                    # int-quantized: the codes, unpacked
        codes, bits = _int_codes(name, weight_packed, weight_shape, bits)
        k = words
    elif weight_shape is not None:
        shape = [int(v) for v in (weight_shape.flatten().tolist()
                                  if isinstance(weight_shape, torch.Tensor) else weight_shape)]
        if len(shape) != 2:
            raise layer_error(name, f"weight_shape must hold [N, K], got {shape}")
        if shape[0] != n:
            raise layer_error(name, f"weight_shape {shape} does not match weight_packed "
                             f"{list(weight_packed.shape)} (N)")
        k = shape[1]
        check_kernel_shape(name, n, k)
        bits = _packed_bits(name, weight_packed, k, bits)
    elif bits is None:
        raise layer_error(name, "pass weight_shape (or bits) to size the weight")
    else:
        k = words * WORD_BITS // bits
    check_bits(name, bits, "compressed-tensors")
    if weight_scale.dim() != 2:
        if weight_scale.numel() == 1:
            raise layer_error(name, "a scalar weight_scale (the 'tensor' strategy) is not supported; "
                             "only 'group' and 'channel'", UnsupportedLayerError)
        raise layer_error(name, f"weight_scale must be [N, G], got {list(weight_scale.shape)}")
    if weight_scale.shape[0] != n:
        raise layer_error(name, f"weight_scale {list(weight_scale.shape)} does not match N={n}")
    num_groups = weight_scale.shape[1]
    gs = resolve_group_size(name, k, num_groups, group_size)
    check_kernel_shape(name, n, k, gs)
    act = layer_dtype(name, dtype, weight_scale.dtype)
    if weight_g_idx is not None and isinstance(weight_g_idx, torch.Tensor) \
            and bool((weight_g_idx == -1).any()):
        weight_g_idx = None
    perm, labels = resolve_groups(name, weight_g_idx, k, num_groups)

    offset = 1 << (bits - 1)
    z_u = None
    if weight_zero_point is not None:
        zp = check_tensor(name, "weight_zero_point", weight_zero_point, 2)
        packed_rows = n * bits // WORD_BITS
        if zp.dtype == torch.int32 and tuple(zp.shape) == (packed_rows, num_groups) \
                and packed_rows != n:
            z_u = unpack_words(zp, bits, dim=0)              # [N, G], already offset
        elif tuple(zp.shape) == (n, num_groups):
            zf = zp.to(torch.float64)
            if not bool((zf == zf.round()).all()) or int(zf.min()) < -offset \
                    or int(zf.max()) > offset - 1:
                raise layer_error(name, f"weight_zero_point values must be integers in "
                                 f"[{-offset}, {offset - 1}]")
            z_u = (zp.to(torch.int16) + offset)
        else:
            raise layer_error(name, f"weight_zero_point must be int32 [{packed_rows}, {num_groups}] "
                             f"(packed along N) or [{n}, {num_groups}], got {zp.dtype} "
                             f"{list(zp.shape)}")
    act_format, in_scale = _input_quantization(name, activations, input_scale, bits)
    q_u = codes if codes is not None else unpack_words(weight_packed, bits, dim=1)[:, :k]   # [N, K], q + offset
    q_u, z_u, s = apply_groups(q_u, z_u, weight_scale, perm, labels)
    qw = finalize_layer(name, q_u, z_u, s, bits=bits, group_size=gs, symmetric=symmetric, act=act)
    layer = ImportedLayer(qweight=qw, perm=perm, act_format=act_format, input_scale=in_scale)
    return shard_imported(layer, name, tp_rank, tp_size, tp_dim)


# ---------------------------------------------------------------------------------------------
# The format's rules (mixgemm.formats.handlers)
# ---------------------------------------------------------------------------------------------
def _ct_rules(targets, scheme: LayerScheme) -> List[Rule]:
    rules = []
    for target in targets or []:
        target = str(target)
        if target.startswith("re:"):
            rules.append(Rule(target[3:], "regex", scheme))
        elif target[:1].isupper() and "." not in target:
            rules.append(Rule(target, "class", scheme))   # a module class, e.g. "Linear"
        else:
            rules.append(Rule(target, "name", scheme))
    return rules


#: The layouts of integer weights that mixgemm reads (a config group's ``format``): codes packed
#: into int32 words (``weight_packed``), or unpacked int8 codes (``weight``: what compressed-tensors
#: writes for integer weights with quantized activations unless told otherwise)
LAYOUTS = ("pack-quantized", "int-quantized")

def stores_int_codes(qconfig: QuantizationConfig, name: str, class_name: str = "Linear",
                     has: Optional[Callable[[str], bool]] = None) -> bool:
    """Whether ``qconfig`` stores the layer ``name`` as compressed-tensors ``"int-quantized"``
    codes (an int8 ``weight`` beside its ``weight_scale``, where another format's primary tensor
    would be): a compressed-tensors config whose group for the layer has that layout and, with
    ``has`` (the checkpoint holds the layer's tensor of a suffix), both tensors there."""
    if qconfig.method is not Format.COMPRESSED_TENSORS:
        return False
    if has is not None and not (has("weight") and has("weight_scale")):
        return False
    scheme = qconfig.scheme_for(name, class_name)
    return scheme.quantized and scheme.checkpoint_format == "int-quantized"


def holds_int_codes(tensors: Mapping, prefix: str) -> bool:
    """Whether the layer ``prefix`` of a state dict is a compressed-tensors ``"int-quantized"``
    one by its tensors alone: an int8 ``weight`` beside a ``weight_scale``, and no
    ``weight_packed`` (a bf16 ``weight`` is a plain one, whatever is beside it).

    Parameters
    ----------
    tensors : Mapping
        A state dict (names as in the checkpoint).
    prefix : str
        The layer's name (``""`` for none).

    Returns
    -------
    bool
    """
    codes = tensors.get(tensor_key(prefix, "weight"))
    return (isinstance(codes, torch.Tensor) and codes.dtype == torch.int8
            and tensor_key(prefix, "weight_scale") in tensors and tensor_key(prefix, "weight_packed") not in tensors)


#: The first compressed-tensors version that packs 3/5/6/7-bit codes densely.
_CT_DENSE_SINCE = (0, 18)


def packing_of_version(version) -> Optional[str]:
    """``"padded"`` or ``"dense"`` from a compressed-tensors ``version`` string ("0.17.1",
    "0.10.3.a20250101", ...); None when there is none or it does not start with major.minor."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(version)) if version is not None else None
    if m is None:
        return None
    return "dense" if (int(m.group(1)), int(m.group(2))) >= _CT_DENSE_SINCE else "padded"


def parse_config(qc: Mapping, raw: dict, where: str) -> QuantizationConfig:
    """A ``"compressed-tensors"`` ``quantization_config`` (``format`` one of :data:`LAYOUTS`, kept
    as each layer's :attr:`LayerScheme.checkpoint_format`): each
    ``config_groups`` entry's ``targets``, ``weights`` and ``input_activations``
    (:func:`activation_scheme`, into :attr:`LayerScheme.activations`; a warning says that
    ``from_pretrained`` computes with bf16/fp16 activations unless given ``act_format="fp8"``), ``ignore``,
    ``version``."""
    fmt = qc.get("format")
    packing = packing_of_version(qc.get("version"))
    rules: List[Rule] = _ct_rules(qc.get("ignore"), LayerScheme(quantized=False))
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        raise CheckpointError(f"{where}: compressed-tensors config_groups must be an object")
    for gname, group in groups.items():
        if not isinstance(group, Mapping):
            raise CheckpointError(f"{where}: compressed-tensors config group {gname!r} must be an object")
        weights = group.get("weights")
        if not weights:
            continue
        gfmt = group.get("format") or fmt
        if gfmt not in LAYOUTS:
            raise CheckpointError(f"{where}: compressed-tensors format {gfmt!r} (config group {gname!r}) is not "
                                  f"supported: mixgemm reads integer weights in the {' and '.join(map(repr, LAYOUTS))} "
                                  f"formats")
        if str(weights.get("type", "int")) != "int":
            raise CheckpointError(f"{where}: compressed-tensors config group {gname!r} has {weights.get('type')!r} "
                                  f"weights; mixgemm reads integer ones")
        activations = None
        if group.get("input_activations"):
            try:
                activations = activation_scheme(group["input_activations"])
            except (TypeError, ValueError) as e:
                warnings.warn(f"mixgemm.hf: {where}: compressed-tensors config group {gname!r} quantizes the input "
                              f"activations ({e}); mixgemm computes with bf16/fp16 activations and ignores that",
                              stacklevel=3)
            else:
                warnings.warn(f"mixgemm.hf: {where}: compressed-tensors config group {gname!r} quantizes the input "
                              f"activations to e4m3 ({activations}); from_pretrained computes with bf16/fp16 "
                              f"activations (exact) unless it is given act_format='fp8'"
                              + (", which quantizes with the layers' static input scales (the largest of the "
                                 "parts' for a fused q/k/v or gate/up layer)" if activations == "fp8-tensor" else
                                 ", which quantizes each token with its own scale"), stacklevel=3)
        strategy = str(weights.get("strategy", "group"))
        group_size = {"group": config_int(weights, "group_size"), "channel": -1}.get(strategy)
        scheme = LayerScheme(bits=config_int(weights, "num_bits"), group_size=group_size, packing=packing,
                             activations=activations, checkpoint_format=gfmt)
        rules.extend(_ct_rules(group.get("targets"), scheme))
    return QuantizationConfig(Format.COMPRESSED_TENSORS, raw, LayerScheme(quantized=False), tuple(rules))


def import_tensors(get, tensors, prefix, *, dtype, bits, group_size, checkpoint_format, symmetric,
                   activations=None):
    """The layer ``prefix`` of a state dict (``get(suffix)``: its tensor), by
    :func:`from_compressed_tensors`: ``weight_packed`` (pack-quantized) or, without one, an int8
    ``weight`` (int-quantized); with ``activations`` (:data:`ACTIVATION_SCHEMES`), its
    ``input_scale`` (static) and an ``input_zero_point``, which must be 0."""
    packed = get("weight_packed", False)
    if packed is None:
        codes = tensors.get(tensor_key(prefix, "weight"))
        packed = codes if isinstance(codes, torch.Tensor) and codes.dtype == torch.int8 else get("weight_packed")
    input_scale = get("input_scale", False) if activations is not None else None
    zero = get("input_zero_point", False) if activations is not None else None
    if zero is not None and bool((zero.float() != 0).any()):
        raise layer_error(prefix, "input_zero_point is not 0: mixgemm's e4m3 activations are symmetric")
    return from_compressed_tensors(
        packed, get("weight_scale"), get("weight_shape", packed.dtype != torch.int8), get("weight_zero_point", False),
        get("weight_g_idx", False), bits=bits, group_size=group_size, dtype=dtype, symmetric=symmetric,
        name=prefix, activations=activations, input_scale=input_scale)


def _ct_layout(prefix: str, what: str, words: torch.Tensor, count: int, dim: int, bits: Optional[int],
               packing: Optional[str]) -> tuple:
    """``(bits, layout)`` of ``count`` compressed-tensors codes in int32 ``words`` along ``dim``:
    ``"dense"`` (a bit stream, 0.18 on) or ``"padded"`` (``32 // bits`` codes per word, up to 0.17),
    told apart by the word count and the padded layout's zero spare bits
    (:func:`packings`); where both remain possible (as many
    words, and different contents), by ``packing`` (the config's version), else refused."""
    shape = list(words.shape)
    found = packings(words, count, bits, dim)
    if not found:
        if bits is None:
            raise FormatError(f"layer {prefix!r}: {what} {shape} does not hold {count} codes of any width")
        need = packed_words(count, bits)
        raise FormatError(f"layer {prefix!r}: {what} {shape} does not hold {count} {bits}-bit codes: need "
                          f"{need['dense']} (dense) or {need['padded']} (padded) int32 words")
    widths = sorted({b for b, _ in found})
    if len(widths) != 1:
        raise FormatError(f"layer {prefix!r}: {what} {shape} does not say the bits for {count} codes "
                          f"({widths} fit); the config's num_bits is needed")
    b = widths[0]
    layouts = {layout for _, layout in found}
    if len(layouts) == 1:
        return b, layouts.pop()
    if -(-count // (32 // b)) == 1:
        return b, "dense"                              # one word: the two layouts are the same
    if packing in ("dense", "padded"):
        return b, packing
    raise FormatError(f"layer {prefix!r}: {what} {shape} holds {count} {b}-bit codes in as many words densely "
                      f"(compressed-tensors 0.18 on) as padded (up to 0.17), and the config's 'version' does not "
                      f"say which wrote it")


def _ct_unpack(words: torch.Tensor, bits: int, layout: str, count: int, dim: int) -> torch.Tensor:
    if layout == "dense":
        return unpack_stream(words, bits, count, dim)
    per = 32 // bits                                   # padded: codes j of word c is element c * per + j
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    codes = (w.unsqueeze(-1) >> (torch.arange(per) * bits)) & ((1 << bits) - 1)
    return codes.flatten(-2)[..., :count].movedim(-1, dim)


def dequantize(tensors: Mapping, prefix: str, scheme: LayerScheme) -> torch.Tensor:
    """compressed-tensors' formula: ``w[n, k] = (q[n, k] - z[n, g]) * s[n, g]`` with signed codes, a
    scalar scale ("tensor" strategy) or any group size, in the scales' dtype, ``[N, K]``."""
    packed, scale = required_tensor(tensors, prefix, "weight_packed"), required_tensor(tensors, prefix, "weight_scale")
    shape = tensors.get(f"{prefix}.weight_shape")
    if shape is None:
        raise FormatError(f"layer {prefix!r}: missing tensor {prefix + '.weight_shape'!r}")
    n, k = (int(v) for v in shape.flatten().tolist())
    bits, layout = _ct_layout(prefix, "weight_packed", packed, k, 1, scheme.bits, scheme.packing)
    offset = 1 << (bits - 1)
    q = _ct_unpack(packed, bits, layout, k, 1) - offset                # [N, K], signed
    dt = scale.dtype
    zp = tensors.get(f"{prefix}.weight_zero_point")
    if scale.numel() == 1:                                            # "tensor" strategy
        z = torch.zeros(()) if zp is None else zp.flatten()[:1].to(torch.int64).reshape(())
        return ((q.to(dt) - z.to(dt)) * scale.reshape(())).contiguous()
    if scale.dim() != 2 or scale.shape[0] != n:
        raise FormatError(f"layer {prefix!r}: weight_scale {list(scale.shape)} is not [N={n}, G]")
    num_groups = scale.shape[1]
    g = dequant_groups(k, num_groups, scheme.group_size, _ct_g_idx(tensors.get(f"{prefix}.weight_g_idx")), prefix)
    w = q.to(dt)
    if zp is not None:
        if zp.dtype == torch.int32 and zp.shape[0] != n:             # packed along N
            _, zlayout = _ct_layout(prefix, "weight_zero_point", zp, n, 0, bits, scheme.packing)
            zp = _ct_unpack(zp, bits, zlayout, n, 0) - offset
        w = w - zp.to(dt)[:, g]
    return (w * scale[:, g]).contiguous()


def _ct_g_idx(g_idx: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if g_idx is None or bool((g_idx == -1).any()) else g_idx


def header_layer(prefix: str, tensors: dict, qconfig: QuantizationConfig, scheme: LayerScheme) -> HeaderLayer:
    """A layer from its tensors' shapes: pack-quantized ``weight_packed`` ``[N, K * bits / 32]``,
    or int-quantized int8 codes ``weight`` ``[N, K]`` (:data:`LAYOUTS`); the layer's
    ``num_bits``; symmetric iff there is no ``weight_zero_point``."""
    codes = scheme.checkpoint_format == "int-quantized" and f"{prefix}.weight_packed" not in tensors
    p = header_shape(tensors, f"{prefix}.weight" if codes else f"{prefix}.weight_packed", 2)
    s = header_shape(tensors, f"{prefix}.weight_scale", 2)
    bits = scheme.bits
    if bits is None:
        raise UserError(f"{prefix}: the compressed-tensors config gives this layer no num_bits")
    if 32 % bits:
        raise SkipLayer(f"{bits}-bit codes")
    kernel_bits(bits)
    n, k = (p[0], p[1]) if codes else (p[0], p[1] * 32 // bits)
    symmetric = f"{prefix}.weight_zero_point" not in tensors
    return HeaderLayer(n, k, WeightType.of(bits, symmetric), header_group(k, s[1]))
