"""The runtime's why-nots and the compile side's codes: every runtime issue is a ``ReasonCode`` of
the same value with the runtime's sentence, and back; the quantized epilogue's refusals answer with
codes (``runtime.cuda.quant_epilogue.QuantFormIssue``), which the planner reports as the cause."""

from __future__ import annotations

import string

import pytest
import torch

from weavepass.compile.reasons import (
    MESSAGES,
    RUNTIME_ISSUE_ENUMS,
    RUNTIME_ISSUE_TEXTS,
    RUNTIME_ISSUES,
    Reason,
    ReasonCode,
    runtime_issue_reason,
)
from weavepass.runtime import QuantIssue
from weavepass.runtime.cuda import support
from weavepass.runtime.cuda.quant_epilogue import QuantEpilogue, QuantFormIssue, plan_quant_epilogue
from weavepass.runtime.issue import Unsupported
from weavepass.testing.quant_steps import form_steps


class _Any:
    """A stand-in for any field: indexable, formats as ``X``."""

    def __getitem__(self, key: object) -> _Any:
        return self

    def __format__(self, spec: str) -> str:
        return "X"

    def __repr__(self) -> str:
        return "X"


def _fields(template: str) -> dict[str, object]:
    names = {name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(template) if name}
    return {name: _Any() for name in names}


def test_every_runtime_issue_is_a_reason_code_with_the_runtimes_sentence():
    members = [issue for enum_type in RUNTIME_ISSUE_ENUMS for issue in enum_type]
    assert len({issue.value for issue in members}) == len(members)  # no value in two enums
    assert [code.value for code in RUNTIME_ISSUES] == [issue.value for issue in members]
    for issue in members:
        code = ReasonCode(issue.value)
        template = RUNTIME_ISSUE_TEXTS[issue.value]
        fields = _fields(template)
        assert Reason.of(code, **fields).render() == template.format(**fields), code


def test_every_reason_code_of_a_runtime_family_is_a_runtime_issue():
    """The other way: a code named like a runtime issue has a runtime member (a code added on the
    compile side alone would render from a sentence that does not exist)."""
    runtime_values = {issue.value for enum_type in RUNTIME_ISSUE_ENUMS for issue in enum_type}
    prefixes = ("npu_", "symm_mem_", "quant_form_")
    named_alike = {code.value for code in ReasonCode if code.value.startswith(prefixes)}
    assert named_alike <= runtime_values, sorted(named_alike - runtime_values)
    assert set(MESSAGES) == set(ReasonCode)  # and every code has a sentence


def _plan(form: str, static_scale=None, group: int | None = None, hidden: int = 256):
    scale_steps, code_steps, group_size = form_steps(form, torch.bfloat16)
    return plan_quant_epilogue(torch.bfloat16, hidden, static_scale, group_size if group is None else group,
                               scale_steps, code_steps, False)


@pytest.mark.parametrize("kwargs, issue, fields", [
    ({"form": "fp8_group", "static_scale": (torch.float32, 0)}, QuantFormIssue.STATIC_SCALE_PER_GROUP, {}),
    ({"form": "fp8_group", "group": 96}, QuantFormIssue.GROUP_SIZE, {"group_size": 96, "hidden": 256}),
    ({"form": "fp8_static", "static_scale": (torch.bfloat16, 0)}, QuantFormIssue.STATIC_SCALE_DTYPE,
     {"dtype": torch.bfloat16}),
])
def test_quant_form_refusals_answer_with_codes(kwargs, issue, fields):
    refused = _plan(**kwargs)
    assert isinstance(refused, Unsupported) and refused.issue is issue, refused
    assert dict(refused.fields) == fields
    assert isinstance(_plan("fp8_row"), QuantEpilogue)  # the control: a carried form


def test_fp8_on_an_older_gpu_is_a_code_with_the_capability(monkeypatch):
    scale_steps, code_steps, group = form_steps("fp8_row", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    refused = support.cuda_quant_epilogue(torch.bfloat16, 256, torch.device("cuda", 0), None, group,
                                          scale_steps, code_steps, False)
    assert isinstance(refused, Unsupported) and refused.issue is QuantFormIssue.FP8_CAPABILITY
    assert dict(refused.fields) == {"capability": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert isinstance(support.cuda_quant_epilogue(torch.bfloat16, 256, torch.device("cuda", 0), None, group,
                                                  scale_steps, code_steps, False), QuantEpilogue)


def test_a_runtime_cause_becomes_a_reason_in_the_chain():
    """``QuantIssue.CUDA_FORM``'s cause is the runtime's ``Unsupported``: the planner's reason carries
    it as a ``Reason`` of the same code, and renders the same sentence."""
    form = Unsupported.of(QuantFormIssue.FP8_CAPABILITY, capability=(8, 0))
    issue = Unsupported.of(QuantIssue.CUDA_FORM, cause=form)
    reason = runtime_issue_reason(issue)
    assert list(reason.codes()) == [ReasonCode.QUANT_CUDA_FORM, ReasonCode.QUANT_FORM_FP8_CAPABILITY]
    assert reason.field("cause") == Reason.of(ReasonCode.QUANT_FORM_FP8_CAPABILITY, capability=(8, 0))
    assert reason.render() == str(issue)  # rendering test: the runtime's sentence, cause included


def test_a_value_registered_twice_with_another_sentence_is_refused():
    """``runtime.issue.register`` is the one registry of the runtime's sentences: an enum whose
    value another module's enum already took would overwrite that sentence, and is refused."""
    from weavepass.config import StrEnum
    from weavepass.runtime.issue import ISSUE_TEXT, register

    class Clash(StrEnum):
        SAME = QuantFormIssue.FP8_CAPABILITY.value

    before = dict(ISSUE_TEXT)
    register({Clash.SAME: ISSUE_TEXT[Clash.SAME.value]})  # the same sentence: nothing changes
    with pytest.raises(ValueError, match="quant_form_fp8_capability"):
        register({Clash.SAME: "another sentence"})
    assert ISSUE_TEXT == before
