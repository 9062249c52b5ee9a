"""A Llama-style tensor-parallel decoder whose collectives torch.compile can trace.

Every rank holds one shard of one mathematical model. The full weights are drawn in fp32 on the CPU
from ``TPConfig.seed`` and then sliced, so the same config gives the same function of the token ids
for every world size and dtype; an fp32 copy of the model is the reference for a bf16 one.

Layer structure (``[AR]`` is ``funcol.all_reduce(x, "sum", group)``, one per site):

    h = embed(ids)                      [AR]    vocab-parallel: each rank owns a slice of the vocab
    for each layer:
        x = input_norm(h)
        h = h + o_proj(attention(x))    [AR]    q/k/v column-parallel, o_proj row-parallel
        x = post_attention_norm(h)
        h = h + down_proj(mlp(x))       [AR]    gate/up column-parallel, down_proj row-parallel
    return norm(h)                              (no lm_head: the output is the normed hidden states)

so ``n_layers`` layers give ``2 * n_layers + 1`` ``all_reduce -> [+ residual] -> RMSNorm`` sites.
``TPDecoder.attach_static_kv_cache`` gives every attention a preallocated (static) KV cache, as
HF's ``cache_implementation="static"`` does: calls then pass ``cache_position`` (the cache slots of
the new tokens) and attend to every filled slot, so a decode step is a call with one new token
per sequence.
With ``n_experts > 0`` the MLP is a mixture of experts whose partial sums are combined on each rank
before the layer's single all_reduce. Shapes: ``input_ids`` [B, S] int64 -> output [B, S, hidden].
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

NORM_IMPLS = ("llama", "torch")


@dataclass(frozen=True)
class TPConfig:
    """Sizes and numerics of the reference decoder. The defaults are tiny, for CPU tests."""

    vocab: int = 256
    """Vocabulary size; split across ranks in contiguous slices (they need not divide evenly)."""
    hidden: int = 64
    """Model width H: the last dim of every all_reduce and RMSNorm."""
    n_layers: int = 2
    """Decoder layers; the model has ``2 * n_layers + 1`` all_reduce -> RMSNorm sites."""
    n_heads: int = 4
    """Query heads; must be divisible by the world size."""
    n_kv_heads: int = 2
    """Key/value heads (GQA); must divide ``n_heads`` and be divisible by the world size."""
    head_dim: int = 16
    """Width of one attention head (even, for RoPE)."""
    intermediate: int = 128
    """Width of the SwiGLU MLP (and of every expert); split across ranks."""
    rms_eps: float = 1e-5
    """Epsilon added to the mean square in every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base: frequencies are ``rope_theta ** (-2i / head_dim)``."""
    n_experts: int = 0
    """0 for a dense SwiGLU MLP; otherwise the number of experts of the MoE MLP."""
    top_k: int = 2
    """Experts each token is routed to (MoE only)."""
    norm_impl: str = "llama"
    """``"llama"``: LlamaRMSNorm written out (fp32 upcast, mean of squares, rsqrt, downcast,
    times weight); ``"torch"``: ``torch.nn.functional.rms_norm``."""
    dtype: torch.dtype = torch.float32
    """Dtype of the parameters and activations."""
    seed: int = 0
    """Seed of the fp32 weights; the same seed gives the same model for every world size."""
    explicit_mask: bool = False
    """Attention gets its causal mask as a boolean ``attn_mask`` tensor instead of ``is_causal``."""
    eager_attention: bool = False
    """Attention written out as Hugging Face's eager attention, ``softmax(q k^T * scale + mask) v``
    with an additive causal mask (two ``bmm`` and a decomposed softmax in the graph), not SDPA."""
    quant: str = "none"
    """``"none"``, or a quantized-activation form of ``weavepass.testing.quant.ACT_QUANTS``
    (``"fp8_row"``, ``"int8_row"``, ...): the linears that read a norm's output (q/k/v, gate/up)
    become ``QuantLinear``s that quantize it as that library does and run its scaled matmul (FP8
    ``_scaled_mm``, int8 ``_int_mm``); the others stay in the model dtype."""

    def __post_init__(self) -> None:
        if self.norm_impl not in NORM_IMPLS:
            raise ValueError(f"norm_impl must be one of {NORM_IMPLS}, got {self.norm_impl!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.n_experts and not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
        if self.quant != "none":
            from weavepass.testing.quant import ACT_QUANTS, GROUP

            if self.quant not in ACT_QUANTS:
                raise ValueError(f"quant must be 'none' or one of {sorted(ACT_QUANTS)}, got {self.quant!r}")
            if self.quant == "fp8_group" and self.hidden % GROUP:
                raise ValueError(f"quant='fp8_group' needs hidden divisible by {GROUP}, got {self.hidden}")

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError unless every rank of ``world_size`` gets whole attention heads."""
        if self.n_heads % world_size or self.n_kv_heads % world_size:
            raise ValueError(
                f"world_size={world_size} must divide n_heads={self.n_heads} and "
                f"n_kv_heads={self.n_kv_heads}"
            )


def full_weights(cfg: TPConfig) -> dict[str, torch.Tensor]:
    """Every weight of the unsharded model, fp32 on the CPU, drawn from ``cfg.seed``.

    Linear weights are ``[out, in]`` with std ``1/sqrt(in)`` so activations stay O(1); norm weights
    are ``1 + 0.1 * N(0, 1)`` so a wrong weight shows in the output. The draw order depends only on
    the config, never on the world size.
    """
    gen = torch.Generator().manual_seed(cfg.seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return normal(out_features, in_features, std=in_features**-0.5)

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal(cfg.hidden, std=0.1)

    h, q, kv = cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    weights = {"embed": normal(cfg.vocab, h, std=1.0)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        weights[p + "input_norm"] = norm_weight()
        weights[p + "q_proj"] = linear(q, h)
        weights[p + "k_proj"] = linear(kv, h)
        weights[p + "v_proj"] = linear(kv, h)
        weights[p + "o_proj"] = linear(h, q)
        weights[p + "post_attention_norm"] = norm_weight()
        experts = [f"experts.{e}." for e in range(cfg.n_experts)] if cfg.n_experts else [""]
        if cfg.n_experts:
            weights[p + "router"] = linear(cfg.n_experts, h)
        for e in experts:
            weights[p + e + "gate_proj"] = linear(cfg.intermediate, h)
            weights[p + e + "up_proj"] = linear(cfg.intermediate, h)
            weights[p + e + "down_proj"] = linear(h, cfg.intermediate)
    weights["norm"] = norm_weight()
    return weights


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over the tensor-parallel group (a functional collective); identity for ``group=None``."""
    if group is None:
        return x
    return funcol.all_reduce(x, "sum", group)


def linear(x: torch.Tensor, weight: torch.Tensor | nn.Module) -> torch.Tensor:
    """``x @ weight.T``, or a quantized linear (``TPConfig.quant``) applied to ``x``."""
    return weight(x) if isinstance(weight, nn.Module) else F.linear(x, weight)


def _param(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(t.to(device=device, dtype=dtype).contiguous(), requires_grad=False)


class RMSNorm(nn.Module):
    """``y = w * x / sqrt(mean(x^2, -1) + eps)`` over the last dim; ``x`` [..., H], ``w`` [H]."""

    def __init__(self, weight: nn.Parameter, eps: float, impl: str):
        super().__init__()
        self.weight = weight
        self.eps = eps
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "torch":
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # LlamaRMSNorm: normalise in fp32, round back to the activation dtype, then scale.
        dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(dtype)


class VocabParallelEmbedding(nn.Module):
    """Rows ``[vocab_start, vocab_start + shard rows)`` of the embedding; other ids give zero rows.

    The all_reduce of the per-rank rows is the model's first site (its norm has no residual).
    """

    def __init__(self, weight: nn.Parameter, vocab_start: int, group: dist.ProcessGroup | None):
        super().__init__()
        self.weight = weight
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        owned = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.masked_fill(~owned, 0), self.weight)
        return all_reduce_sum(rows.masked_fill(~owned.unsqueeze(-1), 0.0), self.group)


class RotaryEmbedding(nn.Module):
    """RoPE in the ``rotate_half`` form: ``x * cos + rotate_half(x) * sin``."""

    def __init__(self, head_dim: int, theta: float, device: torch.device):
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        self.register_buffer("inv_freq", theta**-exponents, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` [B, S] -> ``(cos, sin)``, each [B, 1, S, head_dim] in ``dtype``."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        angles = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class TPAttention(nn.Module):
    """GQA causal self-attention over this rank's heads; returns o_proj's partial sum (not reduced).

    q/k/v are column-parallel (this rank's heads), o_proj is row-parallel (the matching input
    columns), so summing the partial outputs over ranks gives the full attention output.
    """

    def __init__(self, q, k, v, o, n_local_heads: int, n_local_kv_heads: int, head_dim: int,
                 explicit_mask: bool = False, eager_attention: bool = False):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q, k, v, o
        self.n_heads, self.n_kv_heads, self.head_dim = n_local_heads, n_local_kv_heads, head_dim
        self.explicit_mask = explicit_mask
        self.eager_attention = eager_attention
        self.register_buffer("k_cache", None, persistent=False)  # attach_static_kv_cache sets them
        self.register_buffer("v_cache", None, persistent=False)

    def attach_static_kv_cache(self, batch: int, max_len: int) -> None:
        """Zeroed ``[batch, local kv heads, max_len, head_dim]`` key and value buffers; calls with
        fewer sequences use the first rows.

        Their addresses never change (``mark_static_address``), so Inductor's CUDA graphs can
        replay a step that updates them in place.
        """
        shape = (batch, self.n_kv_heads, max_len, self.head_dim)
        for name in ("k_cache", "v_cache"):
            buf = torch.zeros(shape, dtype=self.o_proj.dtype, device=self.o_proj.device)
            torch._dynamo.mark_static_address(buf)
            self.register_buffer(name, buf, persistent=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        cache_position: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``cache_position`` [S]: the cache slots of the S new tokens (with a cache only)."""
        batch, seq, _ = x.shape

        def heads(w: torch.Tensor, n: int) -> torch.Tensor:  # [B, S, H] -> [B, n, S, head_dim]
            return linear(x, w).view(batch, seq, n, self.head_dim).transpose(1, 2)

        q = heads(self.q_proj, self.n_heads)
        k = heads(self.k_proj, self.n_kv_heads)
        v = heads(self.v_proj, self.n_kv_heads)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        mask = None
        if self.k_cache is not None:
            if cache_position is None:
                raise ValueError("a model with a KV cache needs cache_position")
            # The first ``batch`` rows of the cache: one cache serves every batch up to its size.
            k_cache, v_cache = self.k_cache[:batch], self.v_cache[:batch]
            k_cache.index_copy_(2, cache_position, k)
            v_cache.index_copy_(2, cache_position, v)
            k, v = k_cache, v_cache
            # Query i sees every slot up to its own: the prompt's causal mask, and all cached
            # tokens for a decode step.
            slots = torch.arange(k.shape[2], device=x.device)
            mask = slots <= cache_position.unsqueeze(-1)
        group_size = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(group_size, dim=1)
        v = v.repeat_interleave(group_size, dim=1)
        if mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.explicit_mask:
            mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.eager_attention:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            scores = q @ k.transpose(2, 3) * self.head_dim ** -0.5
            scores = scores + torch.where(causal, 0.0, torch.finfo(scores.dtype).min)
            out = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim)
        return F.linear(out, self.o_proj)


class TPSwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` over this rank's slice of the intermediate width.

    gate/up are column-parallel and down is row-parallel: the result is this rank's partial sum.
    """

    def __init__(self, gate: nn.Parameter, up: nn.Parameter, down: nn.Parameter):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate, up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(linear(x, self.gate_proj)) * linear(x, self.up_proj)
        return F.linear(hidden, self.down_proj)


class TPMoE(nn.Module):
    """Softmax top-k mixture of tensor-parallel SwiGLU experts; returns this rank's partial sum.

    The router is replicated, so every rank makes the same routing decision. Each expert runs on
    every token and is weighted by the token's routing weight for it, which is zero unless the
    expert is among the token's top k: the same function as running each expert on its routed
    tokens only, but with static shapes, so torch.compile traces the layer without a graph break
    on data-dependent token counts. The weighted combine happens before the layer's one all_reduce.
    """

    def __init__(self, router: nn.Parameter, experts: list[TPSwiGLU], top_k: int):
        super().__init__()
        self.router = router
        self.experts = nn.ModuleList(experts)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.linear(x, self.router).float().softmax(dim=-1)
        top_probs, top_ids = probs.topk(self.top_k, dim=-1)
        top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        # [..., n_experts] combine weights: the renormalised top-k probabilities, zero elsewhere.
        combine = torch.zeros_like(probs).scatter(-1, top_ids, top_probs).to(x.dtype)
        weighted = [combine[..., e : e + 1] * expert(x) for e, expert in enumerate(self.experts)]
        return functools.reduce(operator.add, weighted)


class TPDecoderLayer(nn.Module):
    def __init__(self, input_norm, attention, post_attention_norm, mlp, group):
        super().__init__()
        self.input_norm = input_norm
        self.attention = attention
        self.post_attention_norm = post_attention_norm
        self.mlp = mlp
        self.group = group

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        cache_position: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attended = self.attention(self.input_norm(h), cos, sin, cache_position)
        h = h + all_reduce_sum(attended, self.group)
        return h + all_reduce_sum(self.mlp(self.post_attention_norm(h)), self.group)


class TPDecoder(nn.Module):
    """One rank's shard of the decoder: ``input_ids`` [B, S] -> normed hidden states [B, S, H]."""

    def __init__(self, cfg: TPConfig, embed, rotary, layers, norm):
        super().__init__()
        self.cfg = cfg
        self.embed = embed
        self.rotary = rotary
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def attach_static_kv_cache(self, batch: int, max_len: int) -> TPDecoder:
        """Give every layer a static KV cache of ``max_len`` slots for ``batch`` sequences; calls
        must then pass ``cache_position``. Returns the model."""
        for layer in self.layers:
            layer.attention.attach_static_kv_cache(batch, max_len)
        return self

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
        cache_position: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``positions`` [B, S] or [S] index RoPE (default ``cache_position``, else ``arange(S)``);
        ``cache_position`` [S] gives the KV-cache slots of the S new tokens (with a cache only)."""
        if positions is None:
            positions = cache_position
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        positions = positions.expand(input_ids.shape)
        h = self.embed(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, cache_position)
        return self.norm(h)


def build_tp_model(
    cfg: TPConfig,
    rank: int = 0,
    world_size: int = 1,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> TPDecoder:
    """Rank ``rank``'s shard of the model of ``cfg`` for a tensor-parallel group of ``world_size``.

    ``group`` is the process group the all_reduces run on; None is allowed only for
    ``world_size == 1`` and builds the unsharded model with no collectives (a single-process
    reference). ``dtype`` overrides ``cfg.dtype``: build an fp32 reference of a bf16 model by
    calling this twice with the same config. The model is in eval mode with frozen parameters.
    """
    if group is None and world_size != 1:
        raise ValueError(f"a process group is needed for world_size={world_size}")
    if group is not None and group.size() != world_size:
        raise ValueError(f"group has {group.size()} ranks, world_size is {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside world_size={world_size}")
    cfg.check_world_size(world_size)
    dtype = dtype or cfg.dtype
    cfg = dataclasses.replace(cfg, dtype=dtype)
    device = torch.device(device)
    weights = full_weights(cfg)

    def shard(name: str, dim: int) -> nn.Parameter:
        return _param(torch.tensor_split(weights[name], world_size, dim=dim)[rank], dtype, device)

    def reads_norm(name: str) -> nn.Parameter | nn.Module:
        """A column-parallel linear that reads a norm's output: quantized with ``cfg.quant``."""
        if cfg.quant == "none":
            return shard(name, 0)
        from weavepass.testing.quant import QuantLinear

        return QuantLinear(torch.tensor_split(weights[name], world_size, dim=0)[rank].to(device), cfg.quant,
                           act_scale)

    act_scale = None
    if cfg.quant != "none":  # one static activation scale for every quantized linear
        from weavepass.testing.quant import STATIC_ACT_SCALE

        act_scale = torch.tensor(STATIC_ACT_SCALE, device=device)

    def replicated(name: str) -> nn.Parameter:
        return _param(weights[name], dtype, device)

    def norm(name: str) -> RMSNorm:
        return RMSNorm(replicated(name), cfg.rms_eps, cfg.norm_impl)

    def swiglu(prefix: str) -> TPSwiGLU:
        gate, up = reads_norm(prefix + "gate_proj"), reads_norm(prefix + "up_proj")
        return TPSwiGLU(gate, up, shard(prefix + "down_proj", 1))

    vocab_start = sum(s.shape[0] for s in torch.tensor_split(weights["embed"], world_size)[:rank])
    embed = VocabParallelEmbedding(shard("embed", 0), vocab_start, group)
    layers = []
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        attention = TPAttention(
            reads_norm(p + "q_proj"),
            reads_norm(p + "k_proj"),
            reads_norm(p + "v_proj"),
            shard(p + "o_proj", 1),
            cfg.n_heads // world_size,
            cfg.n_kv_heads // world_size,
            cfg.head_dim,
            cfg.explicit_mask,
            cfg.eager_attention,
        )
        if cfg.n_experts:
            experts = [swiglu(f"{p}experts.{e}.") for e in range(cfg.n_experts)]
            mlp = TPMoE(replicated(p + "router"), experts, cfg.top_k)
        else:
            mlp = swiglu(p)
        layers.append(
            TPDecoderLayer(
                norm(p + "input_norm"), attention, norm(p + "post_attention_norm"), mlp, group
            )
        )
    rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, device)
    return TPDecoder(cfg, embed, rotary, layers, norm("norm")).eval()


def random_token_ids(
    cfg: TPConfig, batch: int, seq: int, seed: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``[batch, seq]`` int64 ids drawn from ``seed``: identical on every rank for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab, (batch, seq), generator=gen).to(device)
