"""The ``weave`` torch.compile backend: Inductor with ``WeavePass`` as a post-grad pass.

``torch.compile(model, backend="weave")`` finds this module through the ``torch_dynamo_backends``
entry point, so it works without importing weavepass first.
"""

from __future__ import annotations

import itertools

import torch

from weavepass.config import WeaveConfig
from weavepass.report import GraphReport, WeaveReport


class WeaveBackend:
    """A torch.compile backend; keeps the report of every graph it compiled."""

    def __init__(self, config: WeaveConfig | None = None):
        if config is not None and not isinstance(config, WeaveConfig):
            raise TypeError(f"config must be a WeaveConfig, got {type(config).__name__}")
        self.config = config or WeaveConfig()
        self.report = WeaveReport()
        self._graph_ids = itertools.count()  # the report numbers this backend's graphs from 0

    def _record(self, graph_report: GraphReport) -> None:
        self.report.graphs.append(graph_report)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, mode: str | None = None,
                 options: dict | None = None):
        """``torch.compile(..., backend=weave, mode=..., options=...)`` passes ``mode`` and
        ``options`` here; they mean what they mean for Inductor (``mode="reduce-overhead"``: CUDA
        graphs; ``options``: Inductor config entries). Unknown modes or options raise."""
        from torch._inductor.compile_fx import compile_fx

        from weavepass.graph_pass import WeavePass  # imports Inductor: only when compiling

        patches = inductor_patches(mode, options)
        patches["post_grad_custom_pre_pass"] = WeavePass(self.config, on_report=self._record,
                                                           graph_ids=self._graph_ids)
        if self.config.overlap != "off":
            from weavepass.token_split import INDUCTOR_CONFIG_PATCHES

            patches.update(INDUCTOR_CONFIG_PATCHES)
        if self.config.fx_graph_cache:
            return compile_fx(gm, example_inputs, config_patches=patches)
        patches["fx_graph_cache"] = False
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, config_patches=patches)


def inductor_patches(mode: str | None, options: dict | None) -> dict:
    """Inductor config entries for a ``torch.compile`` ``mode`` and ``options``, validated as
    Inductor's own backend validates them."""
    import torch._inductor
    from torch._inductor import config as inductor_config

    try:
        patches = dict(torch._inductor.list_mode_options(mode)) if mode and mode != "default" else {}
    except RuntimeError as error:  # unknown mode
        raise ValueError(f"backend weave: {error}") from None
    current = inductor_config.get_config_copy()
    for key, value in (options or {}).items():
        name = key.replace("-", "_")
        if name not in current:
            raise ValueError(f"backend weave: unknown Inductor option {key!r} in options=")
        patches[name] = value
    if "post_grad_custom_pre_pass" in patches:
        raise ValueError("backend weave: options may not set post_grad_custom_pre_pass (weave's pass uses it)")
    return patches


weave_backend = WeaveBackend()
"""The instance ``backend="weave"`` uses (default ``WeaveConfig``)."""


def make_backend(config: WeaveConfig | None = None) -> WeaveBackend:
    """A backend with its own config and report: ``torch.compile(m, backend=make_backend(cfg))``."""
    return WeaveBackend(config)


def register() -> None:
    """Register ``"weave"`` with dynamo when no installed entry point provides it (source trees).

    Checks the entry points first, so that an installed weavepass does not import dynamo here.
    """
    from importlib.metadata import entry_points

    if "weave" in entry_points(group="torch_dynamo_backends").names:
        return
    from torch._dynamo.backends import registry

    if "weave" not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=weave_backend, name="weave")
