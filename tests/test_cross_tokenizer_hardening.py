"""Cross-tokenizer distillation, hardened: item counts of 0 or below, batches without groups, the models' own
logit transforms (Granite / Cohere), on-policy options refused, a teacher_tokenizer object enabling it, and
heads of different sizes refused unless their relation is known. The reference (float64) is the oracle."""

from __future__ import annotations

import pytest
import torch

from liger_patch_kd.align import CrossTokenizerConfig
from liger_patch_kd.align import reference as xref

from .test_cross_tokenizer_loss import fused_loss, grads, random_case, reference_loss
from .test_cross_tokenizer_topk import teacher_topk, topk_fused

KINDS = ["uld", "exact", "hybrid", "next_byte", "chain"]


def _three_paths(c, cfg, **kw):
    """The fused loss (in-process teacher and top-k teacher) and the reference on the same case."""
    ids, logprobs = teacher_topk(c, k=6)
    n = kw.get("num_items_in_batch")
    ref = xref.cross_tokenizer_kd_loss(
        (c["h_s"] @ c["w_s"].T).double(), (c["h_t"] @ c["w_t"].T).double(), c["s_labels"], c["t_labels"],
        c["s_groups"], c["t_groups"], c["vocab_map"], c["exact_ok"], cfg, n,
    )  # fmt: skip
    topk_ref = xref.cross_tokenizer_topk_kd_loss(
        (c["h_s"] @ c["w_s"].T).double(), ids, logprobs, c["w_t"].shape[0], c["s_labels"], c["t_labels"],
        c["s_groups"], c["t_groups"], c["vocab_map"], c["exact_ok"], cfg, n,
    )  # fmt: skip
    return {"fused": fused_loss(c, cfg, **kw), "fused top-k": topk_fused(c, ids, logprobs, cfg, **kw),
            "reference": ref, "reference top-k": topk_ref}  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_zero_items_give_zero_loss_and_zero_grads(kind):
    """num_items_in_batch=0 with scored rows (the Trainer's count for an accumulation step without items on
    other ranks / micro-batches): 0 and zero gradients, never inf / NaN, on every path."""
    c = random_case(seed=5)
    for name, loss in _three_paths(c, CrossTokenizerConfig(kind=kind, hard_weight=0.5), num_items_in_batch=0).items():
        assert float(loss.detach()) == 0.0, (kind, name)
        assert all(float(g.abs().sum()) == 0.0 for g in grads(loss, c)), (kind, name)
    tensor_zero = fused_loss(c, CrossTokenizerConfig(kind=kind), num_items_in_batch=torch.tensor(0))
    assert float(tensor_zero.detach()) == 0.0 and all(float(g.abs().sum()) == 0 for g in grads(tensor_zero, c))


@pytest.mark.parametrize("bad", [-3, torch.tensor(-3)])
def test_negative_items_are_refused(bad):
    c = random_case(seed=5)
    ids, logprobs = teacher_topk(c, k=6)
    cfg = CrossTokenizerConfig(hard_weight=0.5)
    calls = {
        "fused": lambda: fused_loss(c, cfg, num_items_in_batch=bad),
        "fused top-k": lambda: topk_fused(c, ids, logprobs, cfg, num_items_in_batch=bad),
        "reference": lambda: xref.cross_tokenizer_kd_loss(
            c["h_s"] @ c["w_s"].T, c["h_t"] @ c["w_t"].T, c["s_labels"], c["t_labels"], c["s_groups"],
            c["t_groups"], c["vocab_map"], c["exact_ok"], cfg, bad),
        "reference top-k": lambda: xref.cross_tokenizer_topk_kd_loss(
            c["h_s"] @ c["w_s"].T, ids, logprobs, c["w_t"].shape[0], c["s_labels"], c["t_labels"], c["s_groups"],
            c["t_groups"], c["vocab_map"], c["exact_ok"], cfg, bad),
    }  # fmt: skip
    for name, call in calls.items():
        with pytest.raises(ValueError, match="num_items_in_batch"):
            call()


def test_positive_items_still_divide():
    c = random_case(seed=6)
    cfg = CrossTokenizerConfig(kind="hybrid", hard_weight=0.5)
    out = _three_paths(c, cfg, num_items_in_batch=7)
    total = reference_loss(c, cfg.replace(reduction="sum"))
    for name in ("fused", "reference"):
        torch.testing.assert_close(out[name], total / 7, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out["fused top-k"], out["reference top-k"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hard_weight", [0.0, 0.5])
def test_no_groups_fused_equals_reference_equals_zero(kind, hard_weight):
    """An empty completion: no aligned group (labels still on, or off). The oracle gives what the fused loss
    gives: the CE term only (0 without it), zero KD gradients."""
    c = random_case(seed=3)
    c["s_groups"], c["t_groups"] = torch.full_like(c["s_groups"], -1), torch.full_like(c["t_groups"], -1)
    if hard_weight == 0.0:
        c["s_labels"] = torch.full_like(c["s_labels"], -100)
    cfg = CrossTokenizerConfig(kind=kind, hard_weight=hard_weight)
    out = _three_paths(c, cfg)
    ref_grads = grads(out["reference"], c) if hard_weight else None
    for name, loss in out.items():
        torch.testing.assert_close(loss.double(), out["reference"].double(), rtol=1e-10, atol=1e-12)
        if hard_weight == 0.0:
            assert float(loss.detach()) == 0.0, (kind, name)
            assert all(float(g.abs().sum()) == 0.0 for g in grads(loss, c)), (kind, name)
        else:
            got = ref_grads if name == "reference" else grads(loss, c)
            for a, b in zip(got, ref_grads):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    none = xref.cross_tokenizer_kd_loss(
        c["h_s"] @ c["w_s"].T, c["h_t"] @ c["w_t"].T, c["s_labels"], c["t_labels"], c["s_groups"], c["t_groups"],
        c["vocab_map"], c["exact_ok"], cfg.replace(reduction="none"))  # fmt: skip
    assert none.shape == c["s_labels"].shape


# ------------------------------------------------------------------ the models' own logit transforms (item 1)
from liger_patch_kd.align import CrossTokenizerCollator, VocabMap, byte_level_to_text  # noqa: E402
from liger_patch_kd.demo import BOS, load_corpus  # noqa: E402
from liger_patch_kd.demo.cross_tokenizer import CharTokenizerWithOffsets, train_bpe_tokenizer  # noqa: E402
from liger_patch_kd.trainer.teachers.other_tokenizer import compute_cross_tokenizer_loss  # noqa: E402
from liger_patch_kd.trainer.teachers.other_tokenizer_loss import model_head_inputs  # noqa: E402

from .tiny_models import tiny_model  # noqa: E402

EXAMPLES = [{"prompt": "At dawn, ", "completion": "the fox sees a cat."},
            {"prompt": "", "completion": "A heron watches the old mill; 8 or 9."}]  # fmt: skip
_shift = lambda t: torch.cat([t[:, 1:], torch.full_like(t[:, :1], -100)], 1)  # noqa: E731


@pytest.fixture(scope="module")
def toks():
    char = CharTokenizerWithOffsets(load_corpus())
    bpe = train_bpe_tokenizer(load_corpus()[:8000], 300)
    collator = CrossTokenizerCollator(bpe, char, student_prefix_ids=(BOS,), teacher_prefix_ids=(BOS,))
    return dict(char=char, bpe=bpe, collator=collator, batch=collator(EXAMPLES),
                vocab_map=VocabMap.build(bpe, char, normalize=byte_level_to_text, teacher_vocab_size=len(char)))


def _tiny(arch, vocab, seed):
    return tiny_model(arch, hidden=32, layers=1, vocab=vocab, seed=seed)  # float64


@pytest.mark.parametrize("student_arch, teacher_arch", [("cohere", "granite"), ("llama", "granite"),
                                                        ("cohere", "llama"), ("cohere2", "gemma2")])
@pytest.mark.parametrize("kind", ["hybrid", "chain"])
def test_loss_is_the_references_on_the_models_own_logits(toks, student_arch, teacher_arch, kind):
    """A Granite teacher divides its logits by logits_scaling, a Cohere student multiplies by logit_scale, a
    Gemma-2 teacher soft-caps: the loss and gradients are the reference's on model(...).logits, float64."""
    t = toks
    student = _tiny(student_arch, t["bpe"].get_vocab_size(), seed=1).train()
    teacher = _tiny(teacher_arch, len(t["char"]), seed=2)
    batch = t["batch"]
    cfg = CrossTokenizerConfig(kind=kind, hard_weight=0.5, uld_top_k=32, temperature=1.3)
    out = compute_cross_tokenizer_loss(student, teacher, batch, cfg, t["vocab_map"])
    fused_grads = torch.autograd.grad(out.loss, [p for p in student.parameters()], allow_unused=True)
    with torch.no_grad():
        t_logits = teacher(input_ids=batch["teacher_input_ids"], attention_mask=batch["teacher_attention_mask"]).logits
    s_logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ref_cfg = cfg.replace(softcap=None, teacher_softcap=None)  # the logits below are already capped
    ref = xref.cross_tokenizer_kd_loss(s_logits, t_logits, _shift(batch["labels"]), _shift(batch["teacher_labels"]),
                                       batch["student_align_groups"], batch["teacher_align_groups"], t["vocab_map"],
                                       batch["align_exact_ok"], ref_cfg)  # fmt: skip
    ref_grads = torch.autograd.grad(ref, [p for p in student.parameters()], allow_unused=True)
    torch.testing.assert_close(out.loss, ref, rtol=1e-9, atol=1e-11)
    for a, b in zip(fused_grads, ref_grads):
        if a is None or b is None:
            assert a is None and b is None or float((a if b is None else b).abs().sum()) == 0
            continue
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)
    assert out.soft > 0


def test_offline_topk_student_scale_is_applied(toks):
    """Offline teacher data (top-k of the Granite teacher's own, scaled logits) and a Cohere student."""
    t = toks
    student = _tiny("cohere", t["bpe"].get_vocab_size(), seed=1)
    teacher = _tiny("granite", len(t["char"]), seed=2)
    rows = []
    for example in EXAMPLES:
        ids = torch.tensor([t["collator"].teacher_sequence(example)])
        with torch.no_grad():
            lp = torch.log_softmax(teacher(input_ids=ids).logits, -1)
        values, top = lp.topk(7, dim=-1)
        rows.append(dict(example, teacher_input_ids=ids[0].tolist(), teacher_token_ids=top[0],
                         teacher_logprobs=values[0]))  # fmt: skip
    batch = t["collator"](rows)
    cfg = CrossTokenizerConfig(kind="hybrid", hard_weight=0.5)
    out = compute_cross_tokenizer_loss(student, None, batch, cfg, t["vocab_map"])
    s_logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ref = xref.cross_tokenizer_topk_kd_loss(
        s_logits, batch["teacher_token_ids"], batch["teacher_logprobs"], len(t["char"]), _shift(batch["labels"]),
        _shift(batch["teacher_labels"]), batch["student_align_groups"], batch["teacher_align_groups"],
        t["vocab_map"], batch["align_exact_ok"], cfg,
    )  # fmt: skip
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-6, atol=1e-8)  # the batch's log-probs: float32


def test_unregistered_model_with_a_logit_scale_is_refused():
    class Odd(torch.nn.Module):
        config = type("C", (), {"model_type": "falcon_h1", "lm_head_multiplier": 0.5})()

    h = torch.randn(2, 3)
    with pytest.raises(ValueError, match="logit scale"):
        model_head_inputs(Odd(), h, None)
    Odd.config.lm_head_multiplier = 1.0
    assert model_head_inputs(Odd(), h, None)[0] is h


# ----------------------------------------------------------------- KDTrainer: options and tokenizers
from liger_patch_kd import KDTrainer, KDTrainingArguments  # noqa: E402
from liger_patch_kd.demo import build_model  # noqa: E402

ROWS = [{"prompt": "At dawn, ", "completion": "the fox sees a cat."},
        {"prompt": "The mill ", "completion": "stands by the river."},
        {"prompt": "", "completion": "A heron watches the old mill; 8 or 9."},
        {"prompt": "Night: ", "completion": "owls call twice."}]  # fmt: skip


def _args(tmp_path, **kw):
    return KDTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
        learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        remove_unused_columns=False, **kw,
    )  # fmt: skip


def test_teacher_tokenizer_object_enables_cross_tokenizer_training(toks, tmp_path):
    """KDTrainer(teacher_tokenizer=tok) without kd_teacher_tokenizer: the alignment collator and loss run."""
    student = build_model(toks["bpe"].get_vocab_size(), 32, 1, seed=3, device="cpu")
    teacher = build_model(len(toks["char"]), 32, 1, seed=1, device="cpu")
    trainer = KDTrainer(model=student, teacher_model=teacher, args=_args(tmp_path, kd_hard_weight=0.5),
                        train_dataset=ROWS * 2, processing_class=toks["bpe"], teacher_tokenizer=toks["char"])
    assert trainer.xtok is not None
    trainer.train()
    logged = [h for h in trainer.state.log_history if "kd_soft_loss" in h]
    assert len(logged) == 2 and all(h["kd_soft_loss"] > 0 and h["kd_hard_loss"] > 0 for h in logged), logged


@pytest.mark.parametrize("by_name", [True, False])
def test_cross_tokenizer_sequence_level_kd_is_refused(toks, tmp_path, by_name):
    """The teacher's own generations would reach the student as teacher ids; on-policy steps (kd_lmbda) are
    supported across tokenizers (tests/test_cross_tokenizer_onpolicy.py)."""
    student = build_model(toks["bpe"].get_vocab_size(), 32, 1, seed=3, device="cpu")
    teacher = build_model(len(toks["char"]), 32, 1, seed=1, device="cpu")
    args = _args(tmp_path, kd_seq_kd=True, **({"kd_teacher_tokenizer": "given below"} if by_name else {}))
    with pytest.raises(ValueError, match=r"cross-tokenizer sequence-level KD is not supported.*kd_seq_kd=True"
                                         r".*kd_teacher_tokenizer"):  # fmt: skip
        KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=ROWS,
                  processing_class=toks["bpe"], teacher_tokenizer=toks["char"])  # fmt: skip


# heads of different sizes without a cross-tokenizer option
@pytest.fixture(scope="module")
def hf_toks():
    from transformers import PreTrainedTokenizerFast

    text = load_corpus()[:8000]
    wrap = lambda t: PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>")  # noqa: E731
    return wrap(train_bpe_tokenizer(text, 300)), wrap(train_bpe_tokenizer(text, 464))


def _pair(student_rows, teacher_rows, teacher_dir=None, teacher_tok=None):
    student = build_model(student_rows, 32, 1, seed=3, device="cpu")
    teacher = build_model(teacher_rows, 32, 1, seed=1, device="cpu")
    if teacher_dir is not None:
        if teacher_tok is not None:
            teacher_tok.save_pretrained(teacher_dir)
        teacher.config.save_pretrained(teacher_dir)
        teacher.config._name_or_path = str(teacher_dir)
    return student, teacher


def test_teacher_with_its_own_saved_tokenizer_is_refused(hf_toks, tmp_path):
    """300 vs 464 rows, the teacher's directory holds another tokenizer: no silent padded vocabulary."""
    s_tok, t_tok = hf_toks
    student, teacher = _pair(len(s_tok), len(t_tok), tmp_path / "teacher", t_tok)
    with pytest.raises(ValueError, match=r"tokenizer .*differs.*kd_teacher_tokenizer.*kd_vocab_size"):
        KDTrainer(model=student, teacher_model=teacher, args=_args(tmp_path), train_dataset=ROWS,
                  processing_class=s_tok)  # fmt: skip


def test_unpadded_student_head_next_to_a_longer_unknown_teacher_is_refused(hf_toks, tmp_path):
    s_tok, t_tok = hf_toks
    student, teacher = _pair(len(s_tok), len(t_tok), tmp_path / "weights_only")  # no tokenizer saved there
    with pytest.raises(ValueError, match=r"no tokenizer was found.*kd_teacher_tokenizer.*kd_vocab_size"):
        KDTrainer(model=student, teacher_model=teacher, args=_args(tmp_path), train_dataset=ROWS,
                  processing_class=s_tok)  # fmt: skip


def test_padding_is_taken_when_the_relation_is_known(hf_toks, tmp_path):
    s_tok, _ = hf_toks
    n = len(s_tok)
    # the teacher's saved tokenizer is the student's: its longer head is padding
    student, teacher = _pair(n, n + 16, tmp_path / "same", s_tok)
    trainer = KDTrainer(model=student, teacher_model=teacher, args=_args(tmp_path), train_dataset=ROWS,
                        processing_class=s_tok)  # fmt: skip
    assert trainer.kd_config.vocab_size == n
    # kd_vocab_size given: the user says so, nothing is looked up
    student, teacher = _pair(n, n + 164)
    trainer = KDTrainer(model=student, teacher_model=teacher, args=_args(tmp_path, kd_vocab_size=n),
                        train_dataset=ROWS, processing_class=s_tok)  # fmt: skip
    assert trainer.kd_config.vocab_size == n
    # no tokenizer to be found, both heads padded past len(tokenizer) (Qwen2.5 style): as before
    student, teacher = _pair(n + 8, n + 24)
    trainer = KDTrainer(model=student, teacher_model=teacher, args=_args(tmp_path), train_dataset=ROWS,
                        processing_class=s_tok)  # fmt: skip
    assert trainer.kd_config.vocab_size == n
    # a head shorter than the tokenizer is no padded form of it
    student, teacher = _pair(n, n - 10)
    with pytest.raises(ValueError, match="shorter than the tokenizer"):
        KDTrainer(model=student, teacher_model=teacher, args=_args(tmp_path), train_dataset=ROWS,
                  processing_class=s_tok)  # fmt: skip
