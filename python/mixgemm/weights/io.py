"""Saving and loading tensors and prepacked weights as safetensors files.

File format (version :data:`FORMAT_VERSION`)
--------------------------------------------
A mixgemm file is an ordinary safetensors file:

* a plain tensor ``name`` is stored as the safetensors tensor ``name``;
* a :class:`~mixgemm.weights.types.PackedWeight` ``name`` is stored as the tensors ``name.qdata``
  (uint8 ``[N/16, K/64, 128*bits]``), ``name.scales`` (``[G, N]``, bf16/fp16) and, for
  asymmetric weights, ``name.zeros`` (``[G, N]``), plus the header metadata entry
  ``mixgemm:name`` holding the JSON of :meth:`PackedWeight.metadata` (weight type, group
  size, N, K, arch, layout version, ...); a weight imported with fractional zero points (HQQ)
  also has ``name.zero_offsets`` (float32 ``[G, N]``, see :class:`~mixgemm.weights.types.PackedWeight`);
* the header metadata entry ``mixgemm:format_version`` is the oldest version that can read the
  file: ``"2"`` when a weight has ``zero_offsets`` (which a version-1 reader would ignore), else
  ``"1"``;
* a :class:`~mixgemm.weights.experts.PackedExperts` ``name`` (E experts of one shape and type, stacked)
  is stored like a packed weight with a leading expert dimension on each tensor (``name.qdata``
  ``[E, N/16, K/64, 128*bits]``, ``name.scales`` / ``name.zeros`` ``[E, G, N]``), and its
  ``mixgemm:name`` JSON has ``"format": "mixgemm.packed_experts"`` and ``"experts": "E"``. A
  file holding stacked experts has format version ``"3"`` (older readers refuse it and ask for an
  upgrade); files without them keep the versions above.

User metadata (``str -> str``) is stored alongside; keys starting with ``mixgemm:`` are
reserved. Files written by a newer mixgemm (a larger format or layout version) are refused
with a message asking to upgrade, never misread.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Dict, Optional, Union

import safetensors.torch
import torch
from safetensors import safe_open

from .._version import __version__
from ..dtypes import ActType, WeightType
from ..errors import MixgemmFormatError, ShardError
from ..utils.atomic import check_target, replacing, stale_temporaries
from .experts import EXPERTS_FORMAT, PackedExperts
from .types import LAYOUT_VERSION, SUPPORTED_ARCHS, PackedWeight

__all__ = ["FORMAT_VERSION", "MixgemmFormatError", "save", "load", "read_metadata",
           "check_metadata", "is_mixgemm_metadata", "stale_temporaries"]

#: Version of the file format written by :func:`save` (for a file with stacked experts).
FORMAT_VERSION = 3
#: The version written for files with zero_offsets and no stacked experts.
_OFFSETS_VERSION = 2
#: The version written for files without zero_offsets (readable by mixgemm's first format).
_BASE_VERSION = 1

_PREFIX = "mixgemm:"
_VERSION_KEY = "mixgemm:format_version"
_PACKED_FORMAT = "mixgemm.packed"

TensorOrPacked = Union[torch.Tensor, PackedWeight, PackedExperts]


def _upgrade_hint() -> str:
    return f"this is mixgemm {__version__}; upgrade mixgemm (pip install -U mixgemm) to read it"


# ----------------------------------------------------------------------------------- saving


def _flatten(tensors: Mapping, metadata: Optional[Mapping]) -> tuple[dict, dict]:
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a dict of name -> torch.Tensor | PackedWeight, got "
                        f"{type(tensors).__name__}")
    header: Dict[str, str] = {}
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise TypeError(f"metadata must be a dict of str -> str, got {type(metadata).__name__}")
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"metadata must map str to str, got {key!r}: {value!r}")
            if key.startswith(_PREFIX):
                raise ValueError(f"metadata key {key!r}: keys starting with {_PREFIX!r} are "
                                 f"reserved for mixgemm")
            header[key] = value
    needs_v2 = any(isinstance(v, PackedWeight) and v.zero_offsets is not None for v in tensors.values())
    needs_v3 = any(isinstance(v, PackedExperts) for v in tensors.values())
    header[_VERSION_KEY] = str(FORMAT_VERSION if needs_v3 else _OFFSETS_VERSION if needs_v2 else _BASE_VERSION)

    flat: Dict[str, torch.Tensor] = {}
    owner: Dict[str, str] = {}  # safetensors name -> the dict entry that produced it
    storages: set = set()

    def add(key: str, tensor: torch.Tensor, entry: str) -> None:
        if key in flat:
            raise ValueError(f"tensor name {key!r} (from entry {entry!r}) clashes with the one "
                             f"from entry {owner[key]!r}")
        t = tensor.detach().to("cpu").contiguous()
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in storages:  # safetensors refuses tensors that share memory
                t = t.clone()
            storages.add(ptr)
        flat[key] = t
        owner[key] = entry

    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"tensor names must be non-empty str, got {name!r}")
        if isinstance(value, (PackedWeight, PackedExperts)):
            add(f"{name}.qdata", value.qdata, name)
            add(f"{name}.scales", value.scales, name)
            if value.zeros is not None:
                add(f"{name}.zeros", value.zeros, name)
            if isinstance(value, PackedWeight) and value.zero_offsets is not None:
                add(f"{name}.zero_offsets", value.zero_offsets, name)
            header[_PREFIX + name] = json.dumps(value.metadata(), sort_keys=True)
        elif isinstance(value, torch.Tensor):
            add(name, value, name)
        else:
            raise TypeError(f"{name!r}: values must be torch.Tensor, PackedWeight or PackedExperts, got "
                            f"{type(value).__name__}")
    return flat, header


def save(path: Union[str, os.PathLike], tensors: Mapping[str, TensorOrPacked],
         metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write tensors and prepacked weights to one safetensors file, atomically.

    Parameters
    ----------
    path : str or os.PathLike
        Destination file. Its directory must exist. An existing regular file is replaced;
        anything else that exists there (a directory, a device node, a FIFO, a socket) is
        refused before any work.
    tensors : dict of str -> torch.Tensor or PackedWeight
        Plain tensors (any dtype safetensors supports, any device, any strides; saved
        contiguous, from CPU) and prepacked weights (stored as ``name.qdata``,
        ``name.scales`` and, if asymmetric, ``name.zeros``, see the module docstring).
    metadata : dict of str -> str, optional
        Extra header metadata. Keys starting with ``mixgemm:`` are reserved.

    Notes
    -----
    The file is written inside a private temporary directory in the destination directory,
    ``.<name>.<pid>.<random>.tmp/`` (safetensors makes a temporary file of its own next to the
    file it writes: it lands in there too), flushed to disk, then renamed over ``path``
    (``os.replace``, :func:`mixgemm.utils.atomic.replacing`): readers see either the old file or the
    complete new one, never a half-written file, and a failure, an interrupt
    (KeyboardInterrupt), SIGTERM or SIGHUP leaves no temporary behind. A process killed
    outright (SIGKILL) cannot clean up: its temporary directory stays, under that recognisable
    name, and the next :func:`save` to the same ``path`` removes it once no process of that id
    runs on this machine (:func:`stale_temporaries`).

    Raises
    ------
    TypeError, ValueError
        Bad argument types, clashing tensor names, reserved metadata keys. Nothing is
        written in that case.
    mixgemm.errors.OutputPathError
        Refused before any work (:func:`mixgemm.utils.atomic.check_target`): an empty path, one
        ending in ``/``, a missing directory (also a ``FileNotFoundError``), a directory (also
        an ``IsADirectoryError``), an existing thing that is not a regular file.
    OSError
        The directory is not writable, the disk is full, ...
    """
    path = check_target(path)
    flat, header = _flatten(tensors, metadata)

    with replacing(path, directory=True) as tmp:
        safetensors.torch.save_file(flat, tmp, metadata=header)


# ---------------------------------------------------------------------------------- loading


def _open(path: str):
    if not os.path.exists(path):
        raise MixgemmFormatError(f"{path}: no such file")
    if os.path.isdir(path):
        raise MixgemmFormatError(f"{path} is a directory, not a safetensors file")
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError, ...
        raise MixgemmFormatError(f"{path}: not a valid safetensors file (corrupt or truncated?): "
                                 f"{e}") from e


#: The alignment of every tensor :func:`load` returns (the kernels' vectorized loads need 16).
_ALIGNMENT = 16


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy of it in fresh memory where it is not contiguous or its data
    does not start on a multiple of :data:`_ALIGNMENT` bytes (safetensors returns tensors at
    their offset in the file)."""
    if t.numel() and (t.data_ptr() % _ALIGNMENT or not t.is_contiguous()):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _aligned_packed(packed):
    """A packed weight (or stacked experts) whose tensors are each :func:`_aligned` (a shard's
    slices may start anywhere)."""
    changes = {}
    for field in ("qdata", "scales", "zeros", "zero_offsets"):
        t = getattr(packed, field, None)
        if t is not None and _aligned(t) is not t:
            changes[field] = _aligned(t)
    return dataclasses.replace(packed, **changes) if changes else packed


def read_metadata(path: Union[str, os.PathLike]) -> Dict[str, str]:
    """Header metadata of a safetensors file, without reading any tensor data.

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    dict of str -> str
        The header's ``__metadata__`` (empty if it has none).

    Raises
    ------
    MixgemmFormatError
        Missing file, or not a valid safetensors file.
    """
    path = os.fspath(path)
    with _open(path) as f:
        return dict(f.metadata() or {})


def is_mixgemm_metadata(metadata: Mapping[str, str]) -> bool:
    """True if safetensors header metadata has any mixgemm entry (``mixgemm:*``)."""
    return any(key.startswith(_PREFIX) for key in metadata)


def _as_int(spec: Mapping, field: str, where: str) -> int:
    value = spec.get(field)
    if isinstance(value, bool):
        value = None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise MixgemmFormatError(f"{where}: field {field!r} must be an integer, got "
                                 f"{value!r}") from None


def _parse_spec(name: str, text: str, path: str) -> dict:
    """Validate the JSON metadata of packed weight ``name``; return the constructor kwargs
    (less the tensors) plus ``dtype``."""
    where = f"{path}: packed weight {name!r}"
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise MixgemmFormatError(f"{where}: metadata is not valid JSON ({e})") from None
    if not isinstance(spec, dict):
        raise MixgemmFormatError(f"{where}: metadata must be a JSON object, got {text[:80]!r}")
    if spec.get("format") not in (_PACKED_FORMAT, EXPERTS_FORMAT):
        raise MixgemmFormatError(f"{where}: metadata 'format' must be {_PACKED_FORMAT!r} or "
                                 f"{EXPERTS_FORMAT!r}, got {spec.get('format')!r}")
    experts = None
    if spec["format"] == EXPERTS_FORMAT:
        experts = _as_int(spec, "experts", where)
        if experts < 1:
            raise MixgemmFormatError(f"{where}: 'experts' must be >= 1, got {experts}")
    version = _as_int(spec, "layout_version", where)
    if version > LAYOUT_VERSION:
        raise MixgemmFormatError(f"{where} uses layout version {version}, from the future: this "
                                 f"mixgemm reads layout version {LAYOUT_VERSION}; {_upgrade_hint()}")
    if version != LAYOUT_VERSION:
        raise MixgemmFormatError(f"{where} uses the old layout version {version}; this mixgemm "
                                 f"reads version {LAYOUT_VERSION}: prepack the weight again")
    arch = spec.get("arch")
    if arch not in SUPPORTED_ARCHS:
        raise MixgemmFormatError(f"{where} is packed for unknown arch {arch!r}; this mixgemm "
                                 f"supports {list(SUPPORTED_ARCHS)} ({_upgrade_hint()} if it "
                                 f"should)")
    try:
        weight_type = WeightType(spec.get("weight_type"))
    except ValueError:
        raise MixgemmFormatError(f"{where}: unknown weight_type {spec.get('weight_type')!r}; "
                                 f"expected one of {[t.value for t in WeightType]}") from None
    if "bits" in spec and _as_int(spec, "bits", where) != weight_type.bits:
        raise MixgemmFormatError(f"{where}: bits={spec['bits']!r} contradicts weight_type "
                                 f"{weight_type.value!r}")
    if "symmetric" in spec and str(spec["symmetric"]).lower() != str(weight_type.signed).lower():
        raise MixgemmFormatError(f"{where}: symmetric={spec['symmetric']!r} contradicts "
                                 f"weight_type {weight_type.value!r}")
    try:
        act = ActType(spec.get("dtype"))
    except ValueError:
        raise MixgemmFormatError(f"{where}: unknown dtype {spec.get('dtype')!r}; expected "
                                 f"bf16 or fp16") from None
    return dict(weight_type=weight_type, group_size=_as_int(spec, "group_size", where),
                n=_as_int(spec, "n", where), k=_as_int(spec, "k", where), arch=arch,
                layout_version=version, dtype=act.torch_dtype, experts=experts)


def check_metadata(metadata: Mapping[str, str], path: Union[str, os.PathLike] = "<file>"
                   ) -> Dict[str, dict]:
    """Validate the mixgemm entries of safetensors header metadata.

    Parameters
    ----------
    metadata : dict of str -> str
        A safetensors header's metadata (see :func:`read_metadata`).
    path : str or os.PathLike
        Only used in error messages.

    Returns
    -------
    dict of str -> dict
        For each packed weight name, its parsed description (weight_type, group_size, n, k,
        arch, layout_version, dtype, and experts: E for stacked experts, else None). Empty for a
        plain safetensors file.

    Raises
    ------
    MixgemmFormatError
        Missing or bad format version, a format or layout version from the future (the
        message says to upgrade mixgemm), unknown arch, malformed entries.
    """
    path = os.fspath(path)
    version_text = metadata.get(_VERSION_KEY)
    others = [key for key in metadata if key.startswith(_PREFIX) and key != _VERSION_KEY]
    if version_text is None:
        if others:
            raise MixgemmFormatError(f"{path}: has mixgemm entries ({others[0]!r}, ...) but no "
                                     f"{_VERSION_KEY!r}")
        return {}
    try:
        version = int(version_text)
    except ValueError:
        raise MixgemmFormatError(f"{path}: bad {_VERSION_KEY} {version_text!r}") from None
    if version > FORMAT_VERSION:
        raise MixgemmFormatError(f"{path} uses mixgemm file format version {version}, from the "
                                 f"future: this mixgemm reads version {FORMAT_VERSION}; "
                                 f"{_upgrade_hint()}")
    if version < 1:
        raise MixgemmFormatError(f"{path}: bad {_VERSION_KEY} {version_text!r}")
    specs = {key[len(_PREFIX):]: _parse_spec(key[len(_PREFIX):], metadata[key], path) for key in others}
    stacked = [name for name, spec in specs.items() if spec["experts"] is not None]
    if stacked and version < FORMAT_VERSION:
        raise MixgemmFormatError(f"{path}: {stacked[0]!r} holds stacked experts, which need "
                                 f"{_VERSION_KEY} {FORMAT_VERSION}, but the file says {version}")
    return specs


def load(path: Union[str, os.PathLike], device: Union[str, torch.device] = "cpu", *,
         tp_rank: int = 0, tp_size: int = 1, tp_dims: Optional[Mapping[str, int]] = None
         ) -> Dict[str, TensorOrPacked]:
    """Read a file written by :func:`save` (or any safetensors file).

    Parameters
    ----------
    path : str or os.PathLike
        A safetensors file.
    device : str or torch.device, default "cpu"
        Where to put the tensors (e.g. ``"cuda"``).
    tp_rank, tp_size : int, default 0, 1
        Tensor parallelism: with ``tp_size > 1``, each packed weight named in ``tp_dims`` is
        replaced by this rank's shard (:meth:`PackedWeight.shard`), cut on the CPU before it
        goes to ``device`` (only the shard reaches the device). Plain tensors are returned
        whole.
    tp_dims : mapping of str -> int, optional
        Packed weight name -> the dimension to split: 0 (N, column parallel) or 1 (K, row
        parallel). Packed weights not named are kept whole (replicated). Required when
        ``tp_size > 1``.

    Returns
    -------
    dict of str -> torch.Tensor, PackedWeight or PackedExperts
        Plain tensors as stored, each contiguous and 16-byte aligned on any device (so that a
        weight loaded on the CPU and moved with ``.to("cuda")`` is one the kernels take); each
        packed weight rebuilt from its companion tensors and
        metadata into a :class:`PackedWeight` (validated by its constructor), or its shard, each
        stacked one into a :class:`~mixgemm.weights.experts.PackedExperts`. The header's user metadata is
        not returned: see :func:`read_metadata`.

    Raises
    ------
    MixgemmFormatError
        Missing file; corrupt or truncated file; missing or unexpected companion tensors;
        bad metadata; a format or layout version from the future (upgrade mixgemm); an
        unknown arch.
    """
    path = os.fspath(path)
    device = torch.device(device)
    tp_dims = dict(tp_dims or {})
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or isinstance(tp_rank, bool) \
            or not isinstance(tp_rank, int) or tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need integers 0 <= tp_rank < tp_size, got tp_rank={tp_rank!r}, tp_size={tp_size!r}")
    if tp_size > 1 and not tp_dims:
        raise ValueError("tp_size > 1 needs tp_dims: which packed weights to split, and along which dimension")
    with _open(path) as f:
        specs = check_metadata(f.metadata() or {}, path)
        unknown = sorted(set(tp_dims) - set(specs))
        if unknown:
            raise ValueError(f"{path}: tp_dims names {unknown[:3]}, which are not packed weights of the file")
        try:
            raw = {key: _aligned(f.get_tensor(key)) for key in f.keys()}
        except Exception as e:
            raise MixgemmFormatError(f"{path}: cannot read tensor data (corrupt file?): {e}") from e

    out: Dict[str, TensorOrPacked] = {}
    for name, spec in specs.items():
        where = f"{path}: packed weight {name!r}"
        parts = {}
        for part in ("qdata", "scales", "zeros", "zero_offsets"):
            parts[part] = raw.pop(f"{name}.{part}", None)
        for part in ("qdata", "scales") + (("zeros",) if spec["weight_type"].has_zero else ()):
            if parts[part] is None:
                raise MixgemmFormatError(f"{where}: companion tensor {name + '.' + part!r} is "
                                         f"missing")
        if parts["zeros"] is not None and not spec["weight_type"].has_zero:
            raise MixgemmFormatError(f"{where}: unexpected tensor {name + '.zeros'!r} for "
                                     f"symmetric weight type {spec['weight_type'].value!r}")
        if parts["scales"].dtype != spec["dtype"]:
            raise MixgemmFormatError(f"{where}: scales are {parts['scales'].dtype} but the "
                                     f"metadata says {spec['dtype']}")
        kwargs = {key: value for key, value in spec.items() if key not in ("dtype", "experts")}
        try:
            if spec["experts"] is None:
                packed = PackedWeight(qdata=parts["qdata"], scales=parts["scales"],
                                      zeros=parts["zeros"], zero_offsets=parts["zero_offsets"], **kwargs)
            else:
                if parts["zero_offsets"] is not None:
                    raise ValueError(f"unexpected tensor {name + '.zero_offsets'!r}: experts have no zero offsets")
                packed = PackedExperts(qdata=parts["qdata"], scales=parts["scales"], zeros=parts["zeros"], **kwargs)
                if packed.num_experts != spec["experts"]:
                    raise ValueError(f"the tensors hold {packed.num_experts} experts, the metadata says "
                                     f"{spec['experts']}")
        except (TypeError, ValueError) as e:
            raise MixgemmFormatError(f"{where}: inconsistent with its metadata: {e}") from None
        if tp_size > 1 and name in tp_dims:
            try:
                packed = packed.shard(tp_dims[name], tp_rank, tp_size)
            except ValueError as e:
                raise ShardError(f"{path}: packed weight {name!r}: {e}") from None
        out[name] = _aligned_packed(packed.to(device))
    for key, tensor in raw.items():
        if key in out:
            raise MixgemmFormatError(f"{path}: tensor {key!r} has the same name as a packed weight")
        out[key] = _aligned(tensor.to(device))
    return out
