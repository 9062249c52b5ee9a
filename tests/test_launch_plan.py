"""The CUDA lowering's launch rule (weavepass.runtime.cuda.launch_plan): pure host code, no GPU."""

import pytest

from weavepass.runtime.cuda import launch_plan
from weavepass.runtime.cuda.launch_plan import LaunchOverrides, choose_launch_plan


def test_lamport_only_when_forced_while_off_by_default():
    assert not launch_plan.LAMPORT_BY_DEFAULT
    plan = choose_launch_plan(1, 4096, 2, 2)
    assert plan.one_shot and not plan.lamport
    forced = choose_launch_plan(1, 4096, 2, 2, LaunchOverrides(lamport=True))
    assert forced.one_shot and forced.lamport and not forced.pipelined


def test_lamport_forced_implies_one_shot():
    # 64 tokens x 4096 bf16 = 512 KiB pushed: the rule alone would pick two-shot.
    assert not choose_launch_plan(64, 4096, 2, 2).one_shot
    assert choose_launch_plan(32, 4096, 2, 2, LaunchOverrides(lamport=True)).one_shot


@pytest.mark.parametrize("tokens, hidden, elem, world, one_shot", [
    (33, 4096, 2, 2, None),  # 264 KiB per rank: more than a slot
    (8, 4096, 2, 1, None),  # no peers
    (8, 4096, 2, 2, False),  # contradicts a forced two-shot
])
def test_lamport_refuses_what_it_cannot_serve(tokens, hidden, elem, world, one_shot):
    with pytest.raises(ValueError, match="Lamport"):
        choose_launch_plan(tokens, hidden, elem, world, LaunchOverrides(lamport=True, one_shot=one_shot))


def test_lamport_rule_when_on(monkeypatch):
    monkeypatch.setattr(launch_plan, "LAMPORT_BY_DEFAULT", True)
    assert choose_launch_plan(8, 8192, 2, 2).lamport  # 128 KiB
    assert choose_launch_plan(16, 8192, 2, 2).lamport  # 256 KiB: one slot exactly
    # 32 tokens x 8192 bf16: 512 KiB per rank, two-shot by the one-shot rule already.
    assert not choose_launch_plan(32, 8192, 2, 2).lamport
    assert not choose_launch_plan(8, 8192, 2, 1).lamport  # one rank: nothing to exchange
    assert not choose_launch_plan(8, 8192, 2, 2, LaunchOverrides(lamport=False)).lamport
