"""A float64 model decoded under bfloat16 autocast: autocast never casts float64 tensors (it leaves the product in
float64), so the session must not hold bfloat16 copies of float64 weights. The cast copies made the step multiply
a float64 input by a bfloat16 weight and crash, where the same call without copies decodes."""

import pytest
import torch

from liger_patch_kd.generation import Sampling, decode, release_sessions
from liger_patch_kd.generation import fused_projections

from ..test_generation import _model, _prompts

pytestmark = pytest.mark.usefixtures("clean_patches")


@pytest.mark.parametrize("fuse", [False, True])
def test_float64_weights_under_bf16_autocast_decode_as_without_cast_copies(monkeypatch, fuse):
    model = _model("llama", torch.float64, seed=1)
    ids, mask = _prompts()
    runs = []
    for cast in (False, True):
        with monkeypatch.context() as patch:
            if not cast:
                patch.setattr(fused_projections, "_cast_dtype", lambda *a: None)
            release_sessions(model)
            torch.manual_seed(3)
            with torch.autocast("cpu", torch.bfloat16):
                runs.append(decode(model, ids, mask, max_new_tokens=5, sampling=Sampling(), pad_id=0,
                                   capture="eager", logprobs=True, fuse_projections=fuse))  # fmt: skip
    release_sessions(model)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
