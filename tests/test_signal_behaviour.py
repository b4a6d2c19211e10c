"""The engine's behaviour log-probs (kd_generation_url with kd_onpolicy_loss='pg') are weighed by the signals whose
loss can (a live teacher, hidden states) and refused by every other kind, never dropped: a dropped correction
would train the uncorrected objective on the engine's stale samples without a word."""

import pytest
import torch

from liger_patch_kd.batch.columns import (
    TEACHER_HIDDEN_STATES,
    TEACHER_LOGPROBS,
    TEACHER_SAMPLE_COUNTS,
    TEACHER_SAMPLE_IDS,
    TEACHER_SAMPLE_LOGPROBS,
    TEACHER_TOKEN_IDS,
    TEACHER_WEIGHT,
)
from liger_patch_kd.models.signals import HiddenTeacher, LiveTeacher, SampledTeacher, TeacherMix, TopKTeacher
from liger_patch_kd.models.signals.parse import bind_rows, parse_signal

B, T, K, V, H = 2, 5, 3, 11, 4


def _targets():
    targets = torch.randint(0, V, (B, T))
    targets[:, 0] = -100
    return targets


def _columns(kind: str) -> dict:
    ids = torch.randint(0, V, (B, T, K))
    logprobs = torch.randn(B, T, K).log_softmax(-1)
    if kind == "topk":
        return {TEACHER_TOKEN_IDS: ids, TEACHER_LOGPROBS: logprobs}
    if kind == "hidden":
        return {TEACHER_HIDDEN_STATES: torch.randn(B, T, H), TEACHER_WEIGHT: torch.randn(V, H)}
    sampled = {TEACHER_SAMPLE_IDS: ids, TEACHER_SAMPLE_COUNTS: torch.ones(B, T, K, dtype=torch.long),
               TEACHER_SAMPLE_LOGPROBS: logprobs}  # fmt: skip
    return sampled if kind == "sampled" else {**sampled, TEACHER_TOKEN_IDS: ids, TEACHER_LOGPROBS: logprobs}


@pytest.mark.parametrize("kind", ["topk", "sampled", "hybrid"])
def test_kinds_that_cannot_weigh_behaviour_refuse_it(kind):
    signal = parse_signal(_columns(kind))
    assert isinstance(signal, TopKTeacher if kind == "topk" else SampledTeacher)
    with pytest.raises(ValueError, match="kd_behaviour_logprobs"):
        bind_rows(signal, _targets(), -100, behaviour=torch.zeros(B, T))
    assert bind_rows(signal, _targets(), -100) is not None  # without behaviour the kind is fine


def test_several_live_teachers_refuse_behaviour():
    with pytest.raises(ValueError, match="TeacherMix signal cannot weigh them"):
        TeacherMix(teachers=None).with_behaviour(torch.zeros(B, T))


def test_a_live_teacher_and_hidden_states_keep_behaviour():
    behaviour = torch.randn(B, T)
    for signal in (LiveTeacher(torch.nn.Linear(1, 1)), parse_signal(_columns("hidden"))):
        bound = bind_rows(signal, _targets(), -100, behaviour=behaviour)
        assert isinstance(bound, (LiveTeacher, HiddenTeacher))
        # label-aligned in, row-aligned kept: the log-prob of label t+1 sits on row t
        torch.testing.assert_close(bound.behaviour[:, :-1], behaviour[:, 1:], rtol=0, atol=0)

