"""generation.dependent_launch: the decode step's kernels launched as programmatic dependents only while a step is
captured on a GPU that supports it, and a captured session decodes the same bits with them as without."""

import pytest
import torch

from liger_patch_kd.generation import Sampling, decode, release_sessions
from liger_patch_kd.generation import dependent_launch as dependent_module
from liger_patch_kd.generation import few_row_linear as few_row_module
from liger_patch_kd.generation.dependent_launch import dependent_launch
from liger_patch_kd.ops.backend import triton_available

from .helpers import DEVICE
from .test_engine_kernels import _engine_model, _prompts

pytestmark = pytest.mark.skipif(not triton_available(), reason="dependent launch is a Triton launch option")


def test_off_unless_enabled_captured_and_on_a_gpu(monkeypatch):
    """Not enabled: never. Enabled: not on a CPU, nor on a GPU outside a capture (an eager step has no captured
    order in which no kernel writes a weight)."""
    from liger_patch_kd.ops.triton_utils import dependent_launch_options

    assert dependent_module.ENABLED is False  # off as shipped
    monkeypatch.setattr(dependent_module, "ENABLED", True)
    assert not dependent_launch(torch.device("cpu"))
    assert dependent_launch_options(True, torch.device("cpu")) == {"PDL": False}
    if torch.cuda.is_available():
        assert not dependent_launch(torch.device("cuda"))  # not capturing


def _captured_decode(model, enabled: bool, monkeypatch):
    asked = []
    with monkeypatch.context() as m:
        m.setattr(dependent_module, "ENABLED", enabled)
        supported = dependent_module.dependent_launch_supported
        m.setattr(dependent_module, "dependent_launch_supported", lambda d: asked.append(supported(d)) or asked[-1])
        ids, mask = (t.to(DEVICE) for t in _prompts())
        torch.manual_seed(3)
        out = decode(model, ids, mask, max_new_tokens=6, sampling=Sampling(temperature=0.9), pad_id=0,
                     logprobs=True, capture="graph")  # fmt: skip
    release_sessions(model)
    return out, asked


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA GPU: the step is captured as a CUDA graph")
def test_a_captured_session_decodes_the_same_bits_launched_as_dependents(monkeypatch):
    """Every product through the few-row kernel too (MIN_OUT_FEATURES 0): norms, attention and products launched as
    programmatic dependents where the GPU supports it (Hopper), the same tokens and log-probs bit for bit."""
    monkeypatch.setattr(few_row_module, "MIN_OUT_FEATURES", 0)
    model = _engine_model("llama", torch.bfloat16, seed=6).to(DEVICE)
    (tokens, logprobs), asked = _captured_decode(model, True, monkeypatch)
    (plain, plain_logprobs), _ = _captured_decode(model, False, monkeypatch)
    assert asked  # the step's kernels asked while captured
    if torch.cuda.get_device_capability()[0] >= 9:
        assert all(asked)
    assert torch.equal(tokens, plain)
    assert torch.equal(logprobs, plain_logprobs)
