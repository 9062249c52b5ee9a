"""``inductor_pass(config)``: the weave pass for any pipeline that compiles with Inductor.

The pass is an Inductor ``CustomGraphPass`` for ``torch._inductor.config.post_grad_custom_pre_pass``::

    pass_ = weavepass.inductor_pass(WeaveConfig(...))
    with torch._inductor.config.patch(pass_.config_patches()):
        out = torch.compile(model)(input_ids)
    print(pass_.report)

    compiled = torch.compile(model, options=pass_.config_patches())   # the same, per compile

``backend="weave"`` is this pass with Inductor (``weavepass.backend``). Creating the pass installs
what a weave compile needs in Inductor (``compile.direct_calls``). What the backend adds besides:
the Inductor settings of ``pass_.inductor_settings()`` (patched by ``config_patches()``; without
them the pass warns and says in its report what it could not do), and per-call reports
(``weavepass.explain``, ``weavepass.weave``): ``pass_.report`` holds every graph the pass saw.

Nothing here imports Inductor until a pass is made (``import weavepass`` stays light).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from weavepass.config import WeaveConfig
from weavepass.report import GraphReport, WeaveReport

if TYPE_CHECKING:
    from weavepass.compile.graph_pass import GraphPass, WeavePass

log = logging.getLogger("weavepass")


class _Current:
    """``chain``'s default: whatever Inductor's ``post_grad_custom_pre_pass`` holds now."""

    def __repr__(self) -> str:
        return "<the current post_grad_custom_pre_pass>"


CURRENT: Any = _Current()


def inductor_pass(config: WeaveConfig | None = None, *, chain: Any = CURRENT) -> WeavePass:
    """The weave pass for ``torch._inductor.config.post_grad_custom_pre_pass``.

    ``chain``: the pass(es) to run before weave's on every graph: by default what
    ``post_grad_custom_pre_pass`` holds when this is called (a user's or a framework's pass is kept,
    not replaced); pass the value an engine's Inductor config patches hold, or None for none. A
    weave pass already there is replaced (its own chain is kept). The pass's ``uuid()`` then
    combines the chained passes' (see ``WeavePass.uuid``).

    Patch in ``pass_.config_patches()`` (the pass and the Inductor settings it needs), or at least
    the pass: then the split and FlashComm are not used when the compile lacks their
    settings (a warning and the report say so) and Inductor's FX-graph cache may skip the pass
    for cached graphs (a warning says so).
    """
    return make_pass(config, chain=chain)


def make_pass(config: WeaveConfig | None = None, *, chain: Any = CURRENT, report: WeaveReport | None = None,
              graph_ids: Iterator[int] | None = None,
              on_report: Callable[[GraphReport], None] | None = None, defer_settings: bool = False) -> WeavePass:
    """``inductor_pass`` with the backend's wiring: a shared ``report`` and ``graph_ids`` counter,
    ``on_report`` called with each graph's report, and ``defer_settings`` (``WeavePass``)."""
    from weavepass.compile import direct_calls
    from weavepass.compile.graph_pass import WeavePass
    from weavepass.compile.plan_check import start_heartbeat

    if config is None:
        config = WeaveConfig()
    if not isinstance(config, WeaveConfig):
        raise TypeError(f"config must be a WeaveConfig, got {type(config).__name__}")
    if chain is CURRENT:
        import torch._inductor.config as inductor_config

        chain = inductor_config.post_grad_custom_pre_pass
    # The generated code of a weave compile calls the fused ops' kernels directly; a graph loaded
    # from Inductor's cache calls them too, without running the pass: install before any compile.
    direct_calls.install()
    if config.check_plan_across_ranks:
        start_heartbeat()  # peers waiting in a plan check can tell this process is alive (no group yet: later)
    return WeavePass(config, on_report, graph_ids, report=report, chain=chained_passes(chain), check_settings=True,
                     defer_settings=defer_settings)


def chained_passes(value: Any) -> tuple[GraphPass, ...]:
    """The passes of a ``post_grad_custom_pre_pass`` value (None, a pass, or a list or tuple of
    them) that weave's pass runs first; a weave pass among them gives its own chain instead."""
    from torch._inductor import custom_graph_pass

    from weavepass.compile.graph_pass import WeavePass

    if value is None:
        return ()
    passes = list(value) if isinstance(value, (list, tuple)) else [value]
    chain: list[GraphPass] = []
    for p in passes:
        if isinstance(p, WeavePass):
            log.info("weavepass: a weave pass already in post_grad_custom_pre_pass is replaced (its chained "
                     "passes are kept)")
            chain.extend(p.chain)
            continue
        inference_aware = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", None)
        if inference_aware is not None and isinstance(p, inference_aware):
            raise TypeError(f"weavepass cannot chain {p!r}: it is a CustomInferenceAwareGraphPass, which "
                            "Inductor calls with is_inference, and weave's pass does not know it. Where this "
                            "torch takes a list there, set [your_pass, weavepass.inductor_pass(config, "
                            "chain=None)] instead")
        if not callable(p):
            raise TypeError(f"post_grad_custom_pre_pass holds {p!r}, which is not a graph pass")
        chain.append(p)
    return tuple(chain)
