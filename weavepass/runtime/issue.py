"""Why-nots of the runtime's checks, as codes: the runtime cannot import ``weavepass.compile``, so a
check answers with an ``Unsupported`` (a ``StrEnum`` member of its module and the detail as fields);
``str()`` renders the sentence from ``ISSUE_TEXT``, the one registry of the runtime's sentences
(each module registers its table with ``register``: ``runtime.QUANT_ISSUE_TEXT``,
``runtime.cuda.support.CUDA_ISSUE_TEXT``, ``runtime.cuda.quant_epilogue``'s, ``runtime.npu``'s,
``runtime.symm_mem_matmul``'s). The compile side reports each as the ``ReasonCode`` of the same
value (``weavepass.compile.reasons.RUNTIME_ISSUES``, built from the enums ``RUNTIME_ISSUE_ENUMS``),
rendered from here (``reasons.RUNTIME_ISSUE_TEXTS`` is this registry); a field that is itself an
``Unsupported`` (a ``cause``) becomes a ``Reason`` too (``reasons.runtime_issue_reason``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from weavepass.config import StrEnum

ISSUE_TEXT: dict[str, str] = {}
"""Each registered issue's sentence (a ``str.format`` template over its fields), by the issue's value."""


def register(texts: Mapping[StrEnum, str]) -> None:
    """Add a module's issue sentences to ``ISSUE_TEXT`` (every member of its enum has one)."""
    for issue, text in texts.items():
        if ISSUE_TEXT.setdefault(issue.value, text) != text:  # two enums must not share a value
            raise ValueError(f"issue {issue.value!r} is registered with another sentence")
    members = {member.value for issue in texts for member in type(issue)}
    missing = members - ISSUE_TEXT.keys()
    assert not missing, f"issues without a sentence: {sorted(missing)}"


@dataclass(frozen=True)
class Unsupported:
    """Why a runtime fused op cannot take a call: ``issue`` and its detail (``fields``)."""

    issue: StrEnum
    fields: tuple[tuple[str, object], ...] = ()

    @classmethod
    def of(cls, issue: StrEnum, **fields: object) -> Unsupported:
        return cls(issue, tuple(fields.items()))

    def __str__(self) -> str:
        return ISSUE_TEXT[self.issue.value].format(**dict(self.fields))
