"""The KV storage a fused attention layer keeps between ``generate()`` calls.

transformers' ``generate()`` makes a new static cache on every call, and each cache layer
allocates its keys, values and length counter at its first write. ``torch.compile``'s CUDA-graph
trees (transformers' own compile of the decode step, ``mode="reduce-overhead"``) take those
tensors as static inputs: a graph is recorded for their addresses and replayed while they stay
where they were. A new cache whose tensors land elsewhere makes the trees record the whole
decode step again (warm-up run, capture, instantiation) in the middle of the call, whenever the
allocator happens to place the new cache elsewhere (docs/compile-and-graphs.md measures it).

:class:`StaticKVStore` keeps one layer's tensors after the cache that used them is gone and
hands them to the next cache of the same shapes, dtypes and device, reset to what the cache
would have allocated (zeros, a counter of 0). The addresses then stay fixed from call to call,
and so do the recorded graphs. The tensors are never shared by two live caches: a cache that is
still referenced (a returned ``past_key_values``, a cache passed back for the next turn) keeps
them, and a cache made meanwhile allocates its own, as transformers does (and the store keeps
those for the next call).

The store holds one cache layer's memory after generation (the size of the last static cache);
:func:`release_kv_storage` lets it go.
"""
from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch
from torch import nn

__all__ = ["StaticKVStore", "release_kv_storage"]

#: the tensors of a transformers static cache layer that the store keeps (those present)
FIELDS = ("keys", "values", "cumulative_length")


def _spec(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


class StaticKVStore:
    """One attention layer's static-cache tensors, reused by successive caches (module docstring).

    :meth:`adopt` is called right after a cache layer's ``lazy_initialization``: it either
    swaps in the kept tensors (same shapes, strides, dtypes and device, no live cache using
    them) or keeps the new ones for the next cache.
    """

    def __init__(self):
        self._tensors: Optional[dict[str, torch.Tensor]] = None
        self._owner: Optional[weakref.ref] = None
        self._lock = threading.Lock()     # (two generate() calls in two threads: one gets the tensors)

    def __getstate__(self) -> dict:
        return {}                # a copied or pickled model starts with an empty store

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def __repr__(self) -> str:
        held = "empty" if self._tensors is None else ", ".join(
            f"{k} {tuple(t.shape)}" for k, t in self._tensors.items())
        return f"StaticKVStore({held})"

    @property
    def nbytes(self) -> int:
        """Bytes the store holds."""
        return sum(t.numel() * t.element_size() for t in (self._tensors or {}).values())

    def release(self) -> int:
        """Drop the kept tensors (a live cache that uses them keeps them); returns their bytes."""
        with self._lock:
            n = self.nbytes
            self._tensors, self._owner = None, None
        return n

    def adopt(self, layer) -> bool:
        """Give the freshly initialized cache ``layer`` the kept tensors, or keep its own.

        Returns True when the layer now uses the kept tensors (each set to the value the layer
        had allocated), False when it keeps its own (the first cache, another shape, dtype or
        device, or a cache still alive that uses the kept ones); its own are then kept for the
        next cache."""
        fresh = {name: t for name in FIELDS if isinstance(t := getattr(layer, name, None), torch.Tensor)}
        if not fresh:
            return False
        with self._lock:
            return self._adopt(layer, fresh)

    def _adopt(self, layer, fresh: dict) -> bool:
        owner = self._owner() if self._owner is not None else None
        kept = self._tensors
        if (kept is None or (owner is not None and owner is not layer) or kept.keys() != fresh.keys()
                or any(_spec(kept[k]) != _spec(fresh[k]) for k in fresh)):
            # (the first cache, another shape, or a live cache holding the kept tensors: this one
            # keeps its own, and they are the ones the next cache gets)
            self._tensors = fresh
            self._owner = weakref.ref(layer)
            return False
        for name, t in fresh.items():     # (kept tensors were a cache's own: marked static already)
            kept[name].copy_(t)
            setattr(layer, name, kept[name])
        self._owner = weakref.ref(layer)
        return True


def release_kv_storage(model: nn.Module) -> int:
    """Let every fused attention layer of ``model`` drop the static-cache tensors it keeps for
    the next ``generate()`` call (:class:`StaticKVStore`); returns the bytes released (memory a
    live cache still uses stays with it)."""
    total = 0
    for module in model.modules():
        store = getattr(module, "kv_store", None)
        if isinstance(store, StaticKVStore):
            total += store.release()
    return total
