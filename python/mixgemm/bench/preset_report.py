"""The report of the modes that measure preset by preset (``--model``: :mod:`.model`, ``--moe``:
:mod:`.moe`): one class, :class:`PresetReport`, that each mode subclasses with its schema and
point type, and one table layout, :class:`PresetTable`, that each mode fills with its columns.

* JSON: ``{"schema", "machine", "config", "presets", "points"}`` (standard JSON only: no NaN),
  written atomically; :meth:`PresetReport.from_dict` reads it back.
* ``--save`` splits a run into one report per preset (:func:`split_by_preset`);
  ``--merge`` joins runs on the same GPU that each measured a part (:meth:`PresetReport.merge`).
* The table: the GPU and its measured ceilings, how the run measured, then one block per preset,
  the reasons for any status but ok listed under each block.

A point is a frozen dataclass with at least ``preset``, ``variant``, ``status`` and ``note``
fields and ``key`` (what a merge must not see twice) and ``label`` (the point in words)
properties. Fields named in its ``OMIT_WHEN_NONE`` class attribute (optional fields added after
results were committed) are left out of the JSON when None (:func:`point_to_dict`), so that older
files, which lack them, load and write back byte for byte.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Mapping, Optional, Sequence, TypeVar

from .grid import FAIL, OK, UNAVAILABLE
from .report import MachineInfo, align, fmt, gpu_line, machine_line, write_json_doc

R = TypeVar("R", bound="PresetReport")


def point_to_dict(point: Any) -> dict:
    """A point's JSON object: its fields in order (``dataclasses.asdict``), less those named in
    its class's ``OMIT_WHEN_NONE`` that are None (absent from a document means None)."""
    out = dataclasses.asdict(point)
    for name in getattr(type(point), "OMIT_WHEN_NONE", ()):
        if out.get(name, 0) is None:
            del out[name]
    return out


@dataclasses.dataclass(frozen=True)
class PresetReport:
    """A whole run of a per-preset mode: where (``machine``), how (``config``, the mode's
    ``to_json``), the presets' shapes (``{name: fields}``) and every point, in order.

    Subclasses set :attr:`SCHEMA` and :attr:`POINT`, and what a merge checks and unites.
    """

    machine: MachineInfo
    config: dict
    presets: dict
    points: list

    #: the JSON document's ``schema`` tag
    SCHEMA: ClassVar[str] = ""
    #: the points' dataclass
    POINT: ClassVar[type] = object
    #: ``(config key, words)`` pairs: entries every merged run must share (the words name them in
    #: the error)
    MERGE_SAME: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: config lists that a merge replaces by the sorted union of the runs' and records per run
    MERGE_UNION: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict:
        """The JSON document (standard JSON only: no NaN)."""
        return {"schema": self.SCHEMA, "machine": dataclasses.asdict(self.machine), "config": dict(self.config),
                "presets": {k: dict(v) for k, v in self.presets.items()},
                "points": [point_to_dict(p) for p in self.points]}

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
        """Inverse of :meth:`to_dict` (ValueError for another document)."""
        if data.get("schema") != cls.SCHEMA:
            raise ValueError(f"not a {cls.SCHEMA} document (schema {data.get('schema')!r})")
        return cls(machine=MachineInfo(**data["machine"]), config=dict(data["config"]),
                   presets={k: dict(v) for k, v in data["presets"].items()},
                   points=[cls.POINT(**p) for p in data["points"]])

    @classmethod
    def merge(cls: type[R], reports: Sequence[R]) -> R:
        """One report from runs on the same GPU (e.g. one preset per process): the points of all,
        each as its run measured it; the first run's machine; ``config["runs"]`` lists each run's
        timestamp, read bandwidth and presets (and its :attr:`MERGE_UNION` entries).

        Raises
        ------
        ValueError
            No reports, different GPUs (or :attr:`MERGE_SAME` entries), or a point measured twice.
        """
        if not reports:
            raise ValueError("nothing to merge")
        first = reports[0]
        seen: set = set()
        points: list = []
        presets: dict = {}
        for r in reports:
            if r.machine.gpu_name != first.machine.gpu_name:
                raise ValueError(f"runs on different GPUs: {first.machine.gpu_name!r} and {r.machine.gpu_name!r}")
            for key, words in cls.MERGE_SAME:
                if r.config.get(key) != first.config.get(key):
                    raise ValueError(f"runs with different {words}: {first.config.get(key)} and {r.config.get(key)}")
            for p in r.points:
                if p.key in seen:
                    raise ValueError(f"{p.label} is in more than one run")
                seen.add(p.key)
                points.append(p)
            presets.update(r.presets)
        config = {**first.config, "presets": list(presets)}
        for key in cls.MERGE_UNION:
            config[key] = sorted({v for r in reports for v in r.config.get(key, [])})
        config["runs"] = [{"timestamp": r.machine.timestamp, "read_bw_gbps": r.machine.read_bw_gbps,
                           "presets": list(r.presets), **{key: r.config.get(key) for key in cls.MERGE_UNION}}
                          for r in reports]
        return cls(first.machine, config, presets, points)


def split_by_preset(report: R) -> dict[str, R]:
    """One report per preset, in the order of the points (``--save`` writes
    ``<mode>-<preset>.json``); each one's ``config["presets"]`` names its preset only."""
    names = list(dict.fromkeys(p.preset for p in report.points))
    return {name: type(report)(report.machine, {**report.config, "presets": [name]},
                               {name: report.presets[name]} if name in report.presets else {},
                               [p for p in report.points if p.preset == name])
            for name in names}


def write_report_json(path: Path, report: PresetReport) -> Path:
    """Write ``report`` as JSON, atomically (creating the folder); returns the path."""
    return write_json_doc(path, report.to_dict())


def failed(points: Iterable[Any]) -> list:
    """The points that FAILed (wrong or non-finite results)."""
    return [p for p in points if p.status == FAIL]


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a table: its title, a point's cell, right-aligned or not."""

    title: str
    cell: Callable[[Any], str]
    right: bool = True


def megabytes(nbytes: Optional[int]) -> str:
    """``nbytes`` in MB (10^6 bytes) with one decimal; ``-`` for None."""
    return fmt(None if nbytes is None else nbytes / 1e6, ".1f")


#: Columns that the per-preset modes share.
VARIANT = Column("variant", lambda p: p.variant, right=False)
PERCENT_OF_FLOOR = Column("%floor", lambda p: fmt(None if p.frac_of_floor is None else 100 * p.frac_of_floor,
                                                   ".0f", "%"))
SPEEDUP_VS_BF16 = Column("x bf16", lambda p: fmt(p.speedup_vs_bf16, ".2f", "x"))
ERR = Column("err", lambda p: fmt(p.err, ".1e"))
ITERS = Column("iters", lambda p: fmt(p.iters, "d"))
STATUS = Column("status", lambda p: p.status, right=False)


def first_seen(values: Iterable[Any]) -> dict[Any, int]:
    """``{value: index}`` in the order the values first appear."""
    return {v: i for i, v in enumerate(dict.fromkeys(values))}


@dataclasses.dataclass(frozen=True)
class PresetTable:
    """How a per-preset mode lays its points out as text.

    ``how(config)`` ends the run's line (``bf16 activations, group size G, <how>``);
    ``heading(name, preset, points)`` heads a preset's block when its shape is known (else the
    name); ``order(points)`` gives the sort key of a block's rows; ``note_key(point)`` names a
    point whose status is not ok in the notes (an unavailable variant is named once, by its
    name); ``footer(points)`` gives lines between a block's rows and its notes.
    """

    columns: tuple[Column, ...]
    how: Callable[[Mapping[str, Any]], str]
    heading: Callable[[str, Any, list], str]
    order: Callable[[list], Callable[[Any], Any]]
    note_key: Callable[[Any], str]
    footer: Callable[[list], list[str]] = lambda points: []

    @property
    def header(self) -> tuple[str, ...]:
        return tuple(c.title for c in self.columns)

    def format(self, points: Sequence[Any], machine: Optional[MachineInfo] = None,
               config: Optional[Mapping[str, Any]] = None, presets: Optional[Mapping[str, Any]] = None) -> str:
        """The points as aligned text: the machine and run lines (when given), then one block per
        preset in the order of the points."""
        lines: list[str] = []
        if machine is not None:
            lines += [gpu_line(machine), machine_line(machine)]
        if config:
            quick = "  QUICK RUN (fewer iterations: not a measurement)" if config.get("quick") else ""
            lines.append(f"bf16 activations, group size {config.get('group_size')}, {self.how(config)}{quick}")
        by_preset: dict[str, list] = {}
        for p in points:
            by_preset.setdefault(p.preset, []).append(p)
        for name, mine in by_preset.items():
            preset = (presets or {}).get(name)
            lines += ["", name if preset is None else self.heading(name, preset, mine)]
            rows = [list(self.header)]
            notes: dict[str, str] = {}
            for p in sorted(mine, key=self.order(mine)):
                rows.append([c.cell(p) for c in self.columns])
                if p.status != OK and p.note:
                    notes.setdefault(p.variant if p.status == UNAVAILABLE else self.note_key(p),
                                     f"{p.status}: {p.note}")
            lines += align(rows, [c.right for c in self.columns])
            lines += self.footer(mine)
            lines += [f"  {k}: {v}" for k, v in notes.items()]
        return "\n".join(lines)


__all__ = ["point_to_dict", "PresetReport", "split_by_preset", "write_report_json", "failed", "Column", "megabytes", "VARIANT",
           "PERCENT_OF_FLOOR", "SPEEDUP_VS_BF16", "ERR", "ITERS", "STATUS", "first_seen", "PresetTable"]
