"""``scripts/demo.py``'s argument checks: a world size the demo model cannot split is a usage error
that names the sizes that work, not a traceback (checked before any rank is started)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parent.parent / "scripts" / "demo.py"


def _demo():
    spec = importlib.util.spec_from_file_location("weave_demo_script", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("world_size", ["3", "6", "0"])
def test_demo_rejects_world_size_it_cannot_split(world_size, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _demo().main(["--world-size", world_size, "--moe"])
    assert exit_info.value.code == 2  # argparse's usage error, before any process starts
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"--world-size {world_size}" in err and "1, 2, 4 or 8" in err
