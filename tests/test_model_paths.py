"""The patched forward and KDTrainer the way users run them: mixed precision, packing, all-ignored batches,
padded vocabularies, LoRA on lm_head, default collation, revert. Each path against the materialised reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import liger_patch_kd as L
import liger_patch_kd.models as M
from liger_patch_kd import reference
from liger_patch_kd.models.kd_io import shift_labels

from .helpers import rel_err
from .tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")


def _batch(rows=3, length=12, seed=0, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, length), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100
    return ids, labels


def _trainer_args(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=4, learning_rate=5e-3,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        data_seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    return L.KDTrainingArguments(**{**base, **overrides})


def _rows(n=8, seed=0, vocab=VOCAB, all_ignored=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, vocab, (int(torch.randint(5, 12, (1,), generator=g)),), generator=g)
        labels = torch.full_like(ids, -100) if all_ignored else ids.clone()
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


# --------------------------------------------------------------------------------------- packed sequences
def _packed_and_padded(seed=0):
    """Two sequences, once padded into a batch and once packed into one row as DataCollatorWithFlattening does."""
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, VOCAB, (n,), generator=g) for n in (7, 11)]
    features = [{"input_ids": s.tolist()} for s in seqs]
    packed = DataCollatorWithFlattening(return_position_ids=True)(features)
    width = max(len(s) for s in seqs)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        ids[row, : len(s)], mask[row, : len(s)] = s, 1
    labels = torch.where(mask.bool(), ids, -100)
    padded = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return {k: torch.as_tensor(v) for k, v in packed.items()}, padded


@pytest.mark.parametrize("how", ["fused", "unfused_patch", "return_logits", "trainer_unpatched"])
def test_packed_sequences_equal_padded(tmp_path, how):
    student = tiny_model("llama", seed=1)
    teacher = tiny_model("llama", seed=2, hidden=48)
    packed, padded = _packed_and_padded()

    def run(batch):
        student.zero_grad()
        if how == "trainer_unpatched":
            trainer = L.KDTrainer(model=student, teacher_model=teacher, args=_trainer_args(tmp_path))
            loss = trainer.compute_loss(student, dict(batch))
        else:
            extra = {"return_logits": True} if how == "return_logits" else {}
            loss = student(**batch, teacher_model=teacher, **extra).loss
        loss.backward()
        return loss.detach(), student.lm_head.weight.grad.clone()

    if how != "trainer_unpatched":
        M.apply_kd_patch(model=student, fused_linear_jsd=how != "unfused_patch", beta=0.5)
    loss_packed, grad_packed = run(packed)
    loss_padded, grad_padded = run(padded)
    # float64 models; the defect this guards against was a 1 % difference (the teacher attending across the
    # packed boundary), float32 rounding inside the attention mask is 1e-8
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-6, atol=0)
    assert rel_err(grad_packed, grad_padded) < 1e-6


# ------------------------------------------------------------------------------------- all rows ignored
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("offline", [False, True])
def test_all_ignored_with_zero_items_is_zero_not_nan(fused, offline):
    student = tiny_model("llama", seed=1)
    teacher = tiny_model("llama", seed=2)
    ids, labels = _batch()
    labels[:] = -100
    M.apply_kd_patch(model=student, fused_linear_jsd=fused)
    if offline:
        with torch.no_grad():
            lp = torch.log_softmax(teacher(ids).logits, -1)
        values, top = lp.topk(8, -1)
        kw = {"teacher_token_ids": top, "teacher_logprobs": values}
    else:
        kw = {"teacher_model": teacher}
    out = student(ids, labels=labels, num_items_in_batch=torch.tensor(0), **kw)
    out.loss.backward()
    assert out.loss.item() == 0.0
    for name, p in student.named_parameters():
        assert p.grad is None or torch.equal(p.grad, torch.zeros_like(p.grad)), name


@pytest.mark.parametrize("use_kd_patch", [True, False])
def test_trainer_step_with_only_ignored_labels_keeps_parameters_finite(tmp_path, use_kd_patch):
    """The Trainer passes num_items_in_batch=0 for such a step; no parameter may become NaN."""
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    trainer = L.KDTrainer(
        model=student, teacher_model=tiny_model("llama", dtype=torch.float32, seed=2),
        args=_trainer_args(tmp_path, use_kd_patch=use_kd_patch, max_steps=2, gradient_accumulation_steps=2,
                           logging_nan_inf_filter=False),
        train_dataset=_rows(all_ignored=True),
    )  # fmt: skip
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(v == 0.0 for v in losses), losses
    for name, p in student.named_parameters():
        assert torch.isfinite(p).all(), name
        torch.testing.assert_close(p.detach(), before[name], msg=name)  # zero gradients: AdamW leaves them


# --------------------------------------------------------------------------------------- mixed precision
@pytest.mark.parametrize("use_kd_patch", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_trainer_trains_in_bf16_mixed_precision(tmp_path, use_kd_patch, fused):
    if not use_kd_patch and not fused:
        pytest.skip("kd_patch_config applies to the patched student only")
    trainer = L.KDTrainer(
        model=tiny_model("llama", dtype=torch.float32, seed=1),
        teacher_model=tiny_model("llama", dtype=torch.float32, seed=2),
        args=_trainer_args(
            tmp_path, bf16=True, use_kd_patch=use_kd_patch, gradient_accumulation_steps=2,
            kd_patch_config=None if fused else {"fused_linear_jsd": False},
        ),
        train_dataset=_rows(16),
    )  # fmt: skip
    trainer.train()
    logged = [h for h in trainer.state.log_history if "kd_soft_loss" in h]
    assert logged and all(h["kd_soft_loss"] > 0 and h["loss"] > 0 for h in logged), logged
    # accelerate left its autocast wrapper around the KD forward; after revert the model is plain again
    M.revert_kd_patch(model=trainer.model)
    ids, _ = _batch()
    assert trainer.model(ids).logits.shape == (*ids.shape, VOCAB)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 mixed precision needs a GPU")
def test_trainer_trains_in_fp16_mixed_precision(tmp_path):
    trainer = L.KDTrainer(
        model=tiny_model("llama", dtype=torch.float32, seed=1),
        teacher_model=tiny_model("llama", dtype=torch.float32, seed=2),
        args=_trainer_args(tmp_path, fp16=True, use_kd_patch=True, use_cpu=False),
        train_dataset=_rows(16),
    )
    trainer.train()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_output_carries_kd_terms_as_fields():
    student = M.apply_kd_patch(model=tiny_model("llama", seed=1))
    ids, labels = _batch()
    out = student(ids, labels=labels, teacher_model=tiny_model("llama", seed=2))
    assert isinstance(out, L.KDCausalLMOutput)
    assert {"loss", "kd_soft_loss", "kd_hard_loss"} <= set(out.keys())
    rebuilt = type(out)(**dict(out.items()))  # what mixed-precision wrappers do
    assert torch.equal(rebuilt.kd_soft_loss, out.kd_soft_loss)


# ------------------------------------------------------------------------------------------ bad batches
def test_batch_without_labels_is_a_clear_error(tmp_path):
    trainer = L.KDTrainer(
        model=tiny_model("llama", dtype=torch.float32),
        teacher_model=tiny_model("llama", dtype=torch.float32),
        args=_trainer_args(tmp_path, use_kd_patch=True),
    )
    ids, _ = _batch()
    with pytest.raises(ValueError, match="no 'labels'.*collator"):
        trainer.compute_loss(trainer.model, {"input_ids": ids})


def test_default_collator_pads_variable_length_rows(tmp_path):
    """The README's snippet passes no data_collator: rows of different lengths must still batch."""
    trainer = L.KDTrainer(
        model=tiny_model("llama", dtype=torch.float32, seed=1),
        teacher_model=tiny_model("llama", dtype=torch.float32, seed=2),
        args=_trainer_args(tmp_path, use_kd_patch=True, max_steps=2),
        train_dataset=_rows(8),
    )
    trainer.train()
    assert trainer.state.global_step == 2


def test_kd_patch_config_typo_lists_the_toggles(tmp_path):
    with pytest.raises(ValueError, match="rope.*swiglu.*rms_norm.*fused_linear_jsd"):
        _trainer_args(tmp_path, kd_patch_config={"rms_nrom": False})


# ----------------------------------------------------------------------------------------------- revert
def test_revert_without_arguments_undoes_instance_and_teacher_patches(tmp_path):
    student, teacher = tiny_model("llama", dtype=torch.float32, seed=1), tiny_model("llama", dtype=torch.float32)
    original_norm_forward = type(student.model.norm).forward
    L.KDTrainer(model=student, teacher_model=teacher, args=_trainer_args(tmp_path, use_kd_patch=True))
    ids, labels = _batch()
    student(ids, labels=labels, teacher_model=teacher)  # installs the KD forward on the teacher
    assert "forward" in student.__dict__ and "forward" in teacher.__dict__
    M.revert_kd_patch()
    for model in (student, teacher):
        assert "forward" not in model.__dict__
        assert all("forward" not in sub.__dict__ for sub in model.modules())
    assert type(student.model.norm).forward is original_norm_forward


# ------------------------------------------------------------------------------------------ LoRA lm_head
def _lora_student(dropout=0.0):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=2, target_modules=["lm_head", "q_proj"], lora_dropout=dropout, init_lora_weights=False, lora_alpha=4
    )
    return peft.get_peft_model(tiny_model("llama", seed=1), config)


def test_lora_on_lm_head_trains_with_the_adapters_weight():
    """The fused loss reads W + scaling * B @ A: loss and adapter gradients equal the materialised path."""
    student = _lora_student()
    teacher = tiny_model("llama", seed=2)
    M.apply_kd_patch(model=student)
    ids, labels = _batch()
    lora = [p for n, p in student.named_parameters() if "lm_head" in n and p.requires_grad]
    assert len(lora) == 2

    def run(**extra):
        out = student(input_ids=ids, labels=labels, teacher_model=teacher, **extra)
        return out.loss, torch.autograd.grad(out.loss, lora)

    fused, fused_grads = run()
    materialised, grads = run(return_logits=True)
    torch.testing.assert_close(fused, materialised, rtol=1e-9, atol=1e-12)
    for a, b in zip(fused_grads, grads):
        assert rel_err(a, b) < 1e-9


def test_lora_dropout_on_lm_head_is_a_clear_error():
    student = _lora_student(dropout=0.1).train()
    M.apply_kd_patch(model=student)
    ids, labels = _batch()
    with pytest.raises(ValueError, match="lora_dropout=0.1.*lm_head"):
        student(input_ids=ids, labels=labels, teacher_model=tiny_model("llama", seed=2))


# ------------------------------------------------------------------------------- padded vocabularies
REAL_VOCAB = 241  # len(tokenizer); odd like Qwen2.5's 151665. Heads: student VOCAB=257 rows, teacher 263


def _padded_pair(arch):
    student = tiny_model(arch, seed=1)
    teacher = tiny_model(arch, seed=2, vocab=VOCAB + 6, layers=3)
    with torch.no_grad():  # padding rows that would win every softmax if they were counted
        teacher.lm_head.weight[REAL_VOCAB:] = teacher.lm_head.weight[:1] * 50
        student.lm_head.weight[REAL_VOCAB:] = student.lm_head.weight[:1] * 50
    return student, teacher


def _sliced_reference(student, teacher, ids, labels, cfg):
    targets = shift_labels(labels, -100)
    with torch.no_grad():
        t = teacher(ids).logits[..., :REAL_VOCAB]
    s = student(ids).logits[..., :REAL_VOCAB]
    return reference.kd_loss(s, t, targets, cfg.replace(softcap=None, teacher_softcap=None, vocab_size=None))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("fused", [True, False])
def test_padded_vocabulary_pair_matches_sliced_reference(arch, fused):
    student, teacher = _padded_pair(arch)
    ids, labels = _batch(vocab=REAL_VOCAB)
    cfg = L.KDLossConfig(beta=0.3, temperature=1.5, hard_weight=0.25)
    expected = _sliced_reference(student, teacher, ids, labels, cfg)
    (ref_grad,) = torch.autograd.grad(expected, [student.lm_head.weight])
    M.apply_kd_patch(model=student, fused_linear_jsd=fused, kd_config=cfg, vocab_size=REAL_VOCAB)
    loss = student(ids, labels=labels, teacher_model=teacher).loss
    (grad,) = torch.autograd.grad(loss, [student.lm_head.weight])
    torch.testing.assert_close(loss, expected, rtol=1e-9, atol=1e-12)
    assert rel_err(grad, ref_grad) < 1e-9
    assert torch.equal(grad[REAL_VOCAB:], torch.zeros_like(grad[REAL_VOCAB:]))


def test_padded_heads_without_vocab_size_name_the_fix():
    student, teacher = _padded_pair("llama")
    M.apply_kd_patch(model=student)
    ids, labels = _batch()
    with pytest.raises(ValueError, match="vocab_size"):
        student(ids, labels=labels, teacher_model=teacher)


class _Tokenizer:
    pad_token_id = 0

    def __len__(self):
        return REAL_VOCAB


@pytest.mark.parametrize("use_kd_patch", [True, False])
def test_trainer_takes_the_tokenizer_length_for_padded_heads(tmp_path, use_kd_patch):
    student, teacher = _padded_pair("qwen2")
    student, teacher = student.float(), teacher.float()
    trainer = L.KDTrainer(
        model=student, teacher_model=teacher, args=_trainer_args(tmp_path, use_kd_patch=use_kd_patch),
        train_dataset=_rows(8, vocab=REAL_VOCAB), processing_class=_Tokenizer(),
    )  # fmt: skip
    assert trainer.kd_config.vocab_size == REAL_VOCAB
    trainer.train()
    grad_rows = student.lm_head.weight.grad
    assert grad_rows is None or not grad_rows[REAL_VOCAB:].any()


def test_trainer_refuses_padded_heads_without_a_tokenizer(tmp_path):
    student, teacher = _padded_pair("llama")
    with pytest.raises(ValueError, match="kd_vocab_size.*len\\(tokenizer\\)"):
        L.KDTrainer(model=student, teacher_model=teacher, args=_trainer_args(tmp_path, use_kd_patch=True))


# ------------------------------------------------------------------------------------------- root imports
def test_root_exports_what_users_import():
    for name in ("apply_kd_patch_to_llama", "apply_kd_patch", "revert_kd_patch", "KDTrainer", "KDTrainingArguments",
                 "TeacherLogprobsDataset", "TeacherDataCollator"):  # fmt: skip
        assert callable(getattr(L, name)), name
    with pytest.raises(AttributeError):
        L.no_such_thing  # noqa: B018


def test_materialised_reference_is_not_fooled_by_padding_logits():
    """A cross-check of the test's own reference: slicing changes the value when padding rows carry mass."""
    student, teacher = _padded_pair("llama")
    ids, labels = _batch(vocab=REAL_VOCAB)
    targets = shift_labels(labels, -100)
    with torch.no_grad():
        s, t = student(ids).logits, teacher(ids).logits
    full = reference.kd_loss(F.pad(s, (0, 6), value=0.0), t, targets)
    sliced = reference.kd_loss(s[..., :REAL_VOCAB], t[..., :REAL_VOCAB], targets)
    assert not torch.isclose(full, sliced)
