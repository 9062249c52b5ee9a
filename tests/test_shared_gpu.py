"""``weavepass.testing.shared_gpu``: what ``WEAVE_GPU_SHARED=1`` changes for a spawned rank (the
device, the GPUs a test needs, the group's backend), and that it changes nothing when unset. The
CUDA-IPC workspace itself needs a GPU (run with SHARED=1 in benchmarks/gpu_suite.sh)."""

import torch

from weavepass.testing import shared_gpu


def test_unset_means_one_gpu_per_rank(monkeypatch):
    monkeypatch.delenv(shared_gpu.ENV, raising=False)
    assert not shared_gpu.enabled()
    assert shared_gpu.rank_device(3) == torch.device("cuda", 3)
    assert shared_gpu.gpus_needed(4) == 4


def test_shared_puts_every_rank_on_gpu_0(monkeypatch):
    monkeypatch.setenv(shared_gpu.ENV, "1")
    assert shared_gpu.enabled()
    assert [shared_gpu.rank_device(r) for r in range(3)] == [torch.device("cuda", 0)] * 3
    assert shared_gpu.gpus_needed(8) == 1


def test_install_is_a_no_op_when_unset(monkeypatch):
    from weavepass.runtime.cuda import workspace

    monkeypatch.delenv(shared_gpu.ENV, raising=False)
    before = workspace._new_workspace, workspace.new_symmetric
    shared_gpu.install()
    assert (workspace._new_workspace, workspace.new_symmetric) == before


def test_install_replaces_both_symmetric_allocations(monkeypatch):
    """Under WEAVE_GPU_SHARED=1 both the fused op's workspace and the matmul op's symmetric buffers
    go through CUDA IPC (a rank that kept symmetric memory's rendezvous for one of them would be
    refused: two ranks on one device)."""
    from weavepass.runtime.cuda import workspace

    monkeypatch.setenv(shared_gpu.ENV, "1")
    monkeypatch.setattr(workspace, "_new_workspace", workspace._new_workspace)
    monkeypatch.setattr(workspace, "new_symmetric", workspace.new_symmetric)
    shared_gpu.install()
    assert workspace._new_workspace is shared_gpu._ipc_workspace
    assert workspace.new_symmetric is shared_gpu._ipc_symmetric


def test_spawn_shares_a_gpu_only_when_the_caller_allows_it(monkeypatch):
    """A benchmark's ``spawn`` ignores WEAVE_GPU_SHARED=1: with no GPUs here, an NCCL group of 2
    is refused as too large, not silently moved onto gloo."""
    import pytest

    from weavepass.testing.distributed import spawn

    monkeypatch.setenv(shared_gpu.ENV, "1")
    with pytest.raises(RuntimeError, match="nccl needs 2 GPUs"):
        spawn(print, 2, "nccl")
