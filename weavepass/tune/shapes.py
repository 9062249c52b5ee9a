"""Per-rank layer shapes the tuning command and the model benchmarks measure, and the model built
from one: Llama-style decoder layers (``weavepass.testing.models``) at a shape's widths.

A shape is a preset name (``SHAPES``) or ``name:hidden=H,heads=A,kv_heads=K,mlp=M[,head_dim=D]``
(``parse_shape``), the per-rank widths of your model (heads and MLP divided by the TP degree).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from weavepass.tune.table import LayerWidths


@dataclass(frozen=True)
class Shape:
    """Per-rank widths of one decoder layer (heads of ``head_dim``); ``tp``: the tensor-parallel
    degree of the model these widths are a rank of (None: not a real model's)."""

    hidden: int
    heads: int
    kv_heads: int
    mlp: int
    head_dim: int = 128
    tp: int | None = None

    @property
    def widths(self) -> LayerWidths:
        return LayerWidths(self.hidden, self.heads, self.kv_heads, self.head_dim, self.mlp)

    def simulation_note(self, world: int) -> str | None:
        """What a run at ``world`` ranks measures when that is not the preset's TP degree."""
        if world == 1:
            return ("one GPU: the all_reduce has no peers, so nothing is communicated or hidden; "
                    "the variants differ by what the rewrites cost (report.model_world_size)")
        if self.tp is None or self.tp == world:
            return None
        return (f"per-rank widths of TP={self.tp} with the all_reduce of {world} ranks: a simulation of "
                f"TP={self.tp}")


SHAPES = {
    "70b_tp2": Shape(8192, 32, 4, 14336, tp=2),
    "70b_tp4": Shape(8192, 16, 2, 7168, tp=4),
    "70b_tp8": Shape(8192, 8, 1, 3584, tp=8),
    "8b_tp2": Shape(4096, 16, 4, 7168, tp=2),
    "8b_tp8": Shape(4096, 4, 1, 1792, tp=8),
    "tiny": Shape(64, 4, 2, 128, head_dim=16),
}
# Same widths, the names the 2-GPU tables carry (run at --world 2 to predict TP=8).
SHAPES["70b_tp8sim"] = SHAPES["70b_tp8"]
SHAPES["8b_tp8sim"] = SHAPES["8b_tp8"]
VOCAB_PER_RANK = 4096
_FIELDS = ("hidden", "heads", "kv_heads", "mlp", "head_dim")


def parse_shape(text: str) -> tuple[str, Shape]:
    """``(name, shape)`` from a preset name or ``name:hidden=H,heads=A,kv_heads=K,mlp=M[,head_dim=D]``;
    ValueError naming what is wrong."""
    if ":" not in text:
        if text not in SHAPES:
            raise ValueError(f"unknown shape {text!r}: a preset ({', '.join(sorted(SHAPES))}) or "
                             "name:hidden=H,heads=A,kv_heads=K,mlp=M[,head_dim=D]")
        return text, SHAPES[text]
    name, _, spec = text.partition(":")
    values = {}
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        if key not in _FIELDS or not value.isdigit() or int(value) < 1:
            expected = ", ".join(f"{f}=<positive int>" for f in _FIELDS)
            raise ValueError(f"shape {text!r}: {part!r} is not one of {expected}")
        values[key] = int(value)
    missing = [f for f in _FIELDS[:4] if f not in values]
    if missing or not name:
        raise ValueError(f"shape {text!r}: needs a name and {', '.join(missing) or 'its widths'}")
    if values["heads"] % values["kv_heads"]:
        raise ValueError(
            f"shape {text!r}: heads ({values['heads']}) must be a multiple of kv_heads ({values['kv_heads']})"
        )
    return name, Shape(**values)


def build_model(shape: Shape, group, device, n_layers: int, dtype=torch.bfloat16, seed: int = 0):
    """Rank-local shard at the per-rank widths of ``shape``, random weights drawn on ``device``.

    ``group=None`` builds the same model without collectives (the no-communication floor).
    """
    from weavepass.testing.models import (
        RMSNorm,
        RotaryEmbedding,
        TPAttention,
        TPConfig,
        TPDecoder,
        TPDecoderLayer,
        TPSwiGLU,
        VocabParallelEmbedding,
    )

    hidden, heads, kv_heads, head_dim, mlp = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.mlp
    world = dist.get_world_size() if dist.is_initialized() else 1
    gen = torch.Generator(device=device).manual_seed(seed)

    def w(*dims):
        t = torch.randn(*dims, generator=gen, device=device, dtype=dtype) * dims[-1] ** -0.5
        return torch.nn.Parameter(t, requires_grad=False)

    def norm():
        return RMSNorm(torch.nn.Parameter(torch.ones(hidden, device=device, dtype=dtype),
                                          requires_grad=False), 1e-5, "llama")

    layers = []
    for _ in range(n_layers):
        attention = TPAttention(w(heads * head_dim, hidden), w(kv_heads * head_dim, hidden),
                                w(kv_heads * head_dim, hidden), w(hidden, heads * head_dim),
                                heads, kv_heads, head_dim)
        layers.append(TPDecoderLayer(norm(), attention, norm(),
                                     TPSwiGLU(w(mlp, hidden), w(mlp, hidden), w(hidden, mlp)), group))
    rank = dist.get_rank() if group is not None else 0
    cfg = TPConfig(vocab=VOCAB_PER_RANK * world, hidden=hidden, n_layers=n_layers, n_heads=world * heads,
                   n_kv_heads=world * kv_heads, head_dim=head_dim, intermediate=world * mlp, dtype=dtype)
    embed = VocabParallelEmbedding(w(VOCAB_PER_RANK, hidden), rank * VOCAB_PER_RANK, group)
    return TPDecoder(cfg, embed, RotaryEmbedding(head_dim, 10000.0, device), layers, norm()).eval()
