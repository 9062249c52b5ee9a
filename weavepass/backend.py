"""The ``weave`` torch.compile backend: Inductor with the weave pass (``weavepass.inductor_pass``)
and the Inductor settings it needs, plus per-call reports (``collect_reports``).

``torch.compile(model, backend="weave")`` finds this module through the ``torch_dynamo_backends``
entry point, so it works without importing weavepass first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import typing
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

from weavepass.config import WeaveConfig
from weavepass.report import GraphReport, WeaveReport

log = logging.getLogger("weavepass")

_RECOMPILE_LIMIT_HINT = 8  # torch._dynamo.config.recompile_limit's default
_backends_per_config: Counter[WeaveConfig] = Counter()
_sinks: list[WeaveReport] = []
"""Reports collecting the graphs that run (``collect_reports``). A plain list, not per thread: the
compiled graph checks it on every call, and an empty-list test is the cheapest check there is."""


def start_collecting(report: WeaveReport) -> None:
    """From now on, add to ``report`` every weave-compiled graph that runs, once each, whether
    compiled now or reused from Dynamo's cache: reports per call without a new backend."""
    _sinks.append(report)


def stop_collecting(report: WeaveReport) -> None:
    _sinks.remove(report)


@contextlib.contextmanager
def collect_reports(report: WeaveReport) -> Iterator[WeaveReport]:
    """``start_collecting(report)`` for the block."""
    start_collecting(report)
    try:
        yield report
    finally:
        stop_collecting(report)


CompiledGraph = Callable[..., Any]
"""What Inductor's ``compile_fx`` returns: the compiled graph, called with its inputs."""


def _reporting(compiled: CompiledGraph, graph_reports: list[GraphReport]) -> CompiledGraph:
    """``compiled``, also adding ``graph_reports`` to the reports collecting now. Host cost, measured
    on the CPU dev machine: 0.07 us per graph call when nothing collects; nothing per site."""

    @functools.wraps(compiled)  # keeps attributes such as _boxed_call
    def run(*args: Any) -> Any:
        if _sinks:
            for sink in _sinks:
                sink.add_graphs(graph_reports)
        try:
            return compiled(*args)
        except Exception as error:
            _raise_peer_failure(error)
            raise

    return run


def _raise_peer_failure(error: Exception) -> None:
    """A collective of a compiled graph failed (e.g. gloo's "Connection closed by peer"): where a
    peer's plan check failed and left a note in the store, raise ``PlanMismatchError`` with it, so
    this rank's error says why its peer stopped (docs/reliability.md). Costs nothing per call: only
    a raised exception gets here."""
    from weavepass.compile import plan_check

    note = plan_check._EXCHANGE.explain_run_failure()
    if note is not None:
        raise plan_check.PlanMismatchError(
            f"{note} (this rank's own error: {type(error).__name__}: {error})"
        ) from error


class WeaveBackend:
    """A torch.compile backend; keeps the report of every graph it compiled.

    Dynamo caches compiled code per backend *object*: each new backend compiles a function again,
    and after ``torch._dynamo.config.recompile_limit`` (8) compiles of one function the rest run
    eagerly. Create one backend per config and reuse it (``weavepass.weave`` and
    ``weavepass.explain`` do, through ``shared_backend``); a warning says when many backends with
    one config were made.
    """

    def __init__(self, config: WeaveConfig | None = None):
        if config is not None and not isinstance(config, WeaveConfig):
            raise TypeError(f"config must be a WeaveConfig, got {type(config).__name__}")
        self.config = config or WeaveConfig()
        self.report = WeaveReport()
        _backends_per_config[self.config] += 1
        if _backends_per_config[self.config] == _RECOMPILE_LIMIT_HINT + 1:
            log.warning(
                "weavepass: %d backends made with one WeaveConfig; Dynamo compiles a function again "
                "for each and runs it eagerly after its recompile limit (8). Reuse one backend "
                "(weavepass.shared_backend(config)) or use weavepass.weave", _RECOMPILE_LIMIT_HINT + 1)
        self._graph_ids = itertools.count()  # the report numbers this backend's graphs from 0
        if (self.config.check_plan_across_ranks and torch.distributed.is_available()
                and torch.distributed.is_initialized()):
            from weavepass.compile.plan_check import start_heartbeat

            start_heartbeat()  # from now on, a peer waiting in a plan check can tell this one lives

    def __repr__(self) -> str:
        """What Dynamo's errors print as ``backend=...``: weave, and the fields set off default."""
        default = WeaveConfig()
        changed = ", ".join(f"{f.name}={getattr(self.config, f.name)!r}" for f in dataclasses.fields(WeaveConfig)
                            if getattr(self.config, f.name) != getattr(default, f.name))
        return f"weave(WeaveConfig({changed}))"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                 options: dict[str, Any] | None = None) -> CompiledGraph:
        """``torch.compile(..., backend=weave, mode=..., options=...)`` passes ``mode`` and
        ``options`` here; they mean what they mean for Inductor (``mode="reduce-overhead"``: CUDA
        graphs; ``options``: Inductor config entries). Unknown modes or options raise. A pass in
        ``options["post_grad_custom_pre_pass"]``, else in Inductor's global config, runs before
        weave's (``weavepass.inductor_pass``'s ``chain``)."""
        import torch._inductor.config
        from torch._inductor.compile_fx import compile_fx  # imports Inductor: only when compiling

        from weavepass.compile.graph_pass import settings_needed
        from weavepass.inductor import CURRENT, make_pass

        graph_reports: list[GraphReport] = []  # forward now, backward when it is compiled
        user = inductor_patches(mode, options)
        chain = user.pop("post_grad_custom_pre_pass", CURRENT)
        # The strategies' Inductor settings, except those a strategy defers until it applies (the
        # split with split="auto"): a graph auto does not split compiles with Inductor's own.
        pass_ = make_pass(self.config, chain=chain, report=self.report, graph_ids=self._graph_ids,
                          on_report=graph_reports.append, defer_settings=True)
        _warn_overridden(user, pass_.strategy_settings())
        patches = {**user, **pass_.config_patches()}
        if patches.get("joint_custom_post_pass", torch._inductor.config.joint_custom_post_pass) is None:
            from weavepass.compile.joint_pass import SaveSummedResiduals

            # training: the residual add is saved for backward, not the sum (``joint_pass``)
            patches["joint_custom_post_pass"] = SaveSummedResiduals()
        caches = contextlib.nullcontext()
        if not self.config.fx_graph_cache:  # (torch 2.13 skips the AOT-autograd cache without it anyway)
            caches = torch._functorch.config.patch(enable_autograd_cache=False)
        try:
            with caches:
                compiled = compile_fx(gm, example_inputs, config_patches=patches)
        except Exception as error:
            needed = settings_needed(error)
            if needed is None:
                raise
            # A deferring strategy applies: the same graph again, with its settings, under the
            # same graph number (every rank decides the same, so every rank compiles again).
            _warn_overridden(user, needed.settings)
            pass_ = make_pass(self.config, chain=chain, report=self.report,
                              graph_ids=itertools.chain([needed.graph_index], self._graph_ids),
                              on_report=graph_reports.append, defer_settings=True)
            patches.update(post_grad_custom_pre_pass=pass_, **needed.settings)
            with caches:
                compiled = compile_fx(gm, example_inputs, config_patches=patches)
            settings = ", ".join(f"{key}={value!r}" for key, value in needed.settings.items())
            for report in graph_reports:
                if report.graph_index == needed.graph_index:
                    report.add_note(f"compiled with the {needed.strategy} strategy's Inductor settings ({settings}), "
                                    f"patched in once its token count was in the split's window (graphs "
                                    f"outside it keep Inductor's own)")
        if not callable(compiled):  # (AOT-export modes return paths; a backend compile never does)
            raise TypeError(f"backend weave: Inductor returned {type(compiled).__name__}, not a compiled graph")
        return _reporting(compiled, graph_reports)


_OVERRIDDEN_WARNED: set[tuple[str, Any]] = set()


def _warn_overridden(patches: dict[str, Any], required: dict[str, Any]) -> None:
    """Warn once per setting where the user's Inductor options (or global Inductor config) set
    something a strategy needs otherwise: the strategy's value wins, and the user hears why."""
    import torch._inductor.config as inductor_config

    for key, value in required.items():
        if key in patches:
            current = patches[key]
        else:  # set globally by the user: a value other than Inductor's own default
            # (``_is_default`` does not tell: a config patch's exit leaves the default value
            # behind as an override)
            entry = getattr(inductor_config, "_config", {}).get(key)
            try:
                current = functools.reduce(getattr, key.split("."), inductor_config)
            except AttributeError:
                continue
            if entry is None or current == getattr(entry, "default", current):
                continue
        if current != value and (key, current) not in _OVERRIDDEN_WARNED:
            _OVERRIDDEN_WARNED.add((key, current))
            message = (f"backend weave: Inductor option {key}={current!r} is overridden with {value!r} in "
                       "graphs weave rewrites: a strategy this config enables needs it (the split or "
                       "FlashComm, weavepass.compile.strategies)")
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)


def inductor_patches(mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
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
        # The check torch.compile(backend="inductor") makes (torch._TorchCompileInductorWrapper.
        # apply_options): isinstance against the option's declared type, skipped for generic types
        # such as Optional[int] that isinstance cannot take.
        declared = inductor_config.get_type(name)  # type: ignore[attr-defined]  # (set by install_config_module)
        if typing.get_origin(declared) is None and not isinstance(value, declared):
            raise TypeError(
                f"backend weave: Inductor option {key!r} in options= must be "
                f"{type(current[name]).__name__}, got {type(value).__name__} {value!r}"
            )
        patches[name] = value
    return patches


weave_backend = WeaveBackend()
"""The instance ``backend="weave"`` uses (default ``WeaveConfig``)."""

_shared_backends: dict[WeaveConfig, WeaveBackend] = {weave_backend.config: weave_backend}


def shared_backend(config: WeaveConfig | None = None) -> WeaveBackend:
    """The one backend of this process for ``config`` (configs are frozen, hence hashable):
    what ``weavepass.weave`` and ``weavepass.explain`` compile with, so that Dynamo reuses its
    compiled code across calls. Its report holds every graph compiled with that config."""
    config = config or WeaveConfig()
    if not isinstance(config, WeaveConfig):
        raise TypeError(f"config must be a WeaveConfig, got {type(config).__name__}")
    if config not in _shared_backends:
        _shared_backends[config] = WeaveBackend(config)
    return _shared_backends[config]


def make_backend(config: WeaveConfig | None = None) -> WeaveBackend:
    """A new backend with its own config and report: ``torch.compile(m, backend=make_backend(cfg))``.
    Make it once per config and reuse it (see ``WeaveBackend``)."""
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
