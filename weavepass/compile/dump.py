"""Graph dumps for bug reports: the graph before the pass and after each strategy that ran, as text
files in a directory the user names (``WeaveConfig.dump_graphs_dir`` or ``WEAVE_DUMP_GRAPHS``).

Layout, one folder per graph the pass sees in this process (numbered in compile order)::

    <dir>/rank<R>/graph<NNN>/00_before.txt          the graph as the pass received it
                              01_after_<strategy>.txt  after each strategy that rewrote it, in order
                              report.txt               the explain report of this graph

Every name below ``<dir>`` is built here from numbers and sanitised strategy names, and each path
is checked to resolve inside ``<dir>`` before it is written (a symlinked ``rank0`` pointing
elsewhere is refused with a warning, not followed). Off unless a directory is named.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist

from weavepass.config import WeaveConfig
from weavepass.report import GraphReport, WeaveReport

log = logging.getLogger("weavepass")

ENV_VAR = "WEAVE_DUMP_GRAPHS"
"""The debugging switch: a directory to dump into when the config names none."""

_graph_numbers = itertools.count()  # process-wide: two backends' graph 0 do not overwrite each other


def directory(config: WeaveConfig) -> str | None:
    """The dump directory ``config`` or the environment names, or None (off)."""
    return config.dump_graphs_dir or os.environ.get(ENV_VAR) or None


def safe_name(text: str) -> str:
    """``text`` as one file-name component: lower case, runs of anything but letters, digits,
    ``-`` and ``_`` turned into ``_``, never empty, ``.`` or ``..``."""
    name = re.sub(r"[^a-z0-9_-]+", "_", text.lower()).strip("_")
    return name or "unnamed"


def graph_text(graph: torch.fx.Graph) -> str:
    """The graph as readable Python, with each value's shape and dtype where the nodes carry them."""
    module = graph.owning_module
    if module is not None:
        try:
            return str(module.print_readable(print_output=False, include_stride=True, include_device=True))
        except Exception as error:  # a graph Inductor's pass left unprintable: keep its IR listing
            return f"# print_readable failed ({type(error).__name__}: {error}); the IR:\n{graph}"
    return str(graph)


class GraphDumps:
    """The dumps of one graph (``start`` returns None when dumping is off)."""

    def __init__(self, root: Path, folder: Path):
        self.root = root
        self.folder = folder
        self.count = itertools.count(1)

    @classmethod
    def start(cls, config: WeaveConfig, graph: torch.fx.Graph, report: GraphReport) -> GraphDumps | None:
        name = directory(config)
        if name is None:
            return None
        root = Path(name).expanduser().resolve()
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        dumps = cls(root, root / f"rank{int(rank)}" / f"graph{next(_graph_numbers):03d}")
        if dumps.write("00_before.txt", graph_text(graph)):
            log.info("weavepass: graph %d dumped to %s", report.graph_index, dumps.folder)
        return dumps

    def after(self, strategy: str, graph: torch.fx.Graph) -> None:
        self.write(f"{next(self.count):02d}_after_{safe_name(strategy)}.txt", graph_text(graph))

    def finish(self, graph: torch.fx.Graph, report: GraphReport) -> None:
        self.write("report.txt", str(WeaveReport(graphs=[report])) + "\n")

    def write(self, file_name: str, text: str) -> bool:
        """Write ``folder/file_name``; False, with a warning, where the path would leave the root
        (a symlink inside it pointing elsewhere) or the file cannot be written."""
        path = self.folder / file_name
        try:
            # Checked before creating the folder (a symlink on the way would create it elsewhere)
            # and again for the file itself (an existing file may be a symlink).
            for target in (self.folder, path):
                if not target.resolve().is_relative_to(self.root):
                    log.warning("weavepass: graph dump %s not written: it resolves outside the dump "
                                "directory %s", path, self.root)
                    return False
                if target is self.folder:
                    target.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as error:
            log.warning("weavepass: graph dump %s not written: %s", path, error)
            return False
        return True
