"""Sampled teacher tokens as data: precompute writes them (alone or with the top-k, plain or packed, seeded), the
store reads them back, the collator pads them, and KDTrainer trains from them (patched and materialised)."""

import copy
import json
import math

import pytest
import torch

import liger_patch_kd.models as M
from liger_patch_kd import teacher as TD
from liger_patch_kd.batch.columns import SAMPLE_COLUMNS
from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments

from .helpers import random_sequences
from .tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")


def _store(tmp_path, name, samples=8, top_k=0, encoding="plain", seed=0, temperature=1.0, n=6):
    teacher = tiny_model("llama", dtype=torch.float32, seed=2)
    seqs = random_sequences(VOCAB, n, seed=0)
    out = TD.precompute(
        teacher, seqs, tmp_path / name, top_k=top_k, samples=samples, seed=seed, encoding=encoding,
        temperature=temperature, batch_size=4, shard_size=4, progress=False, logprob_dtype="float32",
    )  # fmt: skip
    return out, teacher, seqs


@pytest.mark.parametrize("top_k,encoding", [(0, "plain"), (4, "plain"), (0, "packed12"), (4, "packed12")])
def test_precompute_writes_draws_from_the_teacher_at_its_temperature(tmp_path, top_k, encoding):
    out, teacher, seqs = _store(tmp_path, "s", top_k=top_k, encoding=encoding, temperature=1.5)
    meta = json.loads((out / "manifest.json").read_text())
    assert meta["format_version"] == 3 and meta["samples"] == 8 and meta["top_k"] == top_k
    data = TD.TeacherLogprobsDataset(out, vocab_size=VOCAB)
    assert len(data) == len(seqs)
    item = data[1]
    ids, counts, lp = item["teacher_sample_ids"], item["teacher_sample_counts"], item["teacher_sample_logprobs"]
    n = len(seqs[1])
    assert ids.shape == counts.shape == lp.shape == (n, 8)
    assert (counts[:-1].sum(-1) == 8).all() and counts[-1].sum() == 0  # the last position predicts nothing
    with torch.no_grad():
        logits = teacher(torch.tensor([seqs[1]])).logits[0].float()
    expected = torch.log_softmax(logits / 1.5, -1)  # every log-prob of the store is at the draws' temperature
    present = counts > 0
    tol = 1e-5 if encoding == "plain" else 0.05  # packed12: half a quantisation step of the row's span
    torch.testing.assert_close(lp[present], expected.gather(-1, ids.clamp(min=0).long())[present], atol=tol, rtol=0)
    if top_k:
        top = item["teacher_token_ids"][:-1].long()
        assert (top == expected[:-1].topk(top_k, -1).indices).all()
        assert not (ids[:-1, :, None] == top[:, None, :]).any()  # the draws come from outside the top-k
    else:
        assert "teacher_token_ids" not in item


def test_draws_are_reproducible_from_the_seed(tmp_path):
    a = _store(tmp_path, "a", seed=3)[0]
    b = _store(tmp_path, "b", seed=3)[0]
    c = _store(tmp_path, "c", seed=4)[0]
    read = [TD.TeacherLogprobsDataset(d) for d in (a, b, c)]
    for i in range(len(read[0])):
        assert torch.equal(read[0][i]["teacher_sample_ids"], read[1][i]["teacher_sample_ids"])
    assert any(not torch.equal(read[0][i]["teacher_sample_ids"], read[2][i]["teacher_sample_ids"]) for i in range(6))


def test_bad_sample_options_are_refused_before_any_work(tmp_path):
    teacher = tiny_model("llama", dtype=torch.float32)
    with pytest.raises(ValueError, match="samples"):
        TD.precompute(teacher, [[1, 2, 3]], tmp_path / "x", samples=300, top_k=0, progress=False)
    with pytest.raises(ValueError, match="top_k"):
        TD.precompute(teacher, [[1, 2, 3]], tmp_path / "x", samples=0, top_k=0, progress=False)
    assert not (tmp_path / "x").exists()


def test_collator_pads_the_sample_columns(tmp_path):
    out = _store(tmp_path, "s", top_k=2)[0]
    data = TD.TeacherLogprobsDataset(out)
    batch = TD.TeacherDataCollator()([data[0], data[1], data[2]])
    longest = batch["input_ids"].shape[1]
    assert batch["teacher_sample_ids"].shape == (3, longest, 8)
    short = int(batch["attention_mask"].sum(-1).argmin())
    pad = batch["attention_mask"][short] == 0
    assert (batch["teacher_sample_ids"][short][pad] == -1).all()
    assert (batch["teacher_sample_counts"][short][pad] == 0).all()
    assert torch.isneginf(batch["teacher_sample_logprobs"][short][pad]).all()


def _args(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3, learning_rate=5e-3,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        data_seed=0, dataloader_num_workers=0, kd_beta=0.0,
    )  # fmt: skip
    return KDTrainingArguments(**{**base, **overrides})


@pytest.mark.parametrize("top_k", [0, 3])
def test_patched_and_materialised_agree_on_a_sampled_batch(tmp_path, top_k):
    out = _store(tmp_path, "s", top_k=top_k, temperature=2.0)[0]
    batch = TD.TeacherDataCollator()([TD.TeacherLogprobsDataset(out)[i] for i in range(3)])
    student = tiny_model("gemma2", seed=1)  # soft-capped logits
    results = []
    for use_kd_patch in (True, False):
        model = copy.deepcopy(student)
        args = _args(tmp_path, use_kd_patch=use_kd_patch, kd_hard_weight=0.3, kd_temperature=2.0)
        trainer = KDTrainer(model=model, args=args)
        loss = trainer.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(29))
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        M.revert_kd_patch(model=model)
    (l1, g1), (l2, g2) = results
    assert math.isfinite(float(l1)) and float(l1) > 0
    torch.testing.assert_close(l1, l2, rtol=1e-9, atol=1e-12)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


def test_trainer_trains_from_sampled_data_bf16_accumulated(tmp_path):
    out = _store(tmp_path, "s", top_k=2, n=8)[0]
    runs = {}
    for use_kd_patch in (True, False):
        student = tiny_model("llama", dtype=torch.float32, seed=1)
        before = copy.deepcopy(student.state_dict())
        trainer = KDTrainer(
            model=student, train_dataset=TD.TeacherLogprobsDataset(out, vocab_size=VOCAB),
            args=_args(tmp_path, use_kd_patch=use_kd_patch, bf16=True, gradient_accumulation_steps=2),
            data_collator=TD.TeacherDataCollator(),
        )  # fmt: skip
        trainer.train()
        # the estimate of one batch may be below 0 (its expectation, the KL, is not): finite is what holds
        runs[use_kd_patch] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert len(runs[use_kd_patch]) == 3 and all(math.isfinite(x) for x in runs[use_kd_patch])
        assert any(not torch.equal(before[k], v) for k, v in student.state_dict().items())
        M.revert_kd_patch(model=student)
    # the fused path against the materialised reference under bf16 autocast: logits rounded at 2^-8 relative
    # (|logit| ~ 1 here) move each drawn id's log S, and so the loss, by ~1e-2 at most
    torch.testing.assert_close(runs[True], runs[False], atol=2e-2, rtol=0)


def test_trainer_refuses_a_sampled_store_it_cannot_train_without_bias(tmp_path):
    out = _store(tmp_path, "t", temperature=2.0)[0]
    data = TD.TeacherLogprobsDataset(out)
    model = tiny_model("llama", dtype=torch.float32)
    with pytest.raises(ValueError, match="kd_beta: the training store holds sampled teacher tokens; beta=0.5"):
        KDTrainer(model=model, args=_args(tmp_path, kd_beta=0.5, kd_temperature=2.0), train_dataset=data)
    with pytest.raises(ValueError, match="kd_temperature=1.0 but the store's teacher tokens were drawn at .* 2.0"):
        KDTrainer(model=model, args=_args(tmp_path), train_dataset=data)


def test_trainer_refuses_beta_above_zero_on_sampled_batches(tmp_path):
    out = _store(tmp_path, "s")[0]
    batch = TD.TeacherDataCollator()([TD.TeacherLogprobsDataset(out)[0]])
    model = tiny_model("llama", dtype=torch.float32)
    trainer = KDTrainer(model=model, args=_args(tmp_path, use_kd_patch=True, kd_beta=0.5))
    with pytest.raises(ValueError, match="beta=0.5: sampled teacher tokens"):
        trainer.compute_loss(model, dict(batch))


def test_interrupted_sampled_precompute_resumes_to_identical_shards(tmp_path, monkeypatch):
    teacher = tiny_model("llama", seed=3, dtype=torch.float32)
    seqs = random_sequences(VOCAB, 7, seed=1)
    opts = dict(top_k=2, samples=5, seed=9, shard_size=2, batch_size=1, progress=False)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    TD.precompute(teacher, seqs, full, **opts)
    original = TD.StoreWriter.write_shard
    calls = {"n": 0}

    def crash_on_third(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TD.StoreWriter, "write_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        TD.precompute(teacher, seqs, resumed, **opts)
    monkeypatch.setattr(TD.StoreWriter, "write_shard", original)
    TD.precompute(teacher, seqs, resumed, **opts)  # the resumed shards draw what the complete run drew
    for shard in sorted(full.glob("shard-*")):
        assert shard.read_bytes() == (resumed / shard.name).read_bytes()
    with pytest.raises(TD.TeacherStoreError, match=r"sample_seed \(store: 9, now: 10\)"):
        TD.precompute(teacher, seqs, resumed, **{**opts, "seed": 10})


def test_packed_sequences_equal_padded_on_sampled_data(tmp_path):
    # two store items packed into one row as DataCollatorWithFlattening packs them (position ids restart, the
    # first label of each sequence ignored), their sample columns concatenated the same way: the loss and the
    # gradient equal the padded batch's (float64 student)
    from transformers import DataCollatorWithFlattening

    out = _store(tmp_path, "s", top_k=2)[0]
    items = [TD.TeacherLogprobsDataset(out)[i] for i in (0, 1)]
    flatten = DataCollatorWithFlattening(return_position_ids=True)
    packed = flatten([{"input_ids": it["input_ids"].tolist()} for it in items])
    packed = {k: torch.as_tensor(v) for k, v in packed.items()}
    for name in ("teacher_token_ids", "teacher_logprobs", *SAMPLE_COLUMNS):
        packed[name] = torch.cat([it[name] for it in items])[None]
    padded = TD.TeacherDataCollator()(items)
    student = tiny_model("llama", seed=1)
    M.apply_kd_patch(model=student, beta=0.0)
    results = []
    for batch in (packed, padded):
        student.zero_grad()
        loss = student(**batch).loss
        loss.backward()
        results.append((loss.detach(), student.lm_head.weight.grad.clone()))
    (lp, gp), (ld, gd) = results
    torch.testing.assert_close(lp, ld, rtol=1e-9, atol=0)  # float64 end to end; only the summation order differs
    torch.testing.assert_close(gp, gd, rtol=1e-7, atol=1e-12)


def test_peft_student_trains_on_sampled_data(tmp_path):
    peft = pytest.importorskip("peft")
    out = _store(tmp_path, "s", n=8)[0]
    base = tiny_model("llama", dtype=torch.float32, seed=1)
    student = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    frozen = {k: v.clone() for k, v in student.named_parameters() if not v.requires_grad}
    lora = {k: v.clone() for k, v in student.named_parameters() if v.requires_grad}
    trainer = KDTrainer(
        model=student, args=_args(tmp_path, use_kd_patch=True, bf16=True, gradient_accumulation_steps=2),
        train_dataset=TD.TeacherLogprobsDataset(out), data_collator=TD.TeacherDataCollator(),
    )  # fmt: skip
    trainer.train()
    params = dict(student.named_parameters())
    assert all(torch.equal(params[k], v) for k, v in frozen.items())  # the base model is untouched
    assert any(not torch.equal(params[k], v) for k, v in lora.items())  # the adapter learned


def test_converters_refuse_a_sampled_store_rather_than_drop_its_draws(tmp_path):
    out = _store(tmp_path, "s", top_k=2)[0]
    with pytest.raises(TD.TeacherStoreError, match="holds sampled teacher tokens .* which this format cannot hold"):
        next(TD.iter_store(out))


def test_a_store_of_top_k_tempered_already_is_not_tempered_again(tmp_path, caplog):
    """precompute --temperature 2 without samples stores a teacher at T = 2; the loss tempers stored log-probs by
    kd_temperature, so kd_temperature 2 would train a teacher at 4 against a student at 2: refused with the fix. At
    kd_temperature 1 the stored teacher trains as it is, said once."""
    import logging

    out = _store(tmp_path, "t", samples=0, top_k=4, temperature=2.0)[0]
    data = TD.TeacherLogprobsDataset(out)
    model = tiny_model("llama", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"kd_temperature=2.0: the train_dataset store holds its teacher's top-4 "
                                         r"log-probs at temperature 2.0 already.* teacher would be at 4 against the "
                                         r"student at 2\. Precompute at --temperature 1"):  # fmt: skip
        KDTrainer(model=model, args=_args(tmp_path, kd_beta=0.0, kd_temperature=2.0), train_dataset=data)
    with caplog.at_level(logging.WARNING, logger="liger_patch_kd"):
        KDTrainer(model=model, args=_args(tmp_path, kd_beta=0.0), train_dataset=data)
    said = [r.getMessage() for r in caplog.records if "at temperature 2" in r.getMessage()]
    assert len(said) == 1 and "kd_temperature=1 trains the student at temperature 1" in said[0]
    # the same store for evaluation is not spoken about twice; another tempered store is
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="liger_patch_kd"):
        KDTrainer(model=model, args=_args(tmp_path, kd_beta=0.0, eval_strategy="no"), train_dataset=data,
                  eval_dataset=TD.TeacherLogprobsDataset(out))  # fmt: skip
    assert len([r for r in caplog.records if "at temperature 2" in r.getMessage()]) == 1
    other = TD.TeacherLogprobsDataset(_store(tmp_path, "t3", samples=0, top_k=4, temperature=3.0)[0])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="liger_patch_kd"):
        KDTrainer(model=model, args=_args(tmp_path, kd_beta=0.0, eval_strategy="no"), train_dataset=data,
                  eval_dataset=other)  # fmt: skip
    said = [r.getMessage() for r in caplog.records if "at temperature" in r.getMessage()]
    assert len(said) == 2 and "eval_dataset store" in said[1] and "temperature 3" in said[1]
    plain = TD.TeacherLogprobsDataset(_store(tmp_path, "one", samples=0, top_k=4)[0])
    KDTrainer(model=model, args=_args(tmp_path, kd_beta=0.0, kd_temperature=2.0), train_dataset=plain)  # T = 1: fine
