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
    before = workspace._new_workspace
    shared_gpu.install()
    assert workspace._new_workspace is before


def test_spawn_shares_a_gpu_only_when_the_caller_allows_it(monkeypatch):
    """A benchmark's ``spawn`` ignores WEAVE_GPU_SHARED=1: with no GPUs here, an NCCL group of 2
    is refused as too large, not silently moved onto gloo."""
    import pytest

    from weavepass.testing.distributed import spawn

    monkeypatch.setenv(shared_gpu.ENV, "1")
    with pytest.raises(RuntimeError, match="nccl needs 2 GPUs"):
        spawn(print, 2, "nccl")
