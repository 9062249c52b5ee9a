"""``SaveSummedResiduals``: the joint-graph pass of a training compile that lets every site fuse.

AOT autograd's partitioner decides which forward values the backward reads. Pointwise ops are
cheap to recompute, so for a residual add ``h = r + all_reduce(p)`` it may save the two operands,
the reduced sum among them, and recompute ``h`` in the backward (HF Llama's first layer: the
embedding's sum is saved anyway). The forward graph then returns the sum itself, a second reader
besides the residual add, and the fused op (which never materialises the sum alone) cannot replace
that site. Marking such adds ``MUST_SAVE`` makes the partitioner save ``h``, which the fused op
returns (its residual output), and no longer the sum; gradients are unchanged (the backward reads
the same value ``h``, saved instead of recomputed; the memory saved is the same one ``[T, H]``
tensor).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy

from weavepass.compile.patterns.allreduce_rmsnorm import ALL_REDUCES, RESIDUAL_ADD, VIEWS, WAIT
from weavepass.compile.patterns.rmsnorm import is_target


def _reads_a_sum(add: torch.fx.Node) -> bool:
    for arg in add.all_input_nodes:
        while is_target(arg, VIEWS) and isinstance(arg.args[0], torch.fx.Node):
            arg = arg.args[0]
        if is_target(arg, {WAIT}) and is_target(arg.args[0], ALL_REDUCES):
            return True
    return False


class SaveSummedResiduals(CustomGraphPass):
    """Inductor's ``joint_custom_post_pass``: every add that reads an all_reduce's sum (through
    views) is saved for backward rather than recomputed from the sum."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if is_target(node, {RESIDUAL_ADD}) and _reads_a_sum(node):
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE

    def uuid(self) -> bytes:
        return get_hash_for_files((str(Path(__file__).resolve()),))
