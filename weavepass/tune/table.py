"""The tuning table: what each rewrite measured against plain Inductor, per layer shape, compile
mode and token count, on one machine at one world size; and the rule ``split="auto"`` picks by.

Written by ``python -m weavepass.tune`` (docs/usage.md), read through ``WeaveConfig.tuning_table``
(``"builtin"``: ``BUILTIN_PATH``, our own measurements; ``"none"``: no table; else a path). JSON,
schema ``weavepass-tuning-table`` version 1::

    {
      "schema": "weavepass-tuning-table", "version": 1,
      "source": "who measured what, how (free text, shown in the explain report)",
      "created_utc": "2026-12-03T15:00:00Z",
      "machine": {"device_type": "cuda", "device_name": "NVIDIA H200", "sms": 132, "gpus": 1},
      "versions": {"torch": "2.11.0+cu130", "triton": "3.6.0", "python": "3.12.3", "weavepass": "..."},
      "world": 1,                    # ranks of the group measured (1: local cost only, nothing communicated)
      "dtype": "bfloat16",
      "layers": 4, "sequences": 1,   # decoder layers per model, sequences per batch
      "time_unit": "ms",             # or "relative": times divided by Inductor's (transcribed tables)
      "timing": "how each time was taken (free text)",
      "min_gain": 0.02,              # a rewrite must be this much faster than Inductor to be chosen
      "entries": [
        {"shape": "70b_tp8sim", "hidden": 8192, "heads": 8, "kv_heads": 1, "head_dim": 128, "mlp": 3584,
         "mode": "default",          # or "reduce-overhead" (Inductor CUDA graphs)
         "cells": [{"tokens": 2048, "times": {"inductor": 4.82, "fuse": 4.70, "split": 5.98},
                    "choice": "fuse"}, ...]}    # tokens strictly increasing; choice = choose() at that cell
      ]
    }

The rule (``choose``; docs/overlap.md, "How `auto` decides"). Rewrites are ordered by how much they
change: ``inductor`` (no rewrite) < ``fuse`` < ``split``. A rewrite is *allowed* at a cell when it
was measured there at least ``min_gain`` faster than Inductor (``time / inductor <= 1 - min_gain``);
Inductor is always allowed. For a token count T:

- T is a measured cell: the fastest rewrite allowed there.
- T lies between two measured cells: a rewrite must be allowed at both; among those, the one whose
  worse ratio of the two is the lowest. Never a rewrite measured slower than Inductor (or within
  ``min_gain`` of it) at a neighbouring cell.
- T lies outside the measured range: only fuse-only is extended, and only when it is allowed at
  the nearest measured cell; the split is never extrapolated.

Ties go to the rewrite that changes less. A symbolic (dynamic) token count is decided per range
(``regions``): [t_i, t_i+1) with both neighbours' rule, below the first and above the last cell with
the outside rule; equal neighbouring ranges merge, and the compile guards the range it was decided
for, so a batch in another range compiles its own graph.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SCHEMA = "weavepass-tuning-table"
VERSION = 1
REWRITES = ("inductor", "fuse", "split")
"""What a cell times, in the order of how much each changes the graph (ties go to the left)."""
MODES = ("default", "reduce-overhead")
TIME_UNITS = ("ms", "relative")
DTYPES = ("bfloat16", "float16", "float32")
BUILTIN = "builtin"
NO_TABLE = "none"
BUILTIN_PATH = Path(__file__).with_name("builtin_table.json")
"""The built-in default table (``WeaveConfig.tuning_table="builtin"``): see its ``source``."""
WIDTHS = ("hidden", "heads", "kv_heads", "head_dim", "mlp")


class TuningTableError(ValueError):
    """A tuning table that cannot be used: not JSON, another schema, a missing or wrong field."""


@dataclass(frozen=True)
class LayerWidths:
    """Per-rank widths of a Llama-style decoder layer (heads of ``head_dim``)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int

    @property
    def row_parallel_k(self) -> frozenset[int]:
        """Inner widths of the layer's row-parallel matmuls (attention output, MLP down), the
        matmuls whose partial sums the all_reduce sites reduce: how a graph is matched to an entry."""
        return frozenset({self.heads * self.head_dim, self.mlp})

    def describe(self) -> str:
        return (f"hidden {self.hidden}, {self.heads}/{self.kv_heads} heads of {self.head_dim}, "
                f"MLP {self.mlp}")


@dataclass(frozen=True)
class Cell:
    """One measured token count: each rewrite's time (``time_unit``)."""

    tokens: int
    times: Mapping[str, float]

    def ratio(self, rewrite: str) -> float | None:
        """``rewrite``'s time over Inductor's at this cell (None: not measured)."""
        time = self.times.get(rewrite)
        return None if time is None else time / self.times["inductor"]


@dataclass(frozen=True)
class Choice:
    """What the rule picked for one token count (or range), and from which cells."""

    rewrite: str
    basis: str
    """``cell`` (a measured count), ``between`` (two neighbours), ``below`` / ``above`` (outside the
    measured range: nearest cell, fuse-only at most)."""
    neighbours: tuple[Cell, ...]

    def ratios(self, rewrite: str) -> str:
        """``rewrite``'s ratios to Inductor at the neighbouring cells, for the report: ``1.24x/1.09x``."""
        return "/".join("not measured" if r is None else f"{r:.2f}x"
                        for r in (cell.ratio(rewrite) for cell in self.neighbours))

    @property
    def at(self) -> str:
        """The neighbouring cells' token counts: ``2048/4096``."""
        return "/".join(str(cell.tokens) for cell in self.neighbours)


@dataclass(frozen=True)
class Entry:
    """One layer shape in one compile mode: its cells, token counts strictly increasing."""

    shape: str
    widths: LayerWidths
    mode: str
    cells: tuple[Cell, ...]


@dataclass(frozen=True)
class TuningTable:
    """A loaded, validated table (module docstring: the schema)."""

    source: str
    created_utc: str
    machine: Mapping[str, object]
    versions: Mapping[str, str]
    world: int
    dtype: str
    layers: int
    sequences: int
    time_unit: str
    timing: str
    min_gain: float
    entries: tuple[Entry, ...]
    label: str = ""
    """How the report names the table: ``builtin`` or its path."""
    digest: str = ""
    """sha256 of the file's bytes: part of the pass's cache key."""

    def entry(self, mode: str, hidden: int, row_parallel_k: frozenset[int]) -> Entry | None:
        """The entry measured in ``mode`` for a layer of ``hidden`` whose row-parallel matmuls have
        the inner widths ``row_parallel_k``, or None."""
        for entry in self.entries:
            if (entry.mode, entry.widths.hidden, entry.widths.row_parallel_k) == (mode, hidden, row_parallel_k):
                return entry
        return None

    def to_json(self) -> dict:
        """The table as the JSON object of the schema (``choice`` recomputed per cell)."""
        return {
            "schema": SCHEMA, "version": VERSION, "source": self.source, "created_utc": self.created_utc,
            "machine": dict(self.machine), "versions": dict(self.versions), "world": self.world,
            "dtype": self.dtype, "layers": self.layers, "sequences": self.sequences,
            "time_unit": self.time_unit, "timing": self.timing, "min_gain": self.min_gain,
            "entries": [
                {"shape": e.shape, **{w: getattr(e.widths, w) for w in WIDTHS}, "mode": e.mode,
                 "cells": [{"tokens": c.tokens, "times": dict(c.times),
                            "choice": choose(e, c.tokens, self.min_gain).rewrite} for c in e.cells]}
                for e in self.entries
            ],
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


# --- the rule --------------------------------------------------------------------------------------


def _best(neighbours: tuple[Cell, ...], candidates: tuple[str, ...], min_gain: float) -> str:
    """The candidate allowed at every neighbour (measured there at least ``min_gain`` faster than
    Inductor: ``ratio <= 1 - min_gain``) with the lowest worst ratio; Inductor if none."""
    best, best_score = "inductor", 1.0
    for rewrite in candidates:
        ratios = [cell.ratio(rewrite) for cell in neighbours]
        measured = [ratio for ratio in ratios if ratio is not None]
        if len(measured) < len(ratios) or any(ratio > 1.0 - min_gain for ratio in measured):
            continue
        if max(measured) < best_score:  # strict: a tie keeps the simpler rewrite
            best, best_score = rewrite, max(measured)
    return best


def choose(entry: Entry, tokens: int, min_gain: float) -> Choice:
    """The rule of the module docstring for a static token count."""
    cells = entry.cells
    if tokens < cells[0].tokens:
        return Choice(_best(cells[:1], ("fuse",), min_gain), "below", cells[:1])
    if tokens > cells[-1].tokens:
        return Choice(_best(cells[-1:], ("fuse",), min_gain), "above", cells[-1:])
    i = bisect.bisect_left([c.tokens for c in cells], tokens)
    if cells[i].tokens == tokens:
        return Choice(_best(cells[i:i + 1], ("fuse", "split"), min_gain), "cell", cells[i:i + 1])
    pair = cells[i - 1:i + 1]
    return Choice(_best(pair, ("fuse", "split"), min_gain), "between", pair)


@dataclass(frozen=True)
class Region:
    """Token counts ``[low, high)`` decided alike (None: unbounded), with the choice of the range
    the hint fell in."""

    low: int | None
    high: int | None
    choice: Choice

    def __contains__(self, tokens: int) -> bool:
        return (self.low is None or tokens >= self.low) and (self.high is None or tokens < self.high)


def _ranges(entry: Entry, min_gain: float) -> list[Region]:
    """Below the first cell, ``[t_i, t_i+1)`` with both neighbours (the last one closed at the last
    cell), above the last cell; each with its choice."""
    cells = entry.cells
    ranges = [Region(None, cells[0].tokens, Choice(_best(cells[:1], ("fuse",), min_gain), "below", cells[:1]))]
    for i in range(len(cells) - 1):
        pair = cells[i:i + 2]
        high = pair[1].tokens + 1 if i == len(cells) - 2 else pair[1].tokens
        ranges.append(Region(pair[0].tokens, high, Choice(_best(pair, ("fuse", "split"), min_gain), "between", pair)))
    ranges.append(Region(ranges[-1].high, None, Choice(_best(cells[-1:], ("fuse",), min_gain), "above", cells[-1:])))
    return ranges


def regions(entry: Entry, min_gain: float) -> list[Region]:
    """The ranges a symbolic token count is decided on (``_ranges``), neighbouring ranges with the
    same rewrite merged (a merged region keeps its first range's choice)."""
    merged: list[Region] = []
    for region in _ranges(entry, min_gain):
        if merged and merged[-1].choice.rewrite == region.choice.rewrite:
            merged[-1] = Region(merged[-1].low, region.high, merged[-1].choice)
        else:
            merged.append(region)
    return merged


def region_of(entry: Entry, tokens: int, min_gain: float) -> tuple[Region, Choice]:
    """The merged region containing ``tokens``, and the choice of the range it is in (whose cells
    the report names)."""
    merged = next(r for r in regions(entry, min_gain) if tokens in r)
    return merged, next(r for r in _ranges(entry, min_gain) if tokens in r).choice


# --- loading and validation ------------------------------------------------------------------------


def _field(data: Mapping, name: str, kind, where: str):
    if name not in data:
        raise TuningTableError(f"{where}: missing field {name!r}")
    value = data[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
        names = " or ".join(k.__name__ for k in kinds)
        raise TuningTableError(f"{where}: field {name!r} must be {names}, got {type(value).__name__} {value!r}")
    return value


def _positive_int(data: Mapping, name: str, where: str) -> int:
    value = _field(data, name, int, where)
    if value < 1:
        raise TuningTableError(f"{where}: field {name!r} must be >= 1, got {value}")
    return value


def _choice_of(data: Mapping, name: str, choices: tuple[str, ...], where: str) -> str:
    value = _field(data, name, str, where)
    if value not in choices:
        raise TuningTableError(f"{where}: field {name!r} must be one of {choices}, got {value!r}")
    return value


def _cell(data, where: str) -> Cell:
    if not isinstance(data, Mapping):
        raise TuningTableError(f"{where}: a cell must be an object, got {type(data).__name__}")
    tokens = _positive_int(data, "tokens", where)
    times = _field(data, "times", Mapping, where)
    unknown = sorted(set(times) - set(REWRITES))
    if unknown:
        raise TuningTableError(f"{where}: unknown rewrite(s) {unknown} in times (known: {REWRITES})")
    if "inductor" not in times:
        raise TuningTableError(f"{where}: times has no 'inductor', the baseline every choice compares with")
    for rewrite, time in times.items():
        if isinstance(time, bool) or not isinstance(time, (int, float)) or not math.isfinite(time) or time <= 0:
            raise TuningTableError(f"{where}: time of {rewrite!r} must be a positive finite number, got {time!r}")
    return Cell(tokens, {r: float(times[r]) for r in REWRITES if r in times})


def _entry(data, where: str, min_gain: float) -> Entry:
    if not isinstance(data, Mapping):
        raise TuningTableError(f"{where}: an entry must be an object, got {type(data).__name__}")
    shape = _field(data, "shape", str, where)
    where = f"{where} ({shape})"
    widths = LayerWidths(*(_positive_int(data, w, where) for w in WIDTHS))
    mode = _choice_of(data, "mode", MODES, where)
    cells_data = _field(data, "cells", list, where)
    if not cells_data:
        raise TuningTableError(f"{where}: no cells")
    cells = tuple(_cell(c, f"{where} cell {i}") for i, c in enumerate(cells_data))
    tokens = [c.tokens for c in cells]
    if any(a >= b for a, b in itertools.pairwise(tokens)):
        raise TuningTableError(f"{where}: cell token counts must be strictly increasing, got {tokens}")
    entry = Entry(shape, widths, mode, cells)
    for i, (cell, raw) in enumerate(zip(cells, cells_data)):
        stored, derived = raw.get("choice"), choose(entry, cell.tokens, min_gain).rewrite
        if stored is not None and stored != derived:
            raise TuningTableError(
                f"{where} cell {i} ({cell.tokens} tokens): choice {stored!r} disagrees with its times, which "
                f"give {derived!r} (min_gain {min_gain}); edit the times or drop the choice")
    return entry


def parse_table(data, label: str = "", digest: str = "") -> TuningTable:
    """Validate the JSON object ``data``; ``TuningTableError`` names the first problem."""
    where = f"tuning table {label}" if label else "tuning table"
    if not isinstance(data, Mapping):
        raise TuningTableError(f"{where}: the top level must be an object, got {type(data).__name__}")
    if data.get("schema") != SCHEMA:
        raise TuningTableError(f"{where}: schema must be {SCHEMA!r}, got {data.get('schema')!r}")
    if data.get("version") != VERSION:
        raise TuningTableError(f"{where}: version {data.get('version')!r} is not supported (this weavepass "
                               f"reads version {VERSION}); regenerate it with python -m weavepass.tune")
    machine = _field(data, "machine", Mapping, where)
    _choice_of(machine, "device_type", ("cuda", "cpu"), f"{where} machine")
    versions = _field(data, "versions", Mapping, where)
    _field(versions, "torch", str, f"{where} versions")
    min_gain = _field(data, "min_gain", (int, float), where)
    if not 0 <= min_gain < 0.5:
        raise TuningTableError(f"{where}: min_gain must be in [0, 0.5), got {min_gain}")
    entries_data = _field(data, "entries", list, where)
    entries = tuple(_entry(e, f"{where} entry {i}", float(min_gain)) for i, e in enumerate(entries_data))
    keys = [(e.mode, e.widths.hidden, e.widths.row_parallel_k) for e in entries]
    for i, key in enumerate(keys):
        if key in keys[:i]:
            raise TuningTableError(f"{where}: entries {keys.index(key)} and {i} measure the same layer widths "
                                   f"in the same mode ({entries[i].widths.describe()}, {key[0]})")
    return TuningTable(
        source=_field(data, "source", str, where), created_utc=_field(data, "created_utc", str, where),
        machine=dict(machine), versions={k: str(v) for k, v in versions.items()},
        world=_positive_int(data, "world", where), dtype=_choice_of(data, "dtype", DTYPES, where),
        layers=_positive_int(data, "layers", where), sequences=_positive_int(data, "sequences", where),
        time_unit=_choice_of(data, "time_unit", TIME_UNITS, where), timing=_field(data, "timing", str, where),
        min_gain=float(min_gain), entries=entries, label=label, digest=digest,
    )


def table_path(setting: str) -> Path | None:
    """The file ``WeaveConfig.tuning_table`` names (None for ``"none"``)."""
    if setting == NO_TABLE:
        return None
    return BUILTIN_PATH if setting == BUILTIN else Path(setting)


def load_table(setting: str) -> TuningTable | None:
    """The table ``WeaveConfig.tuning_table`` names, validated (None for ``"none"``)."""
    path = table_path(setting)
    return None if path is None else read_table(path, setting)


def read_table(path: str | Path, label: str | None = None) -> TuningTable:
    """The table at ``path``, validated; cached per file version (path, size, modification time).
    ``label``: how reports name it (default: the path)."""
    label = str(path) if label is None else label
    try:
        stat = os.stat(path)
    except OSError as error:
        raise TuningTableError(f"tuning table {label!r}: cannot read it ({error})") from None
    return _load(str(path), stat.st_size, stat.st_mtime_ns, label)


@functools.lru_cache(maxsize=16)
def _load(path: str, size: int, mtime_ns: int, label: str) -> TuningTable:
    raw = Path(path).read_bytes()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TuningTableError(f"tuning table {label!r}: not JSON ({error})") from None
    return parse_table(data, label, hashlib.sha256(raw).hexdigest())
