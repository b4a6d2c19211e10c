"""On-policy distillation across tokenizers: the student's sampled ids kept, their text re-tokenized for the
teacher with offsets (align.generated), the cross-tokenizer loss on those rows equal to align.reference's on the
two models' materialised logits, and KDTrainer.train() generating once per optimizer step."""

from __future__ import annotations

import pytest
import torch

from liger_patch_kd.align import CrossTokenizerCollator, CrossTokenizerConfig, VocabMap, byte_level_to_text
from liger_patch_kd.align import reference as xref
from liger_patch_kd.align.generated import GeneratedRows, decode_with_offsets
from liger_patch_kd.demo import BOS, EOS, load_corpus
from liger_patch_kd.demo import build_model as _model
from liger_patch_kd.demo.cross_tokenizer import CharTokenizerWithOffsets, train_bpe_tokenizer
from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments
from liger_patch_kd.trainer.rollouts.onpolicy import GENERATED, OnPolicySteps
from liger_patch_kd.trainer.rollouts.retokenized import rows_maker
from liger_patch_kd.trainer.teachers.other_tokenizer import compute_cross_tokenizer_loss, generated_rows

pytestmark = pytest.mark.usefixtures("clean_patches")

PROMPTS = [{"prompt": "At dawn, "}, {"prompt": "The mill "}, {"prompt": ""}, {"prompt": "Night: owls"}]


@pytest.fixture(scope="module")
def toks():
    char = CharTokenizerWithOffsets(load_corpus())
    bpe = train_bpe_tokenizer(load_corpus()[:8000], 300)
    collator = CrossTokenizerCollator(bpe, char, student_prefix_ids=(BOS,), teacher_prefix_ids=(BOS,))
    return dict(char=char, bpe=bpe, collator=collator)


def _vocab_map(toks):
    return VocabMap.build(toks["bpe"], toks["char"], normalize=byte_level_to_text, teacher_vocab_size=len(toks["char"]))


def test_decode_with_offsets_spans_whole_characters_and_replaces_invalid_bytes():
    pieces = ["é".encode()[:1], "é".encode()[1:] + b"t", b"", b"\xff", b" a"]
    text, offsets = decode_with_offsets(pieces)
    assert text == "ét\ufffd a"
    assert offsets == [(0, 1), (0, 2), (2, 2), (2, 3), (3, 5)]  # both pieces of "é" report it whole


def test_generated_rows_keep_the_students_ids_and_give_the_teacher_its_own(toks):
    """Structure, by hand: the student row is its prompt + sampled ids, labels on the completion only (EOS
    included), the teacher row its own prompt + the completion's text in its tokens + its EOS, one group per
    aligned span, EOS paired with EOS, padding neither labelled nor grouped."""
    bpe, char, collator = toks["bpe"], toks["char"], toks["collator"]
    rows = GeneratedRows.build(collator, bpe.get_vocab_size(), {EOS}, char.eos_token_id)
    prompt = collator([{"prompt": "At dawn, "}])
    s_prompt = prompt["input_ids"][0].tolist()
    t_prompt = prompt["teacher_input_ids"][0, : int(prompt["teacher_prompt_length"][0])].tolist()
    assert t_prompt == [BOS] + char.encode("At dawn, ") and prompt["labels"].eq(-100).all()
    done = bpe.encode("the fox sees a cat.").ids + [EOS]
    cut = bpe.encode("é fox").ids  # stopped at max_new_tokens, no EOS; a multi-byte character the teacher lacks
    batch = rows([s_prompt, [BOS]], [done, cut], [t_prompt, [BOS]])
    assert batch["input_ids"][0].tolist() == s_prompt + done
    assert batch["labels"][0].tolist() == [-100] * len(s_prompt) + done  # EOS scored
    assert batch["labels"][1].tolist() == [-100] + cut + [-100] * (len(done) + len(s_prompt) - len(cut) - 1)
    assert batch["attention_mask"][1].sum() == 1 + len(cut)
    assert batch["teacher_input_ids"][0].tolist() == t_prompt + char.encode("the fox sees a cat.") + [EOS]
    groups, t_groups = batch["student_align_groups"], batch["teacher_align_groups"]
    assert groups[0, -2] == t_groups[0, len(t_prompt) + 18] >= 0 and batch["align_exact_ok"][0, -2]  # EOS <-> EOS
    n0 = int(groups[0].max()) + 1
    assert n0 == len(done)  # a character teacher: every BPE token is one group (the space joins the next word)
    assert (groups[1][groups[1] >= 0] >= n0).all() and (groups[1, len(cut) :] == -1).all()  # padding: no group
    t_labels, t_rows = batch["teacher_labels"][:, 1:], t_groups[:, :-1]  # row r groups token r + 1
    assert (t_labels[t_rows >= 0] >= 0).all() and (t_labels[t_rows < 0] == -100).all()
    assert "é" not in char.get_vocab() and batch["teacher_input_ids"][1].tolist()[:5] == [BOS] + char.encode(" fox")


class ForcedStop:
    """Samples with the model's own generate(), then puts EOS at `at` in row 0, so some rows stop early."""

    def __init__(self, model, at: int = 2):
        self.inner, self.at, self.calls = model.generate, at, []
        model.generate = self

    def __call__(self, **kwargs):
        self.calls.append(kwargs["input_ids"].shape[0])
        out = self.inner(**kwargs)
        out[0, kwargs["input_ids"].shape[1] + self.at] = EOS
        return out


@pytest.mark.parametrize("kind", ["hybrid", "uld", "next_byte", "chain"])
def test_onpolicy_rows_loss_equals_reference_in_float64(toks, kind):
    bpe, char, collator = toks["bpe"], toks["char"], toks["collator"]
    student = _model(bpe.get_vocab_size(), 32, 1, seed=0, device="cpu").double()
    teacher = _model(len(char), 32, 1, seed=1, device="cpu").double().eval()
    stop = ForcedStop(student)
    args = KDTrainingArguments(output_dir="unused", report_to="none", use_cpu=True, kd_lmbda=1.0, kd_max_new_tokens=7,
                               kd_num_generations=2, seed=4)  # fmt: skip
    rows, vocab_map = generated_rows(collator, student, bpe, teacher, _vocab_map(toks))
    batches = [collator(PROMPTS[:2]), collator(PROMPTS[2:])]
    out = OnPolicySteps(args).replace(student, batches, tokenizer=bpe, step=0, device=torch.device("cpu"),
                                      make_rows=rows_maker(rows, collator))  # fmt: skip
    assert stop.calls == [8] and all(b[GENERATED] for b in out)
    stopped = [bool(row[row != -100][-1] == EOS) for b in out for row in b["labels"]]
    assert any(stopped) and not all(stopped)
    cfg = CrossTokenizerConfig(kind=kind, hard_weight=0.5, uld_top_k=16, temperature=1.5, beta=0.3)
    items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in out)
    shift = lambda t: torch.cat([t[:, 1:], torch.full_like(t[:, :1], -100)], 1)  # noqa: E731
    for batch in out:
        fused = compute_cross_tokenizer_loss(student, teacher, batch, cfg, vocab_map, items)
        (fused_grad,) = torch.autograd.grad(fused.loss, student.lm_head.weight)
        with torch.no_grad():
            t_logits = teacher(input_ids=batch["teacher_input_ids"], attention_mask=batch["teacher_attention_mask"])
        s_logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        ref = xref.cross_tokenizer_kd_loss(s_logits, t_logits.logits, shift(batch["labels"]),
                                           shift(batch["teacher_labels"]), batch["student_align_groups"],
                                           batch["teacher_align_groups"], vocab_map, batch["align_exact_ok"], cfg,
                                           items)  # fmt: skip
        (ref_grad,) = torch.autograd.grad(ref, student.lm_head.weight)
        # float64 on both sides: equal up to the reduction order of a few hundred terms
        torch.testing.assert_close(fused.loss, ref, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(fused_grad, ref_grad, rtol=1e-9, atol=1e-12)
        assert fused.soft > 0


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
        learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        kd_teacher_tokenizer="given below", kd_cross_tokenizer_loss="hybrid", kd_uld_top_k=32, kd_hard_weight=0.5,
        remove_unused_columns=False, kd_lmbda=1.0, kd_max_new_tokens=6,
    )  # fmt: skip
    return KDTrainingArguments(**{**base, **kw})


@pytest.mark.parametrize(
    "rows, patched",
    [(PROMPTS, False), ([{"prompt": p["prompt"], "completion": "the fox."} for p in PROMPTS], True)],
    ids=["prompt-only", "prompt+completion, patched student"],
)  # fmt: skip
def test_kd_trainer_trains_on_policy_across_tokenizers_bf16_accumulation_one_generate_per_step(
    toks, tmp_path, rows, patched
):
    student = _model(toks["bpe"].get_vocab_size(), 32, 1, seed=3, device="cpu")
    stop = ForcedStop(student)
    trainer = KDTrainer(model=student, teacher_model=_model(len(toks["char"]), 32, 1, 1, "cpu"),
                        args=_args(tmp_path, bf16=True, use_kd_patch=patched), train_dataset=rows * 2,
                        processing_class=toks["bpe"], teacher_tokenizer=toks["char"])  # fmt: skip
    trainer.train()
    assert stop.calls == [4, 4]  # one generate() per optimizer step, both micro-batches' prompts together
    logged = [h for h in trainer.state.log_history if "kd_soft_loss" in h]
    assert len(logged) == 2 and all(h["kd_soft_loss"] > 0 and h["kd_hard_loss"] > 0 for h in logged), logged


def test_off_policy_steps_refuse_prompt_only_rows_across_tokenizers(toks, tmp_path):
    with pytest.raises(ValueError, match="kd_lmbda=0.0 .* prompts without a completion"):  # before training
        KDTrainer(model=_model(toks["bpe"].get_vocab_size(), 32, 1, seed=3, device="cpu"),
                  teacher_model=_model(len(toks["char"]), 32, 1, 1, "cpu"),
                  args=_args(tmp_path, kd_lmbda=0.0), train_dataset=PROMPTS, processing_class=toks["bpe"],
                  teacher_tokenizer=toks["char"])  # fmt: skip


@pytest.mark.parametrize(
    "option, match",
    [({"kd_seq_kd": True}, "sequence-level KD is not supported.*kd_seq_kd=False"),
     ({"kd_onpolicy_loss": "k3"}, "kd_onpolicy_loss='k3'.*another tokenizer.*'divergence'")],
)  # fmt: skip
def test_what_cross_tokenizer_on_policy_cannot_do_is_refused(toks, tmp_path, option, match):
    with pytest.raises(ValueError, match=match):
        KDTrainer(model=_model(toks["bpe"].get_vocab_size(), 32, 1, seed=3, device="cpu"),
                  teacher_model=_model(len(toks["char"]), 32, 1, 1, "cpu"), args=_args(tmp_path, **option),
                  train_dataset=PROMPTS, processing_class=toks["bpe"], teacher_tokenizer=toks["char"])  # fmt: skip


def test_a_teacher_without_an_eos_is_refused_before_training(toks):
    teacher_tok = CharTokenizerWithOffsets(load_corpus())
    teacher_tok.eos_token_id = None  # and no teacher model to read one from (a served teacher)
    collator = CrossTokenizerCollator(toks["bpe"], teacher_tok)
    with pytest.raises(ValueError, match="teacher EOS id None"):
        generated_rows(collator, _model(300, 32, 1, 0, "cpu"), toks["bpe"], None, _vocab_map(toks))


@pytest.mark.parametrize("kind", ["hybrid", "exact", "uld", "next_byte", "chain"])
def test_the_eos_group_is_scored_by_the_kd_term_except_by_the_byte_chain(toks, kind):
    """A completion that stopped has one more group (EOS <-> EOS) than the same text cut at max_new_tokens; every
    kind but "chain" scores it (chain compares bytes of text, which EOS has none of: CE scores stopping there)."""
    bpe, char, collator = toks["bpe"], toks["char"], toks["collator"]
    student = _model(bpe.get_vocab_size(), 32, 1, seed=0, device="cpu").double()
    teacher = _model(len(char), 32, 1, seed=1, device="cpu").double()
    rows, vocab_map = generated_rows(collator, student, bpe, teacher, _vocab_map(toks))
    prompt = collator([{"prompt": "At dawn, "}])
    s_prompt, t_prompt = prompt["input_ids"][0].tolist(), prompt["teacher_input_ids"][0].tolist()
    text = bpe.encode("the fox").ids
    cfg = CrossTokenizerConfig(kind=kind, reduction="sum")
    stopped = compute_cross_tokenizer_loss(student, teacher, rows([s_prompt], [text + [EOS]], [t_prompt]), cfg,
                                           vocab_map)  # fmt: skip
    cut = compute_cross_tokenizer_loss(student, teacher, rows([s_prompt], [text], [t_prompt]), cfg, vocab_map)
    eos_term = float(stopped.soft - cut.soft)  # causal: the text's groups score the same in both rows
    assert eos_term == 0.0 if kind == "chain" else eos_term > 0.01, eos_term


def test_conversational_prompts_keep_each_models_own_chat_template():
    """{"prompt": [messages]} rows: each side's prompt is its own template's rendering (generation prompt added);
    the sampled completion (multi-byte characters included) reaches the teacher as the same text in its tokens."""
    from .test_align import BRACKETS, CHATML, _chat_tokenizer

    corpus = "the user asks: what is a cat? the cat is an animal. café 🙂 " * 30
    student = _chat_tokenizer(train_bpe_tokenizer(corpus, 300), CHATML)
    teacher = _chat_tokenizer(train_bpe_tokenizer(corpus.upper() + corpus, 330), BRACKETS)
    collator = CrossTokenizerCollator(student, teacher)
    prompt = [{"role": "user", "content": "what is a cat?"}]
    batch = collator([{"prompt": prompt}])
    assert "kd_has_completion" in batch and not batch["kd_has_completion"].any() and batch["labels"].eq(-100).all()
    t_prompt = batch["teacher_input_ids"][0, : int(batch["teacher_prompt_length"][0])].tolist()
    assert teacher.decode(t_prompt) == teacher.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    rows = GeneratedRows.build(collator, len(student), {student.eos_token_id}, teacher.eos_token_id)
    sampled = student.encode("a café 🙂", add_special_tokens=False) + [student.eos_token_id]
    out = rows([batch["input_ids"][0].tolist()], [sampled], [t_prompt])
    t_ids = out["teacher_input_ids"][0].tolist()
    assert t_ids[: len(t_prompt)] == t_prompt and t_ids[-1] == teacher.eos_token_id
    assert teacher.decode(t_ids[len(t_prompt) : -1]) == "a café 🙂"
    s_groups, t_groups = out["student_align_groups"][0], out["teacher_align_groups"][0]
    assert torch.equal(s_groups[s_groups >= 0].unique(), t_groups[t_groups >= 0].unique())
    assert s_groups[-2] >= 0 and s_groups[: len(batch["input_ids"][0]) - 1].eq(-1).all()  # the prompt: no group
