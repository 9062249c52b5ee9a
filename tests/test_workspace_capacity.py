"""The CUDA workspace's capacity travels in the op call, never through module state (issue 12).

CPU-only: the graphs are compiled on a fake process group, and the CUDA lowering is exercised up to
where it needs a GPU (its call-signature cache and its capacity check).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import weavepass
from weavepass import WeaveConfig
from weavepass.config import Lowering
from weavepass.ops import FUSED_ALLREDUCE_RMSNORM
from weavepass.runtime.cuda import dispatch, workspace
from weavepass.testing import fake_process_group

H = 64


def _site(x, w, r, weight):
    """One site: all_reduce -> + residual -> RMSNorm."""
    h = funcol.all_reduce(x @ w, "sum", dist.group.WORLD) + r
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)), h


def _fused_calls(config: WeaveConfig) -> list[tuple]:
    """The fused op calls (their arguments) in the graph ``config``'s backend compiled."""
    calls = []

    def spy(graph):
        calls.extend(n.args for n in graph.nodes if n.target is FUSED_ALLREDUCE_RMSNORM)

    backend = weavepass.make_backend(config)
    torch._dynamo.reset()
    inputs = (torch.randn(8, H), torch.randn(H, H), torch.randn(8, H), torch.rand(H))
    with torch.no_grad(), torch._inductor.config.patch(post_grad_custom_post_pass=spy):
        torch.compile(_site, backend=backend, fullgraph=True)(*inputs)
    assert backend.report.rewritten == 1, backend.report
    return calls


def test_two_backends_keep_their_own_workspace_size():
    """``lowering="cuda_symm"`` on CPU asks the CUDA support check (and falls back to portable):
    the plan used to write the config's size into ``dispatch.DEFAULT_WORKSPACE_TOKENS`` there, so
    the last compiled backend set it for every graph of the process."""
    before = workspace.DEFAULT_WORKSPACE_TOKENS
    with fake_process_group(2):
        small = _fused_calls(WeaveConfig(lowering="cuda_symm", cuda_workspace_tokens=512))
        large = _fused_calls(WeaveConfig(lowering="cuda_symm", cuda_workspace_tokens=4096))
    assert [args[-2:] for args in small] == [("portable", 512)]
    assert [args[-2:] for args in large] == [("portable", 4096)]
    assert dispatch.DEFAULT_WORKSPACE_TOKENS == workspace.DEFAULT_WORKSPACE_TOKENS == before


def test_cuda_lowering_caches_per_capacity():
    """Each capacity is its own call signature: a call never reuses a launch planned for another
    workspace size. On CPU the signature is cached as 'portable' (the kernel cannot serve it)."""
    partial, residual, weight = torch.randn(4, H), torch.randn(4, H), torch.rand(H)
    with fake_process_group(1) as group, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the once-per-reason fallback warning
        known = set(dispatch._LAUNCHES)
        for capacity in (256, 1024, 256):
            dispatch.fused_allreduce_rmsnorm_cuda(partial, residual, weight, 1e-6, group.group_name,
                                                  torch.float32, max_workspace_tokens=capacity)
        new = [key for key in dispatch._LAUNCHES if key not in known]
    capacity_index = 8  # the key: partial's 4 properties, residual, weight, group, out_dtype, capacity, ...
    assert sorted(key[capacity_index] for key in new) == [256, 1024]
    assert all(dispatch._LAUNCHES[key] == Lowering.PORTABLE for key in new)
    without_capacity = {key[:capacity_index] + key[capacity_index + 1:] for key in new}
    assert len(without_capacity) == 1  # the capacity is the only difference


def test_workspace_serves_at_most_the_asked_capacity():
    """A batch over ``max_tokens`` gets no workspace (the call then falls back to portable); the
    check comes before anything is allocated, so it runs on CPU."""
    assert workspace.get_workspace("g", torch.float32, torch.device("cpu"), 65 * H, H, max_tokens=64) is None


def test_lamport_region_is_empty_before_a_peer_can_address_it(monkeypatch):
    """The Lamport region's fill with "empty" (-0.0) has finished when the rendezvous starts: a peer
    that leaves the rendezvous first may push its rows at once, and a fill still queued behind this
    rank's work would erase them (this rank's poll would then wait forever). The rendezvous and the
    device are stood in for; what is checked is the order of the host calls."""
    import torch.distributed._symmetric_memory as symm_mem

    events = []

    class Rendezvoused(Exception):
        pass

    def rendezvous(buffer, group_name):
        events.append(("rendezvous", bool(torch.signbit(buffer[2 * H:]).all())))
        raise Rendezvoused

    monkeypatch.setattr(symm_mem, "empty", lambda n, dtype, device: torch.zeros(n, dtype=dtype))
    monkeypatch.setattr(symm_mem, "rendezvous", rendezvous)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("synchronize"))
    monkeypatch.setattr(workspace, "enable_symm_mem_for_group", lambda group_name: None)
    with fake_process_group(2), pytest.raises(Rendezvoused):
        workspace._new_workspace(dist.group.WORLD.group_name, torch.bfloat16, torch.device("cpu"), H)
    assert events == ["synchronize", ("rendezvous", True)]
