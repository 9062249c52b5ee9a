"""Compiled graphs call the hot ops' kernels directly, not through PyTorch's dispatcher.

Inductor runs a custom op as a fallback kernel: its generated Python calls
``torch.ops.weave.fused_allreduce_rmsnorm.default(...)``, and the dispatcher then parses the
arguments against the schema, converts each to an ``IValue`` and back to Python for the op's Python
kernel, and converts the outputs twice more. For an op called once per site and forward pass that
was the largest share of its host cost: 5-7 us of the synchronous op's 20.6 us on the H200 host
(an op of the same schema with an empty body, ``docs/cuda_kernel.md``).

``install()`` makes a weave compile's generated code call the op's kernel itself
(``weavepass.ops.HOT_OP_KERNELS``: the very function the dispatcher would call, so the numbers
cannot differ) as ``extern_kernels.weave_<op>(...)``: Inductor's own namespace for extern kernels,
which every generated module imports and which its template kernels extend the same way. It does
that by wrapping the op's Inductor lowering: Inductor's default fallback lowering (created here
first, with the layout constraint Inductor itself would pick) builds the node, and the wrapper
renames the function the node's Python call names.

Only graphs compiled with the weave pass are renamed (their FX-graph cache keys carry the pass, so
a cached module that names ``extern_kernels.weave_*`` is only loaded by a weave compile, and making
a weave pass installs them: ``weavepass.inductor_pass``, which the backend uses too);
``torch.compile(backend="inductor")`` without the pass keeps the dispatcher call. The C++
wrapper (``cpp_wrapper``) keeps its own call path. ``WEAVE_DIRECT_CALLS=0`` keeps the dispatcher
call everywhere (a debugging switch).

While a profiler runs, each direct call records a range named like the op (``weave::<op>``), as
the dispatcher does. What the direct call gives up is dispatch to modes (``TorchDispatchMode``);
a compiled graph's generated code runs real tensors under none. The hot ops have no autograd
formula in either path.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload

log = logging.getLogger("weavepass")

Kernel = Callable[..., Any]

_WRAPPED: set[OpOverload] = set()  # the hot ops whose lowering is wrapped
_INSTALL_FAILED: list[str] = []


def extern_name(op: OpOverload) -> str:
    """The name a generated module calls ``op``'s kernel by: ``extern_kernels.<this>``."""
    return f"weave_{op._opname}"


def enabled() -> bool:
    return os.environ.get("WEAVE_DIRECT_CALLS", "1") != "0"


def install() -> bool:
    """Register every hot op's kernel in Inductor's ``extern_kernels`` and wrap the op's lowering
    (idempotent). False, with the reason logged once, when this torch's Inductor lacks a hook used
    here: graphs then call the ops through the dispatcher, as before (correct, slower host path)."""
    from weavepass.ops import HOT_OP_KERNELS

    if len(_WRAPPED) == len(HOT_OP_KERNELS):
        return True
    if _INSTALL_FAILED:
        return False
    try:
        from torch._inductor import lowering
        from torch._inductor.select_algorithm import extern_kernels

        for op, path in HOT_OP_KERNELS.items():
            if op in _WRAPPED:
                continue
            module_name, attr = path.split(":")
            kernel = getattr(importlib.import_module(module_name), attr)
            setattr(extern_kernels, extern_name(op), _profiled(f"weave::{op._opname}", kernel))
            if op not in lowering.lowerings:
                lowering.make_fallback(op, layout_constraint=_default_layout_constraint(op))
            lowering.lowerings[op] = _renaming(op, lowering.lowerings[op])
            _WRAPPED.add(op)
    except (ImportError, AttributeError, TypeError) as error:  # an Inductor without these hooks
        _INSTALL_FAILED.append(f"{type(error).__name__}: {error}")
        log.warning("weavepass: compiled graphs call the fused ops through the dispatcher "
                    "(about 5 us more host time per call): this torch's Inductor lacks a hook "
                    "(%s)", _INSTALL_FAILED[0])
        return False
    return True


def _profiled(name: str, kernel: Kernel) -> Kernel:
    """``kernel``, inside a profiler range named like the op (``weave::<op>``) while a profiler
    runs: the dispatcher records one per op call, and traces (``weavepass.testing.trace``, a
    user's) should not lose the ops' host time. Otherwise one check of a C flag."""
    from torch.autograd.profiler import record_function

    enabled = torch._C._autograd._profiler_enabled

    def call(*args: Any, **kwargs: Any) -> Any:  # Inductor passes arguments with defaults by keyword
        if enabled():
            with record_function(name):
                return kernel(*args, **kwargs)
        return kernel(*args, **kwargs)

    functools.update_wrapper(call, kernel)  # call.__wrapped__ is kernel
    call.__name__ = call.__qualname__ = f"weave_{kernel.__name__}"
    return call


def _default_layout_constraint(op: OpOverload) -> Any:
    """The layout constraint Inductor gives a custom op it falls back to (``GraphLowering.call_function``):
    the op's layout tag, else ``torch._functorch.config.custom_op_default_layout_constraint``."""
    from torch._inductor.lowering import tag_to_layout_constraint
    from torch._library.utils import get_layout_constraint_tag

    return tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))


def _renaming(op: OpOverload, lower: Kernel) -> Kernel:
    """``lower`` (the op's lowering), then, in a weave compile with the Python wrapper, the new
    fallback node of ``op`` calls ``extern_kernels.<extern_name(op)>``."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    name = f"extern_kernels.{extern_name(op)}"

    def lowered(*args: Any, **kwargs: Any) -> Any:
        graph = V.graph
        before = len(graph.operations)
        result = lower(*args, **kwargs)
        if _renames(graph):
            for node in graph.operations[before:]:
                if isinstance(node, ir.FallbackKernel) and getattr(node, "op_overload", None) is op:
                    node.python_kernel_name = name
        return result

    functools.update_wrapper(lowered, lower)  # lowered.__wrapped__ is lower
    return lowered


def _renames(graph: Any) -> bool:
    from torch._inductor import config

    from weavepass.compile.graph_pass import WeavePass

    setting = config.post_grad_custom_pre_pass  # a pass, or (torch 2.13) a list of them
    passes = setting if isinstance(setting, (list, tuple)) else [setting]
    return (
        enabled()
        and any(isinstance(p, WeavePass) for p in passes)
        and not graph.cpp_wrapper
        and not getattr(graph, "fx_wrapper", False)
    )
