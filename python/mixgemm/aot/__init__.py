"""What a model needs built ahead of time: the kernels of its layers (:mod:`.prebuild`) and of
a checkpoint on disk (:mod:`.checkpoint`)."""
from .prebuild import ExpertsUse, WeightUse, build_for, moe_specs_for, specs_for, token_counts, uses_of

__all__ = ["WeightUse", "ExpertsUse", "token_counts", "uses_of", "specs_for", "moe_specs_for", "build_for"]
