"""The compile settings of a ``fuse_layers=True`` model's decode step: CUDA-graph trees with
Dynamo's checks of the model's own modules left out.

Every call of a ``torch.compile``\\ d function first evaluates its guards: Dynamo's checks that
whatever the traced code read is still what it was. For a transformers model they are mostly
the modules' attributes, parameters and buffers, thousands for an 8B model, and on a decode step
that replays a CUDA graph their evaluation is a large share of the host's time per token
(docs/compile-and-graphs.md), time ``generate()`` waits for before each step. A fused model's
modules do not change between steps, so :func:`module_guard_filter` keeps every guard except
those on nn.Module state, and of those still keeps each module's ``training`` flag and each
QuantLinear's ``act_format``, and the attention backend its config names (the settings a user
changes on a loaded model). Forward hooks
registered after the first compiled call are not seen either.

What that assumes: after the first compiled call, modules are not replaced or given new
parameter / buffer tensors (copying new values into them, as ``load_state_dict`` does, is
fine). Call ``torch.compiler.reset()`` after such a change. transformers' ``generate()`` uses
:func:`decode_compile_config` for a model that ``quantize_model(fuse_layers=True)`` or
``from_pretrained(fuse_layers=True)`` made, unless its ``generation_config.compile_config``
was set, or a ``compile_config`` is passed to ``generate()``.
"""
from __future__ import annotations

import re

__all__ = ["module_guard_filter", "decode_compile_config"]

#: module attributes whose guards stay: the settings a user changes on a loaded model (the
#: attention backend is read from the modules' config: ``model.set_attn_implementation``)
KEPT_ATTRIBUTES = ("training", "act_format", "_attn_implementation", "_attn_implementation_internal")

_KEPT = re.compile(r"(?:\.|\[')(?:%s)(?:'\])?$" % "|".join(KEPT_ATTRIBUTES))


def module_guard_filter(entries) -> list[bool]:
    """A ``torch.compile`` ``guard_filter_fn``: keep every guard whose source is not inside an
    nn.Module, the guards on the attributes of :data:`KEPT_ATTRIBUTES`, and the checks that a
    module's instance dict does not shadow a class attribute (a QuantLinear's default
    ``act_format`` is its class's: setting it on the layer must recompile).

    Parameters
    ----------
    entries : sequence of torch._dynamo.types.GuardFilterEntry
        The guards of one compiled frame.

    Returns
    -------
    list of bool
        Whether each guard is kept.
    """
    return [not e.orig_guard.source.is_unspecialized_nn_module() or _KEPT.search(e.name) is not None
            or e.guard_type == "NOT_PRESENT_IN_GENERIC_DICT" for e in entries]


def decode_compile_config():
    """transformers' ``CompileConfig`` for a fused model's decode step: the CUDA-graph trees of
    ``mode="reduce-overhead"`` (as the option ``triton.cudagraphs``: torch.compile takes a mode or
    options, not both) with :func:`module_guard_filter`; transformers' other defaults."""
    from transformers import CompileConfig   # (deferred: transformers is optional)

    return CompileConfig(mode=None, options={"triton.cudagraphs": True, "guard_filter_fn": module_guard_filter})
