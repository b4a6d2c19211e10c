"""generation.dependent_launch: the decode step's kernels launched as programmatic dependents only where enabled, on a
GPU that supports it; a captured session decodes the same bits with them as without."""

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


def test_off_unless_enabled_and_on_a_gpu_that_supports_it(monkeypatch):
    """Not enabled: never. Enabled: not on a CPU; on a GPU where it supports it (Hopper and later)."""
    from liger_patch_kd.ops.triton_utils import dependent_launch_options

    assert dependent_module.ENABLED is False  # off as shipped
    assert not dependent_launch(DEVICE)
    monkeypatch.setattr(dependent_module, "ENABLED", True)
    assert not dependent_launch(torch.device("cpu"))
    assert dependent_launch_options(True, torch.device("cpu")) == {"PDL": False}
    if torch.cuda.is_available():
        assert dependent_launch(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)


KERNEL_MODULES = ("liger_patch_kd.ops.rms_norm", "liger_patch_kd.generation.decode_kernel",
                  "liger_patch_kd.generation.few_row_linear")  # fmt: skip


def _captured_decode(model, enabled: bool, monkeypatch):
    """(tokens, log-probs) of a captured decode call, and the modules whose kernels were launched as programmatic
    dependents (their launch options as the kernels received them)."""
    import importlib

    dependents = set()
    with monkeypatch.context() as m:
        m.setattr(dependent_module, "ENABLED", enabled)
        for name in KERNEL_MODULES:
            module = importlib.import_module(name)
            options = module.dependent_launch_options

            def recorded(dependent, device, _options=options, _name=name):
                chosen = _options(dependent, device)
                if chosen.get("launch_pdl"):
                    dependents.add(_name)
                return chosen

            m.setattr(module, "dependent_launch_options", recorded)
        ids, mask = (t.to(DEVICE) for t in _prompts())
        torch.manual_seed(3)
        out = decode(model, ids, mask, max_new_tokens=6, sampling=Sampling(temperature=0.9), pad_id=0,
                     logprobs=True, capture="graph")  # fmt: skip
    release_sessions(model)
    return out, dependents


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA GPU: the step is captured as a CUDA graph")
def test_a_captured_session_decodes_the_same_bits_launched_as_dependents(monkeypatch):
    """Every product through the few-row kernel too (MIN_OUT_FEATURES 0): on Hopper the norms, the attention and
    the products launched as programmatic dependents, the same tokens and log-probs bit for bit."""
    monkeypatch.setattr(few_row_module, "MIN_OUT_FEATURES", 0)
    model = _engine_model("llama", torch.bfloat16, seed=6).to(DEVICE)
    (tokens, logprobs), dependents = _captured_decode(model, True, monkeypatch)
    (plain, plain_logprobs), none = _captured_decode(model, False, monkeypatch)
    assert not none
    assert dependents == (set(KERNEL_MODULES) if torch.cuda.get_device_capability()[0] >= 9 else set())
    assert torch.equal(tokens, plain)
    assert torch.equal(logprobs, plain_logprobs)
