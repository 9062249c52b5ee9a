"""Bounded waits of the cuda_symm kernels (``weavepass.runtime.cuda.peer_wait``): the host side on CPU.

The kernels' side (give up, record, trap) runs on a GPU:
``tests/gpu/test_kernel_sim_one_gpu.py::test_a_peer_that_never_comes_stops_the_kernel``. Here: every
spin loop of the kernels is bounded (read from the source, so a new unbounded wait fails this file
on any machine), the limit follows the process group, the record becomes a message a user can act
on, and it is reported once.
"""

from __future__ import annotations

import ast
import datetime
import logging
from pathlib import Path

import pytest
import torch

from weavepass.runtime.cuda import peer_wait
from weavepass.runtime.portable import DEFAULT_GROUP_TIMEOUT_S

KERNELS = Path(peer_wait.__file__).with_name("kernels.py")
# every module of kernels that wait
WAITING_MODULES = (KERNELS, KERNELS.with_name("gemm_kernels.py"), KERNELS.with_name("gather_kernels.py"))


def _functions(paths=(KERNELS,)):
    trees = [ast.parse(path.read_text()) for path in paths]
    return {node.name: node for tree in trees for node in tree.body if isinstance(node, ast.FunctionDef)}


def _calls(node, name):
    return [c for c in ast.walk(node) if isinstance(c, ast.Call) and getattr(c.func, "id", None) == name]


def test_every_spin_loop_of_the_kernels_gives_up_after_its_deadline():
    """Each ``while`` of kernels.py, gemm_kernels.py and gather_kernels.py is a wait for a peer; each
    must call ``_give_up_after`` in its body with a deadline from ``_deadline``, and a site code that
    ``peer_wait.SITES`` explains."""
    functions = _functions(WAITING_MODULES)
    loops = [(name, loop) for name, fn in functions.items() for loop in ast.walk(fn) if isinstance(loop, ast.While)]
    # barrier x2, counters, Lamport, push x2; the scatter GEMM, its reduce and the matmul op's gather;
    # the gather prologue's push and GEMM: a new one joins here
    assert len(loops) == 11, [name for name, _ in loops]
    sites = set()
    for name, loop in loops:
        calls = [c for stmt in loop.body for c in _calls(stmt, "_give_up_after")]
        assert calls, f"{name}: a spin loop without _give_up_after (a dead peer would hang the GPU)"
        site = calls[0].args[4]
        assert isinstance(site, ast.Constant) and site.value in peer_wait.SITES, (name, ast.dump(site))
        sites.add(site.value)
        assert _calls(functions[name], "_deadline"), f"{name}: no _deadline before its wait"
    assert sites == set(peer_wait.SITES)


def test_every_waiting_kernel_takes_the_record_and_the_limit():
    """The kernels with a wait take ``watch_addr`` and ``timeout_ns`` (the host's tail passes the
    workspace's ``watch`` and ``timeout_ns``: ``test_launch_plan.py`` checks the push tail)."""
    functions = _functions(WAITING_MODULES)
    waiting = {"fused_allreduce_rmsnorm_kernel", "fused_allreduce_rmsnorm_pipelined_kernel",
               "fused_allreduce_rmsnorm_lamport_kernel", "push_partial_rows_kernel", "persistent_gemm_kernel",
               "reduce_scattered_rows_kernel", "collect_rows_kernel", "push_gather_rows_kernel", "gather_gemm_kernel"}
    for name in waiting:
        params = [a.arg for a in functions[name].args.args]
        assert params.index("watch_addr") + 1 == params.index("timeout_ns"), (name, params)
    dispatch = KERNELS.with_name("dispatch.py").read_text()
    assert dispatch.count("ws.watch, ws.timeout_ns") == 2  # the flat/pipelined tail and the Lamport tail


class _Options:
    def __init__(self, timeout):
        self._timeout = timeout


class _Group:
    def __init__(self, timeout):
        self.options = _Options(timeout)

    def _get_backend(self, device):
        return self


def test_the_limit_is_the_process_groups_timeout(monkeypatch):
    """What NCCL would wait (the group's timeout); the default where the group does not say; the
    environment variable over both."""
    from weavepass.runtime import portable

    monkeypatch.delenv(peer_wait.TIMEOUT_ENV, raising=False)
    monkeypatch.setattr(portable, "resolve_group", lambda name: _Group(datetime.timedelta(seconds=77)))
    assert peer_wait.peer_timeout_ns("g") == 77 * 10**9
    monkeypatch.setattr(portable, "resolve_group", lambda name: _Group(None))
    assert peer_wait.peer_timeout_ns("g") == int(DEFAULT_GROUP_TIMEOUT_S * 1e9)

    def unknown(name):
        raise ValueError("no such group")

    monkeypatch.setattr(portable, "resolve_group", unknown)
    assert peer_wait.peer_timeout_ns("g") == int(DEFAULT_GROUP_TIMEOUT_S * 1e9)
    monkeypatch.setenv(peer_wait.TIMEOUT_ENV, "2.5")
    assert peer_wait.peer_timeout_ns("g") == 2_500_000_000
    monkeypatch.setenv(peer_wait.TIMEOUT_ENV, "0")
    assert peer_wait.peer_timeout_ns("g") == 0
    for bad in ("soon", "-1", "nan", "1e-9"):
        monkeypatch.setenv(peer_wait.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=peer_wait.TIMEOUT_ENV):
            peer_wait.peer_timeout_ns("g")


def test_a_real_gloo_groups_timeout_is_read():
    """The attribute path on this torch, on a real (one-rank, gloo) group."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=93))
    try:
        from weavepass.runtime.portable import group_timeout_s

        assert group_timeout_s(dist.group.WORLD.group_name) == 93
    finally:
        dist.destroy_process_group()


def _record(**fields):
    record = torch.zeros(peer_wait.RECORD_SLOTS, dtype=torch.int32)
    for name, value in fields.items():
        record[getattr(peer_wait, name)] = value
    return record


def test_the_record_becomes_a_message_naming_ranks_site_limit_and_switch():
    assert peer_wait.describe(_record()) is None  # nothing gave up
    message = peer_wait.describe(_record(FLAG=1, RANK=3, PEER=5, SITE=2, WORLD=8, TIMEOUT_S=600))
    assert message.startswith("weave: rank 3 of a 8-rank group waited 600 s for rank 5 ")
    assert peer_wait.SITES[2] in message
    assert "unspecified launch failure" in message and peer_wait.TIMEOUT_ENV in message
    assert "wait site 99" in peer_wait.describe(_record(FLAG=1, SITE=99))  # an unknown code still reads


def test_a_record_is_reported_once(monkeypatch, caplog, capsys):
    monkeypatch.setattr(peer_wait, "_RECORD", _record(FLAG=1, RANK=0, PEER=1, SITE=4, WORLD=2, TIMEOUT_S=2))
    monkeypatch.setattr(peer_wait, "_REPORTED", False)
    with caplog.at_level(logging.ERROR, logger="weavepass"):
        first = peer_wait.check_record()
        again = peer_wait.check_record()
    assert first is not None and peer_wait.SITES[4] in first
    assert again is None
    assert [r.getMessage() for r in caplog.records if r.name == "weavepass"] == [first]


def test_without_logging_the_message_goes_to_stderr(monkeypatch, capsys):
    monkeypatch.setattr(peer_wait, "_RECORD", _record(FLAG=1, RANK=1, PEER=0, SITE=6, WORLD=2, TIMEOUT_S=9))
    monkeypatch.setattr(peer_wait, "_REPORTED", False)
    monkeypatch.setattr(peer_wait, "_logged_somewhere", lambda log: False)
    message = peer_wait.check_record()
    assert message in capsys.readouterr().err


def test_the_packages_null_handler_does_not_count_as_logging():
    """weavepass adds a NullHandler to its logger: without a real handler the message must go to
    stderr (the GPU run of the bounded-wait case printed nothing before this was checked)."""
    import weavepass  # noqa: F401  (adds the NullHandler)

    parent = logging.Logger("bare")
    child = logging.Logger("bare.weavepass")
    child.parent = parent
    child.addHandler(logging.NullHandler())
    assert not peer_wait._logged_somewhere(child)
    parent.addHandler(logging.StreamHandler())
    assert peer_wait._logged_somewhere(child)
    child.propagate = False
    assert not peer_wait._logged_somewhere(child)


def test_no_record_without_cuda(monkeypatch):
    monkeypatch.setattr(peer_wait, "_RECORD", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peer_wait.record_address() == 0 and peer_wait.check_record() is None
