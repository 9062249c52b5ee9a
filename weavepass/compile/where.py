"""Where a graph node comes from in the user's model: its module path and source line.

Dynamo records, on every node it traces, the stack of ``nn.Module`` s it ran in (``nn_module_stack``:
``{key: (qualified name, module class)}``, outermost first) and the Python stack (``stack_trace``);
AOT autograd and Inductor's post-grad passes carry both onto the nodes they derive. The report
names sites by these (``model.layers.0.mlp.down_proj``), since a user never sees the graph's node
names (``add_20``). Nodes the pass makes itself carry neither, and say nothing.
"""

from __future__ import annotations

import os
import re

import torch
from torch.fx import Node

_ROOT = re.compile(r"^L\[['\"][^'\"]+['\"]\](\[\d+\])?\.?")
"""Dynamo's name of the compiled module itself (``L['self']``, ``L['fn']``, ``L['args'][0]``): not
part of the path."""
_INDEX = re.compile(r"\[(\d+)\]")
_MODULES = re.compile(r"_modules\[['\"]([^'\"]+)['\"]\]")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_LIBRARY = (os.path.dirname(torch.__file__) + os.sep, *(f"{os.sep}transformers{os.sep}{folder}{os.sep}"
                                                      for folder in ("distributed", "integrations")))
"""Frames not of the user's model: torch itself (functional collectives, ``nn.Module.__call__``) and
transformers' tensor-parallel hooks, which issue the all_reduce of a row-parallel layer."""


def module_path(node: Node) -> str:
    """The innermost module ``node`` was traced in, as ``named_modules()`` names it
    (``model.layers.0.mlp.down_proj``); "" when the node has no module metadata."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    name = list(stack.values())[-1][0]
    name = _MODULES.sub(r"\1", _ROOT.sub("", str(name)))
    return _INDEX.sub(r".\1", name).replace("..", ".").strip(".")


def source_line(node: Node) -> str:
    """``file.py:123: code`` of the innermost frame of ``node``'s ``stack_trace`` in the model's code
    (not in torch or transformers' tensor-parallel hooks); "" without one."""
    trace = node.meta.get("stack_trace") or ""
    lines = trace.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        frame = _FRAME.search(lines[i])
        if frame is None or any(part in frame.group(1) for part in _LIBRARY):
            continue
        code = lines[i + 1].strip() if i + 1 < len(lines) else ""
        code = "" if set(code) <= set("^~ ") else code
        where = f"{os.path.basename(frame.group(1))}:{frame.group(2)}"
        return f"{where}: {code}" if code else where
    return ""


def where(node: Node) -> str:
    """``module path (file.py:123: code)``, or whichever of the two is known, or ""."""
    path, line = module_path(node), source_line(node)
    if path and line:
        return f"{path} ({line})"
    return path or line


GRAPH_INPUT = "a value this graph receives as an input (computed before a graph break, in an earlier graph)"
"""What ``where_reduced`` says of a collective whose value comes in from outside the graph."""

_MAX_STEPS = 16
"""How far ``where_reduced`` looks up a chain of single-input nodes (views, casts, waits)."""


def where_reduced(collective: Node) -> str:
    """``where(collective)``; where the collective carries no metadata (Dynamo records none on a
    collective issued outside a module's forward, or the collective starts a graph after a graph
    break), the place of the value it reduces: the nearest node up its first tensor input that has
    metadata, or ``GRAPH_INPUT`` when that chain reaches one of the graph's inputs. "" only when
    neither is found (a graph made by hand)."""
    place = where(collective)
    node: Node | None = collective
    for _ in range(_MAX_STEPS):
        if place or node is None:
            return place
        node = next((a for a in node.all_input_nodes), None)
        if node is None:
            return ""
        if node.op == "placeholder":
            return where(node) or GRAPH_INPUT
        place = where(node)
    return place
