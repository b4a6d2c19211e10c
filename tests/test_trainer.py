"""KDTrainer end to end on tiny random models, CPU."""

import copy

import pytest
import torch

import liger_patch_kd.models as M
from liger_patch_kd import teacher as TD
from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments

from .tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")


def _dataset(n=16, seed=0, prompt=3):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(6, 14, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g)
        labels = ids.clone()
        labels[:prompt] = -100  # the prompt is not scored
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _args(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=8, learning_rate=5e-3,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        data_seed=0, dataloader_num_workers=0, kd_beta=0.5,
    )  # fmt: skip
    return KDTrainingArguments(**{**base, **overrides})


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _train(tmp_path, student, teacher=None, data=None, **overrides):
    trainer = KDTrainer(
        model=student, teacher_model=teacher, args=_args(tmp_path, **overrides), train_dataset=data or _dataset(),
        data_collator=TD.TeacherDataCollator(),
    )  # fmt: skip
    trainer.train()
    return trainer


def _decreases(losses):
    assert all(torch.isfinite(torch.tensor(losses))), losses
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < first, losses


@pytest.mark.parametrize("use_kd_patch", [True, False])
def test_online_distillation_trains(tmp_path, use_kd_patch):
    trainer = _train(
        tmp_path,
        tiny_model("llama", dtype=torch.float32, seed=1),
        tiny_model("llama", dtype=torch.float32, seed=2, hidden=96),
        use_kd_patch=use_kd_patch,
        kd_hard_weight=0.1,
    )
    _decreases(_losses(trainer))
    logged = [h for h in trainer.state.log_history if "kd_soft_loss" in h]
    assert logged and {"kd_hard_loss", "kd_top1_agreement"} <= set(logged[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning is only dropped where there is no accelerator")
def test_a_cpu_run_does_not_ask_for_pinned_memory(tmp_path, recwarn):
    """dataloader_pin_memory (True by default) needs an accelerator: on a CPU torch warns at every DataLoader."""
    trainer = _train(tmp_path, tiny_model("llama", dtype=torch.float32, seed=1),
                     tiny_model("llama", dtype=torch.float32, seed=2), max_steps=1,
                     use_cpu=False)  # as the README's example: no use_cpu  # fmt: skip
    assert trainer.args.dataloader_pin_memory is False
    assert not [w for w in recwarn if "pin_memory" in str(w.message)]


def test_offline_distillation_trains_without_a_teacher(tmp_path):
    teacher = tiny_model("qwen3", dtype=torch.float32, seed=2)
    rows = _dataset()
    TD.precompute(teacher, [r["input_ids"].tolist() for r in rows], tmp_path / "store", top_k=16, progress=False)
    data = TD.TeacherLogprobsDataset(tmp_path / "store", vocab_size=VOCAB)
    trainer = _train(tmp_path, tiny_model("qwen3", dtype=torch.float32, seed=1), data=data, use_kd_patch=True)
    _decreases(_losses(trainer))


@pytest.mark.parametrize("mode", [dict(kd_lmbda=1.0), dict(kd_seq_kd=True)])
def test_on_policy_and_sequence_kd_train(tmp_path, mode):
    trainer = _train(
        tmp_path,
        tiny_model("llama", dtype=torch.float32, seed=1),
        tiny_model("llama", dtype=torch.float32, seed=2),
        use_kd_patch=True,
        kd_max_new_tokens=6,
        learning_rate=1e-2,
        **mode,
    )
    losses = _losses(trainer)
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))


def test_patched_and_unpatched_agree_on_loss_and_grads(tmp_path):
    student = tiny_model("gemma2", seed=1)
    teacher = tiny_model("gemma2", seed=2)
    batch = TD.TeacherDataCollator()(_dataset(4))
    results = []
    for use_kd_patch in (True, False):
        model = copy.deepcopy(student)
        trainer = KDTrainer(
            model=model,
            teacher_model=teacher,
            args=_args(tmp_path, use_kd_patch=use_kd_patch, kd_hard_weight=0.3, kd_temperature=2.0),
        )
        loss = trainer.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(29))
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        M.revert_kd_patch(model=model)
    (l1, g1), (l2, g2) = results
    torch.testing.assert_close(l1, l2, rtol=1e-9, atol=1e-12)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


def test_gradient_accumulation_is_exact(tmp_path):
    """One optimizer step over 4 sequences: batch 4 x 1 micro-batch == batch 1 x 4 accumulated."""
    params, before = [], [p.detach().clone() for p in tiny_model("llama", seed=1).parameters()]
    for bs, ga in ((4, 1), (1, 4)):
        student = tiny_model("llama", seed=1)
        teacher = tiny_model("llama", seed=2)
        _train(
            tmp_path,
            student,
            teacher,
            data=_dataset(4),
            use_kd_patch=True,
            per_device_train_batch_size=bs,
            gradient_accumulation_steps=ga,
            max_steps=1,
            optim="sgd",
            learning_rate=1.0,
            kd_hard_weight=0.2,
        )
        params.append([p.detach().clone() for p in student.parameters()])
    # Compare the SGD updates, relative to the largest: float64, but one padded batch of 4 and four unpadded batches
    # of 1 reduce in other orders through BLAS; measured up to 3e-8 of the largest update (2.6e-10 absolute on an
    # AVX2 EPYC). Normalising by each micro-batch's tokens instead of the whole batch's changes updates by O(1).
    updates = [[a - p0 for a, p0 in zip(run, before)] for run in params]
    scale = max(u.abs().max().item() for u in updates[0])
    for a, b in zip(*updates):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * scale)


def test_logged_kd_terms_add_up_to_the_logged_loss_under_gradient_accumulation(tmp_path):
    """kd_soft_loss and kd_hard_loss are per optimizer step like "loss" (they were averaged per micro-batch,
    i.e. divided by the accumulation steps)."""
    trainer = _train(tmp_path, tiny_model("llama", seed=1), tiny_model("llama", seed=2), data=_dataset(8),
                     use_kd_patch=True, per_device_train_batch_size=1, gradient_accumulation_steps=4, max_steps=2,
                     logging_steps=1, kd_hard_weight=0.3)  # fmt: skip
    logged = [h for h in trainer.state.log_history if "kd_soft_loss" in h]
    assert len(logged) == 2
    for h in logged:
        assert h["loss"] == pytest.approx(h["kd_soft_loss"] + 0.3 * h["kd_hard_loss"], rel=1e-3)


def test_checkpoint_resume_continues_identically(tmp_path):
    teacher = tiny_model("llama", dtype=torch.float32, seed=2)
    full = tiny_model("llama", dtype=torch.float32, seed=1)
    _train(tmp_path / "a", full, teacher, use_kd_patch=True, max_steps=4)
    first = tiny_model("llama", dtype=torch.float32, seed=1)
    _train(tmp_path / "b", first, teacher, use_kd_patch=True, max_steps=4, save_strategy="steps", save_steps=2)
    resumed = tiny_model("llama", dtype=torch.float32, seed=7)  # weights come from the checkpoint
    trainer = KDTrainer(
        model=resumed,
        teacher_model=teacher,
        train_dataset=_dataset(),
        data_collator=TD.TeacherDataCollator(),
        args=_args(tmp_path / "b", use_kd_patch=True, max_steps=4),
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "b" / "out" / "checkpoint-2"))
    for a, b in zip(full.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_checkpoint_rotation_never_deletes_another_runs_checkpoints(tmp_path):
    """save_total_limit rotation deletes every checkpoint-* folder in output_dir: a run that does not continue the
    ones already there is refused before it trains; resuming from them (True, or one of them) rotates as before."""
    out = tmp_path / "out"
    for step in (1, 5):  # another run's
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "weights").write_text("theirs")
    student, teacher = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    rotating = dict(max_steps=2, save_strategy="steps", save_steps=1, save_total_limit=1)
    refused = r"already holds checkpoint-1, checkpoint-5, and save_total_limit=1 .*another output_dir.*resume_from"
    with pytest.raises(ValueError, match=refused):
        _train(tmp_path, student, teacher, **rotating)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "checkpoint-5"]
    _train(tmp_path, student, teacher, **{**rotating, "save_total_limit": None})  # no rotation: nothing deleted
    assert {"checkpoint-1", "checkpoint-5"} <= {p.name for p in out.iterdir()}

    mine = tmp_path / "mine"
    _train(mine, tiny_model("llama", seed=1), teacher, **rotating)
    assert sorted(p.name for p in (mine / "out").glob("checkpoint-*")) == ["checkpoint-2"]
    trainer = KDTrainer(model=tiny_model("llama", seed=1), teacher_model=teacher, train_dataset=_dataset(),
                        data_collator=TD.TeacherDataCollator(), args=_args(mine, **{**rotating, "max_steps": 3}))
    trainer.train(resume_from_checkpoint=True)  # continues its own checkpoints, which rotate as they did
    assert trainer.state.global_step == 3
    assert sorted(p.name for p in (mine / "out").glob("checkpoint-*")) == ["checkpoint-3"]


def test_packed_batch_has_no_loss_across_sequence_boundaries():
    """DataCollatorWithFlattening (position ids restart per sequence) gives the padded batch's loss."""
    from transformers import DataCollatorWithFlattening

    student = M.apply_kd_patch_to_llama(model=tiny_model("llama", seed=1), reduction="sum")
    teacher = tiny_model("llama", seed=2)
    rows = _dataset(3)
    padded = TD.TeacherDataCollator()(rows)
    packed = DataCollatorWithFlattening(return_tensors="pt")([{k: v.tolist() for k, v in r.items()} for r in rows])
    assert packed["input_ids"].shape[0] == 1
    a = student(**padded, teacher_model=teacher).loss
    b = student(**packed, teacher_model=teacher).loss
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


class _ImmediateEOS(torch.nn.Module):
    """A generator that ends every completion at once with EOS."""

    def __init__(self):
        super().__init__()
        from transformers import GenerationConfig

        self.generation_config = GenerationConfig(eos_token_id=2, pad_token_id=0, bos_token_id=1)

    def generate(self, input_ids, attention_mask, max_new_tokens, **_):
        tail = torch.zeros((input_ids.shape[0], max_new_tokens), dtype=input_ids.dtype)
        tail[:, 0] = 2
        return torch.cat([input_ids, tail], dim=1)


def test_empty_prompts_and_immediate_eos_are_handled(tmp_path):
    trainer = KDTrainer(
        model=tiny_model("llama"), teacher_model=tiny_model("llama", seed=3), args=_args(tmp_path, use_kd_patch=True)
    )
    rows = _dataset(2, prompt=0)  # every token scored: no prompt at all
    rows[1]["labels"][:4] = -100
    (batch,) = trainer.onpolicy.replace(
        _ImmediateEOS(), [TD.TeacherDataCollator()(rows)], tokenizer=None, step=0, device=torch.device("cpu")
    )
    assert batch["input_ids"][0, :2].tolist() == [1, 2]  # BOS as prompt, then EOS
    assert batch["labels"][0, :2].tolist() == [-100, 2]
    assert batch["labels"][1, 4].item() == 2 and (batch["labels"][1, :4] == -100).all()
    loss = trainer.compute_loss(trainer.model, batch)
    assert torch.isfinite(loss)


def test_self_distillation_with_adapter_disabled(tmp_path):
    peft = pytest.importorskip("peft")
    base = tiny_model("llama", dtype=torch.float32, seed=1)
    student = peft.get_peft_model(
        base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    trainer = KDTrainer(model=student, args=_args(tmp_path, use_kd_patch=True, kd_self_distill=True, max_steps=4),
                        train_dataset=_dataset(), data_collator=TD.TeacherDataCollator())  # fmt: skip
    batch = TD.TeacherDataCollator()(_dataset(2))
    loss = trainer.compute_loss(student, dict(batch))
    assert loss.item() > 0  # the adapter makes the student differ from its base
    with student.disable_adapter():
        assert trainer.compute_loss(student, dict(batch)).abs().item() < 1e-6  # base against itself
    trainer.train()
    assert all(torch.isfinite(torch.tensor(_losses(trainer))))


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="kd_lmbda"):
        _args(tmp_path, kd_lmbda=2.0)
    with pytest.raises(ValueError, match="beta"):
        _args(tmp_path, kd_beta=-0.1)
    trainer = KDTrainer(model=tiny_model("llama"), args=_args(tmp_path, use_kd_patch=True))
    with pytest.raises(ValueError, match="no teacher"):
        trainer.compute_loss(trainer.model, TD.TeacherDataCollator()(_dataset(2)))


@pytest.mark.parametrize("option,value", [("kd_beta", 2.0), ("kd_temperature", 0.0), ("kd_soft_weight", -1.0),
                                          ("kd_hard_weight", float("nan")), ("kd_top_k_tail", "foo"),
                                          ("kd_vocab_size", 0)])  # fmt: skip
def test_a_bad_loss_option_is_named_as_the_option_given(tmp_path, option, value):
    """The loss options are checked by KDLossConfig, whose fields are beta, tail, ...: the error names kd_beta,
    kd_top_k_tail, ... (what the user set, on the command line --kd_beta), not a field they never saw."""
    with pytest.raises(ValueError) as e:
        _args(tmp_path, **{option: value})
    assert str(e.value).startswith(f"{option} must ") and f"got {option}=" in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("bf16,accumulation", [(False, 1), (True, 2)], ids=["fp32", "bf16-accumulated"])
def test_selective_recompute_keeps_later_layers_and_the_same_training(tmp_path, bf16, accumulation):
    """kd_recompute_layers=1 on a 2-layer student: layer 0's attention runs twice per micro-batch (once more when
    the backward recomputes it), layer 1's once; the losses equal those of full recompute (checkpointing changes
    no arithmetic), in fp32 and under bf16 autocast with gradient accumulation. Counted on the attention:
    transformers checkpoints a layer's forward, inside its own hooks."""
    runs = {}
    for limit in (None, 1):
        student = tiny_model("llama", dtype=torch.float32, seed=1)
        calls = [0, 0]
        for i, layer in enumerate(student.model.layers):
            layer.self_attn.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        trainer = _train(
            tmp_path / str(limit), student, tiny_model("llama", dtype=torch.float32, seed=2), max_steps=3,
            gradient_checkpointing=True, kd_recompute_layers=limit, bf16=bf16,
            gradient_accumulation_steps=accumulation,
        )  # fmt: skip
        runs[limit] = (_losses(trainer), calls)
    micro_batches = 3 * accumulation
    assert runs[None][1] == [2 * micro_batches, 2 * micro_batches]  # every layer recomputed
    assert runs[1][1] == [2 * micro_batches, micro_batches]
    assert [layer.gradient_checkpointing for layer in trainer.model.model.layers] == [True, False]
    torch.testing.assert_close(runs[1][0], runs[None][0], rtol=1e-6, atol=0)
    calls = runs[1][1]
    calls[:] = [0, 0]
    trainer.train()  # a second train() turns checkpointing on for every layer again: still narrowed
    assert calls == [2 * micro_batches, micro_batches]


def test_selective_recompute_arguments(tmp_path):
    with pytest.raises(ValueError, match="gradient_checkpointing=True"):
        _args(tmp_path, kd_recompute_layers=2)
    with pytest.raises(ValueError, match="int >= 0"):
        _args(tmp_path, kd_recompute_layers=-1, gradient_checkpointing=True)
    trainer = KDTrainer(
        model=tiny_model("llama", dtype=torch.float32), teacher_model=tiny_model("llama", dtype=torch.float32),
        args=_args(tmp_path, kd_recompute_layers=5, gradient_checkpointing=True, max_steps=1),
        train_dataset=_dataset(), data_collator=TD.TeacherDataCollator(),
    )  # fmt: skip
    with pytest.raises(ValueError, match="has 2 layers"):
        trainer.train()
