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
    assert shared_gpu.process_group_backend("nccl") == "nccl"


def test_shared_puts_every_rank_on_gpu_0_over_gloo(monkeypatch):
    monkeypatch.setenv(shared_gpu.ENV, "1")
    assert shared_gpu.enabled()
    assert [shared_gpu.rank_device(r) for r in range(3)] == [torch.device("cuda", 0)] * 3
    assert shared_gpu.gpus_needed(8) == 1
    assert shared_gpu.process_group_backend("nccl") == "gloo"
    assert shared_gpu.process_group_backend("gloo") == "gloo"


def test_install_is_a_no_op_when_unset(monkeypatch):
    from weavepass.runtime.cuda import workspace

    monkeypatch.delenv(shared_gpu.ENV, raising=False)
    before = workspace._new_workspace
    shared_gpu.install()
    assert workspace._new_workspace is before
