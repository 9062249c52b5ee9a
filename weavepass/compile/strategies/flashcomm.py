"""FlashComm: keep the residual stream sharded by tokens between the first and the last site.

xLLM's FlashComm (``enable_flashcomm1``) for tensor-parallel prefill, as a graph rewrite. For a
graph of ``K`` sites ``all_reduce(P_i) -> [+ residual] -> RMSNorm`` over ``T`` tokens of width
``H`` on ``N`` ranks, with ``T_pad = ceil(T / (16 N)) * 16 N`` and ``R = T_pad / N``::

    P_i [.., H] -> reshape [T, H] -> pad zero rows to [T_pad, H] -> reduce_scatter -> S_i [R, H]
    h_i = S_i + h_{i-1}                   (the residual stream, [R, H]: never gathered)
    y_i = RMSNorm(h_i)                    ([R, H], the graph's own norm ops, replayed on the shard)
    all_gather(y_i) [T_pad, H] -> rows [:T] -> reshape like the norm output -> consumers

so every all_reduce becomes a reduce_scatter, the add + RMSNorm runs on 1/N of the tokens, and one
all_gather per site restores full rows for the consumers that need them (QKV and gate/up
projections, the MoE router and experts, graph outputs). The final norm runs on the shard too,
followed by its one gather. Padding rows are zero, give zero norm outputs (no NaN), and are dropped
right after each gather, so they never reach a consumer; ``T < N`` works (most ranks then own only
padding). A residual stream value read by anything other than the next site (a graph output, say)
is gathered once for those readers.

With ``enable_mmrs_fusion`` the producer matmul of each partial sum joins its reduce_scatter:
``torch_npu.npu_mm_reduce_scatter_base`` on NPU (``weavepass.runtime.npu``) and symmetric-memory
``fused_matmul_reduce_scatter`` on CUDA. The gather after each norm joins a matmul that reads the
gathered rows: ``torch_npu.npu_all_gather_base_mm`` for one such matmul on NPU (the other readers
use its gathered rows), ``fused_all_gather_matmul`` on CUDA when every reader is such a matmul
(``weavepass.runtime.symm_mem_matmul``). A matmul that the fused op cannot take (bias, k out of
range, fp32, world size, the chip's rules, ...) falls back to ``mm -> reduce_scatter`` (or
``all_gather -> mm``) with the reason in the report and a ``FlashComm MMRS skipped`` warning on the
``weavepass`` logger.

The decision (``decide_flashcomm``) depends only on the config, shapes and the group's size, so
every rank decides the same; on NPU the fused ops also read the chip name, the same on every rank
of a job (``weavepass.runtime.npu``). Dynamic shapes: the decision is guard-free, so only a static
token count qualifies; a symbolic one leaves the graph to the normal fuse path with that reason.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, Node
from torch.fx.node import Argument

from weavepass.compile.fx_args import arg, arg_node, as_node, tensor
from weavepass.compile.patterns.allreduce_rmsnorm import VIEWS, FusedAllReduceRMSNormSite, _set_fake_vals, prepare
from weavepass.compile.patterns.rmsnorm import LAYER_NORM, is_target, val
from weavepass.compile.patterns.row_matmul import RowParallelMatmul
from weavepass.compile.planner import (
    SitePlan,
    choose_gemm_epilogue,
    gemm_epilogue_warns,
    group_size,
    inductor_cudagraphs_on,
)
from weavepass.compile.reasons import Reason, ReasonCode, runtime_issue_reason
from weavepass.compile.strategies.base import TRAINING, Decision, GraphRewrite, Strategy
from weavepass.compile.tokens import TokenCount
from weavepass.config import Lowering, WeaveConfig
from weavepass.ops import (
    ALL_GATHER_MATMUL,
    FLASHCOMM_SHARD_ROWS,
    MATMUL_REDUCE_SCATTER_RMSNORM_SHARD,
    NPU_ADD_RMS_NORM,
    NPU_ALL_GATHER_MM,
    NPU_MM_REDUCE_SCATTER,
)
from weavepass.runtime import GATHER_LOWERINGS, npu, symm_mem_matmul
from weavepass.runtime.issue import Unsupported

log = logging.getLogger("weavepass")
_EXPECTED_DECLINES = (ReasonCode.TOO_FEW_TOKENS, ReasonCode.NO_SITES, ReasonCode.GROUP_TOO_SMALL)
"""FlashComm's declines that are the configuration at work (logged at INFO); every other one is a
warning: the user enabled FlashComm and this graph runs without it."""

SYMM_MEM_CUDAGRAPHS_NOTE = Reason(ReasonCode.FLASHCOMM_SYMM_MEM_CUDAGRAPHS)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


# ----------------------------------------------------------------------------------------------
# The decision


@dataclass(frozen=True)
class FlashCommDecision(Decision):
    """Whether a graph runs FlashComm, and the sizes of the sharding when it does."""

    group_name: str = ""
    world_size: int = 0
    tokens: TokenCount = TokenCount(0)
    """every site's (static) token count"""

    @property
    def num_tokens(self) -> int:
        static = self.tokens.static
        if static is None:  # (``decide_flashcomm`` takes static counts only)
            raise ValueError("FlashComm needs a static token count")
        return static

    @property
    def padded_tokens(self) -> int:
        return self.tokens.padded(self.world_size)

    @property
    def rows_per_rank(self) -> int:
        return self.tokens.rows_per_rank(self.world_size)


def _carried(site: FusedAllReduceRMSNormSite) -> Node:
    """The node holding the site's new residual stream value (the add, or the reduced sum)."""
    return site.stream


def _through_views(node: Node) -> Node:
    while is_target(node, VIEWS):
        node = arg_node(node, 0)
    return node


def decide_flashcomm(plans: list[SitePlan], config: WeaveConfig) -> FlashCommDecision:
    """FlashComm for the whole graph, or the first reason against it (graph order).

    Needs: FlashComm enabled; at least one site, all on one known group of at least
    ``min_world_size`` ranks (whether the fused op's lowering could serve a site does not matter);
    one static token count ``T >= flashcomm_min_prefill_tokens`` for all sites; and every site
    after the first continuing the residual stream of the one before it (its residual is that
    site's output), so the stream can stay sharded from the first site to the last. Reads only
    shapes, the config and the group size: the same on every rank.
    """
    def no(code: ReasonCode, stopped: FusedAllReduceRMSNormSite | None = None, **fields: object) -> FlashCommDecision:
        """No, for ``code`` with ``fields``; ``stopped``: the site that stopped FlashComm."""
        return FlashCommDecision(False, Reason.of(code, **fields),
                                 stopped.all_reduce.name if stopped is not None else "")

    if not config.enable_flashcomm:
        return FlashCommDecision(False, Reason(ReasonCode.NOT_ASKED))
    if not plans:
        return no(ReasonCode.NO_SITES)
    first = plans[0].site
    for plan in plans:
        if plan.site.group_name != first.group_name:
            return no(ReasonCode.MIXED_GROUPS, plan.site, site=plan.site.all_reduce.name,
                      group=plan.site.group_name, expected=first.group_name)
    # The group alone decides; a site's fused-op lowering (``plan.lowering``) is not used here.
    world = group_size(first.group_name)
    if world is None:
        return no(ReasonCode.GROUP_UNKNOWN, group=first.group_name)
    if world < config.min_world_size:
        return no(ReasonCode.GROUP_TOO_SMALL, size=world, min_world_size=config.min_world_size)
    tokens: TokenCount | None = None
    for plan in plans:
        site = plan.site
        count = TokenCount.of(site.partial)
        if count.static is None:  # symbolic
            return no(ReasonCode.SYMBOLIC_TOKENS, site, site=site.all_reduce.name)
        if site.hidden != first.hidden or (tokens is not None and count.static != tokens.static):
            assert tokens is not None
            return no(ReasonCode.UNEQUAL_SITES, site, site=site.all_reduce.name, tokens=count.static,
                      hidden=site.hidden, first_tokens=tokens.static, first_hidden=first.hidden)
        tokens = count
        if tensor(site.norm.input).dim() < 2:
            # The norm's ops index the dims of a 1-D value (F.layer_norm's var_mean over [0]);
            # replayed on [R, H] shard rows, dim 0 is the token dim: a mean over tokens.
            return no(ReasonCode.NO_TOKEN_DIM, site, site=site.all_reduce.name,
                      shape=list(tensor(site.norm.input).shape))
    assert tokens is not None and tokens.static is not None  # (plans is not empty; every count is static)
    if tokens.static < config.flashcomm_min_prefill_tokens:
        return no(ReasonCode.TOO_FEW_TOKENS, tokens=tokens.static, min_tokens=config.flashcomm_min_prefill_tokens)
    for before, plan in zip(plans, plans[1:]):
        site, prev = plan.site, before.site
        stream_in = site.residual  # (None exactly when the site has no residual add)
        if site.add is None or stream_in is None:
            return no(ReasonCode.NO_RESIDUAL_ADD, site, previous=prev.all_reduce.name, site=site.all_reduce.name)
        if _through_views(stream_in) is not _carried(prev):
            return no(ReasonCode.STREAM_BROKEN, site, previous=prev.all_reduce.name, site=site.all_reduce.name,
                      residual=stream_in.name, stream=_carried(prev).name)
    return FlashCommDecision(True, group_name=first.group_name, world_size=world, tokens=tokens)


# ----------------------------------------------------------------------------------------------
# Which lowering family the rewrite uses

_forced_device_kind: str | None = None


@contextlib.contextmanager
def force_device_kind(kind: str) -> Iterator[None]:
    """Rewrite as if the tensors were on ``kind`` ("portable", "npu", "cuda"): for tests on CPU.

    Not part of the pass's ``uuid()``: do not combine with ``WeaveConfig.fx_graph_cache=True``.
    """
    global _forced_device_kind
    if kind not in FORMS:
        raise ValueError(f"kind must be one of {tuple(FORMS)}, got {kind!r}")
    saved, _forced_device_kind = _forced_device_kind, kind
    try:
        yield
    finally:
        _forced_device_kind = saved


def device_kind(device: torch.device) -> str:
    """``"npu"`` / ``"cuda"`` for those devices, ``"portable"`` (functional collectives) otherwise."""
    if _forced_device_kind is not None:
        return _forced_device_kind
    return device.type if device.type in ("npu", "cuda") else "portable"


# ----------------------------------------------------------------------------------------------
# The rewrite


@dataclass
class _Matmul:
    """The matmul whose output is a site's partial sum: ``x @ w [+ bias]``, and the nodes from it
    to the partial (all dead once the fused op computes the partial's reduce_scatter)."""

    node: Node
    x: Node
    w: Node
    bias: Node | None
    chain: list[Node]


def _runtime(issue: Unsupported | None) -> Reason | None:
    """A runtime check's answer (``runtime.npu``, ``runtime.symm_mem_matmul``) as its ``Reason``."""
    return None if issue is None else runtime_issue_reason(issue)


def _producer_matmul(site: FusedAllReduceRMSNormSite, tokens: int) -> _Matmul | Reason:
    mm = site.matmul
    if mm is None:
        return Reason(ReasonCode.FLASHCOMM_NO_PRODUCER_MATMUL)
    if mm.target not in (aten.mm.default, aten.addmm.default):
        return Reason.of(ReasonCode.FLASHCOMM_PRODUCER_NOT_MM, op=str(mm.target))
    chain: list[Node] = []
    node = site.partial
    while node is not mm:
        if not is_target(node, VIEWS):  # e.g. a Granite scale moved onto the partial: not dropped
            return Reason.of(ReasonCode.FLASHCOMM_PRODUCER_NOT_VIEW, node=node.name, op=str(node.target))
        if len(node.users) != 1:
            return Reason.of(ReasonCode.FLASHCOMM_PRODUCER_VIEW_READ, node=node.name)
        chain.append(node)
        node = arg_node(node, 0)
    if len(site.partial.users) != 1 or len(mm.users) != 1:
        return Reason(ReasonCode.FLASHCOMM_PRODUCER_READ)
    if tuple(tensor(mm).shape) != (tokens, site.hidden):
        return Reason.of(ReasonCode.FLASHCOMM_PRODUCER_SHAPE, shape=tuple(tensor(mm).shape))
    if mm.target is aten.addmm.default:
        return _Matmul(mm, arg_node(mm, 1), arg_node(mm, 2), arg_node(mm, 0), [*chain, mm])
    return _Matmul(mm, arg_node(mm, 0), arg_node(mm, 1), None, [*chain, mm])


class PortableFlashComm:
    """Rewrites the sites of one graph in order; ``finish()`` gathers leftovers and erases.

    The portable form: functional collectives (reduce_scatter, all_gather) and the graph's own norm
    ops on the shard. ``NpuFlashComm`` and ``CudaFlashComm`` are the device forms: they override
    the steps a device fuses (``mmrs_unsupported_reason`` and ``matmul_reduce_scatter``,
    ``add_rmsnorm``, ``gather_normed``). ``FORMS`` picks one per graph, once."""

    kind = "portable"
    matmul_lowering: str = Lowering.PORTABLE
    """Where ``weave.matmul_reduce_scatter_rmsnorm_shard`` would run on this form's device
    (``WeaveConfig.gemm_epilogue``; ``runtime.matmul_unsupported_reason`` says whether it can)."""

    def __init__(self, graph: Graph, decision: FlashCommDecision, config: WeaveConfig):
        self.graph = graph
        self.d = decision
        self.config = config
        self.position = {n: i for i, n in enumerate(graph.nodes)}
        self.dead: set[Node] = set()
        self.carried_shard: dict[Node, Node] = {}  # original stream node -> its [R, H] shard
        self.new_nodes: list[Node] = []

    # -- small graph helpers (insert at the current insertion point, fake values set later)

    def call(self, target: Callable[..., Any], *args: Argument, **kwargs: Argument) -> Node:
        node = self.graph.call_function(target, args, kwargs)
        self.new_nodes.append(node)
        return node

    def flush(self) -> None:
        _set_fake_vals(self.new_nodes)
        self.new_nodes = []

    def pad_rows(self, rows: Node) -> Node:
        """``[T, k] -> [T_pad, k]`` with zero rows (no node when no padding is needed)."""
        missing = self.d.padded_tokens - self.d.num_tokens
        return rows if missing == 0 else self.call(aten.constant_pad_nd.default, rows, [0, 0, 0, missing], 0.0)

    def gather_rows(self, shard: Node, shape: Sequence[int]) -> Node:
        """``[R, H]`` shards -> all_gather -> drop padding rows -> reshape to ``shape``."""
        d = self.d
        full = self.call(c10d.all_gather_into_tensor.default, shard, d.world_size, d.group_name)
        return self.unpad_rows(self.call(c10d.wait_tensor.default, full), shape)

    def unpad_rows(self, full: Node, shape: Sequence[int]) -> Node:
        """Gathered ``[T_pad, H]`` rows -> drop padding rows -> reshape to ``shape``."""
        d = self.d
        if d.padded_tokens != d.num_tokens:
            full = self.call(aten.slice.Tensor, full, 0, 0, d.num_tokens)
        if list(shape) != [d.num_tokens, shape[-1]]:
            full = self.call(aten.reshape.default, full, list(shape))
        return full

    # -- one site

    def rewrite_site(self, site: FusedAllReduceRMSNormSite) -> tuple[str, list[Reason]]:
        """Rewrite ``site`` on the shard; returns ``(communication label, notes for the report)``."""
        shared = site.shared
        stream_in = site.residual
        # Where the op goes, as a position in the graph as it was: ``prepare`` may put a new node
        # there (the one wait of merged sums without a residual add), and moves late inputs up.
        point = self.position[site.insertion_point()]
        matmul, epilogue_note = self.epilogue_matmul(site)  # (read before ``prepare`` changes the site)
        site = prepare(site, self.graph)  # a shared expert's x is now in the op's residual x + r
        with self.graph.inserting_before(site.insertion_point()):
            shard: Node | None
            shard, label, notes = self.reduce_scatter(site) if matmul is None else (None, "gemm_epilogue", [])
            notes += [epilogue_note]
            residual: Node | None = None
            if site.add is not None:
                stream = as_node(stream_in, site.add, "residual")  # (a residual add has one)
                residual = self.carried_shard.get(_through_views(stream))
                if residual is None:  # the first site: a residual from outside the stream
                    residual = self.shard_rows(as_node(site.residual, site.add, "residual"), site.hidden)
                elif shared is not None:
                    residual = self.add_shared(site, shared, residual)
            if matmul is None:
                assert shard is not None  # (reduce_scatter's rows: no matmul took the site)
                normed, carried, norm_note = self.add_rmsnorm(site, shard, residual)
            else:
                normed, carried, norm_note = self.matmul_norm_shard(site, matmul, residual)
            notes.append(norm_note)
            self.flush()
            gathered, gather_note = self.gather_normed(site, normed, point)
            notes.append(gather_note)
            self.flush()
        if gathered is not None:
            site.norm.output.replace_all_uses_with(gathered)
        self.carried_shard[_carried(site)] = carried
        self.dead.update([*site.norm.nodes, site.norm.output])
        # A view between the add and the norm that others read too stays: it reads the stream,
        # which ``finish`` gathers for it.
        for view in reversed(site.views_to_norm):
            if all(user in self.dead for user in view.users):
                self.dead.add(view)
        self.dead.update([_carried(site), *site.views_to_add, site.wait, site.all_reduce])
        # Views of the stream that only this site's add read (``h.view(T, H) + sum``): nothing
        # reads the stream through them now, so ``finish`` gathers nothing for them.
        stream_view = stream_in
        while stream_view is not None and is_target(stream_view, VIEWS) \
                and all(user in self.dead for user in stream_view.users):
            self.dead.add(stream_view)
            stream_view = arg_node(stream_view, 0)
        return label, [n for n in notes if n is not None and n.code is not ReasonCode.NONE]

    def shard_rows(self, full: Node, hidden: int) -> Node:
        """This rank's ``[R, H]`` rows of a replicated value of ``T x H`` elements (any view)."""
        rows = self.call(aten.reshape.default, full, [self.d.num_tokens, hidden])
        return self.call(FLASHCOMM_SHARD_ROWS, rows, self.d.padded_tokens, self.d.world_size, self.d.group_name)

    def add_shared(self, site: FusedAllReduceRMSNormSite, shared: Node, stream_shard: Node) -> Node:
        """The op's residual ``x + r`` on the shard (``x`` replicated, ``r`` the carried stream):
        ``x``'s rows for this rank's shard (a bias row ``[H]``: itself) plus the carried shard, rounded
        where the fuse path rounds ``x + r``. The full-row ``x + r`` that ``prepare`` made (and its views of ``x``)
        is replaced; it would otherwise make ``finish`` gather the stream for it."""
        folded = as_node(site.residual, site.all_reduce, "residual")  # (``shared``: a residual add's)
        x_rows = arg_node(folded, 0)  # fold_inner_add builds add(views of x, r)
        self.dead.add(folded)
        if tensor(x_rows).dim() == 1:  # bias rows ([H], ``SumTree``): the same for every token
            return self.call(aten.add.Tensor, x_rows, stream_shard)
        while x_rows is not shared and is_target(x_rows, VIEWS):  # (a ``SumTree``'s sum of terms: x itself)
            self.dead.add(x_rows)
            x_rows = arg_node(x_rows, 0)
        return self.call(aten.add.Tensor, self.shard_rows(x_rows, site.hidden), stream_shard)

    def reduce_scatter(self, site: FusedAllReduceRMSNormSite) -> tuple[Node, str, list[Reason | None]]:
        """The site's reduced rows ``[R, H]``: fused with the producer matmul where possible."""
        d = self.d
        notes: list[Reason | None] = []
        if self.config.enable_mmrs_fusion:
            mm = _producer_matmul(site, d.num_tokens)
            reason = mm if isinstance(mm, Reason) else self.mmrs_unsupported_reason(mm)
            if reason is None and not isinstance(mm, Reason):
                out, label = self.matmul_reduce_scatter(self.pad_rows(mm.x), mm)
                self.dead.update(mm.chain)
                return out, label, notes
            notes.append(Reason.of(ReasonCode.FLASHCOMM_MMRS_SKIPPED, cause=reason))
            log.warning("weavepass: FlashComm MMRS skipped for %s: %s", site.all_reduce.name, reason)
        rows = self.call(aten.reshape.default, site.partial, [d.num_tokens, site.hidden])
        scattered = self.call(c10d.reduce_scatter_tensor.default, self.pad_rows(rows), "sum",
                              d.world_size, d.group_name)
        return self.call(c10d.wait_tensor.default, scattered), "portable", notes

    def epilogue_matmul(self, site: FusedAllReduceRMSNormSite) -> tuple[RowParallelMatmul | None, Reason]:
        """The matmul ``weave.matmul_reduce_scatter_rmsnorm_shard`` takes in for ``site`` (as the
        finder matched it), and the report's note on it ("" with ``gemm_epilogue="off"``). The
        quantization of a site stays outside under FlashComm, so it does not count against it."""
        unquantized = site.without_quant(Reason(ReasonCode.QUANT_FLASHCOMM))
        matmul, reason = choose_gemm_epilogue(unquantized, self.matmul_lowering, self.config.gemm_epilogue)
        if reason.code is not ReasonCode.NONE and matmul is None:
            level = logging.WARNING if gemm_epilogue_warns(reason, self.config.gemm_epilogue) else logging.INFO
            log.log(level, "weavepass: FlashComm: %s: %s", site.all_reduce.name, reason)
        return matmul, reason

    def matmul_norm_shard(self, site: FusedAllReduceRMSNormSite, matmul: RowParallelMatmul,
                          residual: Node | None) -> tuple[Node, Node, Reason | None]:
        """``(normed [R, H], new stream value [R, H], note)``: the matmul, its reduce_scatter and
        the add + RMSNorm of the shard in one ``weave.matmul_reduce_scatter_rmsnorm_shard`` (the
        fused op's math, not the graph's norm ops)."""
        d, norm = self.d, site.norm
        fused = self.call(MATMUL_REDUCE_SCATTER_RMSNORM_SHARD, matmul.x, matmul.mat2, residual, norm.weight,
                          norm.eps, d.group_name, norm.out_dtype, d.rows_per_rank, str(self.matmul_lowering),
                          self.config.cuda_workspace_tokens)
        self.dead.update([*matmul.views, matmul.mm])
        return self.call(operator.getitem, fused, 0), self.call(operator.getitem, fused, 1), None

    def mmrs_unsupported_reason(self, mm: _Matmul) -> Reason | None:
        """Why this form cannot fuse ``mm`` with its reduce_scatter (None: it can)."""
        return _operands_reason(mm) or Reason(ReasonCode.FLASHCOMM_NO_FUSED_MMRS)

    def matmul_reduce_scatter(self, x: Node, mm: _Matmul) -> tuple[Node, str]:
        """``(reduced rows [R, H], label)`` of the fused ``x @ mm.w`` + reduce_scatter (only where
        ``mmrs_unsupported_reason`` said it can)."""
        raise NotImplementedError(f"{self.kind}: no fused matmul + reduce_scatter")

    def add_rmsnorm(self, site: FusedAllReduceRMSNormSite, shard: Node,
                    residual: Node | None) -> tuple[Node, Node, Reason | None]:
        """``(normed [R, H], new stream value [R, H], note)`` for the shard: the residual added,
        then the site's own norm ops replayed on the shard."""
        carried = shard if residual is None else self.call(aten.add.Tensor, residual, shard)
        return self.replay_norm(site, carried), carried, None

    def replay_norm(self, site: FusedAllReduceRMSNormSite, x: Node) -> Node:
        """The site's own RMSNorm nodes, copied to read ``x`` [R, H]: eager's rounding, on 1/N rows.

        The copies read ``x`` viewed with the norm input's rank (``[1, .., R, H]``): their dims are
        the graph's own, which may count from the front (a decomposed ``F.layer_norm`` on
        ``[B, S, H]`` takes ``var_mean`` over dim 2)."""
        norm = site.norm
        rank = tensor(norm.input).dim()  # >= 2: decide_flashcomm refuses a 1-D norm input
        shape = [1] * (rank - 2) + [self.d.rows_per_rank, site.hidden]
        env = {norm.input: x if rank == 2 else self.call(aten.view.default, x, shape)}
        for node in sorted({*norm.nodes, norm.output}, key=self.position.__getitem__):
            copy = self.graph.node_copy(node, lambda a: env.get(a, a))
            copy.meta.pop("val", None)
            copy.meta.pop("tensor_meta", None)
            env[node] = copy
            self.new_nodes.append(copy)
        out = env[norm.output]
        return out if rank == 2 else self.call(aten.view.default, out, [self.d.rows_per_rank, site.hidden])

    def gather_normed(self, site: FusedAllReduceRMSNormSite, normed: Node,
                      point: int) -> tuple[Node | None, Reason | None]:
        """Full normed rows for the consumers: ``(node, note)``, or ``(None, note)`` when a fused
        all_gather + matmul took over every consumer. ``point``: the site's position
        (``rewrite_site``); a matmul weight computed after it is not read.

        ``gemm_epilogue="force"`` where the form's lowering carries ``weave.all_gather_matmul``: the
        gather and the consumer matmuls in that op (the gather prologue); where it does not (the
        NPU form's ``npu``), the gather stays, noted and warned as the row-parallel side's
        ``GEMM_EPILOGUE_LOWERING``. ``"auto"`` keeps the gather, with the reason: nothing has
        measured the gather GEMM against the plain matmul."""
        mode = self.config.gemm_epilogue
        note: Reason | None = None
        if mode == "force" and self.matmul_lowering in GATHER_LOWERINGS:
            reason = self.gather_prologue(site, normed, point)
            if reason is None:
                return None, Reason.of(ReasonCode.FLASHCOMM_CONSUMERS_FUSED, op="weave.all_gather_matmul")
            log.info("weavepass: FlashComm gather prologue not used after %s: %s", site.all_reduce.name, reason)
            note = Reason.of(ReasonCode.FLASHCOMM_GATHER_NOT_FUSED, cause=reason)
        elif mode == "force":  # the form's lowering has no kernel of the op (the NPU form's "npu")
            reason = Reason.of(ReasonCode.GEMM_EPILOGUE_LOWERING, mode=mode, lowering=str(self.matmul_lowering),
                               cause="no kernel of weave.all_gather_matmul runs there")
            log.warning("weavepass: FlashComm: %s: %s", site.all_reduce.name, reason)
            note = Reason.of(ReasonCode.FLASHCOMM_GATHER_NOT_FUSED, cause=reason)
        elif mode == "auto":
            note = Reason.of(ReasonCode.FLASHCOMM_GATHER_NOT_FUSED, cause=Reason.of(
                ReasonCode.GEMM_EPILOGUE_UNMEASURED, lowering=str(self.matmul_lowering)))
        return self.gather_rows(normed, tensor(site.norm.output).shape), note

    def row_matmuls(self, site: FusedAllReduceRMSNormSite,
                    point: int) -> tuple[list[Node], list[Node], list[Node]] | Reason:
        """``(mms, views, weights)``: every reader of the normed rows is ``[view ->] mm`` over
        ``[tokens, hidden]`` rows with a weight the op at ``point`` can read; else why not."""
        d, out = self.d, site.norm.output
        rows_shape = (d.num_tokens, site.hidden)
        mms: list[Node] = []
        views: list[Node] = []
        for user in out.users:
            user_val = val(user)
            if is_target(user, VIEWS) and user_val is not None and tuple(user_val.shape) == rows_shape:
                views.append(user)
                readers = [(reader, user) for reader in user.users]
            else:
                readers = [(user, out)]
            for reader, rows in readers:
                if not (is_target(reader, {aten.mm.default}) and arg(reader, 0) is rows  # (``self`` by name)
                        and tuple(tensor(rows).shape) == rows_shape):
                    return Reason.of(ReasonCode.FLASHCOMM_READER_NOT_MM, node=reader.name, op=str(reader.target))
                mms.append(reader)
        if not mms:
            return Reason.of(ReasonCode.FLASHCOMM_NO_ROWS_MM, as_rows=False)
        weights = []
        for mm in mms:
            w = self.weight_before(mm, point)
            if w is None:
                return Reason.of(ReasonCode.FLASHCOMM_WEIGHT_AFTER_NORM, matmul=mm.name)
            weights.append(w)
        return mms, views, weights

    def replace_row_matmuls(self, mms: list[Node], views: list[Node], outputs: Node, padded: bool) -> None:
        """Each of ``mms`` replaced by item ``i`` of the op's list ``outputs`` (``padded``: the op
        gives ``T_pad`` rows, cut to ``T``)."""
        d = self.d
        replacements = []
        for i, mm in enumerate(mms):
            rows = self.call(operator.getitem, outputs, i)
            if padded and d.padded_tokens != d.num_tokens:
                rows = self.call(aten.slice.Tensor, rows, 0, 0, d.num_tokens)
            replacements.append((mm, rows))
        self.flush()
        for mm, rows in replacements:
            mm.replace_all_uses_with(rows)
        self.dead.update([*mms, *views])

    def gather_prologue(self, site: FusedAllReduceRMSNormSite, normed: Node, point: int) -> Reason | None:
        """Replace ``gather -> [view] -> mm`` consumers by one ``weave.all_gather_matmul``."""
        found = self.row_matmuls(site, point)
        if isinstance(found, Reason):
            return found
        mms, views, weights = found
        d = self.d
        outputs = self.call(ALL_GATHER_MATMUL, normed, weights, d.group_name, d.num_tokens, str(self.matmul_lowering),
                            self.config.cuda_workspace_tokens)
        self.replace_row_matmuls(mms, views, outputs, padded=False)
        return None

    def weight_before(self, mm: Node, point: int) -> Node | None:
        """``mm``'s weight as a node the fused op at ``point`` can read, or None (computed later)."""
        w = arg_node(mm, 1)
        if self.position.get(w, point) < point:
            return w
        if is_target(w, {aten.permute.default, aten.t.default}) and self.position.get(arg_node(w, 0), point) < point:
            return self.graph.node_copy(w)  # a transposed weight defined after the norm: move it up
        return None

    # -- after every site

    def finish(self) -> None:
        """Gather stream values that outside readers still need, then erase the replaced nodes."""
        for original, shard in self.carried_shard.items():
            if any(u not in self.dead for u in original.users):
                with self.graph.inserting_before(original):
                    full = self.gather_rows(shard, tensor(original).shape)
                    self.flush()
                original.replace_all_uses_with(full, delete_user_cb=lambda u: u not in self.dead)
        for node in reversed(list(self.graph.nodes)):
            if node in self.dead and not node.users:
                self.graph.erase_node(node)
        left = [n.name for n in self.graph.nodes if n in self.dead]
        if left:
            raise RuntimeError(f"FlashComm left replaced nodes in the graph: {left}")


def _operands_reason(mm: _Matmul) -> Reason | None:
    if val(mm.x) is None or val(mm.w) is None:
        return Reason(ReasonCode.FLASHCOMM_NO_OPERAND_METADATA)
    return None


class NpuFlashComm(PortableFlashComm):
    """The NPU form: torch_npu's fused matmul + reduce_scatter, add + RMSNorm and all_gather +
    matmul (``weavepass.runtime.npu``), each where the chip's rules take the site."""

    kind = "npu"
    matmul_lowering = "npu"

    def __init__(self, graph: Graph, decision: FlashCommDecision, config: WeaveConfig):
        super().__init__(graph, decision, config)
        # The chip and comm_mode of the NPU fused ops, read once per graph.
        self.npu_target = npu.fused_comm_target(config.mmrs_comm_mode) if config.enable_mmrs_fusion else None

    def fused_target(self) -> npu.FusedCommTarget:
        """The chip and comm_mode of the fused ops, read in ``__init__`` with ``enable_mmrs_fusion``
        (the fused ops are asked for only then)."""
        if self.npu_target is None:
            raise RuntimeError("weavepass internal error: an NPU fused op without enable_mmrs_fusion")
        return self.npu_target

    def mmrs_unsupported_reason(self, mm: _Matmul) -> Reason | None:
        operands = _operands_reason(mm)
        if operands is not None:
            return operands
        xv, wv = tensor(mm.x), tensor(mm.w)  # (checked by ``_operands_reason``)
        padded = self.d.padded_tokens != self.d.num_tokens
        x_shape = (self.d.padded_tokens, *xv.shape[1:])
        x_stride = (xv.shape[-1], 1) if padded else tuple(xv.stride())
        return _runtime(npu.matmul_comm_unsupported_reason(
            npu.MMRS, self.fused_target(), x_shape, x_stride, xv.dtype, tuple(wv.shape),
            tuple(wv.stride()), wv.dtype, self.d.world_size, mm.bias is not None))

    def matmul_reduce_scatter(self, x: Node, mm: _Matmul) -> tuple[Node, str]:
        d = self.d
        return self.call(NPU_MM_REDUCE_SCATTER, x, mm.w, d.group_name, d.world_size,
                         self.fused_target().comm_mode), "npu_mmrs"

    def add_rmsnorm(self, site: FusedAllReduceRMSNormSite, shard: Node,
                    residual: Node | None) -> tuple[Node, Node, Reason | None]:
        norm = site.norm
        weight_dtype = tensor(norm.weight).dtype if norm.weight is not None else None
        reason = _runtime(npu.add_rms_norm_unsupported_reason(site.dtype, weight_dtype, norm.out_dtype,
                                                     residual is not None, norm.kind == LAYER_NORM))
        if reason is None:
            fused = self.call(NPU_ADD_RMS_NORM, shard, residual, norm.weight, norm.eps)
            return (self.call(operator.getitem, fused, 0), self.call(operator.getitem, fused, 1),
                    Reason(ReasonCode.FLASHCOMM_NORM_NPU))
        normed, carried, _ = super().add_rmsnorm(site, shard, residual)
        return normed, carried, Reason.of(ReasonCode.FLASHCOMM_NORM_ATEN, cause=reason)

    def gather_normed(self, site: FusedAllReduceRMSNormSite, normed: Node,
                      point: int) -> tuple[Node | None, Reason | None]:
        """On NPU the rows come from ``npu_all_gather_base_mm`` where it can take one consumer matmul."""
        if self.npu_target is None:
            return super().gather_normed(site, normed, point)
        found = self.npu_all_gather_mm(site, normed, point)
        if not isinstance(found, Reason):
            return found
        log.info("weavepass: FlashComm all_gather+matmul not fused after %s: %s",
                 site.all_reduce.name, found)
        return self.gather_rows(normed, tensor(site.norm.output).shape), \
            Reason.of(ReasonCode.FLASHCOMM_GATHER_NOT_FUSED, cause=found)

    def npu_all_gather_mm(self, site: FusedAllReduceRMSNormSite, normed: Node,
                          point: int) -> tuple[Node, Reason] | Reason:
        """Gather the normed shard through ``npu_all_gather_base_mm`` with the first
        ``[tokens, hidden] @ w`` reader: ``(gathered rows for the other readers, note)``, or why not.

        The op multiplies by one weight only; the other readers take its gathered rows.
        """
        d, out = self.d, site.norm.output
        rows_shape = (d.num_tokens, site.hidden)
        candidates: list[tuple[Node, Node | None]] = [(user, None) for user in out.users]
        candidates += [(reader, view) for view in out.users if is_target(view, VIEWS)
                       for reader in view.users]
        first_reason: Reason | None = None
        for mm, view in candidates:
            rows = out if view is None else view
            if not (is_target(mm, {aten.mm.default}) and mm.args[0] is rows
                    and tuple(tensor(rows).shape) == rows_shape):
                continue
            wv, xv = val(mm.args[1]), val(normed)
            reason: Reason | None = Reason(ReasonCode.FLASHCOMM_NO_OPERAND_METADATA) if wv is None or xv is None else \
                _runtime(npu.matmul_comm_unsupported_reason(
                    npu.AGMM, self.fused_target(), tuple(xv.shape), tuple(xv.stride()), xv.dtype,
                    tuple(wv.shape), tuple(wv.stride()), wv.dtype, d.world_size, False))
            w = self.weight_before(mm, point) if reason is None else None
            if w is None:
                first_reason = first_reason or reason or Reason.of(ReasonCode.FLASHCOMM_WEIGHT_AFTER_NORM,
                                                                   matmul=mm.name)
                continue
            fused = self.call(NPU_ALL_GATHER_MM, normed, w, d.group_name,
                              d.world_size, self.fused_target().comm_mode)
            product = self.call(operator.getitem, fused, 0)
            if d.padded_tokens != d.num_tokens:
                product = self.call(aten.slice.Tensor, product, 0, 0, d.num_tokens)
            gathered = self.unpad_rows(self.call(operator.getitem, fused, 1), tensor(out).shape)
            self.flush()
            mm.replace_all_uses_with(product)
            self.dead.add(mm)
            if view is not None and len(view.users) == 1:
                self.dead.add(view)
            return gathered, Reason.of(ReasonCode.FLASHCOMM_CONSUMERS_FUSED, op="npu_all_gather_base_mm",
                                       matmul=mm.name)
        return first_reason or Reason.of(ReasonCode.FLASHCOMM_NO_ROWS_MM, as_rows=True)


class CudaFlashComm(PortableFlashComm):
    """The CUDA form: PyTorch's symmetric-memory fused matmul + reduce_scatter and all_gather +
    matmul (``weavepass.runtime.symm_mem_matmul``), where they take the site."""

    kind = "cuda"
    matmul_lowering = Lowering.CUDA_SYMM

    def __init__(self, graph: Graph, decision: FlashCommDecision, config: WeaveConfig):
        super().__init__(graph, decision, config)
        self.symm_reason: Reason | None = None
        if config.enable_mmrs_fusion:
            self.symm_reason = SYMM_MEM_CUDAGRAPHS_NOTE if inductor_cudagraphs_on() else (
                _runtime(symm_mem_matmul.symm_mem_unavailable_reason(decision.group_name, torch.device("cuda"))))

    def mmrs_unsupported_reason(self, mm: _Matmul) -> Reason | None:
        operands = _operands_reason(mm)
        if operands is not None:
            return operands
        if self.symm_reason is not None:
            return self.symm_reason
        x_shape = (self.d.padded_tokens, *tensor(mm.x).shape[1:])  # (checked by ``_operands_reason``)
        return _runtime(symm_mem_matmul.matmul_reduce_scatter_unsupported_reason(
            x_shape, self.d.world_size, mm.bias is not None))

    def matmul_reduce_scatter(self, x: Node, mm: _Matmul) -> tuple[Node, str]:
        return self.call(symm_mem_matmul.symm_mem_op(symm_mem_matmul.FUSED_MATMUL_REDUCE_SCATTER),
                         x, mm.w, "sum", 0, self.d.group_name), "cuda_symm"

    def gather_normed(self, site: FusedAllReduceRMSNormSite, normed: Node,
                      point: int) -> tuple[Node | None, Reason | None]:
        if not self.config.enable_mmrs_fusion or self.config.gemm_epilogue == "force":
            return super().gather_normed(site, normed, point)
        reason = self.symm_reason or self.all_gather_matmul(site, normed, point)
        if reason is None:
            return None, Reason.of(ReasonCode.FLASHCOMM_CONSUMERS_FUSED, op="fused_all_gather_matmul")
        log.info("weavepass: FlashComm all_gather+matmul not fused after %s: %s",
                 site.all_reduce.name, reason)
        return self.gather_rows(normed, tensor(site.norm.output).shape), \
            Reason.of(ReasonCode.FLASHCOMM_GATHER_NOT_FUSED, cause=reason)

    def all_gather_matmul(self, site: FusedAllReduceRMSNormSite, normed: Node, point: int) -> Reason | None:
        """Replace ``gather -> [view] -> mm`` consumers by one ``fused_all_gather_matmul``."""
        found = self.row_matmuls(site, point)
        if isinstance(found, Reason):
            return found
        mms, views, weights = found
        fused = self.call(symm_mem_matmul.symm_mem_op(symm_mem_matmul.FUSED_ALL_GATHER_MATMUL),
                          normed, weights, 0, self.d.group_name, return_A=True)
        self.replace_row_matmuls(mms, views, self.call(operator.getitem, fused, 1), padded=True)
        return None


FORMS: dict[str, type[PortableFlashComm]] = {
    form.kind: form for form in (PortableFlashComm, NpuFlashComm, CudaFlashComm)}
"""The FlashComm form of each device kind (``device_kind``), picked once per graph."""


FLASHCOMM_DROPS_SPLIT_NOTE = (
    "split={split!r} dropped: FlashComm took this graph, and the split overlaps only "
    "fused all_reduce sites, of which FlashComm leaves none"
)


class FlashCommStrategy(Strategy):
    """FlashComm for the whole graph when ``decide_flashcomm`` says so; it then takes the graph
    (no fuse, no split after it). Inference graphs only."""

    name = "FlashComm"
    reads = frozenset({"sites"})
    writes = frozenset({"sites", "records", "notes"})
    takes_graph = True

    def inductor_patches(self, config: WeaveConfig) -> dict[str, Any]:
        # FlashComm takes static token counts only: exactly the graphs where Inductor's shape
        # padding (fx_passes/pad_mm.py) may pad a producer matmul's token rows, and slice them off
        # before the all_reduce, when a benchmark on this GPU finds that faster. The matmul-
        # reduce_scatter fusion would then see a slice between the matmul and its collective on
        # one rank and not on another: different collectives per rank. Off, as for the split.
        return {"shape_padding": False} if config.enable_flashcomm else {}

    def decide(self, rewrite: GraphRewrite) -> Decision:
        if not rewrite.config.enable_flashcomm:
            return Decision(False, Reason(ReasonCode.NOT_ASKED))
        if rewrite.training:
            return Decision(False, TRAINING)
        return decide_flashcomm(rewrite.plans, rewrite.config)

    def decline(self, rewrite: GraphRewrite, decision: Decision) -> None:
        """The note, and the reason on the record of the site that stopped FlashComm, if one did."""
        report = rewrite.report
        super().decline(rewrite, decision)
        if decision.code is ReasonCode.TRAINING:  # the user asked for it: a warning
            log.warning("weavepass: graph %d: %s", report.graph_index, report.notes[-1])
            return
        records = {r.node: r for r in report.records}
        if decision.stopped_at in records:
            record = records[decision.stopped_at]
            record.reasons.append(Reason.of(ReasonCode.FLASHCOMM_DECLINED, cause=decision.reason))
        # Asked for and not used: a warning, unless the graph is simply too small (decode steps) or
        # has nothing to shard, which is FlashComm working as configured.
        level = logging.INFO if decision.code in _EXPECTED_DECLINES else logging.WARNING
        log.log(level, "weavepass: graph %d: FlashComm not used: %s", report.graph_index, decision.reason)

    def apply(self, rewrite: GraphRewrite, decision: Decision) -> bool:
        if not isinstance(decision, FlashCommDecision):  # (``decide`` said yes with one)
            raise TypeError(f"FlashComm applied with {type(decision).__name__}, not its own decision")
        graph, plans, config, report = rewrite.graph, rewrite.plans, rewrite.config, rewrite.report
        records = {r.node: r for r in report.records}
        kind = device_kind(plans[0].site.device)
        flashcomm = FORMS[kind](graph, decision, config)
        for plan in plans:
            record = records[plan.site.all_reduce.name]  # (before: merging sums renames the all_reduce)
            if plan.site.quant is not None:  # (FlashComm's rewrite leaves it to Inductor, after the gather)
                record.quant_left = Reason(ReasonCode.QUANT_FLASHCOMM)
                record.kind = plan.site.without_quant(record.quant_left).kind
            label, notes = flashcomm.rewrite_site(plan.site)
            record.lowering = f"flashcomm:{label}"
            record.reasons, record.notes = [], notes
            log.info("weavepass: %s -> FlashComm (%s)", record.node, label)
        flashcomm.finish()
        report.add_note(f"FlashComm ({kind}): {decision.num_tokens} tokens padded to "
                        f"{decision.padded_tokens}, {decision.rows_per_rank} rows per rank on "
                        f"{decision.world_size} ranks")
        if config.split != "off":
            report.add_note(FLASHCOMM_DROPS_SPLIT_NOTE.format(split=config.split))
            log.warning("weavepass: graph %d: %s", report.graph_index, report.notes[-1])
        if config.check_replicated:  # FlashComm shards the residual stream by design
            report.add_note("check_replicated: not done in a FlashComm graph (the residual "
                            "stream is sharded by token there)")
        return True
