"""Hand-written MoE routing blocks in Hugging Face's ``grouped_mm`` form (transformers 5.x
``grouped_mm_experts_forward``), in pieces, for the split's routing tests: the pieces
compose the sound block and the variants the split must refuse.

Shapes: ``x [T, H]`` tokens, ``router [E, H]``, ``w_up [E, H, I]``, ``w_down [E, I, H]``; ``k``
experts per token, ``P = T * k`` token-expert pairs.
"""

from __future__ import annotations

import torch


def route(x: torch.Tensor, router: torch.Tensor, k: int):
    """Softmax top-k routing, the pairs sorted by expert: ``(keys [P], perm [P], weights [P] in
    expert order, offsets [E])`` (``offsets``: the cumsum of the rows per expert)."""
    probs = torch.softmax(x @ router.t(), dim=-1)
    top_w, top_i = probs.topk(k, dim=-1)
    top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    keys, perm = torch.sort(top_i.reshape(-1))
    experts = router.shape[0]
    counts = torch.histc(keys.float(), bins=experts, min=0, max=experts - 1)
    return keys, perm, top_w.reshape(-1)[perm], torch.cumsum(counts, dim=0, dtype=torch.int32)


def experts(x, perm, offsets, w_up, w_down, k: int, grouped_mm=None) -> torch.Tensor:
    """Each pair's token row through its expert, rows in expert order ``[P, H]``. ``grouped_mm``:
    ``torch._grouped_mm`` (the default; bf16 only on CPU, its fake kernel included) or
    transformers' fp32 fallback ``torch.ops.transformers.grouped_mm_fallback``."""
    grouped_mm = grouped_mm or torch._grouped_mm
    rows = x[perm // k]
    return grouped_mm(torch.relu(grouped_mm(rows, w_up, offs=offsets)), w_down, offs=offsets)


def unsort(y: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Rows in expert order back in pair order: through the inverse permutation."""
    pairs = perm.shape[0]
    inverse = torch.index_put(torch.empty(pairs, dtype=torch.long), (perm,), torch.arange(pairs))
    return y[inverse]


def grouped_mm_moe(x, router, w_up, w_down, k: int = 2, grouped_mm=None) -> torch.Tensor:
    """The MoE output ``[T, H]``: every token's experts weighted by its renormalised top-k
    probabilities, summed over its k pairs."""
    _, perm, weights, offsets = route(x, router, k)
    y = experts(x, perm, offsets, w_up, w_down, k, grouped_mm) * weights.unsqueeze(-1)
    return unsort(y, perm).view(x.shape[0], k, -1).sum(dim=1)


def moe_weights(hidden: int, inner: int, n_experts: int, generator: torch.Generator):
    """``router, w_up, w_down`` scaled so the outputs stay of order 1."""
    return (torch.randn(n_experts, hidden, generator=generator),
            torch.randn(n_experts, hidden, inner, generator=generator) / hidden ** 0.5,
            torch.randn(n_experts, inner, hidden, generator=generator) / inner ** 0.5)
