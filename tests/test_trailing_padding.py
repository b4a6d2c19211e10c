"""A right-padded batch reaches an SDPA backbone without its attention mask when no scored position is padding
(models/backbone.py: trailing_padding_only, backbone_masks). Every case: the fused KD loss and its gradient against
the materialised path, which runs the model's own forward with the mask (float64)."""

from __future__ import annotations

import pytest
import torch

import liger_patch_kd as L
from liger_patch_kd import models as M
from liger_patch_kd.models.teachers import TeacherSet
from tests.helpers import rel_err
from tests.tiny_models import tiny_model

LENGTHS = (11, 7, 4, 9)  # one row full, the others padded at the end
WIDTH = 11


def right_padded(vocab: int = 200, seed: int = 0, prompt: int = 3):
    """ids, attention_mask, labels: rows of LENGTHS right-padded with 0; labels on each row's tokens past `prompt`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(LENGTHS), WIDTH, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        ids[row, :n] = torch.randint(3, vocab, (n,), generator=g)
        mask[row, :n] = 1
    labels = torch.where(mask.bool(), ids, -100)
    labels[:, :prompt] = -100
    return ids, mask, labels


def sdpa(model):
    model.set_attn_implementation("sdpa")
    return model


class MaskSpy:
    """Records the attention_mask each backbone call receives."""

    def __init__(self, *models):
        self.seen: dict[str, list] = {}
        for name, model in zip(("student", "teacher", "teacher2"), models):
            self._wrap(name, model.model)

    def _wrap(self, name, backbone):
        original = backbone.forward

        def forward(*args, **kwargs):
            self.seen.setdefault(name, []).append(kwargs.get("attention_mask"))
            return original(*args, **kwargs)

        backbone.forward = forward


def fused_and_reference(student, batch, **call):
    """(loss, lm_head grad, embedding grad) of the fused forward and of the materialised one (mask kept)."""
    out = []
    for extra in ({}, {"return_logits": True}):
        student.zero_grad()
        loss = student(**batch, **call, **extra).loss
        loss.backward()
        out.append((loss.detach(), student.lm_head.weight.grad.clone(), student.model.embed_tokens.weight.grad.clone()))
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "cohere2", "mixtral"])
def test_trailing_padding_drops_the_mask_and_keeps_the_loss(arch):
    """Soft-capping (gemma3_text), sliding windows (cohere2), a router loss that reads the mask (mixtral)."""
    student, teacher = sdpa(tiny_model(arch, seed=1)), sdpa(tiny_model(arch, seed=2, hidden=48))
    M.apply_kd_patch(model=student, beta=0.5)
    ids, mask, labels = right_padded()
    spy = MaskSpy(student, teacher)
    (fused, g_head, g_emb), (ref, r_head, r_emb) = fused_and_reference(
        student, {"input_ids": ids, "attention_mask": mask, "labels": labels}, teacher_model=teacher
    )
    assert spy.seen["student"][0] is None and spy.seen["teacher"][0] is None  # the fused call's
    assert spy.seen["student"][1] is not None  # the materialised reference ran with the mask
    # float64 throughout: the fused loss's own rounding (chunked log-sum-exp) is ~1e-15 relative
    torch.testing.assert_close(fused, ref, rtol=1e-9, atol=1e-12)
    assert rel_err(g_head, r_head) < 1e-9 and rel_err(g_emb, r_emb) < 1e-9


def test_scored_hidden_states_equal_the_masked_models():
    """What the drop relies on, checked directly: on attended positions the SDPA backbone's output without the
    mask (causal alone) is its output with it. (Not against eager attention: its softmax is float32 even here.)"""
    model = sdpa(tiny_model("llama", seed=3))
    ids, mask, _ = right_padded()
    with torch.no_grad():
        masked = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        unmasked = model.model(input_ids=ids, attention_mask=None).last_hidden_state
    attended = mask.bool()
    torch.testing.assert_close(unmasked[attended], masked[attended], rtol=1e-10, atol=1e-12)
    assert not torch.allclose(unmasked[~attended], masked[~attended])  # the padding itself differs, unscored


def _left_padded(ids, mask, labels):
    flip = lambda t: torch.stack([torch.roll(r, int((m == 0).sum())) for r, m in zip(t, mask)])  # noqa: E731
    return flip(ids), flip(mask), flip(labels)


@pytest.mark.parametrize("case", ["left padding", "scored padding", "position_ids", "eager", "holes"])
def test_mask_kept_where_dropping_it_could_change_a_scored_position(case):
    student, teacher = sdpa(tiny_model("llama", seed=1)), sdpa(tiny_model("llama", seed=2, hidden=48))
    ids, mask, labels = right_padded()
    extra = {}
    if case == "left padding":
        ids, mask, labels = _left_padded(ids, mask, labels)
    elif case == "scored padding":  # a label on a padded position: its hidden state reads the mask
        labels[2, LENGTHS[2] + 1] = 5
    elif case == "position_ids":
        extra["position_ids"] = torch.arange(WIDTH).expand(len(LENGTHS), -1)
    elif case == "eager":
        student.set_attn_implementation("eager")
        teacher.set_attn_implementation("eager")
    elif case == "holes":  # a masked token between attended ones
        mask[0, 5] = 0
        labels[0, 5] = -100
    M.apply_kd_patch(model=student, beta=0.5)
    spy = MaskSpy(student, teacher)
    (fused, g_head, _), (ref, r_head, _) = fused_and_reference(
        student, {"input_ids": ids, "attention_mask": mask, "labels": labels, **extra}, teacher_model=teacher
    )
    assert spy.seen["student"][0] is not None and spy.seen["teacher"][0] is not None
    torch.testing.assert_close(fused, ref, rtol=1e-9, atol=1e-12)
    assert rel_err(g_head, r_head) < 1e-9


def test_each_teacher_of_a_set_gets_the_mask_its_attention_needs():
    """Several teachers: an SDPA teacher's backbone runs without the mask, an eager one's keeps it; the loss is
    the materialised one."""
    student = sdpa(tiny_model("llama", seed=1))
    first, second = sdpa(tiny_model("llama", seed=2, hidden=48)), tiny_model("llama", seed=4, hidden=32)
    M.apply_kd_patch(model=student, beta=0.5)
    ids, mask, labels = right_padded()
    spy = MaskSpy(student, first, second)
    teachers = TeacherSet({"a": first, "b": second}, torch.tensor([0.25, 0.75], dtype=torch.float64))
    (fused, g_head, _), (ref, r_head, _) = fused_and_reference(
        student, {"input_ids": ids, "attention_mask": mask, "labels": labels}, kd_teacher_set=teachers
    )
    assert spy.seen["student"][0] is None and spy.seen["teacher"][0] is None
    assert spy.seen["teacher2"][0] is not None
    torch.testing.assert_close(fused, ref, rtol=1e-9, atol=1e-12)
    assert rel_err(g_head, r_head) < 1e-9


def test_trainer_on_right_padded_rows_matches_the_materialised_trainer(tmp_path):
    """Through KDTrainer (its collator right-pads rows of different lengths): one step's loss is the unfused run's."""
    rows = []
    ids, mask, labels = right_padded(seed=5)
    for r, m, lab in zip(ids, mask, labels):
        n = int(m.sum())
        rows.append({"input_ids": r[:n].tolist(), "labels": lab[:n].tolist()})
    losses = []
    for fused in (True, False):
        student, teacher = sdpa(tiny_model("llama", seed=1)), sdpa(tiny_model("llama", seed=2, hidden=48))
        args = L.KDTrainingArguments(
            output_dir=str(tmp_path / str(fused)), use_kd_patch=True, kd_patch_config={"fused_linear_jsd": fused},
            kd_beta=0.5, per_device_train_batch_size=4, max_steps=1, report_to=[], save_strategy="no", use_cpu=True,
            learning_rate=0.0, logging_steps=1,
        )  # fmt: skip
        trainer = L.KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows)
        trainer.train()
        losses.append(trainer.state.log_history[0]["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_on_gpu_the_causal_kernel_gives_the_masked_loss():
    """bf16 on a GPU, where the mask picks another kernel (flash without it, a masked one with it): the fused
    loss (mask dropped) against the materialised one (mask kept), within bf16 attention's rounding."""
    student = sdpa(tiny_model("llama", dtype=torch.bfloat16, seed=1)).cuda()
    teacher = sdpa(tiny_model("llama", dtype=torch.bfloat16, seed=2, hidden=48)).cuda()
    M.apply_kd_patch(model=student, beta=0.5)
    ids, mask, labels = (t.cuda() for t in right_padded())
    spy = MaskSpy(student, teacher)
    (fused, g_head, _), (ref, r_head, _) = fused_and_reference(
        student, {"input_ids": ids, "attention_mask": mask, "labels": labels}, teacher_model=teacher
    )
    assert spy.seen["student"][0] is None
    # bf16 hidden states (8 bits of mantissa) through two layers: a few 1e-3 relative on the loss and gradient
    torch.testing.assert_close(fused.float(), ref.float(), rtol=2e-2, atol=1e-3)
    assert rel_err(g_head, r_head) < 5e-2


@pytest.mark.parametrize("several", [False, True])
def test_a_live_teacher_without_input_ids_is_one_line(several):
    """inputs_embeds alone: a live teacher has no tokens to read (it was transformers' own error from inside the
    teacher's forward); a teacher given as signal takes them."""
    student, teacher = sdpa(tiny_model("llama", seed=1)), sdpa(tiny_model("llama", seed=2, hidden=48))
    M.apply_kd_patch(model=student, beta=0.5)
    ids, mask, labels = right_padded()
    embeds = student.get_input_embeddings()(ids).detach()
    call = {"kd_teacher_set": TeacherSet({"a": teacher}, torch.ones(1, dtype=torch.float64))} if several else {
        "teacher_model": teacher}
    with pytest.raises(ValueError, match="a live teacher .* reads the student's input_ids.*inputs_embeds only"):
        student(inputs_embeds=embeds, attention_mask=mask, labels=labels, **call)
    with torch.no_grad():
        logprobs, token_ids = teacher(input_ids=ids, attention_mask=mask).logits.log_softmax(-1).topk(8, -1)
    out = student(inputs_embeds=embeds, attention_mask=mask, labels=labels, teacher_token_ids=token_ids,
                  teacher_logprobs=logprobs)  # fmt: skip
    ref = student(input_ids=ids, attention_mask=mask, labels=labels, teacher_token_ids=token_ids,
                  teacher_logprobs=logprobs, return_logits=True)  # fmt: skip
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("student_sdpa, teacher_sdpa", [(False, False), (False, True), (True, False)])
def test_the_batch_is_read_only_when_some_model_would_drop_its_mask(monkeypatch, student_sdpa, teacher_sdpa):
    """The trailing-padding check costs a host sync: made only when the student or the teacher attends through
    SDPA, and then each gets the mask its own attention needs."""
    import liger_patch_kd.models.backbone as B

    checks = []
    real = B.trailing_padding_only
    monkeypatch.setattr(B, "trailing_padding_only", lambda *a: checks.append(1) or real(*a))
    student, teacher = tiny_model("llama", seed=1), tiny_model("llama", seed=2, hidden=48)
    if student_sdpa:
        sdpa(student)
    if teacher_sdpa:
        sdpa(teacher)
    M.apply_kd_patch(model=student, beta=0.5)
    ids, mask, labels = right_padded()
    spy = MaskSpy(student, teacher)
    (fused, g_head, _), (ref, r_head, _) = fused_and_reference(
        student, {"input_ids": ids, "attention_mask": mask, "labels": labels}, teacher_model=teacher
    )
    assert len(checks) == (1 if student_sdpa or teacher_sdpa else 0)
    assert (spy.seen["student"][0] is None) == student_sdpa and (spy.seen["teacher"][0] is None) == teacher_sdpa
    torch.testing.assert_close(fused, ref, rtol=1e-9, atol=1e-12)
    assert rel_err(g_head, r_head) < 1e-9


@pytest.mark.parametrize("name", ["position_ids", "past_key_values", "cache", "cache_position"])
def test_anything_else_that_shapes_attention_keeps_the_mask(name):
    """A KV cache under either of transformers' names for it (`past_key_values`, and `cache` from 5.2x on), position
    ids or cache positions: the mask stays, whatever the padding looks like."""
    from liger_patch_kd.models.backbone import trailing_padding_only

    ids, mask, labels = right_padded()
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    assert trailing_padding_only(mask, targets, -100, {}) is True  # the padding alone would let it go
    assert trailing_padding_only(mask, targets, -100, {name: object()}) is False
