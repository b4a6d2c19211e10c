"""A decode call under torch.inference_mode builds its session's buffers (KV cache, counters, weight copies) as
inference tensors; the next call of that bucket outside inference mode (no_grad, as the Trainer's rollouts run)
updated them in place and crashed with 'Inplace update to inference tensor outside InferenceMode'."""

import pytest
import torch

from liger_patch_kd.generation import Sampling, decode, release_sessions

from ..test_generation import _model, _prompts

pytestmark = pytest.mark.usefixtures("clean_patches")


def test_a_bucket_decoded_under_inference_mode_then_under_no_grad_decodes_both_times():
    model = _model("llama", torch.float32, seed=4)
    ids, mask = _prompts()
    release_sessions(model)
    runs = []
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode):
        torch.manual_seed(3)
        with mode():
            runs.append(decode(model, ids, mask, max_new_tokens=4, sampling=Sampling(), pad_id=0, capture="eager"))
    release_sessions(model)
    assert all(torch.equal(runs[0][0], r[0]) for r in runs)
