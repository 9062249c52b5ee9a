"""Reasons: why a site or a graph is (not) rewritten the way it could be.

A reason is a ``ReasonCode`` and the detail as named fields (``Reason``); its sentence is rendered
from them (``Reason.render``, the table ``MESSAGES``), by the explain report and the ``weavepass``
logger. Code and tests branch on the code and read the fields, never the text, which may change
freely. A reason may carry another as a field (``cause``): where a reading stopped, inside the step
that gave up (``Reason.codes()`` lists the chain, outermost first).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeGuard, cast

from weavepass.config import StrEnum
from weavepass.runtime import QuantIssue
from weavepass.runtime.cuda.quant_epilogue import QuantFormIssue
from weavepass.runtime.cuda.support import CudaIssue
from weavepass.runtime.issue import ISSUE_TEXT, Unsupported
from weavepass.runtime.npu import NpuIssue
from weavepass.runtime.symm_mem_matmul import SymmMemIssue


class ReasonCode(enum.Enum):
    NONE = "none"
    """Nothing to say: the first choice was taken."""
    NOT_ASKED = "not_asked"
    """The config does not ask for this strategy (nothing is reported)."""

    # -- The finder (``patterns/``): why an all_reduce is not a site
    REDUCE_OP_NOT_SUM = "reduce_op_not_sum"
    INPUT_NO_METADATA = "input_no_metadata"
    """A value the match needs has no fake tensor (``node``)."""
    IN_PLACE_INPUT_READ = "in_place_input_read"
    NOT_ONE_WAIT = "not_one_wait"
    SUM_OTHER_READERS = "sum_other_readers"
    """The sum has readers besides the residual add that feeds the norm (``readers``)."""
    RESIDUAL_ADD_UNFIT = "residual_add_unfit"
    """The add after the sum is not ``S + R`` as the fused op computes it (``cause``)."""
    ADDS_SUM_TO_ITSELF = "adds_sum_to_itself"
    ADD_ALPHA = "add_alpha"
    RESIDUAL_NOT_TENSOR = "residual_not_tensor"
    RESIDUAL_BROADCAST = "residual_broadcast"
    RESIDUAL_DTYPE = "residual_dtype"
    AFTER_ADD = "after_add"
    """Read on past an add of ``added`` (a residual, a shared expert, another sum): ``cause``."""
    AFTER_PARTNER_ADD = "after_partner_add"
    """Read on past the add of another all_reduce's sum (``partner``): ``cause``."""
    BOTH_READINGS_FAIL = "both_readings_fail"
    """``sum + x``: neither ``x`` as the residual (``plain``) nor as added to the sum (``folded``)."""
    PARTNER_UNFIT = "partner_unfit"
    """Added to another all_reduce's sum that cannot share the collective (``cause``)."""
    PARTNER_NOT_A_SUM = "partner_not_a_sum"
    PARTNER_OTHER_GROUP = "partner_other_group"
    PARTNER_OTHER_DTYPE = "partner_other_dtype"
    RANK_LOCAL_INPUT = "rank_local_input"
    """A value the op needs the same on every rank is computed from the site's own partial."""
    LATE_INPUT = "late_input"
    SAVED_INV_RMS_SHAPE = "saved_inv_rms_shape"
    ALREADY_CLAIMED = "already_claimed"
    POST_NORM_SUM = "post_norm_sum"
    """A post-norm model's embedding sum (OLMo2/3, Exaone4): a layer (``layer``) reads it without a
    norm, and the model norms each branch before adding it to the stream: no norm follows the sum."""
    BIAS_NO_NORM = "bias_no_norm"
    """A bias row (``bias``) is added to the sum, and no norm reads the adds' result."""
    BIAS_NO_RESIDUAL = "bias_no_residual"
    """A bias row (``bias``) is added to the sum, with no residual of the sum's shape to carry it."""
    BIAS_TREE_DTYPE = "bias_tree_dtype"
    """A value added to a biased sum (``node``) has another dtype (type promotion is not fused)."""
    BIAS_TREE_BROADCAST = "bias_tree_broadcast"
    """A value added to a biased sum (``node``) is broadcast other than as a bias row ``[H]``."""
    NO_NORM_AFTER_BIAS = "no_norm_after_bias"
    """(Internal start value of the biased-sum reading: no add was read.)"""
    # The norm (``patterns/rmsnorm.py``)
    NO_NORM = "no_norm"
    NORM_OVER_SEVERAL_DIMS = "norm_over_several_dims"
    NORM_STATS_SAVED = "norm_stats_saved"
    NORM_STATS_READ = "norm_stats_read"
    NORM_OUTPUT_GETITEMS = "norm_output_getitems"
    EPS_NOT_CONSTANT = "eps_not_constant"
    EPS_ALPHA = "eps_alpha"
    NORM_VALUE_SHARED = "norm_value_shared"
    """A value inside the norm (``what``) is read elsewhere too (``cause``)."""
    SAVED_FOR_BACKWARD = "saved_for_backward"
    """A training graph saves ``node`` for backward, which the fused op does not return."""
    READ_BY_OUTPUT = "read_by_output"
    READ_BY = "read_by"
    NOT_FOLLOWED_BY = "not_followed_by"
    NORM_NOT_LAST_DIM = "norm_not_last_dim"
    MEAN_DROPS_DIM = "mean_drops_dim"
    NO_ROOT_AFTER_EPS = "no_root_after_eps"
    INV_RMS_NOT_SCALING_INPUT = "inv_rms_not_scaling_input"
    INV_STD_NOT_SCALING_CENTRED = "inv_std_not_scaling_centred"
    NARROWING_CAST = "narrowing_cast"
    VAR_MEAN_NOT_LAST_DIM = "var_mean_not_last_dim"
    UNBIASED_VARIANCE = "unbiased_variance"
    VAR_MEAN_OUTPUTS = "var_mean_outputs"
    MEAN_SUB_ALPHA = "mean_sub_alpha"

    # -- Per site (``planner.SitePlan``)
    GROUP_UNKNOWN = "group_unknown"
    """The process group is not known in this process."""
    GROUP_TOO_SMALL = "group_too_small"
    """The group has fewer than ``min_world_size`` ranks."""
    TRAINING = "training"
    """A training graph: the norm's inverse RMS is saved for backward (a lowering or strategy that
    does not return it refuses)."""
    CUDA_UNSUPPORTED = "cuda_unsupported"
    """The CUDA kernel cannot run the site; ``auto`` leaves it as all_reduce."""
    CUDA_MIN_TOKENS = "cuda_min_tokens"
    """Too few tokens for the CUDA kernel to pay off without CUDA graphs."""
    PORTABLE_FALLBACK = "portable_fallback"
    """``cuda_symm`` was asked for but cannot run: portable instead."""
    CUDA_COPY = "cuda_copy"
    """Information only: the CUDA kernel reads the partial sums from the matmul's output once (it
    stores the peers' rows into their workspaces, the reduce-scatter's transfer; no copy pass)."""
    # What the CUDA lowering cannot serve (the ``cause`` of ``CUDA_UNSUPPORTED``/``PORTABLE_FALLBACK``,
    # and of the split's push note): ``runtime.cuda.support.CudaIssue``, the same values; the
    # sentences are the runtime's (``support.CUDA_ISSUE_TEXT``), which it also warns with at run time.
    CUDA_NOT_ON_CUDA = "cuda_not_on_cuda"
    CUDA_DTYPE = "cuda_dtype"
    CUDA_OUT_DTYPE = "cuda_out_dtype"
    CUDA_HIDDEN_NOT_MULTIPLE = "cuda_hidden_not_multiple"
    CUDA_HIDDEN_TOO_LARGE = "cuda_hidden_too_large"
    CUDA_NO_TRITON = "cuda_no_triton"
    CUDA_GROUP_UNRESOLVED = "cuda_group_unresolved"
    CUDA_WORLD_SIZE = "cuda_world_size"
    CUDA_UNAVAILABLE = "cuda_unavailable"
    CUDA_RESIDUAL_MISMATCH = "cuda_residual_mismatch"
    CUDA_WEIGHT_MISMATCH = "cuda_weight_mismatch"
    CUDA_BIAS_MISMATCH = "cuda_bias_mismatch"
    CUDA_QUANT_FORM = "cuda_quant_form"
    PUSH_WORLD_SIZE = "push_world_size"
    PUSH_LAYER_NORM = "push_layer_norm"
    """``split_comm="push"`` not used: the graph has LayerNorm sites (the push kernel reduces RMSNorm ones)."""
    INDUCTOR_CUDAGRAPHS = "inductor_cudagraphs"
    """Graph-wide: Inductor CUDA graphs are on and the config forbids rewriting under them."""
    INDUCTOR_SETTINGS = "inductor_settings"
    """Graph-wide, per strategy: the compile lacks Inductor settings the strategy needs (the pass
    was patched into Inductor without ``WeavePass.inductor_settings()``): ``strategy``, and
    ``settings``, ``(key, needed, this compile's)`` each."""

    # -- The GEMM-epilogue lowering (``WeaveConfig.gemm_epilogue``, ``patterns/row_matmul.py``): per site
    GEMM_EPILOGUE = "gemm_epilogue"
    """Information: the site's row-parallel matmul (``matmul``) runs inside the op."""
    GEMM_EPILOGUE_NO_MATMUL = "gemm_epilogue_no_matmul"
    """The sum is not a matmul's output through views (``producer``: the first node that is not a view)."""
    GEMM_EPILOGUE_MERGED_SUMS = "gemm_epilogue_merged_sums"
    """The site adds other all_reduces' sums into its collective: the partial is a sum of products."""
    GEMM_EPILOGUE_SCALED = "gemm_epilogue_scaled"
    """The sum is scaled (``factor``), and the scale moves onto the matmul's output."""
    GEMM_EPILOGUE_NOT_MM = "gemm_epilogue_not_mm"
    """The matmul (``matmul``) is not a 2-D ``aten.mm`` (``op``)."""
    GEMM_EPILOGUE_MATMUL_SHAPE = "gemm_epilogue_matmul_shape"
    """The matmul's output (``shape``) is not ``[tokens, hidden]`` rows (``hidden``)."""
    GEMM_EPILOGUE_MATMUL_BIAS = "gemm_epilogue_matmul_bias"
    """The matmul adds a bias inside it (``addmm``), which the op does not take."""
    GEMM_EPILOGUE_MATMUL_READ = "gemm_epilogue_matmul_read"
    """The matmul's output (or a view of it, ``node``) is read elsewhere too (``readers``)."""
    GEMM_EPILOGUE_SITE_FORM = "gemm_epilogue_site_form"
    """The op fuses an RMSNorm inference site without quantization; this site is ``form``."""
    GEMM_EPILOGUE_UNMEASURED = "gemm_epilogue_unmeasured"
    """``auto``: no measurement says the op's GEMM is at least as fast as the plain matmul."""
    GEMM_EPILOGUE_SLOWER = "gemm_epilogue_slower"
    """``auto``: the measured table says the op's GEMM is slower than the plain matmul (``speed``)."""
    GEMM_EPILOGUE_LOWERING = "gemm_epilogue_lowering"
    """The site's lowering (``lowering``) does not carry the op (``cause``: the runtime's words)."""
    GEMM_EPILOGUE_SPLIT = "gemm_epilogue_split"
    """The split (``split``) rewrites fused ops: the matmul stays outside."""

    # -- Per graph (strategy decisions)
    NO_SITES = "no_sites"
    MIXED_GROUPS = "mixed_groups"
    SYMBOLIC_TOKENS = "symbolic_tokens"
    UNEQUAL_SITES = "unequal_sites"
    """Sites with different token counts or hidden sizes."""
    TOO_FEW_TOKENS = "too_few_tokens"
    STREAM_BROKEN = "stream_broken"
    """The residual stream does not run from one site to the next."""
    NO_RESIDUAL_ADD = "no_residual_add"
    """FlashComm: a site after the first has no residual add, so the stream does not continue."""
    NO_TOKEN_DIM = "no_token_dim"
    """A site's norm reads a 1-D ``[H]`` value: its ops name dims of a tensor without a token dim."""
    FLASHCOMM_DECLINED = "flashcomm_declined"
    """On the record of the site that stopped FlashComm: why (``cause``)."""

    # -- FlashComm per site (``strategies/flashcomm.py``): the record's ``notes``, how a site was
    # rewritten where there was a choice; a ``cause`` is one of the codes after them, or (from the
    # runtime's checks: ``runtime.npu``, ``runtime.symm_mem_matmul``) the runtime's words
    FLASHCOMM_MMRS_SKIPPED = "flashcomm_mmrs_skipped"
    """The producer matmul is not fused with the reduce_scatter (``cause``)."""
    FLASHCOMM_NORM_NPU = "flashcomm_norm_npu"
    """Information: the shard's add + norm runs as ``npu_add_rms_norm``."""
    FLASHCOMM_NORM_ATEN = "flashcomm_norm_aten"
    """The shard's add + norm runs as the graph's aten ops, not ``npu_add_rms_norm`` (``cause``)."""
    FLASHCOMM_CONSUMERS_FUSED = "flashcomm_consumers_fused"
    """Information: the normed rows' matmul consumers are fused with the all_gather (``op``, ``matmul``)."""
    FLASHCOMM_GATHER_NOT_FUSED = "flashcomm_gather_not_fused"
    """The all_gather of the normed rows is not fused with its matmul consumers (``cause``)."""
    FLASHCOMM_NO_OPERAND_METADATA = "flashcomm_no_operand_metadata"
    FLASHCOMM_NO_FUSED_MMRS = "flashcomm_no_fused_mmrs"
    """The portable form has no fused matmul + reduce_scatter."""
    FLASHCOMM_SYMM_MEM_CUDAGRAPHS = "flashcomm_symm_mem_cudagraphs"
    FLASHCOMM_NO_PRODUCER_MATMUL = "flashcomm_no_producer_matmul"
    FLASHCOMM_PRODUCER_NOT_MM = "flashcomm_producer_not_mm"
    """The partial comes from ``op``, not a 2-D mm."""
    FLASHCOMM_PRODUCER_NOT_VIEW = "flashcomm_producer_not_view"
    """``node`` (``op``) between the matmul and the all_reduce is not a view."""
    FLASHCOMM_PRODUCER_VIEW_READ = "flashcomm_producer_view_read"
    """``node`` between the matmul and the all_reduce has other readers."""
    FLASHCOMM_PRODUCER_READ = "flashcomm_producer_read"
    FLASHCOMM_PRODUCER_SHAPE = "flashcomm_producer_shape"
    """The matmul's output (``shape``) is not ``[tokens, hidden]``."""
    FLASHCOMM_NO_ROWS_MM = "flashcomm_no_rows_mm"
    """No mm reads the normed rows (``as_rows``: as ``[tokens, hidden]``)."""
    FLASHCOMM_READER_NOT_MM = "flashcomm_reader_not_mm"
    """``node`` (``op``) reads the normed rows, and is not a ``[tokens, hidden]`` mm."""
    FLASHCOMM_WEIGHT_AFTER_NORM = "flashcomm_weight_after_norm"
    """The weight of ``matmul`` is computed after the norm."""
    # Why a torch_npu or symm_mem fused op does not take a site (``runtime.npu.NpuIssue``,
    # ``runtime.symm_mem_matmul.SymmMemIssue``, the same values; the sentences are the runtime's,
    # ``runtime.issue.ISSUE_TEXT``)
    NPU_NO_CHIP_NAME = "npu_no_chip_name"
    NPU_UNKNOWN_CHIP = "npu_unknown_chip"
    NPU_COMM_MODE = "npu_comm_mode"
    NPU_BIAS = "npu_bias"
    NPU_NOT_2D = "npu_not_2d"
    NPU_DTYPES = "npu_dtypes"
    NPU_WORLD_SIZE = "npu_world_size"
    NPU_WORLD_SIZE_FAILING = "npu_world_size_failing"
    NPU_INNER_DIMS = "npu_inner_dims"
    NPU_K_RANGE = "npu_k_range"
    NPU_M_NOT_DIVISIBLE = "npu_m_not_divisible"
    NPU_X1_LAYOUT = "npu_x1_layout"
    NPU_X2_LAYOUT = "npu_x2_layout"
    NPU_GATHER_BYTES = "npu_gather_bytes"
    NPU_NORM_LAYER_NORM = "npu_norm_layer_norm"
    NPU_NORM_NO_RESIDUAL = "npu_norm_no_residual"
    NPU_NORM_DTYPE = "npu_norm_dtype"
    NPU_NORM_NO_WEIGHT = "npu_norm_no_weight"
    NPU_NORM_WEIGHT_DTYPE = "npu_norm_weight_dtype"
    NPU_NORM_OUT_DTYPE = "npu_norm_out_dtype"
    SYMM_MEM_UNAVAILABLE = "symm_mem_unavailable"
    SYMM_MEM_NOT_ON_CUDA = "symm_mem_not_on_cuda"
    SYMM_MEM_GROUP_UNRESOLVED = "symm_mem_group_unresolved"
    SYMM_MEM_NOT_NCCL = "symm_mem_not_nccl"
    SYMM_MEM_BIAS = "symm_mem_bias"
    SYMM_MEM_NOT_2D = "symm_mem_not_2d"
    SYMM_MEM_M_NOT_DIVISIBLE = "symm_mem_m_not_divisible"

    # -- The split (``strategies/split``): why a graph stays fuse-only
    SPLIT_NOT_POSSIBLE = "split_not_possible"
    """The split has no way to cut a node of the region (``cause``, one of the ``SPLIT_*`` below)."""
    SPLIT_NOTHING_FUSED = "split_nothing_fused"
    SPLIT_ONE_SITE = "split_one_site"
    SPLIT_PLAN = "split_plan"
    """The split's planner (``wave_model``) does not cut this graph (``cause``, one of the next five)."""
    SPLIT_TOO_FEW_TOKENS = "split_too_few_tokens"
    """Fewer than 2 ``tokens``: nothing to cut."""
    SPLIT_BELOW_WINDOW = "split_below_window"
    """``split="auto"``: ``tokens`` below the window's low end ``low`` (for a ``kind`` graph: dense or
    MoE); ``tokens`` is None for a symbolic count (then a guard)."""
    SPLIT_ABOVE_WINDOW = "split_above_window"
    """``split="auto"``: ``tokens`` above ``split_max_tokens`` (``high``); None for a symbolic count."""
    SPLIT_WINDOW_PINS_SIZE = "split_window_pins_size"
    """``split="auto"`` with a window of one size (``low``) and a symbolic count: a guard would pin it."""
    SPLIT_FEW_SYMBOLIC_UNITS = "split_few_symbolic_units"
    SPLIT_RUN_TIME_MASK = "split_run_time_mask"
    SPLIT_TOKEN_ARGUMENT_POSITION = 'split_token_argument_position'
    SPLIT_NO_RULE = 'split_no_rule'
    SPLIT_IN_PLACE_WRITE = 'split_in_place_write'
    SPLIT_VIEW_MOVES_CUT = 'split_view_moves_cut'
    SPLIT_BMM_RIGHT_SEQUENCES = 'split_bmm_right_sequences'
    SPLIT_RESIDUAL_PARTIAL_DIMS = 'split_residual_partial_dims'
    SPLIT_OUTPUT_NOT_SPLIT = 'split_output_not_split'
    SPLIT_READS_TOKEN_SIZE = 'split_reads_token_size'
    SPLIT_INPUT_DIMS_DIFFER = 'split_input_dims_differ'
    SPLIT_CAT_TOKEN_DIM = 'split_cat_token_dim'
    SPLIT_NO_BROADCAST = 'split_no_broadcast'
    SPLIT_INDEX_FROM_TOKENS = 'split_index_from_tokens'
    SPLIT_INDEX_SELECT_TOKEN_DIM = 'split_index_select_token_dim'
    SPLIT_INDEXES_TOKEN_DIM = 'split_indexes_token_dim'
    SPLIT_SQUEEZES_TOKEN_DIM = 'split_squeezes_token_dim'
    SPLIT_SLICES_TOKEN_DIM = 'split_slices_token_dim'
    SPLIT_REDUCES_TOKEN_DIM = 'split_reduces_token_dim'
    SPLIT_ALONG_TOKEN_DIM = 'split_along_token_dim'
    SPLIT_ALL_GATHER_TOKEN_DIM = 'split_all_gather_token_dim'
    SPLIT_TOKENS_NOT_ROWS = 'split_tokens_not_rows'
    SPLIT_CONTRACTS_TOKEN_DIM = 'split_contracts_token_dim'
    SPLIT_PARTIAL_NOT_FROM_TOKENS = 'split_partial_not_from_tokens'
    SPLIT_RESIDUAL_NOT_FROM_SITE = 'split_residual_not_from_site'
    SPLIT_NOT_LINED_UP = 'split_not_lined_up'
    SPLIT_OP_INPUT_DIMS_DIFFER = 'split_op_input_dims_differ'
    SPLIT_TOKEN_FREE_INDEX = 'split_token_free_index'
    SPLIT_VIEW_SYMBOLIC_SIZE = 'split_view_symbolic_size'
    SPLIT_COUNTS_AS_ROWS = 'split_counts_as_rows'
    SPLIT_READS_EXPERT_COUNTS = 'split_reads_expert_counts'
    SPLIT_SORT_TOKEN_DIM = 'split_sort_token_dim'
    SPLIT_SORT_DESCENDING = 'split_sort_descending'
    SPLIT_READS_EXPERT_ROWS = 'split_reads_expert_rows'
    SPLIT_MIXES_ROW_ORDERS = 'split_mixes_row_orders'
    SPLIT_TOKEN_FREE_EXPERT_ROWS = 'split_token_free_expert_rows'
    SPLIT_ROW_POSITIONS_ARITHMETIC = 'split_row_positions_arithmetic'
    SPLIT_COUNTS_DTYPE = 'split_counts_dtype'
    SPLIT_HISTC_BINS = 'split_histc_bins'
    SPLIT_GROUPED_MM_OPERANDS = 'split_grouped_mm_operands'
    SPLIT_INDEX_SEVERAL_DIMS = 'split_index_several_dims'
    SPLIT_SCATTER_NOT_BY_POSITIONS = 'split_scatter_not_by_positions'
    SPLIT_SCATTER_NOT_PERMUTATION = 'split_scatter_not_permutation'
    SPLIT_SCATTER_ADDS_POSITIONS = 'split_scatter_adds_positions'
    SPLIT_ROUTING_SYMBOLIC = 'split_routing_symbolic'
    SPLIT_VIEW_REGROUPS_EXPERT_ROWS = 'split_view_regroups_expert_rows'
    SPLIT_GATHER_OTHER_ROWS = 'split_gather_other_rows'
    SPLIT_INDEX_TOKEN_DIM_BY_TOKENS = 'split_index_token_dim_by_tokens'
    SPLIT_INDEX_ADD_DIM = 'split_index_add_dim'
    SPLIT_SCATTER_VALUES_ORDER = 'split_scatter_values_order'
    SPLIT_SCATTER_TARGET = 'split_scatter_target'
    SPLIT_ROUTING_READ_OUTSIDE = 'split_routing_read_outside'
    SPLIT_ROUTING_CONSTANT_EARLY = 'split_routing_constant_early'
    SPLIT_ROUTING_CONSTANT_SHARED = 'split_routing_constant_shared'
    SPLIT_NO_SCORES_RULE = 'split_no_scores_rule'
    SPLIT_BMM_CUT_SEQUENCE = 'split_bmm_cut_sequence'
    SPLIT_READS_SCORES = 'split_reads_scores'
    SPLIT_SCORES_ARGUMENT_POSITION = 'split_scores_argument_position'
    SPLIT_PROBABILITIES_TIMES_NOT_VALUES = 'split_probabilities_times_not_values'
    SPLIT_PROBABILITIES_NOT_MASKED_SOFTMAX = 'split_probabilities_not_masked_softmax'
    SPLIT_SCORES_VIEW = 'split_scores_view'
    SPLIT_SCORES_KEY_DIMS = 'split_scores_key_dims'
    SPLIT_SCORES_REDUCED_OTHER_DIMS = 'split_scores_reduced_other_dims'
    SPLIT_SCORES_REDUCED_OVER_KEYS = 'split_scores_reduced_over_keys'
    SPLIT_SCORES_OTHER_DIM = 'split_scores_other_dim'
    SPLIT_LINED_UP_WITH_KEYS = 'split_lined_up_with_keys'
    SPLIT_KEYS_NOT_MASK = 'split_keys_not_mask'
    SPLIT_ATTENTION_DROPOUT = 'split_attention_dropout'
    SPLIT_MASK_FROM_TOKENS = 'split_mask_from_tokens'
    SPLIT_ATTENTION_OUTPUTS = 'split_attention_outputs'
    SPLIT_QKV_DIMS = 'split_qkv_dims'
    SPLIT_BIDIRECTIONAL_CUT = 'split_bidirectional_cut'
    SPLIT_CAUSAL_OFFSET = 'split_causal_offset'
    SPLIT_MASK_SHAPE = 'split_mask_shape'
    SPLIT_READS_TOKENS = 'split_reads_tokens'
    SPLIT_SCORES_AFTER_LAST_SITE = 'split_scores_after_last_site'
    SPLIT_EXPERT_ROWS_INPUT = 'split_expert_rows_input'
    SPLIT_UNITS_DO_NOT_DIVIDE = 'split_units_do_not_divide'
    SPLIT_INPUT_SHAPE = 'split_input_shape'

    # -- A quantization of a site's normed rows that stays outside the fused op (``patterns/quant.py``,
    # ``QuantLeftOutside``; the norm is fused all the same)
    QUANT_UNKNOWN_STEP = "quant_unknown_step"
    """A cast to fp8/int8 reached through a node (``node``, ``op``) that is no step of a known quantization."""
    QUANT_UNPROVEN_INVERSE = "quant_unproven_inverse"
    """The rows are multiplied by a value (``node``) not computed as ``1 / scale`` in the graph."""
    QUANT_NO_SCALE = "quant_no_scale"
    QUANT_STATIC_NOT_SCALAR = "quant_static_not_scalar"
    QUANT_GLOBAL_SCALE = "quant_global_scale"
    """A dynamic per-tensor scale: its amax needs every rank's rows."""
    QUANT_SHARED_STEP = "quant_shared_step"
    """An intermediate of the quantization (``node``) is also read elsewhere (``reader``)."""
    QUANT_SCALE_MISMATCH = "quant_scale_mismatch"
    """A matmul reading the codes (``reader``) multiplies by ``factor``, not their ``scale``."""
    QUANT_NOT_A_MATMUL = "quant_not_a_matmul"
    """The codes are read by something that is not a scaled matmul (``reader``)."""
    QUANT_SYMBOLIC_VIEW = "quant_symbolic_view"
    """The normed rows are viewed to another shape before the quantization, with symbolic tokens."""
    QUANT_LATE_SCALE = "quant_late_scale"
    """The static scale is computed after the fused op's place and cannot move up (``cause``)."""
    QUANT_LAYER_NORM = "quant_layer_norm"
    QUANT_TRAINING = "quant_training"
    QUANT_LOWERING = "quant_lowering"
    """The site's lowering does not carry the quantization (``cause``: one of the next four)."""
    # Why (``runtime.QuantIssue``, the same values; the sentences are the runtime's, ``QUANT_ISSUE_TEXT``)
    QUANT_LOWERING_NOT_CARRIED = "quant_lowering_not_carried"
    QUANT_CUDA_STATIC_SCALE_DTYPE = "quant_cuda_static_scale_dtype"
    QUANT_CUDA_FORM = "quant_cuda_form"
    QUANT_CUDA_UNVERIFIED = "quant_cuda_unverified"
    # The form the CUDA kernel does not carry (the ``cause`` of ``QUANT_CUDA_FORM`` and
    # ``CUDA_QUANT_FORM``: ``runtime.cuda.quant_epilogue.QuantFormIssue``, the same values)
    QUANT_FORM_STATIC_SCALE_PER_GROUP = "quant_form_static_scale_per_group"
    QUANT_FORM_GROUP_SIZE = "quant_form_group_size"
    QUANT_FORM_STATIC_SCALE_DTYPE = "quant_form_static_scale_dtype"
    QUANT_FORM_STATIC_SCALE_NOT_SCALAR = "quant_form_static_scale_not_scalar"
    QUANT_FORM_TOO_MANY_STEPS = "quant_form_too_many_steps"
    QUANT_FORM_SCALE_NOT_AMAX = "quant_form_scale_not_amax"
    QUANT_FORM_SCALE_CAST = "quant_form_scale_cast"
    QUANT_FORM_SCALE_STEP = "quant_form_scale_step"
    QUANT_FORM_SCALE_NO_AMAX = "quant_form_scale_no_amax"
    QUANT_FORM_CODE_DTYPE = "quant_form_code_dtype"
    QUANT_FORM_FP8_NOT_CLAMPED = "quant_form_fp8_not_clamped"
    QUANT_FORM_CODE_CAST_EARLY = "quant_form_code_cast_early"
    QUANT_FORM_DIVISION_NOT_FIRST = "quant_form_division_not_first"
    QUANT_FORM_RECIPROCAL_DTYPE = "quant_form_reciprocal_dtype"
    QUANT_FORM_DIVISION_DTYPE = "quant_form_division_dtype"
    QUANT_FORM_STEP_BEFORE_DIVISION = "quant_form_step_before_division"
    QUANT_FORM_CODE_STEP = "quant_form_code_step"
    QUANT_FORM_NO_CODE_CAST = "quant_form_no_code_cast"
    QUANT_FORM_FP8_CAPABILITY = "quant_form_fp8_capability"
    QUANT_FLASHCOMM = "quant_flashcomm"
    """FlashComm took the graph: the quantization runs on the rows it gathers."""
    QUANT_SPLIT = "quant_split"
    """Graph-wide: the split does not carry quantized sites (``sites``)."""

    # ``split="auto"`` with a tuning table (``weavepass.compile.tuned``, docs/overlap.md)
    TUNED_NO_REWRITE = "tuned_no_rewrite"
    """The table measured every rewrite slower than Inductor (or not ``min_gain`` faster) at the
    neighbouring cells: the sites stay all_reduce. Each ``TUNED_*`` code's fields: the static
    ``tokens`` (None for a symbolic count, decided for ``low <= tokens < high``, either bound None
    where open), the rule's ``basis`` (``cell``, ``between``, ``below``, ``above``: ``weavepass.tune.table``),
    the ``fuse`` and ``split`` time ratios to Inductor at the neighbouring cells ``at``, ``min_gain``,
    and the entry: ``table``, ``shape``, ``mode``, ``world``."""
    TUNED_FUSE_ONLY = "tuned_fuse_only"
    """The table chose fuse-only: the split was not measured faster at the neighbouring cells."""
    TUNED_SPLIT = "tuned_split"
    """The table chose the split (information; the split may still find the graph unsplittable)."""
    TUNING_TABLE_NOT_APPLICABLE = "tuning_table_not_applicable"
    """The table (``table``) has no entry for this graph (``cause``: one of the next six): the split
    window (``split_min_tokens``..``split_max_tokens``) decides."""
    TUNING_TABLE_SITES_DIFFER = "tuning_table_sites_differ"
    TUNING_TABLE_TOKEN_COUNTS = "tuning_table_token_counts"
    TUNING_TABLE_DEVICE = "tuning_table_device"
    TUNING_TABLE_WORLD = "tuning_table_world"
    TUNING_TABLE_DTYPE = "tuning_table_dtype"
    TUNING_TABLE_NO_ENTRY = "tuning_table_no_entry"
    """No entry for ``hidden`` and the row-parallel ``widths`` in ``mode`` (``entries``: what it has)."""


Fields = tuple[tuple[str, object], ...]


@dataclass(frozen=True)
class Reason:
    """Why: a ``code`` and its detail as named ``fields`` (node names, sizes, dtypes, a ``cause``)."""

    code: ReasonCode
    fields: Fields = ()

    @classmethod
    def of(cls, code: ReasonCode, **fields: object) -> Reason:
        return cls(code, tuple(fields.items()))

    def field(self, name: str) -> object:
        for key, value in self.fields:
            if key == name:
                return value
        raise KeyError(f"{self.code.name} has no field {name!r}")

    def codes(self) -> Iterator[ReasonCode]:
        """This reason's code and those of the reasons it carries (depth first, outermost first)."""
        yield self.code
        for _, value in self.fields:
            if isinstance(value, Reason):
                yield from value.codes()

    def find(self, code: ReasonCode) -> Reason | None:
        """The first reason with ``code`` in this one's chain (itself included, depth first), or None."""
        if self.code is code:
            return self
        for _, value in self.fields:
            found = value.find(code) if isinstance(value, Reason) else None
            if found is not None:
                return found
        return None

    def render(self) -> str:
        """The sentence users read."""
        message = MESSAGES[self.code]
        fields = dict(self.fields)
        return message(fields) if callable(message) else message.format(**fields)

    def __str__(self) -> str:
        return self.render()


def _readers(fields: dict[str, object]) -> str:
    readers = fields["readers"]
    assert isinstance(readers, tuple)
    parts = []
    for name, written_into in readers:
        parts.append(name if not written_into else (
            f"{name} (the sum is written back into the graph input {written_into}: an in-place "
            "all_reduce of, or a copy_ into, a tensor the compiled code was given)"))
    return (f"the all_reduce result has {len(readers)} other user(s) besides the residual add that "
            f"feeds the norm: {', '.join(parts)}")


def _saved_for_backward(fields: dict[str, object]) -> str:
    returns = ("can return only the norm's inverse RMS (rsqrt, in fp32 or fp64) besides its outputs"
               if fields["norm_kind"] == "RMSNorm" else "for a LayerNorm returns only its outputs")
    saved_as = f" (as {fields['user']})" if fields["user"] else ""
    return (f"training: {fields['node']} is saved for backward{saved_as}, and the fused op {returns} "
            "(run the model under torch.no_grad() or torch.inference_mode() to fuse it)")


def _both_readings(fields: dict[str, object]) -> str:
    plain, folded = fields["plain"], fields["folded"]
    assert isinstance(plain, Reason) and isinstance(folded, Reason)
    # Said once where the second reading stopped where the first did, or for the same cause one
    # add further on (a lifted eps stops every norm alike).
    if _past_add(plain) in (folded, _past_add(folded)):
        return plain.render()
    return f"{plain.render()}; after that: {folded.render()}"


def _past_add(reason: Reason) -> Reason:
    """``reason`` without the add it read past (``AFTER_ADD``): where the reading stopped."""
    if reason.code in (ReasonCode.AFTER_ADD, ReasonCode.AFTER_PARTNER_ADD):
        cause = reason.field("cause")
        assert isinstance(cause, Reason)
        return cause
    return reason


EPS_NOT_CONSTANT_TEXT = (
    "the norm's eps is not a constant but a graph input (torch.compile(dynamic=True) lifts Python "
    "floats into inputs): set torch._dynamo.config.specialize_float = True, or mark only the token "
    "dim dynamic with torch._dynamo.mark_dynamic"
)

INDUCTOR_CUDAGRAPHS_TEXT = (
    "left as all_reduce: Inductor CUDA graphs (mode='reduce-overhead') are on and "
    "WeaveConfig.allow_inductor_cudagraphs is False"
)

CUDA_COPY_TEXT = ("the CUDA kernel reads the partial sums once, from the producing matmul's output: it "
                  "stores the peers' rows into their symmetric workspaces (the reduce-scatter's "
                  "transfer) and reduces its own rows in place, with no copy pass")

TRAINING_TEXT = (
    "training: the norms' inverse RMS is saved for backward; FlashComm and the split "
    "rewrite inference graphs only (the graph's sites are fused without them)"
)



def _not_a_replaceable_matmul(detail: str) -> Callable[[dict[str, object]], str]:
    """The sentence of a ``GEMM_EPILOGUE_*`` code that says why the sum's producer is not a matmul
    the lowering can replace, ``detail`` a template over the reason's fields."""
    def render(fields: dict[str, object]) -> str:
        return ("gemm_epilogue: the sum is not produced by a matmul the lowering can replace: "
                f"{fields['module'] or 'no module metadata'}: {detail.format(**fields)}")
    return render


def _inductor_settings(fields: dict[str, object]) -> str:
    settings = fields["settings"]
    assert isinstance(settings, tuple)
    listed = ", ".join(f"{key}={needed!r} (this compile: {current!r})" for key, needed, current in settings)
    return (f"{fields['strategy']} needs the Inductor settings {listed}; patch in the pass's "
            "config_patches() (weavepass.inductor_pass), not only the pass")


def _tuned(word: str, rule: bool = False) -> Callable[[dict[str, object]], str]:
    """The sentence of a ``TUNED_*`` code: the table's call (``word``) and the measurements behind it,
    in the words of the rule (``weavepass.tune.table``); ``rule``: the rewrite was not ``min_gain`` faster."""
    where = {"cell": "", "between": " (both neighbouring cells)",
             "below": " (below the measured range: the nearest cell; the split is not extrapolated)",
             "above": " (above the measured range: the nearest cell; the split is not extrapolated)"}

    def render(f: dict[str, object]) -> str:
        if f["tokens"] is not None:
            span = f"{f['tokens']} tokens"
        else:
            span = " <= ".join(str(x) for x in (f["low"], "tokens") if x is not None)
            span += (f" < {f['high']}" if f["high"] is not None else "") + " (symbolic, guarded)"
        basis = str(f["basis"])
        measured = f"fuse {f['fuse']}" + (f" and split {f['split']}" if basis in ("cell", "between") else "")
        gain = f"; a rewrite must be at least {f['min_gain']:.0%} faster than Inductor at every neighbouring cell" \
            if rule else ""
        return (f"auto: {word} at {span}: measured {measured} Inductor at {f['at']} tokens{where[basis]}{gain} "
                f"in tuning table {f['table']} ({f['shape']}, {f['mode']} mode, world {f['world']})")

    return render


Message = str | Callable[[dict[str, object]], str]

MESSAGES: dict[ReasonCode, Message] = {
    ReasonCode.NONE: "",
    ReasonCode.NOT_ASKED: "not asked for",
    ReasonCode.REDUCE_OP_NOT_SUM: "all_reduce op is {op!r}; only 'sum' is a row-parallel reduction",
    ReasonCode.INPUT_NO_METADATA: "{node} has no tensor metadata",
    ReasonCode.IN_PLACE_INPUT_READ: "in-place all_reduce whose input is read elsewhere",
    ReasonCode.NOT_ONE_WAIT: "the all_reduce result is not consumed through exactly one wait_tensor",
    ReasonCode.SUM_OTHER_READERS: _readers,
    ReasonCode.RESIDUAL_ADD_UNFIT: "the residual add ({add}): {cause}",
    ReasonCode.ADDS_SUM_TO_ITSELF: "it adds the reduced sum to itself, so there is no residual",
    ReasonCode.ADD_ALPHA: "alpha={alpha} scales {operand}; only a plain add (alpha=1) is fused",
    ReasonCode.RESIDUAL_NOT_TENSOR: "the residual {residual} is not a tensor",
    ReasonCode.RESIDUAL_BROADCAST: ("the residual's shape {shape} is not the reduced sum's {sum_shape} "
                                    "(broadcasting is not fused)"),
    ReasonCode.RESIDUAL_DTYPE: ("it adds {sum_dtype} and a {dtype} residual into {out_dtype}; the fused op "
                                "needs one dtype (no type promotion)"),
    ReasonCode.AFTER_ADD: "after adding {added}: {cause}",
    ReasonCode.AFTER_PARTNER_ADD: "after adding {added} ({partner}'s sum): {cause}",
    ReasonCode.BOTH_READINGS_FAIL: _both_readings,
    ReasonCode.PARTNER_UNFIT: ("the sum is added to another all_reduce's sum, which cannot share its "
                               "collective: {cause}"),
    ReasonCode.PARTNER_NOT_A_SUM: "{partner}: {cause}",
    ReasonCode.PARTNER_OTHER_GROUP: "{partner} reduces over group {group!r}, not {expected!r}",
    ReasonCode.PARTNER_OTHER_DTYPE: "{partner} sums {dtype}, not {expected}",
    ReasonCode.RANK_LOCAL_INPUT: ("{input} is computed from the all_reduce's own partial sum ({partial}), "
                                  "which differs between ranks; the fused op needs it the same on every rank"),
    ReasonCode.LATE_INPUT: ("{node} is computed after {point}, where the fused op goes, and depends on it; "
                            "cannot fuse"),
    ReasonCode.SAVED_INV_RMS_SHAPE: ("training: the inverse RMS {node} saved for backward has shape {shape}, "
                                     "not the fused op's {expected} (a view between the residual add and the norm)"),
    ReasonCode.ALREADY_CLAIMED: "{node} is already part of the site of {site}",
    ReasonCode.POST_NORM_SUM: ("nothing to fuse: {layer} reads this sum as its input without a norm in between, "
                               "and no norm follows the sum (a post-norm model norms each branch's output "
                               "before adding it to the residual stream, so its first sum, the embedding's, "
                               "is never normed)"),
    ReasonCode.BIAS_NO_NORM: ("a bias row ({bias}) is added to the sum, and no RMSNorm or LayerNorm reads the "
                              "adds' result"),
    ReasonCode.BIAS_NO_RESIDUAL: ("a bias row ({bias}) is added to the sum, and no residual of the sum's shape: "
                                  "the fused op's residual would be the broadcast bias"),
    ReasonCode.BIAS_TREE_DTYPE: "{node} is added to the sum as {dtype}, not {expected} (type promotion is not fused)",
    ReasonCode.BIAS_TREE_BROADCAST: ("{node} of shape {shape} is broadcast onto the sum's {sum_shape}: only a bias "
                                     "row of the hidden size is fused"),
    ReasonCode.NO_NORM_AFTER_BIAS: "no add after the sum",
    ReasonCode.NO_NORM: "no RMSNorm or LayerNorm consumes the value (first user: {first_user}{place})",
    ReasonCode.NORM_OVER_SEVERAL_DIMS: "{op} normalises over {ndims} dims, not only the last",
    ReasonCode.NORM_STATS_SAVED: ("training: the norm's statistics output {node} is saved for backward "
                                  "({op} is not fused in training graphs)"),
    ReasonCode.NORM_STATS_READ: "the norm's statistics outputs are used elsewhere",
    ReasonCode.NORM_OUTPUT_GETITEMS: "the norm output is read through several getitems",
    ReasonCode.EPS_NOT_CONSTANT: EPS_NOT_CONSTANT_TEXT,
    ReasonCode.EPS_ALPHA: "the eps add scales eps by alpha={alpha}; only mean + eps is matched",
    ReasonCode.NORM_VALUE_SHARED: "{what}: {cause}",
    ReasonCode.SAVED_FOR_BACKWARD: _saved_for_backward,
    ReasonCode.READ_BY_OUTPUT: "{node} is also used by output (the graph returns it)",
    ReasonCode.READ_BY: "{node} is also used by {user}",
    ReasonCode.NOT_FOLLOWED_BY: "{what} is not followed by {wanted}",
    ReasonCode.NORM_NOT_LAST_DIM: "the norm reduces over dims {dims}, not the last dim",
    ReasonCode.MEAN_DROPS_DIM: "{what} drops its dim",
    ReasonCode.NO_ROOT_AFTER_EPS: "{what} plus eps is not followed by rsqrt or sqrt",
    ReasonCode.INV_RMS_NOT_SCALING_INPUT: "the inverse RMS does not scale the norm's own input",
    ReasonCode.INV_STD_NOT_SCALING_CENTRED: ("the inverse standard deviation does not scale the "
                                             "mean-subtracted input"),
    ReasonCode.NARROWING_CAST: ("the norm casts its {dtype} input to float32 and computes the norm in "
                                "torch.float32; the fused op would compute it in {acc_dtype}"),
    ReasonCode.VAR_MEAN_NOT_LAST_DIM: "the norm's var_mean is not over the last dim with keepdim",
    ReasonCode.UNBIASED_VARIANCE: "the variance has correction={correction}; LayerNorm's is biased (0)",
    ReasonCode.VAR_MEAN_OUTPUTS: "the norm's var_mean outputs are not each read once",
    ReasonCode.MEAN_SUB_ALPHA: "{node} subtracts the mean with alpha={alpha}; only x - mean is matched",
    ReasonCode.GROUP_UNKNOWN: "process group {group!r} is not known here",
    ReasonCode.GROUP_TOO_SMALL: "group of {size} rank(s) < min_world_size={min_world_size}",
    ReasonCode.TRAINING: TRAINING_TEXT,
    ReasonCode.CUDA_UNSUPPORTED: "left as all_reduce: the CUDA kernel cannot run it ({cause})",
    ReasonCode.CUDA_MIN_TOKENS: (
        "left as all_reduce: {tokens} tokens < cuda_min_tokens={min_tokens} without CUDA graphs "
        "(host-bound: the fused op's launch costs more than it saves); set cuda_min_tokens=1 if you "
        "capture CUDA graphs yourself (torch.cuda.graph)"),
    ReasonCode.PORTABLE_FALLBACK: "portable instead of cuda_symm: {cause}",
    ReasonCode.CUDA_COPY: CUDA_COPY_TEXT,
    ReasonCode.PUSH_LAYER_NORM: ("the push variant's reduce kernel carries RMSNorm sites only, and this graph has "
                                 "LayerNorm sites"),
    ReasonCode.INDUCTOR_CUDAGRAPHS: INDUCTOR_CUDAGRAPHS_TEXT,
    ReasonCode.INDUCTOR_SETTINGS: _inductor_settings,
    ReasonCode.NO_SITES: "no all_reduce -> RMSNorm site in the graph",
    ReasonCode.MIXED_GROUPS: "site {site} is on group {group!r}, not {expected!r}",
    ReasonCode.SYMBOLIC_TOKENS: ("site {site}: the token count is symbolic (dynamic shapes); FlashComm "
                                 "decides guard-free, on static token counts only"),
    ReasonCode.UNEQUAL_SITES: ("site {site} has {tokens} tokens x {hidden}, not {first_tokens} x "
                               "{first_hidden} like the first site"),
    ReasonCode.TOO_FEW_TOKENS: "{tokens} tokens < flashcomm_min_prefill_tokens={min_tokens}",
    ReasonCode.STREAM_BROKEN: ("boundary {previous} -> {site}: the residual of {site} is {residual}, not "
                               "the stream value {stream} of {previous}; the stream cannot stay sharded "
                               "across it"),
    ReasonCode.NO_RESIDUAL_ADD: ("boundary {previous} -> {site}: {site} has no residual add, so the "
                                 "residual stream does not continue through it"),
    ReasonCode.QUANT_UNKNOWN_STEP: "{node} ({op}) is not a step of a known quantization",
    ReasonCode.QUANT_UNPROVEN_INVERSE: (
        "it multiplies the rows by {node}, which the graph does not compute as 1 / scale, so the scale "
        "the matmul multiplies by cannot be shown to be the one the rows were divided by"),
    ReasonCode.QUANT_NO_SCALE: "{node} casts the rows to the code dtype without a scale",
    ReasonCode.QUANT_STATIC_NOT_SCALAR: "its static scale {node} is not one number",
    ReasonCode.QUANT_GLOBAL_SCALE: (
        "its scale is the amax of all rows, and each rank normalises only 1/N of them: fusing it needs "
        "one more collective (an all_reduce(max)) before any code is written, so the norm is fused and "
        "Inductor quantizes the gathered rows"),
    ReasonCode.QUANT_SHARED_STEP: "{node} of the quantization is also read by {reader}",
    ReasonCode.QUANT_SCALE_MISMATCH: (
        "{reader} ({op}) reads the codes and multiplies by {factor}, not by the scale {scale} the rows "
        "were divided by"),
    ReasonCode.QUANT_NOT_A_MATMUL: "the codes are read by {reader}, not by a scaled matmul",
    ReasonCode.QUANT_SYMBOLIC_VIEW: ("the normed rows are viewed from {rows} to {shape} before it, with a "
                                     "symbolic token count"),
    ReasonCode.QUANT_LATE_SCALE: "its static scale: {cause}",
    ReasonCode.QUANT_LAYER_NORM: "only an RMSNorm site carries a quantization",
    ReasonCode.QUANT_TRAINING: "a training graph's fused op returns the inverse RMS, not codes",
    ReasonCode.QUANT_LOWERING: "{cause}",
    ReasonCode.QUANT_FLASHCOMM: ("FlashComm does not carry it yet: the quantization runs on the normed rows "
                                 "after FlashComm gathers them, as before"),
    ReasonCode.QUANT_SPLIT: ("the split does not carry quantized sites ({sites}: their fused ops "
                             "return codes and scales)"),
    ReasonCode.GEMM_EPILOGUE: "gemm_epilogue={mode!r}: the row-parallel matmul {matmul} runs inside the op",
    ReasonCode.GEMM_EPILOGUE_NO_MATMUL: _not_a_replaceable_matmul("it is {producer}"),
    ReasonCode.GEMM_EPILOGUE_MERGED_SUMS: _not_a_replaceable_matmul(
        "the site adds other all_reduces' sums into its collective, so each rank's partial is a sum of "
        "products"),
    ReasonCode.GEMM_EPILOGUE_SCALED: _not_a_replaceable_matmul(
        "the sum is scaled by {factor}, which moves onto the matmul's output"),
    ReasonCode.GEMM_EPILOGUE_NOT_MM: _not_a_replaceable_matmul("{matmul} is {op}, not a 2-D aten.mm"),
    ReasonCode.GEMM_EPILOGUE_MATMUL_SHAPE: _not_a_replaceable_matmul(
        "{matmul}'s output is {shape}, not rows of the hidden size {hidden}"),
    ReasonCode.GEMM_EPILOGUE_MATMUL_BIAS: _not_a_replaceable_matmul(
        "{matmul} adds a bias inside the matmul (addmm), which the op does not take"),
    ReasonCode.GEMM_EPILOGUE_MATMUL_READ: _not_a_replaceable_matmul(
        "{node} (the matmul's output or a view of it) is also read by {readers}"),
    ReasonCode.GEMM_EPILOGUE_SITE_FORM: ("gemm_epilogue: the matmul op fuses an RMSNorm inference site "
                                         "without quantization; this one is {form}: the matmul stays outside"),
    ReasonCode.GEMM_EPILOGUE_UNMEASURED: (
        "gemm_epilogue='auto' moves the matmul into the op only where a measured table says the op's GEMM "
        "is at least as fast as the plain matmul ({lowering} lowering), and none has measured it yet "
        "(docs/gemm_epilogue.md): the matmul stays outside"),
    ReasonCode.GEMM_EPILOGUE_SLOWER: (
        "gemm_epilogue='auto': the measured table says the {lowering} lowering's GEMM runs at {speed}x the "
        "plain matmul's speed for this shape (runtime.cuda.gemm.MEASURED_SPEED): the matmul stays outside"),
    ReasonCode.GEMM_EPILOGUE_LOWERING: ("gemm_epilogue={mode!r}: the {lowering} lowering does not carry the "
                                        "matmul op: {cause}; the matmul stays outside"),
    ReasonCode.GEMM_EPILOGUE_SPLIT: ("gemm_epilogue: the split (split={split!r}) rewrites fused ops, "
                                     "so the matmul stays outside for it to cut the site"),
    ReasonCode.TUNED_NO_REWRITE: _tuned("no rewrite (plain Inductor)", rule=True),
    ReasonCode.TUNED_FUSE_ONLY: _tuned("fuse-only"),
    ReasonCode.TUNED_SPLIT: _tuned("split"),
    ReasonCode.TUNING_TABLE_NOT_APPLICABLE: "auto: tuning table {table} not used: {cause}; the split window decides",
    ReasonCode.TUNING_TABLE_SITES_DIFFER: "its sites differ in group, hidden size or dtype",
    ReasonCode.TUNING_TABLE_TOKEN_COUNTS: "its sites have different token counts",
    ReasonCode.TUNING_TABLE_DEVICE: "measured on {measured}, this graph runs on {device}",
    ReasonCode.TUNING_TABLE_WORLD: ("measured at world {measured}, this group has {world} rank(s) "
                                    "(python -m weavepass.tune --world {world} measures it)"),
    ReasonCode.TUNING_TABLE_DTYPE: "measured in {measured}, this graph computes in {dtype}",
    ReasonCode.TUNING_TABLE_NO_ENTRY: lambda f: (
        f"no entry for hidden {f['hidden']} with row-parallel matmul widths {list(cast(tuple[int, ...], f['widths']))} "
        f"in {f['mode']} mode (it has: {f['entries']})"),
    ReasonCode.NO_TOKEN_DIM: ("site {site}: the norm reads a 1-D {shape} value; its reduction dims cannot "
                              "be replayed on [rows, hidden] shard rows"),
    ReasonCode.FLASHCOMM_DECLINED: "FlashComm: {cause}",
    ReasonCode.FLASHCOMM_MMRS_SKIPPED: "MMRS skipped: {cause}",
    ReasonCode.FLASHCOMM_NORM_NPU: "norm: npu_add_rms_norm",
    ReasonCode.FLASHCOMM_NORM_ATEN: "norm: aten on the shard (npu_add_rms_norm: {cause})",
    ReasonCode.FLASHCOMM_CONSUMERS_FUSED: lambda f: (
        f"consumers: {f['op']}" + (f" ({f['matmul']})" if f.get("matmul") else "")),
    ReasonCode.FLASHCOMM_GATHER_NOT_FUSED: "all_gather+matmul not fused: {cause}",
    ReasonCode.FLASHCOMM_NO_OPERAND_METADATA: "the matmul operands have no tensor metadata",
    ReasonCode.FLASHCOMM_NO_FUSED_MMRS: "no fused matmul + reduce_scatter for this device (portable lowering)",
    ReasonCode.FLASHCOMM_SYMM_MEM_CUDAGRAPHS: (
        "Inductor CUDA graphs are on: PyTorch's symm_mem fused matmul ops allocate their symmetric "
        "workspace on first use, inside the CUDA-graph pool, which CUDA-graph trees reject ('tensors in "
        "the cudagraph pool not tracked as outputs', 2 x H200, 2026-11-30); plain reduce_scatter and "
        "all_gather instead"),
    ReasonCode.FLASHCOMM_NO_PRODUCER_MATMUL: "no matmul produces the partial sum",
    ReasonCode.FLASHCOMM_PRODUCER_NOT_MM: "the partial sum comes from {op}, not a 2-D mm",
    ReasonCode.FLASHCOMM_PRODUCER_NOT_VIEW: "{node} ({op}) between the matmul and the all_reduce is not a view",
    ReasonCode.FLASHCOMM_PRODUCER_VIEW_READ: "{node} between the matmul and the all_reduce has other users",
    ReasonCode.FLASHCOMM_PRODUCER_READ: "the matmul output has other users",
    ReasonCode.FLASHCOMM_PRODUCER_SHAPE: "the matmul output is {shape}, not [tokens, hidden]",
    ReasonCode.FLASHCOMM_NO_ROWS_MM: lambda f: (
        "no mm reads the normed rows" + (" as [tokens, hidden]" if f.get("as_rows") else "")),
    ReasonCode.FLASHCOMM_READER_NOT_MM: "{node} ({op}) reads the normed rows, not a [tokens, hidden] mm",
    ReasonCode.FLASHCOMM_WEIGHT_AFTER_NORM: "the weight of {matmul} is computed after the norm",
    ReasonCode.SPLIT_NOT_POSSIBLE: "split not possible: {cause}",
    ReasonCode.SPLIT_NOTHING_FUSED: ("no site was fused, so there is no communication to overlap (each "
                                     "site's line says why it was kept)"),
    ReasonCode.SPLIT_ONE_SITE: "1 fused site: no compute between sites to overlap with",
    ReasonCode.SPLIT_PLAN: "{cause}",
    ReasonCode.SPLIT_TOO_FEW_TOKENS: "{tokens} token(s): nothing to split",
    ReasonCode.SPLIT_BELOW_WINDOW: lambda f: (
        f"symbolic token count below the split threshold {f['low']} ({f['kind']}); guarded, so a batch "
        "at or above it compiles its own graph" if f["tokens"] is None
        else f"{f['tokens']} tokens < split threshold {f['low']} ({f['kind']}): fuse-only pays more"),
    ReasonCode.SPLIT_ABOVE_WINDOW: lambda f: (
        f"symbolic token count above split_max_tokens {f['high']}; guarded, so a batch inside the "
        "window compiles its own graph" if f["tokens"] is None
        else f"{f['tokens']} tokens > split_max_tokens {f['high']}: measured slower split"),
    ReasonCode.SPLIT_WINDOW_PINS_SIZE: (
        "symbolic token count and a window of one size ({low} tokens, {kind}): guards for it would pin "
        "the dynamic size to one value, so only a static batch of that size is split (widen "
        "split_min_tokens..split_max_tokens to split dynamic batches)"),
    ReasonCode.SPLIT_FEW_SYMBOLIC_UNITS: (
        "{units} {mode} unit(s) on a symbolic count: a half of one unit would specialise the graph; "
        "split from {min_units} units on"),
    ReasonCode.SPLIT_RUN_TIME_MASK: (
        "the attention mask {masks} is an input: whether it hides every key after the cut from every "
        "query before it is known only at run time, so split='auto' does not cut the sequence "
        "(split='force' does, with a run-time check that stops a mask that does not)"),
    ReasonCode.SPLIT_TOKEN_ARGUMENT_POSITION: '{node} ({op}): token tensor in an unsupported argument position',
    ReasonCode.SPLIT_NO_RULE: '{node}: the split has no rule for {op}',
    ReasonCode.SPLIT_IN_PLACE_WRITE: (
        '{node} (copy_) writes into {target} in place: the halves would each write a part of one tensor '
        'that lives outside them'
    ),
    ReasonCode.SPLIT_VIEW_MOVES_CUT: '{node}: view {src} -> {dst} does not keep the token cut in one dim',
    ReasonCode.SPLIT_BMM_RIGHT_SEQUENCES: '{node} (bmm): the right operand does not carry the same sequences in dim 0',
    ReasonCode.SPLIT_RESIDUAL_PARTIAL_DIMS: '{node}: residual and partial carry tokens in different dims',
    ReasonCode.SPLIT_OUTPUT_NOT_SPLIT: '{node}: output {index} of {source} is not split along tokens',
    ReasonCode.SPLIT_READS_TOKEN_SIZE: '{node} reads the size of the token dim',
    ReasonCode.SPLIT_INPUT_DIMS_DIFFER: '{node}: inputs carry tokens in different dims {dims}',
    ReasonCode.SPLIT_CAT_TOKEN_DIM: '{node} concatenates along the token dim',
    ReasonCode.SPLIT_NO_BROADCAST: '{node} ({op}) does not broadcast, and its tensors differ in the token dim: {sizes}',
    ReasonCode.SPLIT_INDEX_FROM_TOKENS: '{node} (index_select): its index {index} is computed from tokens',
    ReasonCode.SPLIT_INDEX_SELECT_TOKEN_DIM: '{node} (index_select) indexes along the token dim',
    ReasonCode.SPLIT_INDEXES_TOKEN_DIM: '{node} ({op}) indexes along the token dim',
    ReasonCode.SPLIT_SQUEEZES_TOKEN_DIM: '{node} squeezes the token dim',
    ReasonCode.SPLIT_SLICES_TOKEN_DIM: '{node} ({op}) slices the token dim',
    ReasonCode.SPLIT_REDUCES_TOKEN_DIM: '{node} ({op}) reduces over the token dim',
    ReasonCode.SPLIT_ALONG_TOKEN_DIM: '{node} ({op}) works along the token dim',
    ReasonCode.SPLIT_ALL_GATHER_TOKEN_DIM: (
        "{node} (all_gather_into_tensor) gathers along the token dim: each half's gather would interleave "
        "the ranks' blocks differently from the whole"
    ),
    ReasonCode.SPLIT_TOKENS_NOT_ROWS: '{node} ({op}): tokens are not the rows of the left operand',
    ReasonCode.SPLIT_CONTRACTS_TOKEN_DIM: '{node} ({op}) contracts or indexes over the token dim',
    ReasonCode.SPLIT_PARTIAL_NOT_FROM_TOKENS: (
        '{node}: its input {partial} is not computed from the tokens of the first site'
    ),
    ReasonCode.SPLIT_RESIDUAL_NOT_FROM_SITE: '{node}: residual {residual} does not come from an earlier site',
    ReasonCode.SPLIT_NOT_LINED_UP: '{node}: {t} does not line up with the tokens',
    ReasonCode.SPLIT_OP_INPUT_DIMS_DIFFER: '{node} ({op}): inputs carry tokens in different dims',
    ReasonCode.SPLIT_TOKEN_FREE_INDEX: '{node} ({op}): token-free index or source',
    ReasonCode.SPLIT_VIEW_SYMBOLIC_SIZE: '{node}: view infers a symbolic size ({size}) besides the token dim',
    ReasonCode.SPLIT_COUNTS_AS_ROWS: '{node}: expert counts of an MoE routing block read as rows',
    ReasonCode.SPLIT_READS_EXPERT_COUNTS: (
        "{node} ({op}) reads the expert counts of an MoE routing block, computed across the tokens "
        "(a capacity or a load-balancing term): only their cumsum and a grouped matmul's offsets may"
    ),
    ReasonCode.SPLIT_SORT_TOKEN_DIM: (
        "{node} ({op}) sorts along the token dim, and its keys are not the flattened experts of a topk "
        "(MoE routing that groups the token-expert pairs by expert): a half's order is not its part "
        "of the whole's"
    ),
    ReasonCode.SPLIT_SORT_DESCENDING: (
        "{node} ({op}) sorts the experts in descending order: the grouped matmul's offsets would give "
        "rows other experts than their own"
    ),
    ReasonCode.SPLIT_READS_EXPERT_ROWS: (
        '{node} ({op}) reads rows of an MoE routing block in expert order: only per-row ops, gathers '
        'and scatters of rows may'
    ),
    ReasonCode.SPLIT_MIXES_ROW_ORDERS: (
        '{node} ({op}) combines rows in token order with rows an MoE routing block sorted by expert: '
        'the halves would pair other rows than the whole'
    ),
    ReasonCode.SPLIT_TOKEN_FREE_EXPERT_ROWS: (
        '{node} ({op}): token-free {lined_up} is lined up with rows an MoE routing block sorted by '
        'expert, which a half cannot slice'
    ),
    ReasonCode.SPLIT_ROW_POSITIONS_ARITHMETIC: (
        "{node} ({op}) computes with the row positions of an MoE routing block (a half's positions "
        "are its own, not the whole's): only gathers, scatters and a floor division from pairs to tokens "
        "may read them"
    ),
    ReasonCode.SPLIT_COUNTS_DTYPE: (
        "{node} ({op}) holds the expert counts of an MoE routing block in {dtype}, which does not hold "
        "every row count exactly: the whole's offsets would round or wrap where a half's do not"
    ),
    ReasonCode.SPLIT_HISTC_BINS: (
        "{node} (histc) counts rows other than one bin per expert of an MoE routing block's sorted "
        "keys"
    ),
    ReasonCode.SPLIT_GROUPED_MM_OPERANDS: (
        '{node} ({op}): not rows sorted by expert times token-free expert weights, grouped by the offsets '
        'of the same sort'
    ),
    ReasonCode.SPLIT_INDEX_SEVERAL_DIMS: '{node} (index.Tensor) indexes more than one dim',
    ReasonCode.SPLIT_SCATTER_NOT_BY_POSITIONS: (
        "{what} scatters along the token dim by values that are not an MoE routing block's positions"
    ),
    ReasonCode.SPLIT_SCATTER_NOT_PERMUTATION: (
        "{what} writes by positions that are not a permutation of the rows: some rows would keep the "
        "target's contents"
    ),
    ReasonCode.SPLIT_SCATTER_ADDS_POSITIONS: '{what} adds up positions of an MoE routing block',
    ReasonCode.SPLIT_ROUTING_SYMBOLIC: (
        'MoE routing block on a symbolic token count: its constants have no per-half size'
    ),
    ReasonCode.SPLIT_VIEW_REGROUPS_EXPERT_ROWS: '{node}: view regroups rows an MoE routing block sorted by expert',
    ReasonCode.SPLIT_GATHER_OTHER_ROWS: (
        "{node} (index.Tensor) gathers by an MoE routing block's positions from {x}, which is not the "
        "rows they index"
    ),
    ReasonCode.SPLIT_INDEX_TOKEN_DIM_BY_TOKENS: (
        '{node} (index.Tensor) indexes along the token dim by values computed from the tokens'
    ),
    ReasonCode.SPLIT_INDEX_ADD_DIM: '{node} (index_add) adds along another dim than the rows',
    ReasonCode.SPLIT_SCATTER_VALUES_ORDER: '{what}: the values are not rows in the order of the positions',
    ReasonCode.SPLIT_SCATTER_TARGET: (
        '{what}: the target is neither a new tensor as long as the rows nor the rows the positions '
        'index'
    ),
    ReasonCode.SPLIT_ROUTING_READ_OUTSIDE: (
        '{node}: rows, positions or counts of an MoE routing block are read outside it ({readers}) '
        'before they are back in token order'
    ),
    ReasonCode.SPLIT_ROUTING_CONSTANT_EARLY: '{node}: a constant of an MoE routing block is made before the first site',
    ReasonCode.SPLIT_ROUTING_CONSTANT_SHARED: (
        "{node}: a constant of an MoE routing block is also read by {readers}, not by the block's scatters: "
        "each half rebuilds it with its own rows"
    ),
    ReasonCode.SPLIT_NO_SCORES_RULE: '{node}: the split has no rule for {op} on attention scores',
    ReasonCode.SPLIT_BMM_CUT_SEQUENCE: (
        '{node} (bmm): over a cut sequence, neither q @ k^T (tokens in dim 1 of q and dim 2 of k^T) '
        'nor probabilities @ v'
    ),
    ReasonCode.SPLIT_READS_SCORES: '{node} ({node_kind}) reads attention scores',
    ReasonCode.SPLIT_SCORES_ARGUMENT_POSITION: '{node} ({op}): attention scores in an unsupported argument position',
    ReasonCode.SPLIT_PROBABILITIES_TIMES_NOT_VALUES: (
        '{node} (bmm): attention probabilities times something other than the values (tokens in dim '
        '1)'
    ),
    ReasonCode.SPLIT_PROBABILITIES_NOT_MASKED_SOFTMAX: (
        "{node} (bmm): attention probabilities over a cut sequence that are not a mask lined up with "
        "the keys followed by a softmax on every path from the scores: half A's queries would miss "
        "half B's keys"
    ),
    ReasonCode.SPLIT_SCORES_VIEW: '{node}: view of attention scores that does not keep the keys in the last dim',
    ReasonCode.SPLIT_SCORES_KEY_DIMS: '{node}: attention scores with keys in different dims {keys}',
    ReasonCode.SPLIT_SCORES_REDUCED_OTHER_DIMS: '{node} ({op}) reduces attention scores over other dims than the keys',
    ReasonCode.SPLIT_SCORES_REDUCED_OVER_KEYS: (
        "{node} ({op}) reduces attention scores over the keys where the keys a mask hides change the "
        "result (half A leaves out half B's keys): only the amax of masked scores and the sum of the "
        "softmax's exp are taken"
    ),
    ReasonCode.SPLIT_SCORES_OTHER_DIM: '{node} ({op}) works along another dim than the keys',
    ReasonCode.SPLIT_LINED_UP_WITH_KEYS: '{node}: {t} is lined up with the keys of attention scores',
    ReasonCode.SPLIT_KEYS_NOT_MASK: (
        "{node} ({op}): {t} is lined up with the keys but is neither a mask added to the scores nor "
        "where()'s condition choosing between the scores and the dtype's lowest value, so the split "
        "cannot check that no query before the cut sees a key after it"
    ),
    ReasonCode.SPLIT_ATTENTION_DROPOUT: '{node}: attention with dropout',
    ReasonCode.SPLIT_MASK_FROM_TOKENS: '{node}: the attention mask is computed from token tensors',
    ReasonCode.SPLIT_ATTENTION_OUTPUTS: '{node}: attention outputs other than the result are used',
    ReasonCode.SPLIT_QKV_DIMS: '{node}: q/k/v carry tokens in dims {dims}, expected {expected}',
    ReasonCode.SPLIT_BIDIRECTIONAL_CUT: (
        "{node}: bidirectional attention (no mask, not causal) over a cut sequence: half A's queries "
        "would miss half B's keys"
    ),
    ReasonCode.SPLIT_CAUSAL_OFFSET: (
        "{node}: causal attention with {queries} queries over {keys} keys over a cut sequence: half "
        "B's queries would see half A's keys past their own position"
    ),
    ReasonCode.SPLIT_MASK_SHAPE: '{node}: attention mask of shape {mshape}',
    ReasonCode.SPLIT_READS_TOKENS: '{node} ({node_kind}) reads token tensors',
    ReasonCode.SPLIT_SCORES_AFTER_LAST_SITE: '{node}: attention scores are read after the last site',
    ReasonCode.SPLIT_EXPERT_ROWS_INPUT: '{node}: its input is rows of an MoE routing block not back in token order',
    ReasonCode.SPLIT_UNITS_DO_NOT_DIVIDE: 'a token dim of size {size} is not a multiple of {units} {mode} units',
    ReasonCode.SPLIT_INPUT_SHAPE: "first site's input has shape {shape}, not [B, S, H] or [T, H]",
}
"""Each code's sentence: a ``str.format`` template over the reason's fields, or a function of them."""


def _runtime_words(code: ReasonCode) -> Message:
    """The runtime's sentence for the code of a runtime issue (``RUNTIME_ISSUE_TEXTS``)."""
    def render(fields: dict[str, object]) -> str:
        return RUNTIME_ISSUE_TEXTS[code.value].format(**fields)

    return render


RUNTIME_ISSUE_TEXTS: Mapping[str, str] = ISSUE_TEXT
"""The runtime's sentence of each issue, by the issue's value: the runtime's one registry
(``runtime.issue.ISSUE_TEXT``), which every module of ``RUNTIME_ISSUE_ENUMS`` registers its table in."""

RUNTIME_ISSUE_ENUMS: tuple[type[StrEnum], ...] = (CudaIssue, QuantIssue, NpuIssue, SymmMemIssue, QuantFormIssue)
"""The runtime's why-not enums: each member is reported as the ``ReasonCode`` of the same value,
rendered from the runtime's sentence (``tests/test_reason_codes.py`` checks both ways)."""


def _runtime_codes(*enums: type[StrEnum]) -> tuple[ReasonCode, ...]:
    return tuple(ReasonCode(issue.value) for enum_type in enums for issue in enum_type)


CUDA_ISSUES = _runtime_codes(CudaIssue)
"""The codes of ``runtime.cuda.support.CudaIssue``."""
QUANT_ISSUES = _runtime_codes(QuantIssue)
"""The codes of ``runtime.QuantIssue``."""
RUNTIME_ISSUES = _runtime_codes(*RUNTIME_ISSUE_ENUMS)
"""The codes of every runtime issue (``RUNTIME_ISSUE_ENUMS``), ``CUDA_ISSUES`` and ``QUANT_ISSUES`` among them."""
MESSAGES.update({code: _runtime_words(code) for code in RUNTIME_ISSUES})


def runtime_issue_reason(issue: Unsupported) -> Reason:
    """A runtime check's answer as the ``Reason`` of the same code (``RUNTIME_ISSUES``), with its
    fields; a field that is itself a runtime issue (a ``cause``) becomes its ``Reason`` too."""
    fields = tuple((key, runtime_issue_reason(value) if _is_runtime_issue(value) else value)
                   for key, value in issue.fields)
    return Reason(ReasonCode(issue.issue.value), fields)


def _is_runtime_issue(value: object) -> TypeGuard[Unsupported]:
    return isinstance(value, Unsupported) and isinstance(value.issue, RUNTIME_ISSUE_ENUMS)
