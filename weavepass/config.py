"""``WeaveConfig``: every choice the pass makes that a user can steer, one documented field each.

Knobs are passed explicitly (``weavepass.weave(config=...)`` or ``weavepass.make_backend(config)``);
importing weavepass never changes global Inductor config.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    StrEnum = enum.StrEnum
else:  # Python 3.10 (requires-python): enum.StrEnum's behaviour, a str whose str() is its value

    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)


class Lowering(StrEnum):
    """How a fused op runs: the op call's ``lowering`` argument, which the runtime resolves
    (``weavepass.runtime.get_lowering``). The planner chooses it once per site
    (``weavepass.compile.planner.choose_lowering``); it is a ``str``, so the graph and the report
    carry its name."""

    PORTABLE = "portable"
    """reduce_scatter -> add + norm on ``ceil(T / N)`` rows -> all_gather, on any process group."""
    CUDA_SYMM = "cuda_symm"
    """The fused Triton kernel over symmetric memory (``weavepass.runtime.cuda``)."""


LOWERINGS = ("auto", *(lowering.value for lowering in Lowering))
"""``WeaveConfig.lowering``: ``"auto"`` (the planner picks per site) or a ``Lowering``."""
SPLIT_MODES = ("off", "auto", "force")
"""``WeaveConfig.split``."""
SPLIT_COMM_MODES = ("fused", "push")
"""``WeaveConfig.split_comm``."""
RENAMED_FIELDS = {
    "overlap": "split",
    "overlap_min_tokens": "split_min_tokens",
    "overlap_max_tokens": "split_max_tokens",
    "overlap_min_tokens_moe": "split_min_tokens_moe",
    "overlap_comm": "split_comm",
    "overlap_comm_ctas": "split_comm_ctas",
}
"""Deprecated ``WeaveConfig`` field names and the fields that replaced them. Passing an old name
(to ``WeaveConfig(...)`` or ``replace``) warns (``DeprecationWarning``) and sets the new field;
reading ``config.<old>`` warns and returns the new field's value. (``dataclasses.replace`` with an
old name passes the new field's current value too, so it raises where they differ: use
``config.replace``.) No environment variable had the old names."""
MMRS_COMM_MODES = ("auto", "aiv", "ai_cpu", "ccu", "none")
GEMM_EPILOGUE_MODES = ("off", "auto", "force")
_LONGEST_WAIT_S = timedelta.max.days * 86400.0  # what timedelta(seconds=...) still takes
# Field annotations are strings (``from __future__ import annotations``); every field is one of these.
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {"bool": bool, "int": int, "float": (int, float), "str": str}


_Class = TypeVar("_Class", bound=type)


def _with_new_names(changes: dict[str, Any], stacklevel: int) -> dict[str, Any]:
    """``changes`` with each deprecated field name (``RENAMED_FIELDS``) replaced by its new name, and
    a ``DeprecationWarning`` naming the new one, attributed ``stacklevel`` frames above the caller.
    An old and a new name given together must agree."""
    changes = dict(changes)
    for old, new in RENAMED_FIELDS.items():
        if old not in changes:
            continue
        value = changes.pop(old)
        warnings.warn(f"WeaveConfig.{old} is deprecated: use WeaveConfig.{new} (the same setting)",
                      DeprecationWarning, stacklevel=stacklevel + 1)
        if new in changes and changes[new] != value:
            raise ValueError(f"WeaveConfig: {old}={value!r} (deprecated) and {new}={changes[new]!r} disagree; "
                             f"pass {new} only")
        changes[new] = value
    return changes


def _old_name_reader(old: str, new: str) -> Callable[[Any], Any]:
    def read(config: Any) -> Any:
        warnings.warn(f"WeaveConfig.{old} is deprecated: use WeaveConfig.{new} (the same setting)",
                      DeprecationWarning, stacklevel=2)
        return getattr(config, new)

    return read


def _accepting_old_names(cls: _Class) -> _Class:
    """The dataclass ``cls``, whose ``__init__`` also takes the deprecated names of
    ``RENAMED_FIELDS`` and which reads them as properties. They are no fields: the repr,
    ``dataclasses.asdict`` and the pass's ``uuid()`` see only the new names."""
    init = cls.__dict__["__init__"]  # the dataclass's own
    fields = {f.name for f in dataclasses.fields(cls)}
    if not set(RENAMED_FIELDS).isdisjoint(fields) or not set(RENAMED_FIELDS.values()) <= fields:
        raise TypeError(f"RENAMED_FIELDS must map names that are no fields to fields of {cls.__name__}")

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **_with_new_names(kwargs, stacklevel=2))

    setattr(cls, "__init__", __init__)  # noqa: B010 (mypy refuses an assignment to a method)
    for old, new in RENAMED_FIELDS.items():
        setattr(cls, old, property(_old_name_reader(old, new), doc=f"Deprecated: ``{new}``."))
    return cls


@_accepting_old_names
@dataclass(frozen=True)
class WeaveConfig:
    enabled: bool = True
    """Run the rewrite at all. When False the backend is plain Inductor (the report says so)."""

    lowering: str = "auto"
    """How fused sites run: ``"auto"`` picks per device (CUDA: the symmetric-memory Triton kernel
    when it supports the site, else portable); ``"portable"`` forces reduce_scatter -> add+RMSNorm
    -> all_gather through ``torch.distributed``; ``"cuda_symm"`` asks for the CUDA kernel (sites it
    cannot run still fall back to portable, with the reason in the report)."""

    min_world_size: int = 2
    """Groups smaller than this are left alone: with one rank the all_reduce is already a no-op,
    and the reduce_scatter/all_gather pair would only add work."""

    cuda_workspace_tokens: int = 16384
    """Rows of symmetric memory the CUDA lowering reserves per group and dtype (x hidden). Batches
    with more tokens run on the portable lowering, with a one-time warning."""

    cuda_min_tokens: int = 1
    """With ``lowering="auto"`` on CUDA and without Inductor CUDA graphs: sites whose static token
    count is below this stay plain all_reduce, with the reason in the report. 1 (every size fused)
    since the host cost per fused op fell from 54 to 25.5 us (2 x H200, 2026-12-01,
    docs/cuda_kernel.md): a 16-layer 8b_tp2 decode step with static batches of 1, 32 and 256
    sequences then ran 0.70x, 0.69x and 0.98x of plain Inductor's time, fully fused
    (docs/benchmarks.md). History: it was 1024 because at 512 tokens the old host cost made a
    4-layer model 1.11x slower; static 512-1024-token batches were not re-measured with the new host
    path. Raise it to keep small static batches on NCCL's all_reduce. Under Inductor's CUDA graphs
    (with ``allow_inductor_cudagraphs``) every size is fused whatever this says."""

    allow_inductor_cudagraphs: bool = True
    """Rewrite graphs that Inductor wraps in CUDA-graph trees (``mode="reduce-overhead"``). On by
    default since the split, fuse-only and FlashComm passed their reduce-overhead GPU tests on 2
    H200s (2026-11-30, tests/gpu). Set False to leave such graphs plain Inductor as a whole (every
    site's report line then says why), e.g. to rule weave out when a CUDA-graph run misbehaves.
    History: the split gave wrong answers there until its async ops' inputs were kept from
    Inductor's in-place buffer reuse (now by ``weave::join_async``: weavepass/runtime/streams.py)."""

    split: str = "off"
    """The split: the tokens cut in two halves whose communication runs on a second stream while
    the other half computes (the design of TokenWeave, docs/overlap.md). ``"off"`` never
    splits, ``"auto"`` splits between ``split_min_tokens`` and ``split_max_tokens``,
    ``"force"`` splits whenever the graph allows (tests use this). With a ``tuning_table`` that has
    an entry for the graph, ``"auto"`` picks plain Inductor, fuse-only or the split from the
    table's measurements instead of the window. Off by default: on 2 H200s
    (4 Llama-3-70B TP=2 layers, docs/overlap.md, 2026-11-30) the split was 1.03x faster than
    plain Inductor at 16K tokens, even at 8K, 1.03-2.9x *slower* from 512 to 4K tokens and 1.13x
    slower at 32K; weave must never make a batch slower, and one measured size is thin evidence."""

    split_min_tokens: int = 16384
    """With ``split="auto"``: smallest token count (batch x sequence) a dense model is split at.
    Measured (docs/overlap.md): below 16K the split did not pay on 2 H200s (host overhead of the
    doubled launches below 2K, a tie at 8K). On a symbolic token count the comparison is a guard.
    A window of one size (``split_min_tokens == split_max_tokens``, the default) splits only
    static batches of exactly that size: guards for it would pin a dynamic token count to one value
    (an error for ``mark_dynamic`` inputs), so a symbolic count is not split, and the report says so."""

    split_max_tokens: int = 16384
    """With ``split="auto"``: largest token count split. Measured: at 32K tokens the split ran
    1.13x slower than plain Inductor (each half then fills the symmetric workspace)."""

    split_min_tokens_moe: int = 16384
    """``split_min_tokens`` for graphs with a routed MoE (``topk``). Not measured on GPUs (no MoE
    benchmark yet): set no lower than the dense threshold, since TokenWeave reports MoE gains only
    at larger batches."""

    tuning_table: str = "builtin"
    """With ``split="auto"``: the measured cost table that picks, per graph and token count,
    between plain Inductor (sites left as all_reduce), fuse-only and the split
    (``weavepass.tune.table``; the rule: docs/overlap.md, "How `auto` decides"). ``"builtin"``: our
    own measurements (one H200, a group of one rank: it applies to nothing else); ``"none"``: no
    table; else the path of a table written by ``python -m weavepass.tune`` on your machine. A
    graph the table has no entry for (another world size, device, dtype, compile mode, layer
    widths) is decided by the split's token window above, and the report says why. Loaded and validated
    when the config is made: a malformed table raises ``TuningTableError``."""

    split_comm_ctas: int = 0
    """CTAs of the fused CUDA kernel when it runs on the communication stream beside the other
    half's compute (0: the kernel's own launch rule: up to 32 CTAs on 2+ ranks, one CTA per 16 KiB
    tile, uncapped, on a group of one rank; launch_plan.py), or of the push kernel with
    ``split_comm="push"`` (0: 16). Fewer CTAs leave more SMs to the GEMMs and make the
    communication itself slower."""

    split_comm: str = "fused"
    """What the split's communication stream runs per half and site. ``"fused"``: the whole
    fused kernel (push, reduce, add + RMSNorm, finalise) on the side stream. ``"push"``: only this
    rank's partial rows stored into the peer's staging slot (a few CTAs of remote stores); the
    reduce + add + RMSNorm of all rows runs as one full-width kernel on the compute stream at the
    op's join (docs/overlap.md, "The push variant"). World 2 only: there one-shot
    moves the bytes of two-shot; on N ranks it would move (N-1) S per rank against 2 (N-1)/N S, so
    other world sizes keep ``"fused"`` and the report says why. CUDA ``cuda_symm`` sites only: on
    other lowerings and devices the push op runs as the fused async op (same numbers). Off by
    default: not yet measured on GPUs (issue 11)."""

    enable_flashcomm: bool = False
    """FlashComm (xLLM's ``enable_flashcomm1``, ``weavepass/compile/strategies/flashcomm.py``, docs/flashcomm.md): keep
    the residual stream sharded by token between the first and last site, all_reduce ->
    reduce_scatter, add + RMSNorm on 1/N of the tokens, all_gather only where full rows are needed.
    Chosen per graph, only when the token count is static and reaches
    ``flashcomm_min_prefill_tokens`` and every site continues the residual stream of the one before;
    otherwise the explain report says which condition or boundary stopped it."""

    flashcomm_min_prefill_tokens: int = 8192
    """Smallest token count (before padding to a multiple of ``16 * world_size``) for which
    FlashComm is chosen. xLLM's default, 8192, is a conservative start; the break-even point
    depends on the model."""

    enable_mmrs_fusion: bool = False
    """With FlashComm: fuse matmul + reduce_scatter (``torch_npu.npu_mm_reduce_scatter_base`` on
    NPU, symmetric-memory ``fused_matmul_reduce_scatter`` and ``fused_all_gather_matmul`` on CUDA).
    Read only when FlashComm is on. A matmul the fused op cannot take (bias, fp32, k outside
    [256, 65535), unsupported world size, ...) falls back to mm + reduce_scatter, with the reason in
    the report and a ``FlashComm MMRS skipped`` warning."""

    mmrs_comm_mode: str = "auto"
    """``comm_mode`` of torch_npu's fused matmul + communication ops (MMRS and all-gather + matmul).
    ``"auto"`` picks the chip's mode: ``"aiv"`` on Atlas A2/A3, ``"ccu"`` on Ascend 950. Explicit:
    ``"aiv"``, ``"ai_cpu"`` (A2/A3; documented for training only), ``"ccu"`` (Ascend 950), or
    ``"none"`` (not passed; torch_npu then uses ``"ai_cpu"``). A mode the chip does not take turns
    the fused ops off with the reason (``weavepass.runtime.npu.CHIPS``)."""

    gemm_epilogue: str = "off"
    """Run the row-parallel matmul that produces a site's partial sum (o_proj, down_proj) inside the
    fused op: ``weave.matmul_reduce_scatter_rmsnorm`` (docs/gemm_epilogue.md), matmul ->
    reduce_scatter -> add + RMSNorm -> all_gather on the portable lowering; with FlashComm, its
    sharded form keeps the norm's rows on the shard; on ``cuda_symm`` a persistent Triton GEMM whose
    epilogue stores each tile into the owner rank's symmetric staging (``runtime/cuda/matmul.py``).
    ``"off"``: never. ``"force"``: every site whose sum is a plain ``mm`` (through views) and whose
    lowering carries the op (portable, ``cuda_symm``); the others keep the fused op, with the reason
    in the report. ``"auto"``: only on ``cuda_symm`` where the measured table
    (``runtime.cuda.gemm.MEASURED_SPEED``) says the Triton GEMM is at least as fast as cuBLAS for the
    shape; elsewhere the fused op stays, and the report says the GEMM is unmeasured or slower. Not
    with the split (``split``), which rewrites fused ops: its sites keep the matmul outside."""

    fx_graph_cache: bool = False
    """Let Inductor load compiled graphs from its FX-graph cache. The cache key includes the pass's
    ``uuid()``, so results stay correct, but a cache hit skips the pass and the explain report then
    has no entries for that graph. Off by default so the report is always complete."""

    check_plan_across_ranks: bool = True
    """At compile time, compare the collectives each rewritten graph will run with every other
    rank of its group (through the default group's store) and raise ``PlanMismatchError`` when
    they differ, instead of hanging until the group timeout. Ranks differ after control flow that
    depends on the rank, e.g. a graph break on one rank only (docs/reliability.md). A recompile of
    a graph already checked (a rank-local guard) passes without store traffic; a failure leaves the
    check clean for the next compile; a dead peer is named within seconds (``PeerGoneError``).
    Costs a few store round trips per new compiled graph with collectives; nothing per step."""

    plan_check_timeout_s: float = 60.0
    """How long the plan check waits for an alive peer that has published nothing for this point of
    the group's stream of new collectives, once the peer has published some: how far apart ranks
    that have met in the group's collectives since may reach a compile; at most the group's own
    timeout. A peer's first graph on a group is awaited for the group's timeout
    (``init_process_group(timeout=...)``), since start-up skew is healthy for as long as the
    group's first collective would wait. A peer whose heartbeat stopped is named within about 5 s."""

    check_replicated: bool = False
    """Debug check, run on every call of every fused site: all-gather an exact digest of the
    residual and the norm weight (``weavepass/runtime/replication.py``) and raise ``ReplicationError`` when
    the ranks' digests differ. Tensor parallelism assumes both are replicated across the group;
    the fused lowerings compute each block of rows with its owner rank's copy, so a rank-dependent
    residual or weight gives silently wrong results. Adds one small all_gather and a copy of the
    residual per site and call; not done in FlashComm graphs (their residual stream is sharded on
    purpose)."""

    dump_graphs_dir: str = ""
    """Debugging: a directory to write, for every graph the pass sees, the graph before the pass and
    after each strategy that rewrote it, and its report (``<dir>/rank<R>/graph<NNN>/``,
    ``weavepass/compile/dump.py``): attach it to a report of a wrong rewrite. Empty (the default):
    off, unless the environment variable ``WEAVE_DUMP_GRAPHS`` names a directory. Nothing is
    written outside the directory."""

    def __post_init__(self) -> None:
        self._check_types()
        if self.lowering not in LOWERINGS:
            raise ValueError(f"WeaveConfig.lowering must be one of {LOWERINGS}, got {self.lowering!r}")
        if self.split not in SPLIT_MODES:
            raise ValueError(f"WeaveConfig.split must be one of {SPLIT_MODES}, got {self.split!r}")
        if self.split_comm not in SPLIT_COMM_MODES:
            raise ValueError(f"WeaveConfig.split_comm must be one of {SPLIT_COMM_MODES}, got {self.split_comm!r}")
        if self.gemm_epilogue not in GEMM_EPILOGUE_MODES:
            raise ValueError(
                f"WeaveConfig.gemm_epilogue must be one of {GEMM_EPILOGUE_MODES}, got {self.gemm_epilogue!r}"
            )
        if self.mmrs_comm_mode not in MMRS_COMM_MODES:
            raise ValueError(
                f"WeaveConfig.mmrs_comm_mode must be one of {MMRS_COMM_MODES}, got {self.mmrs_comm_mode!r}"
            )
        if self.split_min_tokens < 2 or self.split_min_tokens_moe < 2:
            raise ValueError("WeaveConfig.split_min_tokens(_moe) must be >= 2")
        if self.split_max_tokens < max(self.split_min_tokens, self.split_min_tokens_moe):
            raise ValueError(
                f"WeaveConfig.split_max_tokens ({self.split_max_tokens}) must be >= split_min_tokens "
                f"({self.split_min_tokens}) and split_min_tokens_moe ({self.split_min_tokens_moe})"
            )
        if self.split_comm_ctas != 0 and not 2 <= self.split_comm_ctas <= 32:
            raise ValueError(f"WeaveConfig.split_comm_ctas must be 0 or 2..32, got {self.split_comm_ctas}")
        if not self.tuning_table:
            raise ValueError('WeaveConfig.tuning_table must be "builtin", "none" or a path, got ""')
        from weavepass.tune.table import load_table

        load_table(self.tuning_table)  # a malformed table fails here, naming its problem
        if self.flashcomm_min_prefill_tokens < 1:
            raise ValueError("WeaveConfig.flashcomm_min_prefill_tokens must be >= 1")
        if self.min_world_size < 1:
            raise ValueError(f"WeaveConfig.min_world_size must be >= 1, got {self.min_world_size}")
        if self.cuda_min_tokens < 1:
            raise ValueError(f"WeaveConfig.cuda_min_tokens must be >= 1, got {self.cuda_min_tokens}")
        if self.cuda_workspace_tokens < 1:
            raise ValueError(
                f"WeaveConfig.cuda_workspace_tokens must be >= 1, got {self.cuda_workspace_tokens}"
            )
        if not 0 < self.plan_check_timeout_s <= _LONGEST_WAIT_S:  # also rejects nan and inf
            raise ValueError(f"WeaveConfig.plan_check_timeout_s must be > 0 and at most {_LONGEST_WAIT_S:g} "
                             f"(the longest wait a store takes), got {self.plan_check_timeout_s}")

    def _check_types(self) -> None:
        """Each field holds its declared type: ``enabled="no"`` would otherwise be truthy (on),
        and ``min_world_size="2"`` would fail later without naming the field. ``True`` is an
        ``int`` to Python, but never a count here."""
        for f in dataclasses.fields(self):
            declared = f.type if isinstance(f.type, str) else f.type.__name__
            value, expected = getattr(self, f.name), _FIELD_TYPES[declared]
            if not isinstance(value, expected) or (declared != "bool" and isinstance(value, bool)):
                raise TypeError(
                    f"WeaveConfig.{f.name} must be {declared}, got {type(value).__name__} {value!r}"
                )

    def replace(self, **changes: Any) -> WeaveConfig:
        """A copy with ``changes``; a deprecated name (``RENAMED_FIELDS``) warns and sets its new field."""
        return dataclasses.replace(self, **_with_new_names(changes, stacklevel=2))
