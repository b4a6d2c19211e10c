"""The exact served teacher (issue 41): `liger-kd serve`'s hidden states and head over the wire, and KDTrainer with
kd_teacher_protocol="hidden" training on exactly the in-process teacher's objective."""

import json
import math
import threading
import urllib.request

import pytest
import torch

from liger_patch_kd.ops.fp8 import FP8_MAX
from liger_patch_kd.teacher.serve import TeacherReplyError
from liger_patch_kd.teacher.serve.hidden_wire import (
    FP8_DTYPE,
    TeacherHead,
    decode_head,
    decode_hidden,
    encode_head,
    encode_hidden,
)

from .tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")


# ------------------------------------------------------------------------------------------------ the wire
def _states(hidden=96, lengths=(5, 1, 12), seed=0):
    g = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    # rows of very different magnitudes, and a row of zeros: the per-row scale must follow each
    states = [torch.randn(n, hidden, generator=g) * torch.logspace(-3, 2, n)[:, None] for n in lengths]
    states[1].zero_()
    return sequences, states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE])
def test_hidden_reply_round_trip_and_bytes(dtype):
    sequences, states = _states()
    blob = encode_hidden(states, sequences, dtype, version=3)
    back, version = decode_hidden(blob, sequences, request="r")
    assert version == 3 and [b.shape for b in back] == [s.shape for s in states]
    tokens, hidden = sum(map(len, sequences)), states[0].shape[-1]
    per_token = (len(blob) - 24 - 4 * len(sequences)) / tokens  # the header and lengths come once per reply
    assert per_token == {torch.float32: 4 * hidden + 4, torch.bfloat16: 2 * hidden + 4, FP8_DTYPE: hidden + 8}[dtype]
    assert dtype != torch.bfloat16 or per_token <= 2 * hidden + 16  # the budget
    for b, s in zip(back, states):
        if dtype == torch.float32:
            assert torch.equal(b, s)
        elif dtype == torch.bfloat16:
            assert torch.equal(b, s.to(torch.bfloat16))
        else:
            # e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself; values below the smallest
            # normal (2^-6 of the scale) by at most half the subnormal step, 2^-10 of the row's scale
            scale = s.abs().amax(-1, keepdim=True) / FP8_MAX
            bound = torch.maximum(s.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
            assert ((b - s).abs() <= bound).all()
            assert b.dtype == torch.float32


def test_hidden_reply_is_checked_against_the_request():
    sequences, states = _states()
    blob = encode_hidden(states, sequences, torch.bfloat16, version=0)
    with pytest.raises(TeacherReplyError, match="row 0 is of token"):
        decode_hidden(blob, [[(sequences[0][0] + 1) % VOCAB, *sequences[0][1:]], *sequences[1:]], request="r")
    with pytest.raises(TeacherReplyError, match="expected"):
        decode_hidden(blob[:-2], sequences, request="r")
    with pytest.raises(TeacherReplyError, match="not a liger hidden-state reply"):
        decode_hidden(b"LKD2" + blob[4:], sequences, request="r")
    states[2][4, 7] = math.nan
    with pytest.raises(TeacherReplyError, match="row 10 holds NaN"):
        decode_hidden(encode_hidden(states, sequences, torch.float32, 0), sequences, request="r")


@pytest.mark.parametrize("bias", [False, True])
def test_head_round_trip(bias):
    weight = torch.randn(VOCAB + 7, 32, dtype=torch.bfloat16)
    head = TeacherHead(5, weight, torch.randn(VOCAB + 7) if bias else None, 30.0 if bias else None, VOCAB, 0.3)
    back = decode_head(encode_head(head), request="r")
    assert torch.equal(back.weight, weight) and back.version == 5 and back.vocab_size == VOCAB
    assert back.softcap == head.softcap and back.logit_scale == 0.3
    assert back.bias is None if not bias else torch.equal(back.bias, head.bias.to(torch.bfloat16))
