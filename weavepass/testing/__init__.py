"""Reference models, a correctness harness and process-group helpers for testing weavepass.

Nothing here downloads anything: the models are built from a seed, and the distributed helpers run
on gloo (CPU), NCCL (GPUs) or a fake process group (graph-only tests).
"""

from weavepass.testing.distributed import fake_process_group, free_port, spawn
from weavepass.testing.harness import ATOL, ComparisonReport, OutputComparison, check_against_eager
from weavepass.testing.models import (
    TPConfig,
    TPDecoder,
    build_tp_model,
    full_weights,
    random_token_ids,
)

__all__ = [
    "ATOL",
    "ComparisonReport",
    "OutputComparison",
    "TPConfig",
    "TPDecoder",
    "build_tp_model",
    "check_against_eager",
    "fake_process_group",
    "free_port",
    "full_weights",
    "random_token_ids",
    "spawn",
]
