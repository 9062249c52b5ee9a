"""weavepass: a torch.compile backend that fuses tensor-parallel all_reduce -> add -> RMSNorm.

    model = torch.compile(model, backend="weave")          # default config
    model.forward = weavepass.weave(config=WeaveConfig(lowering="portable"))(model.forward)
    print(weavepass.explain(model, input_ids))             # what was rewritten, and why not
"""

from __future__ import annotations

import logging

import torch

# Register every torch.ops.weave.* op, also those only FlashComm graphs use: a graph loaded from
# Inductor's cache calls them without running the pass.
from weavepass import flashcomm, ops, replication  # noqa: F401
from weavepass.backend import WeaveBackend, make_backend, register, weave_backend
from weavepass.config import WeaveConfig
from weavepass.report import AllReduceRecord, GraphReport, WeaveReport

__all__ = [
    "AllReduceRecord",
    "GraphReport",
    "WeaveBackend",
    "WeaveConfig",
    "WeaveReport",
    "explain",
    "last_report",
    "make_backend",
    "weave",
]

logging.getLogger("weavepass").addHandler(logging.NullHandler())
register()


def weave(fn=None, *, config: WeaveConfig | None = None, **compile_kwargs):
    """Compile ``fn`` (a function, a module, or a model's forward) with the weave backend.

    Usable bare (``@weave``) or with arguments (``@weave(config=WeaveConfig(...), dynamic=True)``);
    ``compile_kwargs`` go to ``torch.compile``. The result has ``.weave_report``, the report of
    every graph compiled for it so far.
    """

    def wrap(target):
        backend = WeaveBackend(config)
        compiled = torch.compile(target, backend=backend, **compile_kwargs)
        compiled.weave_report = backend.report
        return compiled

    return wrap(fn) if fn is not None else wrap


def explain(fn, *args, config: WeaveConfig | None = None, **kwargs) -> WeaveReport:
    """Compile ``fn`` with a fresh weave backend, run it once on ``args``, and return the report."""
    backend = WeaveBackend(config)
    with torch.no_grad():
        torch.compile(fn, backend=backend)(*args, **kwargs)
    return backend.report


def last_report() -> WeaveReport:
    """The report of everything compiled through ``backend="weave"`` in this process."""
    return weave_backend.report
