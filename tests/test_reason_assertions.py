"""Tests assert reason codes and fields, never the rendered text (docs/architecture.md, "Reasons"):
this scan fails on an assertion in ``tests/`` that compares against a phrase of a reason's sentence
(``MESSAGES``, the runtime's ``RUNTIME_ISSUE_TEXTS``), outside a test marked ``rendering test`` (a
comment or docstring in the test function, or the file's docstring).

A heuristic: the phrases are the fixed parts of every sentence (the text between ``{fields}``) of 20
characters or more; an assertion hits where one of its string constants compared with ``==``, ``in``,
``startswith``/``endswith``/``count``, or given as ``match=`` (of ``pytest.warns``: an error that
``pytest.raises`` matches is no reason), shares 20 characters (words, not one identifier) with such a
phrase."""

from __future__ import annotations

import ast
import difflib
import pathlib
import re

from weavepass.compile.reasons import RUNTIME_ISSUE_TEXTS

TESTS = pathlib.Path(__file__).parent
REASONS_SOURCE = TESTS.parent / "weavepass" / "compile" / "reasons.py"
MARK = "rendering test"
MIN_PHRASE = 20
_TEXT_METHODS = {"startswith", "endswith", "count", "find", "index", "search", "match", "fullmatch"}


def _sentence_strings() -> list[str]:
    """Every string of ``reasons.py`` but its docstrings (the templates, their pieces in renderers),
    and the runtime's sentences."""
    tree = ast.parse(REASONS_SOURCE.read_text())
    docstrings = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    strings = [node.value for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]
    return strings + list(RUNTIME_ISSUE_TEXTS.values())


def sentence_phrases() -> set[str]:
    phrases = set()
    for text in _sentence_strings():
        for piece in re.split(r"\{[^{}]*\}", text):
            piece = piece.strip(" :;,.()'\"")
            if len(piece) >= MIN_PHRASE and " " in piece:
                phrases.add(piece)
    return phrases


def _compared_strings(node: ast.AST) -> list[str]:
    """The string constants ``node`` (an assertion) compares text with."""
    found: list[ast.AST] = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Compare):
            found += [sub.left, *sub.comparators]
        elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in _TEXT_METHODS:
            found += sub.args
    strings = []
    for operand in found:
        for sub in ast.walk(operand):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                strings.append(sub.value)
            if isinstance(sub, ast.Call):  # Reason.of(..., node="...") and the like: fields, not text
                break
    return strings


def _hits(text: str, phrases: set[str]) -> bool:
    """Whether ``text`` shares a run of ``MIN_PHRASE`` characters, words among them, with a phrase."""
    if len(text) < MIN_PHRASE:
        return False
    for phrase in phrases:
        match = difflib.SequenceMatcher(None, text, phrase, autojunk=False).find_longest_match(
            0, len(text), 0, len(phrase))
        if match.size >= MIN_PHRASE and " " in text[match.a:match.a + match.size].strip():
            return True
    return False


def text_assertions(path: pathlib.Path, phrases: set[str]) -> list[str]:
    """``path:line: phrase`` for each assertion of ``path`` on a sentence's text, outside rendering tests."""
    source = path.read_text()
    tree = ast.parse(source)
    if MARK in (ast.get_docstring(tree) or "").lower():
        return []
    lines = source.splitlines()
    marked: list[tuple[int, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            end = node.end_lineno or node.lineno
            if any(MARK in line.lower() for line in lines[start - 1:end]):
                marked.append((start, end))
    found = []
    for node in ast.walk(tree):
        checked: list[ast.AST] = []
        if isinstance(node, ast.Assert):
            checked = [node]
        elif isinstance(node, ast.Call) and not (isinstance(node.func, ast.Attribute) and node.func.attr == "raises"):
            checked = [k.value for k in node.keywords if k.arg == "match"]  # (an error raised is no reason)
        for part in checked:
            if any(start <= part.lineno <= end for start, end in marked):
                continue
            strings = [s for s in _compared_strings(part) if _hits(s, phrases)]
            if isinstance(node, ast.Call):  # match=: the pattern itself
                strings = [s.value for s in ast.walk(part)
                           if isinstance(s, ast.Constant) and isinstance(s.value, str) and _hits(s.value, phrases)]
            if strings:
                found.append(f"{path.name}:{part.lineno}: {strings[0]!r}")
    return found


def test_the_scan_sees_a_text_assertion(tmp_path):
    """The check can fail: a test asserting a sentence's phrase is found, a marked one is not, and an
    assertion on codes and fields is not."""
    phrases = sentence_phrases()
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "def test_text(record):\n"
        "    assert 'other user(s) besides the residual add' in record.reason\n"
        "def test_match(f):\n"
        "    with pytest.warns(UserWarning, match='is not followed by rsqrt or sqrt'):\n"
        "        f()\n"
        "def test_error(f):\n"
        "    with pytest.raises(ValueError, match='is not followed by rsqrt or sqrt'):\n"
        "        f()\n"
        "def test_rendered(record):  # Rendering test\n"
        "    assert 'other user(s) besides the residual add' in record.reason\n"
        "def test_codes(record):\n"
        "    assert record.reasons == [Reason.of(ReasonCode.READ_BY, node='the norm reads a value x')]\n"
    )
    hits = text_assertions(probe, phrases)
    assert [h.split(":")[1] for h in hits] == ["2", "4"], hits  # not the error, the marked test, the codes


def test_no_test_asserts_on_reason_text():
    phrases = sentence_phrases()
    assert len(phrases) > 100  # the scan reads the sentences (it is not vacuous)
    found = [hit for path in sorted(TESTS.rglob("*.py")) for hit in text_assertions(path, phrases)]
    assert not found, ("assert the ReasonCode and its fields (record.codes, reason.find(code), "
                       "reason.field(name)), or mark the test 'rendering test':\n" + "\n".join(found))
