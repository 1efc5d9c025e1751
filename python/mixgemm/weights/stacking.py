"""Per-expert tensors of a checkpoint, stacked into :class:`~mixgemm.weights.experts.PackedExperts`.

Mixture-of-experts checkpoints store each expert's projections as separate linears:

* Qwen-MoE / DeepSeek / most: ``<prefix>.experts.<e>.gate_proj.weight``, ``...up_proj...``,
  ``...down_proj...``;
* Mixtral: ``<prefix>.experts.<e>.w1.weight`` (gate), ``w3`` (up), ``w2`` (down).

:func:`stack_experts` takes the packed tensors of ``mixgemm prepack`` (with or without
``--from``) and replaces every such set by one stacked tensor per projection, named after the
experts' prefix:

* ``<prefix>.experts.w13.weight``: gate and up interleaved in 8-row stripes
  (:func:`mixgemm.weights.quantize.interleave_gate_up`, per expert), as
  :func:`mixgemm.moe.fused_moe` and the swiglu epilogue expect, when both are packed;
  otherwise ``<prefix>.experts.gate_proj.weight`` / ``up_proj`` (``w1`` / ``w3``) alone;
* ``<prefix>.experts.w2.weight``: the down projections (``down_proj`` or Mixtral's ``w2``).

Every expert id from 0 to E-1 must have the same projections, of one shape and type; anything
else (a missing expert, ids that skip a number, experts of different shapes or types, some
experts packed and others not) raises :class:`ValueError` naming the experts' prefix, before
anything is written. Other tensors (biases, the router's ``gate.weight``, norms) are left as
they are.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from .experts import PackedExperts
from .layout import prepack, unpack
from .quantize import interleave_gate_up
from .types import PackedWeight

__all__ = ["EXPERT_NAME", "GATE", "UP", "DOWN", "stack_experts", "describe_stacked"]

#: ``<prefix>.experts.<e>.<projection>.<suffix>``
EXPERT_NAME = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<expert>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<suffix>weight)$")
GATE, UP, DOWN = "gate", "up", "down"
#: checkpoint projection name -> its role
ROLES = {"gate_proj": GATE, "w1": GATE, "up_proj": UP, "w3": UP, "down_proj": DOWN, "w2": DOWN}
#: the stacked tensor's projection name for a role alone (gate and up together: "w13")
STACKED_NAMES = {GATE: "gate_proj", UP: "up_proj", DOWN: "w2"}


def _group(tensors: Mapping[str, Any]) -> dict:
    """``{(prefix, suffix): {role: {expert: (name, value)}}}`` of every per-expert tensor."""
    groups: dict = {}
    for name, value in tensors.items():
        m = EXPERT_NAME.match(name)
        if m is None:
            continue
        roles = groups.setdefault((m["prefix"], m["suffix"]), {})
        role = ROLES[m["proj"]]
        experts = roles.setdefault(role, {})
        e = int(m["expert"])
        if e in experts:
            raise ValueError(f"{m['prefix']}: expert {e} has its {role} projection twice "
                             f"({experts[e][0]!r} and {name!r})")
        experts[e] = (name, value)
    return groups


def _check_group(prefix: str, roles: dict) -> None:
    """Same expert ids for every role, ids 0..E-1, every tensor packed."""
    ids = {role: set(experts) for role, experts in roles.items()}
    union = set().union(*ids.values())
    for role, have in ids.items():
        missing = sorted(union - have)
        if missing:
            raise ValueError(f"{prefix}: expert {missing[0]} has no {role} projection (missing expert"
                             f"{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing[:8]))} of {role}); "
                             f"every expert needs the same projections")
    want = set(range(len(union)))
    if union != want:
        gaps = sorted(want - union)
        raise ValueError(f"{prefix}: expert ids are not contiguous from 0: found {len(union)} experts, ids "
                         f"{min(union)}..{max(union)}, missing {', '.join(map(str, gaps[:8]))}")
    for role, experts in roles.items():
        plain = [name for name, value in experts.values() if not isinstance(value, PackedWeight)]
        if plain and len(plain) < len(experts):
            raise ValueError(f"{prefix}: some experts' {role} projections are packed and others not (e.g. "
                             f"{sorted(plain)[0]!r} is not): pack all of them or none (--include / --exclude)")


def stack_experts(tensors: Mapping[str, Any]) -> dict:
    """Replace every set of per-expert packed weights in ``tensors`` by stacked
    :class:`~mixgemm.weights.experts.PackedExperts` (see the module docstring for the names).

    Parameters
    ----------
    tensors : Mapping[str, torch.Tensor | PackedWeight]
        A packed checkpoint, in order.

    Returns
    -------
    dict
        The same tensors with each expert set replaced, in place of its first tensor.
        Unchanged when there are no per-expert packed weights.

    Raises
    ------
    ValueError
        A missing expert, ids not contiguous from 0, experts of different shapes or types, an
        expert with fractional zero points, a projection packed for some experts only.
    """

    groups = _group(tensors)
    position = {name: i for i, name in enumerate(tensors)}
    replaced: dict[str, str] = {}           # first per-expert name of a group -> group key
    stacked: dict[str, dict] = {}
    for (prefix, suffix), roles in groups.items():
        _check_group(prefix, roles)
        if not all(isinstance(v, PackedWeight) for experts in roles.values() for _, v in experts.values()):
            continue                        # none packed: copied as they are
        e_count = len(next(iter(roles.values())))
        ordered = {role: [roles[role][e][1] for e in range(e_count)] for role in roles}
        out: dict = {}
        try:
            if GATE in ordered and UP in ordered:
                w13 = []
                for e, (g, u) in enumerate(zip(ordered.pop(GATE), ordered.pop(UP))):
                    if g.zero_offsets is not None or u.zero_offsets is not None:
                        raise ValueError(f"expert {e} has zero_offsets (fractional zero points): not supported "
                                         f"for experts")
                    if (g.n, g.k, g.weight_type, g.group_size, g.dtype) != (u.n, u.k, u.weight_type, u.group_size,
                                                                             u.dtype):
                        raise ValueError(f"expert {e}: gate {g.weight_type.value} [{g.n}, {g.k}] g{g.group_size} "
                                         f"{g.dtype} and up {u.weight_type.value} [{u.n}, {u.k}] g{u.group_size} "
                                         f"{u.dtype} differ")
                    w13.append(prepack(interleave_gate_up(unpack(g), unpack(u))))
                out[f"{prefix}.w13.{suffix}"] = PackedExperts.stack(w13)
            for role, weights in ordered.items():
                out[f"{prefix}.{STACKED_NAMES[role]}.{suffix}"] = PackedExperts.stack(weights)
        except ValueError as e:
            raise ValueError(f"{prefix}: {e}") from None
        clash = [k for k in out if k in tensors]
        if clash:
            raise ValueError(f"{prefix}: the stacked tensor {clash[0]!r} would replace a tensor of the checkpoint")
        first = min((name for experts in roles.values() for name, _ in experts.values()),
                    key=position.__getitem__)
        replaced[first] = f"{prefix}.{suffix}"
        stacked[f"{prefix}.{suffix}"] = out
    if not stacked:
        return dict(tensors)
    members = {name for (prefix, suffix), roles in groups.items() if f"{prefix}.{suffix}" in stacked
               for experts in roles.values() for name, _ in experts.values()}
    result: dict = {}
    for name, value in tensors.items():
        if name in replaced:
            result.update(stacked[replaced[name]])
        elif name not in members:
            result[name] = value
    return result


def describe_stacked(tensors: Mapping[str, Any]) -> str:
    """One line for a file's metadata: the stacked tensors and the w13 convention."""
    names = [k for k, v in tensors.items() if isinstance(v, PackedExperts)]
    if not names:
        return ""
    return (f"{len(names)} stacked expert tensors (mixgemm.packed_experts); *.w13.*: gate/up interleaved per "
            f"expert in 8-row stripes (mixgemm.moe.fused_moe's w13), *.w2.*: down")
