"""On-policy distillation through KDTrainer: TRL-style prompt datasets, one generation pass per optimizer step,
completions scored up to and including EOS, seeded rollouts, and the sampled-token losses against their
materialised reference."""

import copy
import logging
import math

import pytest
import torch

import liger_patch_kd.models as M
import liger_patch_kd.trainer.rollouts.generate as R
from liger_patch_kd.batch.prompts import PromptCollator, tokenize_prompt_row
from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments
from liger_patch_kd.trainer.rollouts.generate import RolloutSettings, generate_rollouts, prompts_of
from liger_patch_kd.trainer.rollouts.onpolicy import GENERATED, OnPolicySteps

from .tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")

CHATML = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXT = "the cat sat on the mat. a dog ran to the park. the sun is warm today. " * 20


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    from liger_patch_kd.demo.cross_tokenizer import train_bpe_tokenizer

    tok = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe_tokenizer(TEXT, 200), pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tok.chat_template = CHATML
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)  # the tiny models' ids
    return tok


def _args(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        seed=0, dataloader_num_workers=0, use_kd_patch=True, kd_lmbda=1.0, kd_max_new_tokens=5,
        remove_unused_columns=False,
    )  # fmt: skip
    return KDTrainingArguments(**{**base, **overrides})


class CountingGenerate:
    """Wraps a model's generate to count calls and the rows each call generates."""

    def __init__(self, model):
        self.calls, self.inner = [], model.generate
        model.generate = self

    def __call__(self, **kwargs):
        self.calls.append(kwargs["input_ids"].shape[0])
        return self.inner(**kwargs)


PROMPTS = [{"prompt": p} for p in ("the cat", "a dog ran", "the sun is", "on the mat.", "the", "a dog")] * 2
CHATS = [{"prompt": [{"role": "user", "content": p["prompt"]}]} for p in PROMPTS]


@pytest.mark.parametrize("rows", [PROMPTS, CHATS], ids=["text", "conversational"])
def test_prompt_datasets_train_with_bf16_and_accumulation_one_generate_per_step(tmp_path, tokenizer, rows):
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    counter = CountingGenerate(student)
    trainer = KDTrainer(
        model=student, teacher_model=tiny_model("llama", dtype=torch.float32, seed=2), processing_class=tokenizer,
        args=_args(tmp_path, bf16=True), train_dataset=rows,
    )  # fmt: skip
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    # one generate() per optimizer step, for both micro-batches' prompts together (2 x 2 rows)
    assert counter.calls == [4, 4, 4]
    assert len(trainer.kd_rollout_seconds) == 3


def test_rollouts_end_at_eos_which_is_scored_and_padding_never_is(tokenizer):
    class FixedLength(torch.nn.Module):
        """Emits 5, 6, EOS for the first row, 7 then max_new_tokens of 8 for the second (no EOS)."""

        def __init__(self):
            super().__init__()
            from transformers import GenerationConfig

            self.generation_config = GenerationConfig(eos_token_id=2, pad_token_id=0, bos_token_id=1)

        def generate(self, input_ids, max_new_tokens, **_):
            rows = [[5, 6, 2] + [0] * (max_new_tokens - 3), [7] + [8] * (max_new_tokens - 1)]
            order = [0, 1] if input_ids[0, -1] == 11 else [1, 0]  # rows are sorted by prompt length
            return torch.cat([input_ids, torch.tensor([rows[i] for i in order])], dim=1)

    steps = OnPolicySteps(_args_plain(kd_max_new_tokens=6))
    batch = {
        "input_ids": torch.tensor([[10, 11, 0, 0], [12, 13, 14, 15]]),
        "attention_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]),
        "labels": torch.tensor([[-100, -100, -100, -100], [-100, -100, 14, 15]]),
    }
    (out,) = steps.replace(FixedLength(), [batch], tokenizer=tokenizer, step=0, device=torch.device("cpu"))
    assert out[GENERATED]
    assert out["input_ids"][0].tolist()[:5] == [10, 11, 5, 6, 2]
    assert out["labels"][0].tolist() == [-100, -100, 5, 6, 2, -100, -100, -100]  # EOS scored, padding not
    assert out["labels"][1].tolist() == [-100, -100, 7, 8, 8, 8, 8, 8]  # the prompt is the tokens before labels
    assert out["attention_mask"][0].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]


def _args_plain(**overrides):
    return KDTrainingArguments(output_dir="unused", report_to="none", use_cpu=True, **overrides)


def test_the_same_seed_gives_the_same_completions_and_the_global_rng_is_untouched():
    model = tiny_model("llama", dtype=torch.float32, seed=1)
    prompts = [[5, 6, 7], [8], []]
    settings = RolloutSettings(max_new_tokens=6, num_generations=2, seed=3)
    kw = dict(pad_id=0, eos_ids={2}, start_id=1)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a = generate_rollouts(model, prompts, settings, step=4, **kw)
    assert torch.equal(torch.get_rng_state(), state)
    b = generate_rollouts(model, prompts, settings, step=4, **kw)
    c = generate_rollouts(model, prompts, settings, step=5, **kw)
    assert a == b and a != c
    assert [r.prompt for r in a] == [[5, 6, 7], [5, 6, 7], [8], [8], [1], [1]]  # prompt-major, BOS for an empty one
    assert not model.training  # it was in eval mode before, and is again


def test_off_policy_steps_refuse_prompt_only_rows_and_mix_with_completions(tmp_path, tokenizer):
    teacher = tiny_model("llama", dtype=torch.float32, seed=2)
    with pytest.raises(ValueError, match="kd_lmbda=0.5"):
        KDTrainer(
            model=tiny_model("llama", dtype=torch.float32, seed=1), teacher_model=teacher, processing_class=tokenizer,
            args=_args(tmp_path, kd_lmbda=0.5, max_steps=6), train_dataset=PROMPTS,
        ).train()  # fmt: skip
    rows = [{**p, "completion": " sat on the mat."} for p in PROMPTS]
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    counter = CountingGenerate(student)
    trainer = KDTrainer(
        model=student, teacher_model=teacher, processing_class=tokenizer,
        args=_args(tmp_path, kd_lmbda=0.5, max_steps=6), train_dataset=rows,
    )  # fmt: skip
    trainer.train()
    assert 0 < len(counter.calls) < 6  # some steps generated, some trained on the dataset's completions


def test_prompt_rows_tokenize_as_trl_does(tokenizer):
    prompt, completion = tokenize_prompt_row(tokenizer, {"prompt": "the cat", "completion": " sat"})
    assert prompt == tokenizer("the cat")["input_ids"] and completion[-1] == tokenizer.eos_token_id
    chat = {"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"}]}
    prompt, completion = tokenize_prompt_row(tokenizer, chat)
    text = tokenizer.decode(prompt + completion)
    assert text.endswith("<|assistant|>sat</s>") and tokenizer.decode(prompt).endswith("<|assistant|>")
    batch = PromptCollator(tokenizer)([{"prompt": "the cat"}, chat])
    assert batch["kd_has_completion"].tolist() == [False, True]
    assert (batch["labels"][0] == -100).all() and prompts_of(batch)[0] == tokenizer("the cat")["input_ids"]
    with pytest.raises(ValueError, match="assistant"):
        tokenize_prompt_row(tokenizer, {"messages": [{"role": "user", "content": "x"}]})


def test_a_batch_of_rows_tokenizes_in_one_call_as_row_by_row(tokenizer, monkeypatch):
    """tokenize_prompt_rows: text prompts (with BOS), text completions (EOS added once), conversational rows and
    messages in one batch give each row what tokenize_prompt_row gives it alone, with the text prompts in one
    tokenizer call and the completions in another."""
    from liger_patch_kd.batch.prompts import tokenize_prompt_rows

    chat = {"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"}]}
    rows = [{"prompt": "the cat"}, {"prompt": "a dog", "completion": " ran to the park"}, chat,
            {"prompt": [{"role": "user", "content": "the sun"}]}, {"prompt": "", "completion": ""},
            {"prompt": "the mat", "completion": " warm</s>"}]  # fmt: skip
    alone = [tokenize_prompt_row(tokenizer, row) for row in rows]
    calls = []
    original = type(tokenizer).__call__
    monkeypatch.setattr(
        type(tokenizer), "__call__", lambda self, text, **kw: calls.append(text) or original(self, text, **kw)
    )
    assert tokenize_prompt_rows(tokenizer, rows) == alone
    text_calls = [c for c in calls if isinstance(c, list) and len(c) > 1]
    assert text_calls == [["the cat", "a dog", "", "the mat"], [" ran to the park", "", " warm</s>"]]
    assert alone[5][1].count(tokenizer.eos_token_id) == 1 and alone[4][1] == [tokenizer.eos_token_id]
    with pytest.raises(ValueError, match=r"^prompt row 2 of this batch: 'prompt' must be a string"):
        tokenize_prompt_rows(tokenizer, [rows[0], rows[1], {"prompt": 5}])
    # a conversation of the assistant's turn alone: no prompt turn to render, a one-line fix (was the template's
    # "Cannot apply chat template to an empty conversation")
    for row in ({"messages": [{"role": "assistant", "content": "sat"}]}, {"prompt": [], "completion": []}):
        with pytest.raises(ValueError, match=r"^a conversational prompt needs at least one turn .*add the turn it "
                                             r"answers, or give the text as \{'text': \.\.\.\}"):  # fmt: skip
            tokenize_prompt_row(tokenizer, row)


@pytest.mark.parametrize("loss", ["pg", "k1", "k3", "divergence"])
def test_onpolicy_losses_fused_equal_materialised_on_the_same_rollouts(tmp_path, tokenizer, loss):
    student = tiny_model("qwen3", seed=1)  # float64
    teacher = tiny_model("qwen3", seed=2)
    batch = PromptCollator(tokenizer)(PROMPTS[:4])
    # transformers' sampling is not float64-safe (NaN probabilities): the rollouts come from a float32 copy
    steps = OnPolicySteps(_args(tmp_path, kd_num_generations=2))
    sampler = copy.deepcopy(student).float()
    (generated,) = steps.replace(sampler, [batch], tokenizer=tokenizer, step=0, device=torch.device("cpu"))
    assert generated["input_ids"].shape[0] == 8  # two completions per prompt
    scored = int((generated["labels"][:, 1:] != -100).sum())
    results = []
    for use_kd_patch in (True, False):
        model = copy.deepcopy(student)
        trainer = KDTrainer(
            model=model, teacher_model=teacher, processing_class=tokenizer, train_dataset=PROMPTS,
            args=_args(tmp_path, use_kd_patch=use_kd_patch, kd_onpolicy_loss=loss),
        )  # fmt: skip
        loss_value = trainer.compute_loss(model, dict(generated), num_items_in_batch=torch.tensor(scored))
        loss_value.backward()
        results.append((loss_value.detach(), [p.grad.clone() for p in model.parameters()]))
        M.revert_kd_patch(model=model)
    (loss_f, grads_f), (loss_m, grads_m) = results
    assert loss_f != 0
    # float64 models; fused and materialised sum in other orders: ~1e-13 relative through the decoder
    torch.testing.assert_close(loss_f, loss_m, rtol=1e-9, atol=1e-12)
    for a, b in zip(grads_f, grads_m):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


def test_onpolicy_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="kd_generation_temperature=1"):
        _args(tmp_path, kd_onpolicy_loss="pg", kd_generation_temperature=0.7)
    with pytest.raises(ValueError, match="kd_onpolicy_loss"):
        _args(tmp_path, kd_onpolicy_loss="reverse")
    with pytest.raises(ValueError, match="kd_num_generations"):
        _args(tmp_path, kd_num_generations=0)
    with pytest.raises(ValueError, match="kd_generation_cache"):
        _args(tmp_path, kd_generation_cache="paged")
    with pytest.raises(ValueError, match="no offline store"):
        KDTrainer(model=tiny_model("llama"), args=_args(tmp_path), train_dataset=[{"input_ids": [1, 2, 3]}])
    with pytest.raises(ValueError, match="processing_class"):
        KDTrainer(
            model=tiny_model("llama"), teacher_model=tiny_model("llama"), args=_args(tmp_path), train_dataset=PROMPTS
        )


def test_a_patched_student_generates_with_its_own_forward():
    """generate() on a patched model sees the model's own forward (logits_to_keep: last-position logits only at
    prefill), and samples exactly what the unpatched model samples."""
    import inspect

    plain = tiny_model("llama", dtype=torch.float32, seed=1)
    patched = copy.deepcopy(plain)
    M.apply_kd_patch(model=patched)
    with M.original_forward(patched) as model:
        assert "logits_to_keep" in inspect.signature(model.forward).parameters
    assert patched.forward.func is M.kd_causal_lm_forward  # put back: the instance's KD forward again
    settings = RolloutSettings(max_new_tokens=5, seed=1)
    kw = dict(pad_id=0, eos_ids={2}, start_id=1)
    prompts = [[5, 6], [7]]
    assert generate_rollouts(patched, prompts, settings, **kw) == generate_rollouts(plain, prompts, settings, **kw)


def test_evaluation_rows_without_a_completion_are_refused_not_scored_as_zero(tmp_path, tokenizer):
    """Evaluation scores the rows' completions and generates none: prompt-only evaluation rows (which on-policy
    training takes) would give eval_loss 0. Refused by index when KDTrainer is built; a prompt-only dataset given to
    evaluate() later is refused at its first batch; rows with a completion evaluate to a positive loss."""
    from datasets import Dataset

    teacher = tiny_model("llama", dtype=torch.float32, seed=2)
    build = lambda evaluation: KDTrainer(  # noqa: E731
        model=tiny_model("llama", dtype=torch.float32, seed=1), teacher_model=teacher, processing_class=tokenizer,
        args=_args(tmp_path), train_dataset=PROMPTS, eval_dataset=evaluation,
    )  # fmt: skip
    completed = [{**p, "completion": " sat on the mat."} for p in PROMPTS[:4]]
    for evaluation, where in ((PROMPTS[:4], r"eval_dataset\[0\]"), ([*completed, PROMPTS[0]], r"eval_dataset\[4\]"),
                              ({"held": CHATS[:2]}, r"eval_dataset\['held'\]\[0\]"),
                              (Dataset.from_list(PROMPTS[:4]), r"eval_dataset\[0\]"),
                              (Dataset.from_list([*completed[:2], PROMPTS[0]]), r"eval_dataset\[2\]")):  # fmt: skip
        with pytest.raises(ValueError, match=where + " is a prompt without a completion.*eval_loss would be 0"):
            build(evaluation)
    trainer = build(completed)
    assert trainer.evaluate()["eval_loss"] > 0
    with pytest.raises(ValueError, match="evaluation batch holds prompts without a completion"):
        trainer.evaluate(eval_dataset=PROMPTS[:2])


def test_messages_rows_ending_with_the_users_turn_are_refused_with_the_prompt_form(tmp_path, tokenizer):
    """A conversation ending in the user's turn has no completion; the prompt-only form is {'prompt': [turns]}:
    said when KDTrainer is built (the first batch comes only once training started), for training rows and
    evaluation rows."""
    asked = [{"messages": [{"role": "user", "content": p["prompt"]}]} for p in PROMPTS]
    build = lambda train, evaluation=None: KDTrainer(  # noqa: E731
        model=tiny_model("llama", dtype=torch.float32, seed=1), processing_class=tokenizer, args=_args(tmp_path),
        teacher_model=tiny_model("llama", dtype=torch.float32, seed=2), train_dataset=train, eval_dataset=evaluation,
    )  # fmt: skip
    for train, evaluation, where in ((asked, None, "train_dataset"), (PROMPTS, asked, "eval_dataset")):
        with pytest.raises(ValueError, match=f"{where}: its 'messages' rows end with the 'user' turn.*'prompt'"):
            build(train, evaluation)
    with pytest.raises(ValueError, match=r"for a prompt alone give \{'prompt': \[turns\]\}"):
        tokenize_prompt_row(tokenizer, asked[0])
    build(CHATS)  # the prompt-only form of the same conversations


def test_a_prompt_without_a_completion_anywhere_in_the_rows_is_refused_before_training_off_policy_steps():
    """Rows mixing prompt + completion and prompts alone, with off-policy steps (kd_lmbda < 1): refused when the
    trainer is built, naming the first prompt alone, not at the first off-policy step that meets it."""
    from liger_patch_kd.trainer.dataset_setup import check_completions_for_off_policy

    class Args:
        generates_every_step, kd_lmbda, kd_onpolicy_warmup_steps = False, 0.5, 0

    rows = [{"prompt": "a", "completion": " b"}] * 3 + [{"prompt": "c"}] + [{"prompt": "d", "completion": " e"}]
    with pytest.raises(ValueError, match=r"kd_lmbda=0.5 .* prompts without a completion \(row 3 the first\)"):
        check_completions_for_off_policy(Args(), rows)
    datasets = pytest.importorskip("datasets")
    with pytest.raises(ValueError, match=r"\(row 3 the first\)"):
        check_completions_for_off_policy(Args(), datasets.Dataset.from_list(
            [{"prompt": r["prompt"], "completion": r.get("completion")} for r in rows]))
    check_completions_for_off_policy(Args(), rows[:3])  # every row completed
    Args.generates_every_step = True
    check_completions_for_off_policy(Args(), rows)  # every step generated: completions never read


def test_rollout_rows_are_the_row_by_row_collation_of_prompt_plus_completion():
    """rollout_batch builds its rows on the joined ids: the same batch as padding each row's prompt + completion
    (labels: the completion) one by one, and each behaviour log-prob at its own token's position."""
    from liger_patch_kd.batch.columns import BEHAVIOUR
    from liger_patch_kd.teacher import TeacherDataCollator
    from liger_patch_kd.trainer.rollouts.generate import Rollout, rollout_batch

    g = torch.Generator().manual_seed(0)
    rollouts = []
    for prompt, completion in ((3, 4), (1, 0), (6, 2), (2, 7), (5, 1)):
        p, c = torch.randint(1, 99, (prompt,), generator=g).tolist(), torch.randint(1, 99, (completion,), generator=g)
        logprobs = tuple((-torch.rand(completion, generator=g)).tolist())
        rollouts.append(Rollout(p, c.tolist(), completion % 2 == 1, logprobs))
    got = rollout_batch(rollouts, pad_id=0, ignore_index=-7, behaviour=True)
    rows = [{"input_ids": r.prompt + r.completion, "labels": [-7] * len(r.prompt) + r.completion} for r in rollouts]
    expected = TeacherDataCollator(pad_token_id=0, ignore_index=-7)(rows)
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(got[key], expected[key]), key
    behaviour = torch.zeros(got["input_ids"].shape)
    for row, r in enumerate(rollouts):
        behaviour[row, len(r.prompt) : len(r.prompt) + len(r.completion)] = torch.tensor(r.logprobs)
    assert torch.equal(got[BEHAVIOUR], behaviour)
    with pytest.raises(ValueError, match="rollout 1 has no behaviour log-prob"):
        rollout_batch([rollouts[0], Rollout([1], [2], False, None)], pad_id=0, behaviour=True)


@pytest.mark.parametrize("beta,temperature", [(0.5, 1.0), (0.0, 2.0), (1.0, 0.5)])
@pytest.mark.parametrize("use_kd_patch", [True, False], ids=["fused", "materialised"])
def test_a_kd_term_of_weight_zero_runs_no_teacher_and_trains_cross_entropy(tmp_path, tokenizer, use_kd_patch, beta,
                                                                          temperature):  # fmt: skip
    """kd_soft_weight=0 (sequence-level KD's cross-entropy): the teacher's forward never runs in a step, the loss is
    the float64 cross-entropy of the completions on materialised logits whatever the KD term's beta and temperature
    (0 on a batch with nothing scored, num_items_in_batch 0), and neither kd_soft_loss nor kd_top1_agreement is
    logged (a term against no teacher); kd_hard_loss is. Trained with bf16 too: fp32 weights under bf16 autocast,
    and bf16 weights."""
    import torch.nn.functional as F

    student, teacher = tiny_model("llama", dtype=torch.float64, seed=1), tiny_model("llama", seed=2)
    calls = []
    teacher.register_forward_pre_hook(lambda *a: calls.append(1))
    rows = [{"prompt": "the cat", "completion": " sat on the mat"}, {"prompt": "a dog", "completion": " ran to"}] * 4
    options = dict(kd_lmbda=0.0, kd_soft_weight=0.0, kd_hard_weight=1.0, use_kd_patch=use_kd_patch, kd_beta=beta,
                   kd_temperature=temperature, gradient_accumulation_steps=1)  # fmt: skip
    args = _args(tmp_path, learning_rate=0.0, **options)
    trainer = KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows, processing_class=tokenizer)
    batch = trainer.data_collator(rows[:2])
    scored = batch["labels"][:, 1:] != -100
    loss = trainer.compute_loss(student, dict(batch), num_items_in_batch=scored.sum())
    with torch.no_grad():
        logits = copy.deepcopy(student).double()(input_ids=batch["input_ids"]).logits[:, :-1]
    expected = F.cross_entropy(logits[scored], batch["labels"][:, 1:][scored], reduction="sum") / scored.sum()
    # float64 weights: the fused chunks' fp32 log-softmax rounds a loss of order 5 to ~1e-6 relative
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5)
    unscored = dict(batch, labels=torch.full_like(batch["labels"], -100))
    assert float(trainer.compute_loss(student, unscored, num_items_in_batch=torch.tensor(0)).detach()) == 0.0
    trainer.train()
    for dtype in (torch.float32, torch.bfloat16):  # bf16 autocast over fp32 weights, then bf16 weights
        bf16 = KDTrainer(model=tiny_model("llama", dtype=dtype, seed=1), teacher_model=teacher, args=_args(
            tmp_path, bf16=True, **options), train_dataset=rows, processing_class=tokenizer)  # fmt: skip
        bf16.train()
        assert all(math.isfinite(h["loss"]) for h in bf16.state.log_history if "loss" in h)
    assert calls == []
    for run in (trainer, bf16):
        logged = [h for h in run.state.log_history if "loss" in h]
        assert logged and all("kd_hard_loss" in h and "kd_soft_loss" not in h and "kd_top1_agreement" not in h
                              for h in logged)  # fmt: skip


def test_on_policy_steps_with_a_kd_term_of_weight_zero_run_no_teacher_under_every_estimator(tmp_path, tokenizer):
    """The estimators (behaviour log-probs from the sampler) with kd_soft_weight=0: the steps train, on the
    student's own completions, without a teacher forward."""
    teacher = tiny_model("llama", seed=2)
    calls = []
    teacher.register_forward_pre_hook(lambda *a: calls.append(1))
    for loss in ("pg", "k1", "divergence"):
        args = _args(tmp_path, kd_onpolicy_loss=loss, kd_soft_weight=0.0, kd_hard_weight=1.0, max_steps=2)
        trainer = KDTrainer(model=tiny_model("llama", seed=1), teacher_model=teacher, args=args,
                            train_dataset=[{"prompt": "the cat"}, {"prompt": "a dog"}] * 4, processing_class=tokenizer)
        trainer.train()
        assert trainer.state.global_step == 2 and calls == [], loss


class RecordingBar:
    """Stands in for transformers' tqdm in generate_rollouts: records the bar's total, updates and close."""

    made: list = []

    def __init__(self, total, **kwargs):
        self.total, self.kwargs, self.updates, self.closed = total, kwargs, [], False
        RecordingBar.made.append(self)

    def update(self, n=1):
        self.updates.append(n)

    def close(self):
        self.closed = True


@pytest.mark.parametrize("loop", ["lean", "generate"])
def test_a_rollout_progress_bar_counts_each_decode_step_on_a_cpu_and_changes_no_token(monkeypatch, loop):
    model = tiny_model("llama", dtype=torch.float32, seed=1)
    if loop == "generate":
        monkeypatch.setattr(R, "lean_decode_applies", lambda *a: False)
    monkeypatch.setattr(R.logging, "tqdm", RecordingBar)
    monkeypatch.setattr(RecordingBar, "made", [])
    prompts, kw = [[5, 6, 7], [8], [9, 10]], dict(pad_id=0, eos_ids={2}, start_id=1, step=1)
    settings = RolloutSettings(max_new_tokens=6, num_generations=2, batch_size=2, seed=3, cache="dynamic")
    quiet = generate_rollouts(model, prompts, settings, **kw)
    assert RecordingBar.made == []  # no bar unless asked for
    assert generate_rollouts(model, prompts, settings, progress=True, **kw) == quiet
    (bar,) = RecordingBar.made
    assert bar.total == 2 * 6 and sum(bar.updates) == bar.total and bar.closed  # 2 calls (2 prompts each) x 6 steps
    assert bar.updates.count(1) >= 2 * 6 - 2  # a tick per decode step (the last update of a call fills what EOS cut)
    assert bar.kwargs["leave"] is False and bar.kwargs["delay"] == R.PROGRESS_DELAY_S


def test_the_first_generated_step_says_how_it_generates_once_and_a_progress_bar_follows_it(tmp_path, tokenizer,
                                                                                           caplog, capsys, monkeypatch):
    """On a CPU a generated step can take long with the Trainer's bar standing still: the first says at INFO what
    it generates and how, once a run; with the Trainer's bars on, a bar of its own follows the decode steps."""
    monkeypatch.setattr(R, "PROGRESS_DELAY_S", 0.0)  # shown at once: the tiny model's rollouts take no time
    trainer = KDTrainer(
        model=tiny_model("llama", dtype=torch.float32, seed=1), teacher_model=tiny_model("llama", dtype=torch.float32,
        seed=2), processing_class=tokenizer, args=_args(tmp_path, max_steps=2, disable_tqdm=False),
        train_dataset=PROMPTS,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="liger_patch_kd.trainer.rollouts"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if r.name == "liger_patch_kd.trainer.rollouts.onpolicy"]
    assert len(said) == 1, said  # the first generated step only, not every step
    assert said[0].startswith("on-policy step 0: the student samples 4 completions (4 prompts x 1) of up to 5 new "
                              "tokens in 1 call (4 rows) on cpu, eager: the lean sampling loop")  # fmt: skip
    err = capsys.readouterr().err
    assert "rollouts (step 0)" in err and "rollouts (step 1)" in err


def test_an_on_policy_run_builds_its_decode_session_once(tmp_path, tokenizer, monkeypatch):
    """The session's key reads the model's state at every call (utils/module_state.py): nothing the Trainer, the KD
    forward or its caches do between steps may change it, or every step would build (on a GPU: capture) anew."""
    import liger_patch_kd.generation.engine as E

    made = []
    build = E.DecodeSession.__init__

    def counted(self, *args, **kwargs):
        made.append(args[1])
        build(self, *args, **kwargs)

    monkeypatch.setattr(E.DecodeSession, "__init__", counted)
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    student.set_attn_implementation("sdpa")
    trainer = KDTrainer(model=student, teacher_model=tiny_model("llama", dtype=torch.float32, seed=2),
                        processing_class=tokenizer, train_dataset=PROMPTS,
                        args=_args(tmp_path, max_steps=4, kd_generation_cache="graph",
                                   gradient_checkpointing=True))  # fmt: skip
    trainer.train()
    assert len(made) == 1, [key.rows for key in made]
