"""The suite's two tiers. CI (``scripts/test.sh``) runs every test but those marked ``full``: a
``full`` test repeats a case that a cheaper CI test already covers (another world size, another
model variant) and is skipped with its reason, visible under ``-rs``. ``WEAVE_TEST_FULL=1``
(``bash scripts/test_full.sh``) runs them too, and every Hugging Face family with every strategy
(tests/test_hf_models.py)."""

from __future__ import annotations

import os

import pytest

FULL = os.environ.get("WEAVE_TEST_FULL") == "1"


def pytest_collection_modifyitems(config, items):
    if FULL:
        return
    for item in items:
        marker = item.get_closest_marker("full")
        if marker is not None:
            covered_by = marker.kwargs.get("covered_by") or (marker.args[0] if marker.args else "")
            if not covered_by:
                raise pytest.UsageError(
                    f"{item.nodeid}: pytest.mark.full needs covered_by= (the CI test that covers it)"
                )
            item.add_marker(pytest.mark.skip(reason=f"full tier (WEAVE_TEST_FULL=1): CI covers it with {covered_by}"))
