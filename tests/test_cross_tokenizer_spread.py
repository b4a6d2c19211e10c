"""Cross-tokenizer distillation and how the models are spread over processes, in one process: the loss taken
inside the models' own forwards (through a wrapper of the forward, as accelerate's autocast is), and the
refusals of what does not run (FSDP1, ZeRO-3, a model without a registry entry under DDP / FSDP2). The runs
over 2 processes (FSDP2 and DDP against one process) are in test_distributed.py."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from liger_patch_kd.align import reference as xref
from liger_patch_kd.models import revert_kd_patch
from liger_patch_kd.trainer.teachers.other_tokenizer import CrossTokenizerSetup
from liger_patch_kd.trainer.teachers.other_tokenizer_loss import check_spread, compute_cross_tokenizer_loss

from . import xtok_worker

CFG = xtok_worker.CONFIG
_shift = lambda t: torch.cat([t[:, 1:], torch.full_like(t[:, :1], -100)], 1)  # noqa: E731


@pytest.fixture(scope="module")
def data():
    return xtok_worker.build_inputs(world=1)


def _models(data):
    student = xtok_worker.model_of(xtok_worker.STUDENT, data["sizes"]["student"], torch.float64).train()
    teacher = xtok_worker.model_of(xtok_worker.TEACHER, data["sizes"]["teacher"], torch.float64)
    return student, teacher.requires_grad_(False)


def _reference(student, teacher, batch, vocab_map):
    """The reference loss on the models' own logits (their forwards apply their logit scales and caps)."""
    s_logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    with torch.no_grad():
        t_logits = teacher(input_ids=batch["teacher_input_ids"], attention_mask=batch["teacher_attention_mask"])
    return xref.cross_tokenizer_kd_loss(
        s_logits, t_logits.logits, _shift(batch["labels"]), _shift(batch["teacher_labels"]),
        batch["student_align_groups"], batch["teacher_align_groups"], vocab_map, batch["align_exact_ok"],
        CFG.replace(softcap=None, teacher_softcap=None),
    )  # fmt: skip


def _gpt2(vocab: int):
    """A model type the registry has no entry for."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=vocab, n_positions=128, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config).double().eval().requires_grad_(False)


def test_loss_through_a_wrapped_forward_is_the_references(data):
    """The student is given the KD forward when the run is set up; a wrapper installed afterwards around its
    forward (accelerate's autocast is one) is called, and the loss and gradients stay the reference's (float64)."""
    student, teacher = _models(data)
    batch, vocab_map = data["batches"]["online"][0], data["vocab_map"]
    bpe, char, _ = xtok_worker.tokenizers()
    CrossTokenizerSetup.build(_xtok_args(), bpe, student, teacher, teacher_tokenizer=char)
    calls = []
    inner_forward = student.forward

    @functools.wraps(inner_forward)
    def wrapped(*args, **kwargs):  # what accelerate puts on the instance: a function around the forward
        calls.append(sorted(kwargs))
        return inner_forward(*args, **kwargs)

    student.forward = wrapped
    try:
        out = compute_cross_tokenizer_loss(student, teacher, batch, CFG, vocab_map)
        grads = torch.autograd.grad(out.loss, list(student.parameters()))
        assert calls and "kd_head_request" in calls[0]
        del student.forward  # the KD forward installed at set-up again
        ref = _reference(student, teacher, batch, vocab_map)
        ref_grads = torch.autograd.grad(ref, list(student.parameters()))
        torch.testing.assert_close(out.loss, ref, rtol=1e-9, atol=1e-11)
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)
    finally:
        revert_kd_patch(model=student)


def test_a_wrapped_forward_without_the_kd_forward_is_refused(data):
    student, teacher = _models(data)
    student.forward = functools.partial(type(student).forward, student)  # wrapped before the KD forward was given
    with pytest.raises(ValueError, match=r"wrapped forward but not the KD forward.*apply_kd_patch"):
        compute_cross_tokenizer_loss(student, teacher, data["batches"]["online"][0], CFG, data["vocab_map"])


def test_zero3_and_fsdp1_are_refused(data):
    student, teacher = _models(data)
    next(student.parameters()).ds_id = 0  # what a ZeRO-3 partitioned parameter carries
    with pytest.raises(ValueError, match=r"cross-tokenizer distillation under ZeRO-3 is not supported.*FSDP2"):
        compute_cross_tokenizer_loss(student, teacher, data["batches"]["online"][0], CFG, data["vocab_map"])
    with pytest.raises(ValueError, match=r"under FSDP1 is not supported \(the teacher"):
        check_spread(teacher, "teacher", "FSDP1")


def test_unregistered_model_runs_in_one_process_and_is_refused_when_spread(data):
    """A teacher of a type the registry does not know (GPT-2) still runs in one process (its decoder called
    directly), and is refused under DDP or FSDP2, where that would skip the wrappers' hooks."""
    student, _ = _models(data)
    teacher = _gpt2(data["sizes"]["teacher"])
    out = compute_cross_tokenizer_loss(student, teacher, data["batches"]["online"][0], CFG, data["vocab_map"])
    assert torch.isfinite(out.loss) and out.soft > 0
    for spread in ("DDP", "FSDP2"):
        with pytest.raises(ValueError, match=rf"the teacher GPT2LMHeadModel has no registry entry.*under {spread}"):
            check_spread(teacher, "teacher", spread)


@pytest.mark.parametrize(
    "kind, settings, refused",
    [
        ("FSDP", dict(fsdp_version=1), "FSDP1"),
        ("FSDP", dict(fsdp_version=2), None),
        ("DEEPSPEED", dict(zero_stage=3), "ZeRO-3"),
        ("DEEPSPEED", dict(zero_stage=2), None),
        ("MULTI_CPU", {}, None),
        ("MULTI_CPU", {}, "no registry entry"),  # the same with a GPT-2 teacher
    ],
)
def test_kdtrainer_refuses_at_start_from_accelerates_settings(data, kind, settings, refused):
    """KDTrainer checks before anything is sharded, from accelerate's settings (the student is wrapped only when
    training starts)."""
    student, teacher = _models(data)
    if refused == "no registry entry":
        teacher = _gpt2(data["sizes"]["teacher"])
    plugin = SimpleNamespace(**settings)
    accelerator = SimpleNamespace(distributed_type=kind, num_processes=2,
                                  state=SimpleNamespace(fsdp_plugin=plugin, deepspeed_plugin=plugin))  # fmt: skip
    if refused is None:
        CrossTokenizerSetup.check_spread(accelerator, (student, teacher))
        return
    with pytest.raises(ValueError, match=refused):
        CrossTokenizerSetup.check_spread(accelerator, (student, teacher))


def _xtok_args():
    from liger_patch_kd.trainer import KDTrainingArguments

    return KDTrainingArguments(output_dir="unused", report_to="none", kd_teacher_tokenizer="unused: passed")


def test_peft_student_through_its_wrapper_is_the_references(data):
    """A LoRA student (adapters on attention and on lm_head) is called through PeftModel's forward: the loss and
    the adapters' gradients are the reference's on the PEFT model's own logits (float64)."""
    peft = pytest.importorskip("peft")
    student, teacher = _models(data)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"])
    model = peft.get_peft_model(student, config)
    for name, p in model.named_parameters():  # LoRA's B starts at zero: move it, so lm_head's update counts
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    batch, vocab_map = data["batches"]["online"][0], data["vocab_map"]
    trained = [p for p in model.parameters() if p.requires_grad]
    try:
        out = compute_cross_tokenizer_loss(model, teacher, batch, CFG, vocab_map)
        grads = torch.autograd.grad(out.loss, trained)
        ref = _reference(model, teacher, batch, vocab_map)
        ref_grads = torch.autograd.grad(ref, trained)
        torch.testing.assert_close(out.loss, ref, rtol=1e-9, atol=1e-11)
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)
    finally:
        revert_kd_patch(model=student)
