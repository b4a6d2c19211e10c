"""A NaN / inf loss or gradient stops KDTrainer with one clear error: HF's Trainer only hides a
NaN loss from its logs (logging_nan_inf_filter) and applies the NaN gradient. Checked where the value is on the
host anyway: per micro-batch with logging_nan_inf_filter (the default; before the optimizer step, so the weights
are untouched), at the logging step otherwise, and for the gradient norm."""

import pytest
import torch

from liger_patch_kd.trainer import KDTrainer

from .test_onpolicy import PROMPTS, _args, tokenizer  # noqa: F401
from .tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")


def nan_teacher():
    teacher = tiny_model("llama", dtype=torch.float32, seed=2)
    with torch.no_grad():
        teacher.lm_head.weight[3] = float("nan")  # every teacher distribution is NaN: so is the KD loss
    return teacher


def train(tmp_path, tokenizer, teacher, student=None, **overrides):  # noqa: F811
    student = student or tiny_model("llama", dtype=torch.float32, seed=1)
    trainer = KDTrainer(model=student, teacher_model=teacher, processing_class=tokenizer, train_dataset=PROMPTS,
                        args=_args(tmp_path, max_steps=2, **overrides))  # fmt: skip
    trainer.train()
    return trainer


def test_a_nan_loss_stops_training_before_the_optimizer_step(tmp_path, tokenizer):  # noqa: F811
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    before = [p.detach().clone() for p in student.parameters()]
    with pytest.raises(
        FloatingPointError, match=r"the training loss of optimizer step 0 is nan: training stops before"
    ):
        train(tmp_path, tokenizer, nan_teacher(), student)
    assert all(torch.equal(a, b) for a, b in zip(before, student.parameters()))  # nothing was applied


def test_without_the_trainers_per_step_read_it_stops_at_the_logging_step(tmp_path, tokenizer):  # noqa: F811
    with pytest.raises(FloatingPointError, match=r"the loss logged at optimizer step 1 is nan.*logging_nan_inf_filter"):
        train(tmp_path, tokenizer, nan_teacher(), logging_nan_inf_filter=False)


def test_a_nan_gradient_under_a_finite_loss_stops_at_the_logging_step(tmp_path, tokenizer):  # noqa: F811
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    student.model.norm.weight.register_hook(lambda grad: grad * float("nan"))
    with pytest.raises(FloatingPointError, match=r"the grad_norm logged at optimizer step 1 is nan"):
        train(tmp_path, tokenizer, tiny_model("llama", dtype=torch.float32, seed=2), student)


def test_finite_training_is_untouched(tmp_path, tokenizer):  # noqa: F811
    trainer = train(tmp_path, tokenizer, tiny_model("llama", dtype=torch.float32, seed=2))
    assert len([h for h in trainer.state.log_history if "loss" in h]) == 2
