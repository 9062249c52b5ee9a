"""Rendering tests: the sentences of the reasons whose renderers have logic of their own, and of the
reasons that tell the user what to do. Every other test asserts codes and fields
(``tests/test_reason_assertions.py`` keeps it so); these are the few that read the text."""

from __future__ import annotations

import pytest

from weavepass.compile.reasons import Reason, ReasonCode


@pytest.mark.parametrize("reason, advice", [
    (Reason(ReasonCode.EPS_NOT_CONSTANT), "torch._dynamo.config.specialize_float = True"),
    (Reason.of(ReasonCode.CUDA_MIN_TOKENS, tokens=512, min_tokens=1024), "set cuda_min_tokens=1 if you capture"),
    (Reason.of(ReasonCode.SPLIT_RUN_TIME_MASK, masks="arg3_1"), "(split='force' does, with a run-time check"),
    (Reason.of(ReasonCode.SAVED_FOR_BACKWARD, node="rsqrt", user="", norm_kind="RMSNorm"),
     "run the model under torch.no_grad() or torch.inference_mode() to fuse it"),
    (Reason(ReasonCode.INDUCTOR_CUDAGRAPHS), "Inductor CUDA graphs (mode='reduce-overhead') are on"),
])
def test_sentences_say_what_to_do(reason, advice):
    assert advice in reason.render(), reason.render()


def test_other_readers_name_a_write_back_into_an_input():
    reason = Reason.of(ReasonCode.SUM_OTHER_READERS, readers=(("mul", None), ("copy_", "arg4_1")))
    assert reason.render() == (
        "the all_reduce result has 2 other user(s) besides the residual add that feeds the norm: mul, copy_ (the "
        "sum is written back into the graph input arg4_1: an in-place all_reduce of, or a copy_ into, a tensor "
        "the compiled code was given)")


def test_saved_for_backward_says_what_the_op_returns():
    layer_norm = Reason.of(ReasonCode.SAVED_FOR_BACKWARD, node="rsqrt", user="div_1", norm_kind="LayerNorm")
    assert layer_norm.render() == (
        "training: rsqrt is saved for backward (as div_1), and the fused op for a LayerNorm returns only its "
        "outputs (run the model under torch.no_grad() or torch.inference_mode() to fuse it)")


def test_both_readings_say_a_shared_cause_once():
    """``sum + x`` read both ways stops at the same norm (a lifted eps): one sentence, not two."""
    eps = Reason(ReasonCode.EPS_NOT_CONSTANT)
    once = Reason.of(ReasonCode.BOTH_READINGS_FAIL, plain=eps,
                     folded=Reason.of(ReasonCode.AFTER_ADD, added="x", cause=eps))
    assert once.render() == eps.render()
    other = Reason.of(ReasonCode.NO_NORM, first_user="mul", place="")
    twice = Reason.of(ReasonCode.BOTH_READINGS_FAIL, plain=eps, folded=other)
    assert twice.render() == f"{eps.render()}; after that: {other.render()}"
