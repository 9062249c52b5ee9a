"""weavepass: a torch.compile backend that fuses tensor-parallel all_reduce -> add -> RMSNorm.

    model = torch.compile(model, backend="weave")          # default config
    model.forward = weavepass.weave(config=WeaveConfig(lowering="portable"))(model.forward)
    print(weavepass.explain(model, input_ids))             # what was rewritten, and why not

    pass_ = weavepass.inductor_pass(config)                # the pass alone, for any Inductor compile
    model = torch.compile(model, options=pass_.config_patches()); print(pass_.report)
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from typing import Any

import torch

# Register every torch.ops.weave.* op, also those only FlashComm graphs use: a graph loaded from
# Inductor's cache calls them without running the pass.
from weavepass import ops  # noqa: F401
from weavepass.backend import (
    WeaveBackend,
    collect_reports,
    make_backend,
    register,
    shared_backend,
    start_collecting,
    stop_collecting,
    weave_backend,
)
from weavepass.config import WeaveConfig
from weavepass.inductor import inductor_pass
from weavepass.report import AllReduceRecord, GraphReport, WeaveReport

__all__ = [
    "AllReduceRecord",
    "GraphReport",
    "WeaveBackend",
    "WeaveConfig",
    "WeaveReport",
    "explain",
    "inductor_pass",
    "last_report",
    "make_backend",
    "shared_backend",
    "weave",
]

logging.getLogger("weavepass").addHandler(logging.NullHandler())
register()


def weave(fn: Callable[..., Any] | None = None, *, config: WeaveConfig | None = None,
          **compile_kwargs: Any) -> Any:
    """Compile ``fn`` (a function, a module, or a model's forward) with the weave backend.

    Usable bare (``@weave``) or with arguments (``@weave(config=WeaveConfig(...), dynamic=True)``);
    ``compile_kwargs`` go to ``torch.compile``. The result has ``.weave_report``, the report of
    every graph that has run through it so far. Every call with one config compiles with the same
    backend (``shared_backend``), so wrapping many layers reuses Dynamo's compiled code instead of
    hitting its recompile limit.
    """

    def wrap(target: Callable[..., Any]) -> Any:
        compiled: Any = torch.compile(target, backend=shared_backend(config), **compile_kwargs)
        report = WeaveReport()
        result: Any
        if isinstance(compiled, torch.nn.Module):
            compiled.register_forward_pre_hook(lambda *_: start_collecting(report))
            compiled.register_forward_hook(lambda *_: stop_collecting(report), always_call=True)
            result = compiled
        else:
            @functools.wraps(target)
            def result(*args: Any, **kwargs: Any) -> Any:
                with collect_reports(report):
                    return compiled(*args, **kwargs)
        result.weave_report = report
        return result

    return wrap(fn) if fn is not None else wrap


def explain(fn: Callable[..., Any], *args: Any, config: WeaveConfig | None = None, **kwargs: Any) -> WeaveReport:
    """Compile ``fn`` with the weave backend of ``config``, run it once on ``args``, and return the
    report of every graph that ran (compiled now, or earlier with the same config), and the
    collectives that broke a graph while it compiled (they ran eagerly: ``not_compiled``)."""
    from torch._dynamo.utils import counters

    breaks_before = dict(counters["graph_break"])
    with torch.no_grad(), collect_reports(WeaveReport()) as report:
        torch.compile(fn, backend=shared_backend(config))(*args, **kwargs)
    for reason, count in counters["graph_break"].items():
        if count > breaks_before.get(reason, 0):
            collective = _COLLECTIVE_IN_BREAK.search(reason)
            if collective is not None:
                report.not_compiled.append(
                    f"{collective.group(1)}: Dynamo broke the graph there ({reason.splitlines()[0]}), so it "
                    "ran eagerly and was not rewritten")
    return report


_COLLECTIVE_IN_BREAK = re.compile(
    r"<function (all_reduce|reduce_scatter\w*|all_gather\w*|all_to_all\w*|broadcast|reduce) at ")
"""A collective named in a Dynamo graph-break reason (e.g. ``all_reduce(..., async_op=True)``)."""


def last_report() -> WeaveReport:
    """The report of everything compiled through ``backend="weave"`` in this process."""
    return weave_backend.report
