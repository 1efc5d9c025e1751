"""Load a quantized Hugging Face checkpoint straight into a transformers model:
:func:`from_pretrained` (:mod:`.pretrained` says how it works)."""
from .materialize import FusedQKVAttention, GatedMLP, LoadSummary
from .pretrained import from_pretrained

__all__ = ["from_pretrained", "FusedQKVAttention", "GatedMLP", "LoadSummary"]
