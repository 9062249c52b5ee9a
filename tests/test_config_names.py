"""One name for the split (issue 32): ``WeaveConfig.split*``. The fields' old names (``overlap*``,
``weavepass.config.RENAMED_FIELDS``) still work, with a ``DeprecationWarning`` naming the new field;
nothing in the package, its scripts or its other tests uses them any more."""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

import pytest

from weavepass.config import RENAMED_FIELDS, WeaveConfig

ROOT = Path(__file__).resolve().parents[1]
OLD_VALUES = {"overlap": "auto", "overlap_min_tokens": 1024, "overlap_max_tokens": 32768,
              "overlap_min_tokens_moe": 2048, "overlap_comm": "push", "overlap_comm_ctas": 8}
"""A valid, non-default value for every old name."""


def test_every_old_name_has_a_new_field():
    fields = {f.name for f in dataclasses.fields(WeaveConfig)}
    assert set(OLD_VALUES) == set(RENAMED_FIELDS)
    assert set(RENAMED_FIELDS.values()) <= fields
    assert not set(RENAMED_FIELDS) & fields  # the old names are no fields


@pytest.mark.parametrize("old", sorted(RENAMED_FIELDS))
def test_old_name_warns_and_sets_the_new_field(old):
    new, value = RENAMED_FIELDS[old], OLD_VALUES[old]
    assert getattr(WeaveConfig(), new) != value  # the value below is not the default
    with pytest.warns(DeprecationWarning, match=rf"WeaveConfig\.{old} is deprecated: use WeaveConfig\.{new}\b") as seen:
        config = WeaveConfig(**{old: value})
    assert getattr(config, new) == value
    assert config == WeaveConfig(**{new: value})
    assert seen[0].filename == __file__  # attributed to the caller, not to config.py
    # the repr (and with it the pass's uuid) and asdict show the new name only
    assert f"{new}={value!r}" in repr(config) and f"{old}=" not in repr(config)
    assert old not in dataclasses.asdict(config)


@pytest.mark.parametrize("old", sorted(RENAMED_FIELDS))
def test_replace_and_read_by_old_name(old):
    new, value = RENAMED_FIELDS[old], OLD_VALUES[old]
    base = WeaveConfig(split_max_tokens=16384)
    with pytest.warns(DeprecationWarning, match=rf"use WeaveConfig\.{new}\b"):
        replaced = base.replace(**{old: value})
    assert getattr(replaced, new) == value
    with pytest.warns(DeprecationWarning, match=rf"WeaveConfig\.{old} is deprecated"):
        assert getattr(replaced, old) == value


def test_new_names_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = WeaveConfig(split="force", split_min_tokens=64, split_max_tokens=128, split_min_tokens_moe=64,
                             split_comm="push", split_comm_ctas=4).replace(split="auto")
    assert (config.split, config.split_min_tokens, config.split_comm_ctas) == ("auto", 64, 4)


def test_old_and_new_name_must_agree():
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"overlap='force' \(deprecated\) and "
                                                                           r"split='auto' disagree; pass split only"):
        WeaveConfig(overlap="force", split="auto")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="overlap_comm_ctas=8"):
        WeaveConfig().replace(overlap_comm_ctas=8, split_comm_ctas=4)
    with pytest.warns(DeprecationWarning):
        assert WeaveConfig(overlap="force", split="force").split == "force"  # the same value: no conflict


def test_old_name_value_is_validated_as_the_new_field():
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"WeaveConfig\.split must be one of"):
        WeaveConfig(overlap="sometimes")
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match=r"WeaveConfig\.split_comm_ctas must be int"):
        WeaveConfig(overlap_comm_ctas="8")


OLD_NAME_USE = re.compile(
    r"\boverlap(?:_min_tokens_moe|_min_tokens|_max_tokens|_comm_ctas|_comm)?\s*=(?!=)"  # a keyword argument
    r"|\.overlap(?:_min_tokens_moe|_min_tokens|_max_tokens|_comm_ctas|_comm)?\b"  # an attribute
    r"|[\"']overlap(?:_min_tokens_moe|_min_tokens|_max_tokens|_comm_ctas|_comm)?[\"']\s*:"  # a dict key
    r"|\bOVERLAP_(?:COMM_)?MODES\b")
"""A use of an old name; not a word such as "the overlap fraction" or ``bench_overlap.py``."""


def test_the_old_name_pattern_finds_uses():
    """The scan below cannot pass for a pattern that matches nothing."""
    uses = ['WeaveConfig(overlap="force")', "config.overlap_comm", "{'overlap_max_tokens': 8}",
            ".replace(overlap_min_tokens_moe=2)", "OVERLAP_COMM_MODES", "WeaveConfig(overlap = 'auto')"]
    words = ["the overlap fraction", "bench_overlap.py", "weave_overlap", "stream_overlap(trace)",
             "OVERLAP_SCHEDULING", "split_comm='push'", "if overlap == 1:", "comm_overlapped_us"]
    assert all(OLD_NAME_USE.search(u) for u in uses), [u for u in uses if not OLD_NAME_USE.search(u)]
    assert not any(OLD_NAME_USE.search(w) for w in words), [w for w in words if OLD_NAME_USE.search(w)]


def test_no_old_names_left_in_the_package_scripts_and_tests():
    """Only this file (the alias tests) and config.py's table of the old names name them (benchmarks too)."""
    files = [p for d in ("weavepass", "scripts", "tests", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))]
    files = [p for p in files if p.resolve() != Path(__file__).resolve()]
    assert len(files) > 50, files  # the scan reads the tree, not an empty folder
    table = re.compile(r'^    "overlap\w*": "split\w*",$')  # RENAMED_FIELDS' entries
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
            if OLD_NAME_USE.search(line) and not (p.name == "config.py" and table.match(line))]
    assert hits == []
