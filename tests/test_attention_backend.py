"""kd_attention_backend: the SDPA order holds for the whole training step (forward, teacher, backward with
checkpointing's recomputed forward), changes nothing where the backend cannot run (a CPU), and is checked."""

import pytest
import torch

from liger_patch_kd import KDTrainer
from liger_patch_kd.models import attention_backend

from .test_trainer import _args, _dataset
from .tiny_models import tiny_model

CUDNN = int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)


def _first_backend() -> int:
    return torch._C._get_sdp_priority_order()[0]


def test_the_order_is_set_inside_and_restored_after():
    before = torch._C._get_sdp_priority_order()
    with attention_backend("cudnn"):
        assert _first_backend() == CUDNN
    assert torch._C._get_sdp_priority_order() == before
    with attention_backend("default"):
        assert torch._C._get_sdp_priority_order() == before
    with pytest.raises(ValueError, match="attention backend must be one of"):
        with attention_backend("fa3"):
            pass


def test_the_step_runs_under_the_choice_forward_and_recomputed_forward_alike(tmp_path):
    seen = {}
    results = {}
    for choice in ("default", "cudnn"):
        student, teacher = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
        seen[choice] = []
        # every attention call of the student (the first forward and the one checkpointing recomputes in the
        # backward) and of the teacher records the order it ran under
        for model in (student, teacher):
            for layer in model.model.layers:
                layer.self_attn.register_forward_pre_hook(lambda *_, s=seen[choice]: s.append(_first_backend()))
        args = _args(
            tmp_path / choice, kd_attention_backend=choice, max_steps=2, use_kd_patch=True,
            gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        )  # fmt: skip
        trainer = KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=_dataset(8))
        trainer.train()
        results[choice] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    layers = len(tiny_model("llama").model.layers)
    assert len(seen["cudnn"]) == 2 * 3 * layers  # two steps: student forward, its recompute, the teacher
    assert set(seen["cudnn"]) == {CUDNN} and CUDNN not in seen["default"][:1]
    assert results["cudnn"] == results["default"]  # a CPU has no cuDNN attention: the same kernels ran


def test_a_wrong_choice_is_refused_when_the_arguments_are_made(tmp_path):
    with pytest.raises(ValueError, match="kd_attention_backend must be one of"):
        _args(tmp_path, kd_attention_backend="cuDNN")
