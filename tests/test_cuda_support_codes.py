"""The CUDA lowering's support checks answer with codes (``runtime.cuda.support.CudaIssue``), which
the compile side reports as the ``ReasonCode`` of the same value; the sentence is the runtime's.
Graph-level: a site planned for ``cuda_symm`` on CPU says why, by code. No GPU needed: the checks
read dtypes, sizes, the device type and the group."""

from __future__ import annotations

import pytest
import torch

from weavepass.compile.reasons import CUDA_ISSUES, MESSAGES, Reason, ReasonCode, runtime_issue_reason
from weavepass.runtime.cuda.support import (
    CUDA_ISSUE_TEXT,
    MAX_HIDDEN,
    CudaIssue,
    cuda_site_unsupported_reason,
    cuda_unsupported_reason,
)
from weavepass.runtime.issue import Unsupported
from weavepass.testing import fake_process_group

CUDA = torch.device("cuda", 0)  # only its type is read


def test_every_issue_has_a_reason_code_rendered_alike():
    assert {code.value for code in CUDA_ISSUES} == {issue.value for issue in CudaIssue}
    assert set(CUDA_ISSUE_TEXT) == set(CudaIssue)
    issue = Unsupported.of(CudaIssue.HIDDEN_TOO_LARGE, hidden=20000, max_hidden=MAX_HIDDEN)
    reason = runtime_issue_reason(issue)
    assert reason.code is ReasonCode.CUDA_HIDDEN_TOO_LARGE and reason.field("hidden") == 20000
    assert reason.render() == str(issue)  # rendering test: the runtime's sentence
    assert all(code in MESSAGES for code in CUDA_ISSUES)


@pytest.fixture
def group():
    with fake_process_group(2) as group:
        yield group.group_name


@pytest.mark.parametrize("call, issue, fields", [
    (dict(device=torch.device("cpu")), CudaIssue.NOT_ON_CUDA, {"device": "cpu"}),
    (dict(dtype=torch.float64), CudaIssue.DTYPE, {"dtype": torch.float64}),
    (dict(out_dtype=torch.int8), CudaIssue.OUT_DTYPE, {"dtype": torch.int8}),
    (dict(hidden=132), CudaIssue.HIDDEN_NOT_MULTIPLE, {"hidden": 132}),
    (dict(hidden=2 * MAX_HIDDEN), CudaIssue.HIDDEN_TOO_LARGE, {"hidden": 2 * MAX_HIDDEN, "max_hidden": MAX_HIDDEN}),
    (dict(group_name="no such group"), CudaIssue.GROUP_UNRESOLVED, {"group": "no such group"}),
])
def test_site_checks_answer_with_codes(group, call, issue, fields):
    pytest.importorskip("triton")
    args = dict(dtype=torch.bfloat16, hidden=4096, device=CUDA, group_name=group, out_dtype=None) | call
    got = cuda_site_unsupported_reason(**args)
    assert got is not None and got.issue is issue
    assert fields.items() <= dict(got.fields).items()
    ok = dict(dtype=torch.bfloat16, hidden=4096, device=CUDA, group_name=group, out_dtype=None)
    assert cuda_site_unsupported_reason(**ok) is None  # the same call without the fault passes


def test_call_checks_answer_with_codes(group):
    pytest.importorskip("triton")
    x = torch.zeros(4, 64)
    assert cuda_unsupported_reason(x, torch.zeros(4, 32), torch.ones(64), group).issue is CudaIssue.RESIDUAL_MISMATCH
    assert cuda_unsupported_reason(x, None, torch.ones(32), group).issue is CudaIssue.WEIGHT_MISMATCH
    assert cuda_unsupported_reason(x, x, torch.ones(64), group).issue is CudaIssue.NOT_ON_CUDA


def test_a_site_asked_onto_cuda_symm_on_cpu_says_why_by_code(group):
    """Graph level: ``lowering="cuda_symm"`` on a CPU graph plans the portable lowering, with the
    runtime's code as the cause and its sentence in the report."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    from weavepass import WeaveConfig
    from weavepass.compile.patterns import find_allreduce_rmsnorm_sites
    from weavepass.compile.planner import plan_sites

    def f(x, w, r, g):
        h = funcol.all_reduce(x @ w, "sum", dist.group.WORLD) + r
        return g * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)), h

    graph = make_fx(f, tracing_mode="fake")(torch.randn(6, 16), torch.randn(16, 64), torch.randn(6, 64),
                                            torch.randn(64)).graph
    sites, _ = find_allreduce_rmsnorm_sites(graph)
    (plan,) = plan_sites(sites, WeaveConfig(lowering="cuda_symm"))
    assert plan.lowering == "portable"
    assert plan.reason == Reason.of(ReasonCode.PORTABLE_FALLBACK,
                                    cause=Reason.of(ReasonCode.CUDA_NOT_ON_CUDA, device="cpu"))
