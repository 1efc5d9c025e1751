"""The safetensors shards of a model directory (with or without ``model.safetensors.index.json``),
read lazily: :class:`Shards`. Needs no transformers."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from ..weights import io as mio
from ..weights.types import PackedWeight

__all__ = ["Shards", "INDEX"]

#: The index transformers writes next to a sharded checkpoint.
INDEX = "model.safetensors.index.json"


class Shards:
    """The safetensors shards of a model directory, read lazily.

    Plain safetensors shards are opened with ``safe_open`` (their headers are validated on
    opening: a truncated file is refused then) and each tensor is read when asked for; a
    :func:`mixgemm.save` shard is read whole by :func:`mixgemm.load` (its packed weights are
    entries of their own). Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, model_dir: Union[str, os.PathLike]):
        self.dir = Path(model_dir)
        self._stack = contextlib.ExitStack()
        self._where: Dict[str, Tuple[object, str]] = {}   # key -> (handle or dict, file name)
        self._weight_map: Optional[Dict[str, str]] = None   # from the index, if there is one
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _files(self) -> List[Path]:
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted({str(v) for v in weight_map.values()})
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
            missing = [f for f in files if not (self.dir / f).is_file()]
            if missing:
                raise CheckpointError(f"{self.dir}: the shard {missing[0]!r} listed in {INDEX} is missing "
                                      f"({len(missing)} of {len(files)} shards missing: an incomplete download?)")
            self._weight_map = {str(k): str(v) for k, v in weight_map.items()}
            return [self.dir / f for f in files]
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            other = sorted(p.name for p in self.dir.glob("*.bin"))
            hint = f" (found {other[0]}: PyTorch pickle checkpoints are not read)" if other else ""
            raise CheckpointError(f"{self.dir}: no *.safetensors weights{hint}")
        return files

    def _open(self) -> None:
        for path in self._files():
            try:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            except Exception as e:  # SafetensorError, OSError
                raise CheckpointError(f"{path}: not a valid safetensors file (truncated or corrupt?): {e}") from None
            raw_keys = list(handle.keys())
            if self._weight_map is not None:
                wrong = [k for k in raw_keys if self._weight_map.get(k) != path.name]
                listed = [k for k, f in self._weight_map.items() if f == path.name and k not in set(raw_keys)]
                if wrong or listed:
                    key = (wrong or listed)[0]
                    raise CheckpointError(f"{path}: disagrees with {INDEX}: tensor {key!r} is "
                                          f"{'in this file but not listed for it' if wrong else 'listed but missing'}")
            source: object = handle
            keys = raw_keys
            if mio.is_mixgemm_metadata(handle.metadata() or {}):
                try:
                    source = mio.load(str(path))       # packed weights are entries of their own
                except mio.MixgemmFormatError as e:
                    raise CheckpointError(str(e)) from None
                keys = list(source)
            for key in keys:
                if key in self._where:
                    raise CheckpointError(f"{self.dir}: tensor {key!r} is in both {self._where[key][1]} and {path.name}")
                self._where[key] = (source, path.name)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "Shards":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def file_of(self, key: str) -> str:
        return self._where[key][1]

    def is_packed(self, key: str) -> bool:
        """Whether ``key`` is a mixgemm packed weight."""
        source, _ = self._where[key]
        return isinstance(source, dict) and isinstance(source[key], PackedWeight)

    def shape(self, key: str) -> Tuple[int, ...]:
        """The stored shape (``(N, K)`` for a packed weight), without reading the data."""
        source, _ = self._where[key]
        if isinstance(source, dict):
            value = source[key]
            return (value.n, value.k) if isinstance(value, PackedWeight) else tuple(value.shape)
        return tuple(source.get_slice(key).get_shape())

    def get(self, key: str) -> Union[torch.Tensor, PackedWeight]:
        """The tensor (or packed weight) ``key``, on the CPU, as stored."""
        source, name = self._where[key]
        if isinstance(source, dict):
            return source[key]
        try:
            return source.get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"{self.dir / name}: cannot read tensor {key!r} (corrupt file?): {e}") from None

    def get_part(self, key: str, dim: int, rank: int, size: int) -> torch.Tensor:
        """The ``rank``-th of ``size`` equal slices of the plain tensor ``key`` along ``dim``,
        on the CPU: read as a slice from the file (safetensors ``get_slice``: the rest is never
        read), or cut from a mixgemm file's tensor."""
        source, name = self._where[key]
        shape = self.shape(key)
        part = shape[dim] // size
        index = tuple(slice(rank * part, (rank + 1) * part) if d == dim else slice(None) for d in range(len(shape)))
        if isinstance(source, dict):
            return source[key][index].contiguous()
        try:
            return source.get_slice(key)[index].contiguous()
        except Exception as e:
            raise CheckpointError(f"{self.dir / name}: cannot read tensor {key!r} (corrupt file?): {e}") from None
