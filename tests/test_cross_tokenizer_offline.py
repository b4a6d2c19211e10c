"""Offline cross-tokenizer data: the teacher's top-k on its own ids (a store), joined to the text by the
collator, scored without a teacher model; with K = V_t it equals the in-process teacher exactly."""

from __future__ import annotations

import pytest
import torch

from liger_patch_kd.align import CrossTokenizerCollator, CrossTokenizerConfig, VocabMap, byte_level_to_text
from liger_patch_kd.align import reference as xref
from liger_patch_kd.demo import BOS, load_corpus
from liger_patch_kd.demo import build_model as _model
from liger_patch_kd.demo.cross_tokenizer import CharTokenizerWithOffsets, train_bpe_tokenizer
from liger_patch_kd.teacher import TeacherLogprobsDataset
from liger_patch_kd.teacher.precompute import precompute, teacher_topk
from liger_patch_kd.trainer.teachers.other_tokenizer import compute_cross_tokenizer_loss

EXAMPLES = [{"prompt": "At dawn, ", "completion": "the fox sees a cat."},
            {"prompt": "", "completion": "A heron watches the old mill; 8 or 9."}]  # fmt: skip


@pytest.fixture(scope="module")
def setup():
    char = CharTokenizerWithOffsets(load_corpus())
    bpe = train_bpe_tokenizer(load_corpus()[:8000], 300)
    student, teacher = _model(bpe.get_vocab_size(), 32, 1, seed=0, device="cpu"), _model(len(char), 32, 1, 1, "cpu")
    collator = CrossTokenizerCollator(bpe, char, student_prefix_ids=(BOS,), teacher_prefix_ids=(BOS,))
    vocab_map = VocabMap.build(bpe, char, normalize=byte_level_to_text, teacher_vocab_size=len(char))
    return dict(char=char, student=student, teacher=teacher, collator=collator, vocab_map=vocab_map)


def offline_rows(s, k):
    """The examples joined with the teacher's top-k computed on collator.teacher_sequence(example)."""
    rows = []
    for example in EXAMPLES:
        ids = torch.tensor([s["collator"].teacher_sequence(example)])
        top_ids, top_lp = teacher_topk(s["teacher"], ids, torch.ones_like(ids), k)
        rows.append(dict(example, teacher_input_ids=ids[0].tolist(), teacher_token_ids=top_ids[0],
                         teacher_logprobs=top_lp[0]))  # fmt: skip
    return rows


def test_full_vocabulary_offline_batch_equals_the_in_process_teacher(setup):
    s, cfg = setup, CrossTokenizerConfig(kind="hybrid", hard_weight=0.5, temperature=1.5)
    offline = s["collator"](offline_rows(s, k=len(s["char"])))
    live = s["collator"](EXAMPLES)
    assert offline["teacher_token_ids"].shape[:2] == live["teacher_input_ids"].shape
    out = compute_cross_tokenizer_loss(s["student"], None, offline, cfg, s["vocab_map"])
    ref = compute_cross_tokenizer_loss(s["student"], s["teacher"], live, cfg, s["vocab_map"])
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert out.soft > 0


def test_topk_offline_batch_equals_reference_on_the_students_logits(setup):
    s, cfg = setup, CrossTokenizerConfig(kind="chain", hard_weight=0.5, temperature=2.0)
    batch = s["collator"](offline_rows(s, k=5))
    out = compute_cross_tokenizer_loss(s["student"], None, batch, cfg, s["vocab_map"])
    shift = lambda t: torch.cat([t[:, 1:], torch.full_like(t[:, :1], -100)], 1)  # noqa: E731
    logits = s["student"](input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ref = xref.cross_tokenizer_topk_kd_loss(
        logits.double(), batch["teacher_token_ids"], batch["teacher_logprobs"], len(s["char"]),
        shift(batch["labels"]), shift(batch["teacher_labels"]), batch["student_align_groups"],
        batch["teacher_align_groups"], s["vocab_map"], batch["align_exact_ok"], cfg,
    )  # fmt: skip
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-5, atol=1e-6)


def test_offline_data_on_other_ids_is_refused(setup):
    rows = offline_rows(setup, k=4)
    rows[1]["teacher_input_ids"] = rows[1]["teacher_input_ids"][:-2] + [7, 7]
    with pytest.raises(ValueError, match="example 1: its teacher_input_ids"):
        setup["collator"](rows)
    rows = offline_rows(setup, k=4)
    del rows[0]["teacher_token_ids"]
    with pytest.raises(ValueError, match="every example"):
        setup["collator"](rows)


def test_kd_trainer_trains_from_a_precomputed_store_without_a_teacher(setup, tmp_path):
    from liger_patch_kd import KDTrainer, KDTrainingArguments

    s = setup
    sequences = [s["collator"].teacher_sequence(example) for example in EXAMPLES]
    store = TeacherLogprobsDataset(precompute(s["teacher"], sequences, tmp_path / "store", top_k=8, progress=False))
    rows = [dict(example, teacher_input_ids=item["input_ids"].tolist(), teacher_token_ids=item["teacher_token_ids"],
                 teacher_logprobs=item["teacher_logprobs"]) for example, item in zip(EXAMPLES, store)] * 2  # fmt: skip
    args = KDTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-3, logging_steps=1,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, kd_teacher_tokenizer="given below",
        kd_cross_tokenizer_loss="hybrid", kd_uld_top_k=32, kd_hard_weight=0.5, remove_unused_columns=False,
    )  # fmt: skip
    student = _model(len(s["collator"].student_tokenizer.get_vocab()), 32, 1, seed=3, device="cpu")
    trainer = KDTrainer(model=student, teacher_model=None, args=args, train_dataset=rows, data_collator=s["collator"],
                        processing_class=s["collator"].student_tokenizer, teacher_tokenizer=s["char"])  # fmt: skip
    trainer.train()
    logged = [h for h in trainer.state.log_history if "kd_soft_loss" in h]
    assert len(logged) == 2 and all(h["kd_soft_loss"] > 0 for h in logged), logged


@pytest.fixture(scope="module")
def served(setup, tmp_path_factory):
    """`liger-kd serve` with the character teacher (CPU, float32)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from .test_teacher_server import Server

    path = tmp_path_factory.mktemp("char_teacher")
    setup["teacher"].save_pretrained(path)
    srv = Server(path, extra=("--dtype", "float32")).start()
    yield srv
    srv.stop()


def test_served_teacher_is_asked_about_its_own_tokenization(setup, served):
    """The prefetcher asks the server about teacher_input_ids (not the student's ids) and aligns the replies with
    them: the loss equals the one from the same top-k computed in process (offline rows)."""
    from liger_patch_kd.teacher import TeacherClient, TeacherPrefetcher
    from liger_patch_kd.trainer.teachers.served import CROSS_TOKENIZER_KEYS

    from .test_teacher_server import TOP_K

    s, cfg = setup, CrossTokenizerConfig(kind="chain", hard_weight=0.5, temperature=1.5)
    client = TeacherClient(served.url, "liger", top_k=TOP_K, vocab_size=len(s["char"]))
    loader = torch.utils.data.DataLoader(EXAMPLES, batch_size=2, collate_fn=s["collator"])
    batch = next(iter(TeacherPrefetcher(loader, client, keys=CROSS_TOKENIZER_KEYS)))
    offline = s["collator"](offline_rows(s, k=TOP_K))
    assert batch["teacher_token_ids"].shape == offline["teacher_token_ids"].shape
    out = compute_cross_tokenizer_loss(s["student"], None, batch, cfg, s["vocab_map"])
    ref = compute_cross_tokenizer_loss(s["student"], None, offline, cfg, s["vocab_map"])
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert out.soft > 0


def test_kd_trainer_trains_against_a_served_teacher_with_another_tokenizer(setup, served, tmp_path):
    from liger_patch_kd import KDTrainer, KDTrainingArguments

    from .test_teacher_server import TOP_K

    s = setup
    args = KDTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-3, logging_steps=1,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, kd_teacher_tokenizer="given below",
        kd_cross_tokenizer_loss="chain", kd_hard_weight=0.5, remove_unused_columns=False,
        kd_teacher_url=served.url, kd_teacher_protocol="liger", kd_teacher_top_k=TOP_K,
    )  # fmt: skip
    student = _model(len(s["collator"].student_tokenizer.get_vocab()), 32, 1, seed=3, device="cpu")
    trainer = KDTrainer(model=student, args=args, train_dataset=EXAMPLES * 2, data_collator=s["collator"],
                        processing_class=s["collator"].student_tokenizer, teacher_tokenizer=s["char"])  # fmt: skip
    trainer.train()
    logged = [h for h in trainer.state.log_history if "kd_soft_loss" in h]
    assert len(logged) == 2 and all(h["kd_soft_loss"] > 0 for h in logged), logged


def test_on_policy_rows_are_scored_by_the_served_teacher_on_its_own_tokens(setup, served, tmp_path):
    """kd_lmbda=1 against `liger-kd serve` with another tokenizer: the generated rows' teacher tokens are sent to
    the server, and its top-k gives the loss the same top-k computed in process gives; then train()."""
    from liger_patch_kd import KDTrainer, KDTrainingArguments
    from liger_patch_kd.teacher import TeacherClient, TeacherPrefetcher
    from liger_patch_kd.trainer.rollouts.onpolicy import OnPolicySteps
    from liger_patch_kd.trainer.rollouts.retokenized import rows_maker
    from liger_patch_kd.trainer.teachers.other_tokenizer import generated_rows
    from liger_patch_kd.trainer.teachers.served import CROSS_TOKENIZER_KEYS

    from .test_teacher_server import TOP_K

    s, cfg = setup, CrossTokenizerConfig(kind="hybrid", hard_weight=0.5, uld_top_k=16)
    bpe = s["collator"].student_tokenizer
    prompts = [{"prompt": "At dawn, "}, {"prompt": ""}]
    args = KDTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-3, logging_steps=1,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, kd_teacher_tokenizer="given below",
        kd_cross_tokenizer_loss="hybrid", kd_uld_top_k=16, kd_hard_weight=0.5, remove_unused_columns=False,
        kd_teacher_url=served.url, kd_teacher_protocol="liger", kd_teacher_top_k=TOP_K, kd_lmbda=1.0,
        kd_max_new_tokens=6,
    )  # fmt: skip
    student = _model(len(bpe.get_vocab()), 32, 1, seed=3, device="cpu")
    rows, vocab_map = generated_rows(s["collator"], student, bpe, None, s["vocab_map"])
    client = TeacherClient(served.url, "liger", top_k=TOP_K, vocab_size=len(s["char"]))
    prefetcher = TeacherPrefetcher([], client, keys=CROSS_TOKENIZER_KEYS)
    (batch,) = OnPolicySteps(args).replace(student, [s["collator"](prompts)], tokenizer=bpe, step=0,
                                           device=torch.device("cpu"), attach_teacher=prefetcher.with_teacher,
                                           make_rows=rows_maker(rows, s["collator"]))  # fmt: skip
    local = dict(batch)
    local["teacher_token_ids"], local["teacher_logprobs"] = teacher_topk(
        s["teacher"], batch["teacher_input_ids"], batch["teacher_attention_mask"], TOP_K
    )
    served_loss = compute_cross_tokenizer_loss(student, None, batch, cfg, vocab_map)
    local_loss = compute_cross_tokenizer_loss(student, None, local, cfg, vocab_map)
    torch.testing.assert_close(served_loss.loss, local_loss.loss, rtol=1e-5, atol=1e-6)
    assert served_loss.soft > 0
    trainer = KDTrainer(model=student, args=args, train_dataset=prompts * 2, data_collator=s["collator"],
                        processing_class=bpe, teacher_tokenizer=s["char"])  # fmt: skip
    trainer.train()
    logged = [h for h in trainer.state.log_history if "kd_soft_loss" in h]
    assert len(logged) == 2 and all(h["kd_soft_loss"] > 0 for h in logged), logged
    assert len(trainer.kd_rollout_seconds) == 2


def test_evaluation_asks_the_served_teacher_about_its_own_tokenization(setup, served, tmp_path):
    """trainer.evaluate() with a served teacher of another tokenizer: the server is asked about the evaluation rows'
    teacher tokens, and the eval_loss is the one from the same top-k computed in process (offline rows), which also
    evaluate with no teacher at all; plain evaluation rows with offline training rows are refused when built."""
    from liger_patch_kd import KDTrainer, KDTrainingArguments

    from .test_teacher_server import TOP_K

    s = setup
    offline = offline_rows(s, k=TOP_K) * 2

    def trainer(train, evaluation, **overrides):
        args = KDTrainingArguments(
            output_dir=str(tmp_path), per_device_eval_batch_size=3, report_to="none", use_cpu=True,
            disable_tqdm=True, kd_teacher_tokenizer="given below", kd_cross_tokenizer_loss="chain",
            kd_hard_weight=0.5, kd_temperature=1.5, remove_unused_columns=False, **overrides,
        )  # fmt: skip
        student = _model(len(s["collator"].student_tokenizer.get_vocab()), 32, 1, seed=3, device="cpu")
        return KDTrainer(model=student, args=args, train_dataset=train, eval_dataset=evaluation,
                         data_collator=s["collator"], processing_class=s["collator"].student_tokenizer,
                         teacher_tokenizer=s["char"])  # fmt: skip

    want = trainer(offline, offline).evaluate()["eval_loss"]
    served_run = trainer(EXAMPLES * 2, EXAMPLES * 2, kd_teacher_url=served.url, kd_teacher_protocol="liger",
                         kd_teacher_top_k=TOP_K)  # fmt: skip
    got = served_run.evaluate()["eval_loss"]
    assert want > 0
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)  # as the loss test's
    with pytest.raises(ValueError, match=r"eval_dataset's rows carry no teacher data .* pass teacher_model"):
        trainer(offline, EXAMPLES)
