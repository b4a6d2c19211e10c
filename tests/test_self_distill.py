"""The student as its own teacher (kd_self_distill): its frozen current weights, or its base model with the adapter
disabled, reading the teacher's own prompt; with kd_lmbda=1 on-policy self-distillation (OPSD / SDFT): the student
samples from its own prompt and its frozen self scores the completion after the teacher prompt."""

import contextlib
import copy

import pytest
import torch

import liger_patch_kd.models as M
from liger_patch_kd.batch.prompts import PromptCollator, tokenize_prompt_row
from liger_patch_kd.trainer import FrozenStudentTeacher, KDTrainer
from liger_patch_kd.trainer.rollouts.onpolicy import GENERATED, OnPolicySteps

from .helpers import rel_err
from .test_onpolicy import (
    CountingGenerate,
    tokenizer,  # noqa: F401  (the BPE tokenizer fixture)
)
from .test_privileged import _args, _batch, _hand_reference, _rows
from .tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")

KERNELS_OFF = {"rope": False, "swiglu": False, "rms_norm": False}  # float64 throughout


def _student(mode):
    model = tiny_model("llama", seed=1)  # float64
    if mode == "adapter":
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                           init_lora_weights=False))  # fmt: skip
    return model


class _Reference:
    """The teacher of the hand reference: an independent copy of the student, in eval mode, adapter disabled for
    'adapter'."""

    def __init__(self, student, mode):
        self.model, self.mode = copy.deepcopy(student).eval(), mode

    def __call__(self, **kwargs):
        off = self.model.disable_adapter() if self.mode == "adapter" else contextlib.nullcontext()
        with off:
            return self.model(**kwargs)


@pytest.mark.parametrize("use_kd_patch", [True, False], ids=["fused", "materialised"])
@pytest.mark.parametrize("mode", ["frozen", "adapter"])
def test_the_self_teacher_reads_the_teacher_prompt_and_only_the_student_side_learns(tmp_path, mode, use_kd_patch):
    student = _student(mode)
    reference_student, reference_teacher = copy.deepcopy(student), _Reference(student, mode)
    trainer = KDTrainer(
        model=student, args=_args(tmp_path, use_kd_patch=use_kd_patch, kd_self_distill=mode,
                                  kd_patch_config=KERNELS_OFF),
    )  # fmt: skip
    seen = []  # (training, grad enabled) of each call of the first decoder layer: student first, then teacher
    inner = M.unwrap_model(student).model.layers[0]
    inner.register_forward_pre_hook(lambda module, _: seen.append((module.training, torch.is_grad_enabled())))
    student.train()
    rows = _rows()
    num_items = torch.tensor(sum(len(c) for _, _, c in rows))
    loss = trainer.compute_loss(student, _batch(rows, "right"), num_items_in_batch=num_items)
    loss.backward()
    assert seen == [(True, True), (False, False)]  # the teacher: eval (no dropout), no grad
    assert all(m.training for m in student.modules())  # modes put back
    M.revert_kd_patch(model=M.unwrap_model(student))
    expected = _hand_reference(reference_student, reference_teacher, rows, trainer.kd_config, num_items)
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-8, atol=1e-12)  # as test_privileged
    trained = [(n, p) for n, p in student.named_parameters() if p.requires_grad]
    reference = dict(reference_student.named_parameters())
    for name, p in trained:
        assert rel_err(p.grad, reference[name].grad) < 1e-6, name


def test_the_frozen_self_teacher_refuses_rows_without_a_teacher_prompt(tmp_path):
    student = tiny_model("llama", seed=1)
    trainer = KDTrainer(model=student, args=_args(tmp_path, kd_self_distill=True))  # not PEFT: True is frozen
    assert isinstance(trainer.teacher_model, FrozenStudentTeacher)
    rows = [(s, s, c) for s, _, c in _rows()]
    batch = {k: v for k, v in _batch(rows, "right").items() if not k.startswith("teacher_")}
    with pytest.raises(ValueError, match="gives loss 0"):
        trainer.compute_loss(student, batch)


PROMPTS = [("the cat", "the sun is warm today. the cat"), ("a dog ran", "the cat sat on the mat. a dog ran"),
           ("the sun is", "the"), ("on the mat.", "a dog ran to the park. on the mat.")] * 2  # fmt: skip
ROWS = [{"prompt": p, "teacher_prompt": t} for p, t in PROMPTS]


def test_rollouts_carry_the_teacher_prompt_before_the_same_completion(tmp_path, tokenizer):  # noqa: F811
    batch = PromptCollator(tokenizer)(ROWS[:4])
    steps = OnPolicySteps(_args(tmp_path, kd_lmbda=1.0, kd_max_new_tokens=5, kd_num_generations=2))
    sampler = tiny_model("llama", dtype=torch.float32, seed=1)
    (out,) = steps.replace(sampler, [batch], tokenizer=tokenizer, step=0, device=torch.device("cpu"))
    assert out[GENERATED] and out["input_ids"].shape[0] == 8
    for r in range(8):
        row = ROWS[r // 2]
        prompt = tokenize_prompt_row(tokenizer, row)[0]
        teacher_prompt = tokenize_prompt_row(tokenizer, {"prompt": row["teacher_prompt"]})[0]
        completion = out["labels"][r][out["labels"][r] != -100].tolist()
        assert completion and out["input_ids"][r, : len(prompt) + len(completion)].tolist() == prompt + completion
        t_len = len(teacher_prompt) + len(completion)
        assert out["teacher_input_ids"][r, :t_len].tolist() == teacher_prompt + completion
        assert out["teacher_labels"][r].tolist()[:t_len] == [-100] * len(teacher_prompt) + completion
        assert int(out["teacher_attention_mask"][r].sum()) == t_len


def test_on_policy_self_distillation_trains_with_bf16_and_accumulation(tmp_path, tokenizer):  # noqa: F811
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    counter = CountingGenerate(student)
    trainer = KDTrainer(
        model=student, processing_class=tokenizer, train_dataset=ROWS,
        args=_args(tmp_path, kd_self_distill="frozen", kd_lmbda=1.0, kd_max_new_tokens=5, bf16=True,
                   gradient_accumulation_steps=2, max_steps=2),
    )  # fmt: skip
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert counter.calls == [4, 4] and len(losses) == 2
    assert all(torch.isfinite(torch.tensor(losses))) and all(x > 0 for x in losses)  # the hint makes a difference


@pytest.mark.parametrize("loss", ["divergence", "k1"])
def test_on_policy_self_distillation_fused_equals_materialised(tmp_path, tokenizer, loss):  # noqa: F811
    student = tiny_model("llama", seed=1)  # float64
    steps = OnPolicySteps(_args(tmp_path, kd_lmbda=1.0, kd_max_new_tokens=5))
    (generated,) = steps.replace(copy.deepcopy(student).float(), [PromptCollator(tokenizer)(ROWS[:4])],
                                 tokenizer=tokenizer, step=0, device=torch.device("cpu"))  # fmt: skip
    num_items = torch.tensor(int((generated["labels"] != -100).sum()))
    results = []
    for use_kd_patch in (True, False):
        model = copy.deepcopy(student)
        trainer = KDTrainer(
            model=model, processing_class=tokenizer, train_dataset=ROWS,
            args=_args(tmp_path, use_kd_patch=use_kd_patch, kd_self_distill="frozen", kd_lmbda=1.0,
                       kd_onpolicy_loss=loss, kd_patch_config=KERNELS_OFF),
        )  # fmt: skip
        value = trainer.compute_loss(model, dict(generated), num_items_in_batch=num_items)
        value.backward()
        results.append((value.detach(), [p.grad.clone() for p in model.parameters()]))
        M.revert_kd_patch(model=model)
    (loss_f, grads_f), (loss_m, grads_m) = results
    assert loss_f.abs() > 0
    torch.testing.assert_close(loss_f, loss_m, rtol=1e-8, atol=1e-12)
    for a, b in zip(grads_f, grads_m):
        assert rel_err(a, b) < 1e-6


def test_sequence_level_kd_writes_after_the_teacher_prompt_and_trains_after_the_students(tmp_path, tokenizer):  # noqa: F811
    batch = PromptCollator(tokenizer)(ROWS[:4])
    steps = OnPolicySteps(_args(tmp_path, kd_seq_kd=True, kd_max_new_tokens=4))
    writer = tiny_model("llama", dtype=torch.float32, seed=2)
    asked = []
    inner = writer.generate

    def generate(**kwargs):
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        asked.extend(ids[r][mask[r].bool()].tolist() for r in range(ids.shape[0]))
        return inner(**kwargs)

    writer.generate = generate
    (out,) = steps.replace(writer, [batch], tokenizer=tokenizer, step=0, device=torch.device("cpu"))
    teacher_prompts = [tokenize_prompt_row(tokenizer, {"prompt": r["teacher_prompt"]})[0] for r in ROWS[:4]]
    assert sorted(asked) == sorted(teacher_prompts)  # the teacher wrote after its own prompt
    for r, row in enumerate(ROWS[:4]):
        prompt = tokenize_prompt_row(tokenizer, row)[0]
        completion = out["labels"][r][out["labels"][r] != -100].tolist()
        assert out["input_ids"][r, : len(prompt) + len(completion)].tolist() == prompt + completion
        t_len = len(teacher_prompts[r]) + len(completion)
        assert out["teacher_input_ids"][r, :t_len].tolist() == teacher_prompts[r] + completion
