"""Trainer hooks, the demo function and the benchmark's CPU smoke test for cross-tokenizer distillation."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from liger_patch_kd.align import CrossTokenizerCollator, CrossTokenizerConfig, VocabMap, byte_level_to_text
from liger_patch_kd.align import reference as xref
from liger_patch_kd.demo import BOS, load_corpus
from liger_patch_kd.demo import build_model as _model
from liger_patch_kd.demo.cross_tokenizer import (
    CharTokenizerWithOffsets,
    CrossTokenizerDemoSizes,
    demo_splits,
    run_cross_tokenizer_demo,
    student_subset,
    train_bpe_tokenizer,
)
from liger_patch_kd.trainer import KDTrainingArguments
from liger_patch_kd.trainer.teachers.other_tokenizer import (
    CrossTokenizerSetup,
    compute_cross_tokenizer_loss,
    cross_tokenizer_config,
    cross_tokenizer_enabled,
    is_cross_tokenizer_batch,
)


@pytest.fixture(scope="module")
def setup():
    text = load_corpus()[:8000]
    char = CharTokenizerWithOffsets(load_corpus())
    bpe = train_bpe_tokenizer(text, 300)
    student, teacher = _model(bpe.get_vocab_size(), 32, 1, seed=0, device="cpu"), _model(len(char), 32, 1, 1, "cpu")
    collator = CrossTokenizerCollator(bpe, char, student_prefix_ids=(BOS,), teacher_prefix_ids=(BOS,))
    batch = collator([{"prompt": "At dawn, ", "completion": "the fox sees a cat."},
                      {"prompt": "", "completion": "A heron watches the old mill; 8 or 9."}])  # fmt: skip
    return dict(bpe=bpe, char=char, student=student, teacher=teacher, batch=batch,
                vocab_map=VocabMap.build(bpe, char, normalize=byte_level_to_text))  # fmt: skip


@pytest.mark.parametrize("kind", ["hybrid", "next_byte"])
def test_trainer_loss_equals_reference_on_the_models_logits(setup, kind):
    s, cfg = setup, CrossTokenizerConfig(kind=kind, hard_weight=0.5, uld_top_k=32)
    batch = s["batch"]
    assert is_cross_tokenizer_batch(batch)
    out = compute_cross_tokenizer_loss(s["student"], s["teacher"], batch, cfg, s["vocab_map"])
    out.loss.backward()
    fused_grad = s["student"].lm_head.weight.grad.clone()
    s["student"].zero_grad()
    shift = lambda t: torch.cat([t[:, 1:], torch.full_like(t[:, :1], -100)], 1)  # noqa: E731
    with torch.no_grad():
        t_logits = s["teacher"](input_ids=batch["teacher_input_ids"]).logits
    s_logits = s["student"](input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ref = xref.cross_tokenizer_kd_loss(s_logits, t_logits, shift(batch["labels"]), shift(batch["teacher_labels"]),
                                       batch["student_align_groups"], batch["teacher_align_groups"], s["vocab_map"],
                                       batch["align_exact_ok"], cfg)  # fmt: skip
    ref.backward()
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_grad, s["student"].lm_head.weight.grad, rtol=1e-4, atol=1e-6)
    s["student"].zero_grad()
    assert out.soft > 0 and out.hard > 0


def test_setup_from_training_arguments(setup):
    args = KDTrainingArguments(output_dir="unused", report_to="none", kd_teacher_tokenizer="unused: the tokenizer is "
                               "passed", kd_cross_tokenizer_loss="uld", kd_uld_top_k=64, kd_beta=0.0,
                               kd_hard_weight=1.0)  # fmt: skip
    assert cross_tokenizer_enabled(args) and not cross_tokenizer_enabled(KDTrainingArguments(output_dir="unused"))
    assert cross_tokenizer_config(args) == CrossTokenizerConfig(kind="uld", uld_top_k=64, hard_weight=1.0)
    built = CrossTokenizerSetup.build(args, setup["bpe"], setup["student"], setup["teacher"],
                                      teacher_tokenizer=setup["char"])  # fmt: skip
    assert len(built.vocab_map) == len(setup["vocab_map"]) > 20
    assert built.vocab_map.teacher_first_byte[BOS] == 256 and built.vocab_map.student_first_byte[BOS] == 256
    with pytest.raises(ValueError, match="live teacher_model"):
        compute_cross_tokenizer_loss(setup["student"], None, setup["batch"], built.config, built.vocab_map)


def test_demo_function_runs_on_a_given_teacher():
    char = CharTokenizerWithOffsets(load_corpus())
    teacher = _model(len(char), 32, 1, seed=0, device="cpu")
    results = run_cross_tokenizer_demo(
        teacher, device="cpu", sizes=CrossTokenizerDemoSizes(chars=32, steps=4, batch=2, seeds=(1,))
    )
    assert set(results["recipes"]) == {
        "CE only",
        "CE + next-byte KD",
        "CE + GOLD-style hybrid",
        "CE + 2 x byte-chain KD",
    }
    for r in results["recipes"].values():
        assert r["ce_per_char"] > 0 and r["train_ce_per_char"] > 0
        assert len(r["ce_per_char_by_quarter"]) == 4 and r["ce_per_char_by_quarter"][-1] == r["ce_per_char"]


def test_student_subset_is_a_fixed_nested_fraction_in_corpus_order():
    windows = [f"w{i:03d}" for i in range(200)]
    tenth, quarter = student_subset(windows, 0.1), student_subset(windows, 0.25)
    assert len(tenth) == 20 and len(quarter) == 50
    assert tenth == sorted(tenth) and set(tenth) <= set(quarter) <= set(windows)  # a larger fraction adds windows
    assert tenth == student_subset(windows, 0.1) and tenth != windows[:20]  # fixed, and spread over the corpus
    assert student_subset(windows, 1.0) == windows
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            student_subset(windows, bad)
    with pytest.raises(ValueError, match="student_fraction"):
        CrossTokenizerDemoSizes(student_fraction=0.0)


def test_validation_split_is_carved_from_the_training_text():
    text = load_corpus()
    train, test = demo_splits(text)
    val_train, validation = demo_splits(text, validation=True)
    assert train + test == text and len(test) == len(text) - int(len(text) * 0.9)
    assert val_train + validation == train  # validation comes out of training text, never touches the test text
    assert len(validation) >= len(text) // 11


def test_benchmark_tiny(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    from benchmarks.training import bench_cross_tokenizer

    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench", "--tiny", "--ns", "64", "--out", str(out)])
    bench_cross_tokenizer.main()
    payload = json.loads(out.read_text())
    gold_uld = [r for r in payload["rows"] if r["method"] == "TRL GOLD uld (materialised)"]
    assert gold_uld and gold_uld[0]["rel_diff_vs_ours"] < 1e-5
    assert [r["k"] for r in payload["topk"]] == [16, 64] and payload["topk"][1]["mean_rel_err"] < 0.01


def test_kd_trainer_trains_across_tokenizers(setup, tmp_path):
    """The way users run it: KDTrainer.train() with kd_teacher_tokenizer, gradient accumulation."""
    from liger_patch_kd import KDTrainer, KDTrainingArguments

    rows = [{"prompt": "At dawn, ", "completion": "the fox sees a cat."},
            {"prompt": "The mill ", "completion": "stands by the river."},
            {"prompt": "", "completion": "A heron watches the old mill; 8 or 9."},
            {"prompt": "Night: ", "completion": "owls call twice."}] * 2  # fmt: skip
    args = KDTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
        learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        kd_teacher_tokenizer="given below", kd_cross_tokenizer_loss="hybrid", kd_uld_top_k=32, kd_hard_weight=0.5,
        remove_unused_columns=False,
    )  # fmt: skip
    student = _model(setup["bpe"].get_vocab_size(), 32, 1, seed=3, device="cpu")
    trainer = KDTrainer(
        model=student, teacher_model=setup["teacher"], args=args, train_dataset=rows,
        processing_class=setup["bpe"], teacher_tokenizer=setup["char"],
    )  # fmt: skip
    trainer.train()
    logged = [h for h in trainer.state.log_history if "kd_soft_loss" in h]
    assert len(logged) == 2 and all(h["kd_soft_loss"] > 0 and h["kd_hard_loss"] > 0 for h in logged), logged
