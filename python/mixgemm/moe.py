"""Mixture of experts: stacked expert weights and the grouped GEMM over them.

* :class:`PackedExperts` (:mod:`mixgemm.experts`): E prepacked weights of one shape and type.
"""
from __future__ import annotations

from .experts import PackedExperts

__all__ = ["PackedExperts"]
