"""Offline on-policy distillation: the student's rollouts sampled once, scored by the teacher once, stored
(`liger-kd precompute --rollouts-from`), trained on through KDTrainer with the divergence or the sampled-token
estimators, refreshed in part by the current student, and refused when a different teacher is given."""

import copy
import json
import logging
import math
import re
from pathlib import Path

import pytest
import torch

from liger_patch_kd.batch.prompts import tokenize_prompt_row
from liger_patch_kd.cli import main
from liger_patch_kd.teacher import TeacherLogprobsDataset
from liger_patch_kd.teacher.store import read_manifest
from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments
from liger_patch_kd.trainer.offline_onpolicy import ScoreOptions, precompute_rollouts
from liger_patch_kd.trainer.offline_onpolicy import store as rollout_store
from liger_patch_kd.trainer.rollouts.generate import Rollout, RolloutSettings, generate_rollouts

from .tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")
TEXT = "the cat sat on the mat. a dog ran to the park. the sun is warm today. " * 20
PROMPTS = [{"prompt": p} for p in ("the cat", "a dog ran", "the sun is", "on the mat.")]
SETTINGS = RolloutSettings(max_new_tokens=5, num_generations=2, seed=3)


def _tokenizer(size: int = 200, text: str = TEXT):
    from transformers import PreTrainedTokenizerFast

    from liger_patch_kd.demo.cross_tokenizer import train_bpe_tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=train_bpe_tokenizer(text, size), pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer()


@pytest.fixture(scope="module")
def models():
    return tiny_model("llama", dtype=torch.float32, seed=1), tiny_model("llama", dtype=torch.float32, seed=2)


def _prompts(tokenizer):
    return [tokenize_prompt_row(tokenizer, row)[0] for row in PROMPTS]


def _store(path, models, tokenizer, settings=SETTINGS, **options):
    student, teacher = models
    return precompute_rollouts(student, teacher, _prompts(tokenizer), path, settings=settings,
                               score=options.pop("score", ScoreOptions(top_k=8)), prompts_per_call=2, shard_size=4,
                               tokenizer=tokenizer, progress=False, **options)  # fmt: skip


def _logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)


def test_stored_rows_are_what_an_on_policy_step_samples_and_scores(tmp_path, models, tokenizer):
    student, teacher = models
    store = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    prompts = _prompts(tokenizer)
    assert len(store) == len(prompts) * SETTINGS.num_generations
    rows = []
    for call in range(2):  # call c: prompts [2c, 2c + 2), as on-policy step c samples them with this seed
        rows += generate_rollouts(student, prompts[2 * call : 2 * call + 2], SETTINGS, pad_id=0, eos_ids={2},
                                  start_id=1, step=call)  # fmt: skip
    for i, rollout in enumerate(rows):
        item, seq = store[i], rollout.prompt + rollout.completion
        assert item["input_ids"].tolist() == seq
        p = len(rollout.prompt)
        assert item["labels"].tolist() == [-100] * p + rollout.completion
        t_lp, s_lp = _logprobs(teacher, seq), _logprobs(student, seq)
        own = torch.tensor(seq[p:])
        for column, full in (("teacher_token_logprobs", t_lp), ("behaviour_logprobs", s_lp)):
            expected = full[p - 1 : -1].gather(1, own[:, None])[:, 0]  # row t predicts token t + 1
            torch.testing.assert_close(item[column][p:].double(), expected, atol=1e-5, rtol=0)
        assert not item["behaviour_logprobs"][:p].any() and not item["teacher_token_logprobs"][:p].any()
        # the top-k: each stored value is the teacher's at its id, and they are the 8 largest (near-ties may swap)
        got = item["teacher_token_ids"][:-1].long()
        torch.testing.assert_close(item["teacher_logprobs"][:-1].double(), t_lp[:-1].gather(1, got), atol=1e-5, rtol=0)
        torch.testing.assert_close(item["teacher_logprobs"][:-1].double(), t_lp[:-1].topk(8, -1).values, atol=1e-5,
                                   rtol=0)  # fmt: skip
        assert item["teacher_token_ids"][-1].tolist() == [-1] * 8  # the last position predicts nothing
    meta = read_manifest(tmp_path / "s")
    assert meta["format_version"] == 4 and meta["rollouts"]["sampling"] == {"temperature": 1.0, "top_p": 1.0,
                                                                              "top_k": 0, "seed": 3}  # fmt: skip
    assert meta["rollouts"]["num_generations"] == 2 and meta["rollouts"]["max_new_tokens"] == 5


def _args(tmp_path, **overrides):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=1,
                max_steps=3, learning_rate=3e-3, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                disable_tqdm=True, seed=0, dataloader_num_workers=0, use_kd_patch=True,
                kd_max_new_tokens=5)  # fmt: skip (remove_unused_columns stays True: the store's columns get through)
    return KDTrainingArguments(**{**base, **overrides})


def _losses(trainer, key="loss"):
    return [h[key] for h in trainer.state.log_history if key in h]


@pytest.mark.parametrize("loss", ["k1", "pg"])
def test_training_on_the_store_equals_on_policy_training_on_those_rollouts(tmp_path, models, tokenizer, loss):
    student, teacher = models
    one = RolloutSettings(max_new_tokens=5, num_generations=1, seed=3)
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer, settings=one))
    stored = {tuple(data[i]["input_ids"][data[i]["labels"] == -100].tolist()): data[i] for i in range(len(data))}

    def from_store(generator, prompts, settings, **_):  # the on-policy run samples exactly the stored rollouts
        out = []
        for p in prompts:
            item = stored[tuple(p)]
            scored = item["labels"] != -100
            out.append(Rollout(p, item["input_ids"][scored].tolist(), True,
                               tuple(item["behaviour_logprobs"][scored].tolist())))  # fmt: skip
        return out

    online = KDTrainer(
        model=copy.deepcopy(student), teacher_model=copy.deepcopy(teacher), processing_class=tokenizer,
        args=_args(tmp_path / "a", kd_lmbda=1.0, kd_onpolicy_loss=loss), train_dataset=PROMPTS,
    )  # fmt: skip
    online.onpolicy.source = from_store
    online.onpolicy.behaviour = loss == "pg"  # as an engine's rollouts: their behaviour log-probs go to the loss
    online.train()
    offline = KDTrainer(model=copy.deepcopy(student), processing_class=tokenizer,
                        args=_args(tmp_path / "b", kd_onpolicy_loss=loss), train_dataset=data)  # fmt: skip
    offline.train()
    assert len(_losses(online)) == 3
    torch.testing.assert_close(torch.tensor(_losses(offline)), torch.tensor(_losses(online)), rtol=1e-4, atol=1e-5)
    kl = _losses(offline, "kd_behaviour_kl")
    assert len(kl) == 3 and abs(kl[0]) < 1e-6 and kl[-1] > kl[0]  # fresh at step 0, stale as the student moves


@pytest.mark.parametrize("loss", ["pg", "divergence"])
def test_the_fused_and_materialised_store_losses_agree(tmp_path, models, tokenizer, loss):
    student, _ = models
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    runs = []
    for fused in (True, False):
        trainer = KDTrainer(model=copy.deepcopy(student), processing_class=tokenizer, train_dataset=data,
                            args=_args(tmp_path / str(fused), kd_onpolicy_loss=loss, use_kd_patch=fused))  # fmt: skip
        trainer.train()
        runs.append((_losses(trainer), _losses(trainer, "kd_behaviour_kl")))
    torch.testing.assert_close(torch.tensor(runs[0][0]), torch.tensor(runs[1][0]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(runs[0][1]), torch.tensor(runs[1][1]), rtol=1e-3, atol=1e-6)
    assert len(runs[0][1]) == 3 and runs[0][1][-1] > 0


@pytest.mark.parametrize("loss", ["k1", "divergence"])
def test_kd_behaviour_kl_is_the_whole_optimizer_steps_under_gradient_accumulation(tmp_path, models, tokenizer, loss):
    """Four micro-batches of two rows make one optimizer step: the logged kd_behaviour_kl is the token-weighted
    mean over all eight rows (float64 from the student's own log-probs), not the last micro-batch's."""
    from liger_patch_kd.trainer.offline_onpolicy.source import behaviour_kl

    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    assert len(data) == 8
    student = tiny_model("llama", dtype=torch.float32, seed=5)  # not the sampler: the KL is far from 0
    log_q, log_b = [], []
    for i in range(len(data)):
        item = data[i]
        scored = item["labels"] != -100
        ids = item["input_ids"].tolist()
        picked = _logprobs(student, ids)[:-1].gather(1, item["input_ids"][1:, None])[:, 0]
        log_q.append(picked[scored[1:]])
        log_b.append(item["behaviour_logprobs"][scored].double())
    expected = behaviour_kl(torch.cat(log_q), torch.cat(log_b), torch.ones(sum(map(len, log_q)), dtype=torch.bool))
    trainer = KDTrainer(model=student, processing_class=tokenizer, train_dataset=data,
                        args=_args(tmp_path / "t", kd_onpolicy_loss=loss, gradient_accumulation_steps=4,
                                   max_steps=1, learning_rate=0.0))  # fmt: skip
    trainer.train()
    logged = _losses(trainer, "kd_behaviour_kl")
    assert len(logged) == 1 and expected > 1e-3
    # the loss path reads log-probs in float32 (fused chunks): the mean's error is float32 rounding of O(1) terms
    assert logged[0] == pytest.approx(float(expected), rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("option,value,needle", [
    ("kd_max_new_tokens", 3, "kd_max_new_tokens=3 (the store's completions, and a refresh's, are at most 5 tokens"),
    ("kd_generation_temperature", 0.5, "kd_generation_temperature=0.5 (the store was sampled, and a refresh samples, "
                                       "at 1.0"),
    ("kd_num_generations", 3, "kd_num_generations=3 (the store holds 2 completion(s) a prompt, each a row"),
    ("kd_store_refresh_fraction", 0.5, "kd_store_refresh_fraction=0.5 (the share of a step a refresh regenerates"),
    ("kd_rollout_batch_size", 4, "kd_rollout_batch_size=4 (the prompts of a refresh's generation calls"),
])  # fmt: skip
def test_options_that_a_store_fixes_are_refused_not_ignored(tmp_path, models, tokenizer, option, value, needle):
    """Rows cut or sampled when the store was made: an option that would cut or sample them otherwise did nothing
    (the rows trained whole, a refresh sampled with the store's settings); it is refused in one line. The store's own
    value, or the default, passes."""
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    with pytest.raises(ValueError, match=re.escape(needle)) as e:
        KDTrainer(model=copy.deepcopy(models[0]), processing_class=tokenizer, train_dataset=data,
                  args=_args(tmp_path / "t", **{option: value}))  # fmt: skip
    assert "\n" not in str(e.value) and "would never be used: leave it unset" in str(e.value)
    KDTrainer(model=copy.deepcopy(models[0]), processing_class=tokenizer, train_dataset=data,
              args=_args(tmp_path / "t", kd_max_new_tokens=SETTINGS.max_new_tokens,
                         kd_num_generations=SETTINGS.num_generations))  # the store's own values: no change


@pytest.mark.parametrize("options", [{"kd_max_length": 4}, {"kd_max_prompt_length": 2},
                                     {"kd_max_length": 4, "kd_max_prompt_length": 2}])  # fmt: skip
def test_length_options_beside_rows_that_come_tokenized_are_refused_not_ignored(tmp_path, models, tokenizer, options):
    """kd_max_length / kd_max_prompt_length cut rows KDTrainer tokenizes: beside a store (rollout or plain) or
    input_ids rows nothing cuts, so they are refused in one line naming each; text rows are still cut."""
    from liger_patch_kd import teacher as TD

    named = " and ".join(f"{k}={v}" for k, v in options.items())
    rollouts = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    TD.precompute(models[1], [[3, 4, 5, 6, 7, 8]] * 2, tmp_path / "plain", top_k=4, progress=False)
    plain = TeacherLogprobsDataset(tmp_path / "plain")
    for data, kind in ((rollouts, "a teacher store's rows"), (plain, "a teacher store's rows"),
                       ([{"input_ids": [3, 4, 5, 6, 7, 8]}] * 2, "rows given as input_ids")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(kind) + ".*" + re.escape(f"{named} would never be used")) as e:
            KDTrainer(model=copy.deepcopy(models[0]), processing_class=tokenizer, train_dataset=data,
                      args=_args(tmp_path / "t", **options))
        assert "\n" not in str(e.value)
    trainer = KDTrainer(model=copy.deepcopy(models[0]), teacher_model=models[1], processing_class=tokenizer,
                        train_dataset=[{"text": "the cat sat on the mat. a dog ran to the park."}] * 2,
                        args=_args(tmp_path / "t", kd_max_length=4))  # fmt: skip
    assert len(trainer.train_dataset[0]["input_ids"]) == 4


def test_length_options_pass_beside_a_store_already_cut_to_them(tmp_path, models, tokenizer):
    """A store made with --max-length M (and --max-prompt-length P) holds no longer rows: kd_max_length >= M (and
    kd_max_prompt_length >= P) would cut nothing more, as a recipe beside a store made with its lengths; a shorter
    one would, and is refused."""
    from liger_patch_kd import teacher as TD

    TD.precompute(models[1], [[3, 4, 5, 6, 7, 8]] * 2, tmp_path / "cut", top_k=4, progress=False,
                  inputs={"max_length": 6, "max_prompt_length": 3})  # fmt: skip
    store = TeacherLogprobsDataset(tmp_path / "cut")
    for options in ({"kd_max_length": 6}, {"kd_max_length": 1024, "kd_max_prompt_length": 768}):
        KDTrainer(model=copy.deepcopy(models[0]), processing_class=tokenizer, train_dataset=store,
                  args=_args(tmp_path / "t", **options))  # fmt: skip
    with pytest.raises(ValueError, match=r"kd_max_prompt_length=2 would never be used"):
        KDTrainer(model=copy.deepcopy(models[0]), processing_class=tokenizer, train_dataset=store,
                  args=_args(tmp_path / "t", kd_max_length=1024, kd_max_prompt_length=2))  # fmt: skip


def test_evaluation_beside_a_rollout_store_is_a_rollout_store_or_refused(tmp_path, models, tokenizer):
    from torch.utils.data import Subset

    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    plain = [{"input_ids": data[i]["input_ids"].tolist()} for i in range(2)]
    for evaluation, where in ((plain, "eval_dataset"), ({"held": plain}, "eval_dataset['held']")):
        with pytest.raises(ValueError, match=rf"{re.escape(where)} is not a rollout store \(list\), and "
                                             r"train_dataset is one") as e:  # fmt: skip
            KDTrainer(model=copy.deepcopy(models[0]), processing_class=tokenizer, train_dataset=data,
                      eval_dataset=evaluation, args=_args(tmp_path / "t"))  # fmt: skip
        assert "\n" not in str(e.value)
    trainer = KDTrainer(model=copy.deepcopy(models[0]), processing_class=tokenizer,
                        train_dataset=Subset(data, range(6)), eval_dataset=Subset(data, range(6, 8)),
                        args=_args(tmp_path / "t"))  # fmt: skip
    assert trainer.evaluate()["eval_loss"] >= 0  # rows held out of the store are scored as stored rollouts


def resumed_store_is_the_uninterrupted_one(build, tmp_path: Path, monkeypatch) -> Path:
    """`build(out)` writes a store into `out`: once whole, once killed while scoring its second shard (one shard
    kept) and resumed; the two folders must hold the same files, byte for byte. Returns the whole store's folder."""
    whole = Path(build(tmp_path / "whole"))
    calls, real = [], rollout_store.score_rollouts

    def dies_in_the_second_shard(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(rollout_store, "score_rollouts", dies_in_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path / "cut")
    assert len(read_manifest(tmp_path / "cut")["shards"]) == 1
    monkeypatch.setattr(rollout_store, "score_rollouts", real)
    build(tmp_path / "cut")
    names = sorted(p.name for p in whole.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "cut").iterdir())
    for name in names:
        assert (whole / name).read_bytes() == (tmp_path / "cut" / name).read_bytes(), name
    return whole


@pytest.mark.parametrize(
    "extra", [{"repetition_penalty": 1.3}, {"suppress_tokens": list(range(10, 190))}, {"no_repeat_ngram_size": 1}]
)
def test_a_students_own_generation_config_is_set_aside_when_it_samples(tmp_path, models, tokenizer, extra, caplog):
    """A checkpoint's generation_config.json may ask generate() for more than sampling (Qwen2.5-Instruct's
    repetition_penalty). Applied, the tokens would come from another distribution than the raw policy whose
    log-probs the store keeps as the behaviour's and the manifest names (temperature 1, no truncation: what pg and
    k1 assume). The student samples its own distribution: the very store of the same student without them, one
    warning naming them, and its own generation config back in place after."""
    student, teacher = models
    plain = TeacherLogprobsDataset(_store(tmp_path / "plain", models, tokenizer))
    tuned = copy.deepcopy(student)
    own = tuned.generation_config
    for key, value in extra.items():
        setattr(own, key, value)
    with caplog.at_level(logging.WARNING, logger="liger_patch_kd"):
        store = TeacherLogprobsDataset(_store(tmp_path / "tuned", (tuned, teacher), tokenizer))
    assert tuned.generation_config is own and all(getattr(own, k) == v for k, v in extra.items())
    assert len(store) == len(plain) == len(PROMPTS) * SETTINGS.num_generations
    for a, b in zip(store, plain):
        for column in ("input_ids", "labels", "behaviour_logprobs"):
            assert torch.equal(a[column], b[column]), column
    said = [r.getMessage() for r in caplog.records if "generation_config asks for" in r.getMessage()]
    assert len(said) == 1 and all(key in said[0] for key in extra), said


def test_a_killed_run_resumes_to_the_uninterrupted_store(tmp_path, models, tokenizer, monkeypatch):
    resumed_store_is_the_uninterrupted_one(lambda out: _store(out, models, tokenizer), tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="other inputs") as e:  # another seed is another store
        _store(tmp_path / "cut", models, tokenizer, settings=RolloutSettings(max_new_tokens=5, num_generations=2))
    # only the fields that differ, with the flag that sets them (not the whole rollouts section, twice)
    assert f"rollouts.sampling.seed (store: {SETTINGS.seed}, now: 0), set by --seed" in str(e.value)
    assert "fingerprint" not in str(e.value) and "prompts_per_call" not in str(e.value)


def test_refresh_replaces_exactly_its_slice(tmp_path, models, tokenizer):
    student, teacher = models
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    trainer = KDTrainer(model=copy.deepcopy(student), teacher_model=teacher, processing_class=tokenizer,
                        train_dataset=data, args=_args(tmp_path, kd_store_refresh_steps=2,
                                                       kd_store_refresh_fraction=0.5))  # fmt: skip
    offline = trainer.offline
    batches = [offline.collator([data[0], data[1]]), offline.collator([data[2], data[3]])]
    assert offline.refreshed(batches, trainer.model, trainer.teacher_model, tokenizer=tokenizer, step=1,
                             vocab_size=None) is batches  # not due at step 1  # fmt: skip
    out = offline.refreshed(batches, trainer.model, trainer.teacher_model, tokenizer=tokenizer, step=2,
                            vocab_size=None)  # fmt: skip
    prompts = [data[i]["input_ids"][data[i]["labels"] == -100].tolist() for i in (0, 2)]
    settings = RolloutSettings(max_new_tokens=5, num_generations=1, seed=0)
    fresh = generate_rollouts(trainer.model, prompts, settings, pad_id=0, eos_ids={2}, start_id=1, step=2)
    for batch, before, rollout in zip(out, batches, fresh):
        n = len(rollout.prompt) + len(rollout.completion)
        assert batch["input_ids"][0, :n].tolist() == rollout.prompt + rollout.completion  # row 0: regenerated
        seq = rollout.prompt + rollout.completion
        own = torch.tensor(seq[len(rollout.prompt) :])
        expected = _logprobs(teacher, seq)[len(rollout.prompt) - 1 : -1].gather(1, own[:, None])[:, 0]
        got = batch["kd_teacher_token_logprobs"][0, len(rollout.prompt) : n].double()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        keep = before["attention_mask"][1].sum()
        for key, value in before.items():  # row 1: the stored row, unchanged
            if torch.is_tensor(value) and value.dim() >= 2:
                assert torch.equal(batch[key][1, :keep], value[1, :keep]), key
    trainer.train()
    assert offline.refresh.refreshed_steps == [2, 2] and len(_losses(trainer)) == 3  # the call above, then step 2


def test_a_refresh_is_logged_with_its_step_and_rows_and_counted_in_the_trainers_logs(tmp_path, models, tokenizer,
                                                                                        caplog):
    student, teacher = models
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    trainer = KDTrainer(model=copy.deepcopy(student), teacher_model=teacher, processing_class=tokenizer,
                        train_dataset=data, args=_args(tmp_path, max_steps=5, kd_store_refresh_steps=2,
                                                       kd_store_refresh_fraction=0.5))  # fmt: skip
    with caplog.at_level(logging.INFO, logger="liger_patch_kd.trainer.offline_onpolicy"):
        trainer.train()
    # 2 rows a step: ceil(0.5 x 2) = 1 regenerated at steps 2 and 4; per log (every step) the rows since the last
    assert _losses(trainer, "kd_refreshed_rows") == [0, 0, 1, 0, 1]
    said = [r.getMessage() for r in caplog.records if "regenerated" in r.getMessage()]
    # counted as the Trainer's logs count steps: the rows of optimizer steps 3 and 5 (2 and 4 done before them)
    assert said == [f"kd_store_refresh_steps=2: optimizer step {s} regenerated 1 of its 2 stored rows with the "
                    f"current student, rescored by the teacher" for s in (3, 5)]  # fmt: skip
    offline = KDTrainer(model=copy.deepcopy(student), processing_class=tokenizer, train_dataset=data,
                        args=_args(tmp_path / "b", max_steps=1))  # fmt: skip
    offline.train()
    assert not _losses(offline, "kd_refreshed_rows")  # no refresh asked for: no figure


def test_a_refresh_samples_and_scores_under_the_trainers_autocast(tmp_path, models, tokenizer, monkeypatch):
    """bf16=True with float32 weights: the live teacher's forward runs under the Trainer's autocast (compute_loss),
    so the teacher scores the refreshed rows under it too (in float32 they took twice a live step's time on a GPU);
    their completions are sampled under it, as an on-policy step's are (the decode engine reads the autocast before
    its first step: its weight copies and cache in bf16, as the student's forward computes); their behaviour
    log-probs are taken by the student's forward, under accelerate's wrapper of it, as before."""
    from liger_patch_kd.trainer.offline_onpolicy import refresh, scoring

    seen = []
    real_score, real_generate = refresh.score_rollouts, refresh.generate_rollouts

    def score(*args, **kwargs):
        seen.append(("score", torch.is_autocast_enabled("cpu")))
        return real_score(*args, **kwargs)

    real_teacher_rows, real_behaviour = scoring.teacher_rows, scoring.student_next_logprobs

    def teacher_rows(*args, **kwargs):
        seen.append(("teacher", torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return real_teacher_rows(*args, **kwargs)

    def behaviour(*args, **kwargs):
        seen.append(("behaviour", torch.is_autocast_enabled("cpu")))
        return real_behaviour(*args, **kwargs)

    def generate(*args, **kwargs):
        seen.append(("generate", torch.is_autocast_enabled("cpu")))
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(refresh, "score_rollouts", score)
    monkeypatch.setattr(refresh, "generate_rollouts", generate)
    monkeypatch.setattr(scoring, "teacher_rows", teacher_rows)
    monkeypatch.setattr(scoring, "student_next_logprobs", behaviour)
    student, teacher = models
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    trainer = KDTrainer(model=copy.deepcopy(student), teacher_model=teacher, processing_class=tokenizer,
                        train_dataset=data, args=_args(tmp_path, max_steps=3, bf16=True, kd_store_refresh_steps=2,
                                                       kd_store_refresh_fraction=0.5))  # fmt: skip
    seen.clear()  # the store's own scoring above
    trainer.train()
    # one refresh, at step 2: the sampling and the teacher under the autocast, the behaviour log-probs called outside
    # it (the student's forward enters it itself)
    assert seen == [("generate", True), ("score", False), ("teacher", True, torch.bfloat16), ("behaviour", False)]


def test_a_store_scored_by_another_teacher_is_refused(tmp_path, models, tokenizer):
    student, _ = models
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    with pytest.raises(ValueError, match="scored by teacher .* but teacher_model has fingerprint"):
        KDTrainer(model=copy.deepcopy(student), teacher_model=tiny_model("llama", dtype=torch.float32, seed=5),
                  processing_class=tokenizer, train_dataset=data, args=_args(tmp_path, kd_store_refresh_steps=1))
    with pytest.raises(ValueError, match="sampled with"):  # k1 / pg assume the student's own distribution
        hot = RolloutSettings(max_new_tokens=5, num_generations=1, seed=3, temperature=0.7)
        KDTrainer(model=copy.deepcopy(student), processing_class=tokenizer, args=_args(tmp_path, kd_onpolicy_loss="k1"),
                  train_dataset=TeacherLogprobsDataset(_store(tmp_path / "hot", models, tokenizer, settings=hot)))


# ------------------------------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, models, tokenizer):
    root = tmp_path_factory.mktemp("models")
    for name, model, tok in (("student", models[0], tokenizer), ("teacher", models[1], tokenizer),
                             ("other", models[1], _tokenizer(300, "lorem ipsum dolor sit amet. " * 20))):  # fmt: skip
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    models[1].save_pretrained(root / "bare teacher")  # weights and config, no tokenizer
    short = copy.deepcopy(models[0])
    short.config.max_position_embeddings = 14  # the longest prompt (11 tokens) fits, + 4 new ones not
    short.save_pretrained(root / "short")
    tokenizer.save_pretrained(root / "short")
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    (root / "empty.jsonl").write_text("\n")
    (root / "latin.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    (root / "long.jsonl").write_text(json.dumps({"prompt": "the cat sat on the mat. " * 10}) + "\n")
    privileged = {"prompt": "the cat", "teacher_prompt": "it sat. the cat"}
    (root / "privileged.jsonl").write_text(json.dumps(privileged) + "\n")
    return root


def _command(root, out, data="prompts.jsonl", teacher="teacher", student="student", *extra):
    return ["precompute", "--teacher", str(root / teacher), "--rollouts-from", str(root / student), "--data",
            str(root / data), "--out", str(out), "--top-k", "4", "--max-new-tokens", "4", "--num-generations", "2",
            "--dtype", "float32", *extra]  # fmt: skip


def test_the_command_writes_a_store_that_names_who_generated_and_scored(tmp_path, checkpoints, capsys):
    assert main(_command(checkpoints, tmp_path / "out")) == 0
    meta = read_manifest(tmp_path / "out")
    assert meta["generator"].endswith("student") and meta["teacher"].endswith("teacher")
    assert len(meta["rollouts"]["generator_fingerprint"]) == len(meta["rollouts"]["teacher_fingerprint"]) == 16
    assert len(TeacherLogprobsDataset(tmp_path / "out")) == 8


def test_max_prompt_length_keeps_each_prompts_last_tokens_so_a_long_prompt_fits(tmp_path, checkpoints, models,
                                                                               tokenizer):  # fmt: skip
    """--max-prompt-length with --rollouts-from keeps each prompt's last tokens, as kd_max_prompt_length does (a
    prompt too long for the context had no other fix than editing the data); the manifest records it, so training
    the store with that kd_max_prompt_length is no option left unused."""
    out = tmp_path / "cut"
    assert main(_command(checkpoints, out, "long.jsonl", "teacher", "short", "--max-prompt-length", "8")) == 0
    assert read_manifest(out)["inputs"]["max_prompt_length"] == 8
    whole = rollout_store.read_prompt_lines(checkpoints / "long.jsonl", tokenizer)[0][0]
    assert len(whole) > 14  # past the short model's context
    data = TeacherLogprobsDataset(out)
    for row in data:
        scored = int((row["labels"] != -100).nonzero()[0])
        assert row["input_ids"][:scored].tolist() == whole[-8:]
    KDTrainer(model=copy.deepcopy(models[0]), processing_class=tokenizer, train_dataset=data,
              args=_args(tmp_path, kd_max_prompt_length=8, kd_max_new_tokens=4))  # fmt: skip
    with pytest.raises(ValueError, match="kd_max_prompt_length=4 would never be used.*--max-prompt-length cut"):
        KDTrainer(model=copy.deepcopy(models[0]), processing_class=tokenizer, train_dataset=data,
                  args=_args(tmp_path, kd_max_prompt_length=4, kd_max_new_tokens=4))  # fmt: skip


@pytest.mark.parametrize("case,needle", [
    ("no prompts", "no prompts"),
    ("another tokenizer", "has another tokenizer"),
    ("foreign files", "no run of this tool left there"),
    ("past the context", "exceeds the context"),
    ("--max-length", "--max-length applies to --data of text sequences"),
    ("--skip-bad-lines", "--skip-bad-lines applies to --data of text sequences"),
    ("not UTF-8", "--data "),
    ("a prompt as long as the context", "leaves no room for a completion in the context of 14 tokens"),
    ("a teacher prompt", "privileged.jsonl:1: the row has a 'teacher_prompt'"),
    ("--out under a file", "a file, so no folder can be made there"),
    ("--tokenizer not the student's", "is not the tokenizer in --rollouts-from"),
    ("another tool's manifest", "not a teacher store's manifest (another tool's manifest.json?); give a folder"),
    ("--out a model's folder", "holds a config.json: a model's folder, not a store's"),
])  # fmt: skip
def test_bad_inputs_are_one_line_before_any_model_loads(tmp_path, checkpoints, capsys, monkeypatch, case, needle):
    import transformers

    def never(*_, **__):
        raise AssertionError("a model loaded before the inputs were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    out = tmp_path / "out"
    argv = {
        "no prompts": _command(checkpoints, out, "empty.jsonl"),
        "another tokenizer": _command(checkpoints, out, teacher="other"),
        "foreign files": _command(checkpoints, out),
        "past the context": _command(checkpoints, out, "prompts.jsonl", "teacher", "short"),
        "--max-length": _command(checkpoints, out, "prompts.jsonl", "teacher", "student", "--max-length", "8"),
        "--skip-bad-lines": _command(checkpoints, out, "prompts.jsonl", "teacher", "student", "--skip-bad-lines"),
        "not UTF-8": _command(checkpoints, out, "latin.jsonl"),
        "a prompt as long as the context": _command(checkpoints, out, "long.jsonl", "teacher", "short"),
        "a teacher prompt": _command(checkpoints, out, "privileged.jsonl"),
        "--out under a file": _command(checkpoints, out / "store"),  # was [Errno 20] once the models had run
        "another tool's manifest": _command(checkpoints, out),
        "--out a model's folder": _command(checkpoints, out),
        # the teacher's folder without a tokenizer: nothing else would have compared --tokenizer with the student's
        "--tokenizer not the student's": _command(checkpoints, out, "prompts.jsonl", "bare teacher", "student",
                                                  "--tokenizer", str(checkpoints / "other")),
    }[case]
    if case == "--out under a file":
        out.write_text("mine")
    if case == "another tool's manifest":
        out.mkdir()
        (out / "manifest.json").write_text('{"mine": 1}')
    if case == "foreign files":
        out.mkdir()
        (out / "shard-00000.safetensors").write_bytes(b"mine")
    if case == "--out a model's folder":
        out.mkdir()
        (out / "config.json").write_text('{"model_type": "llama"}')
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    if case == "foreign files":
        assert (out / "shard-00000.safetensors").read_bytes() == b"mine"
    if case == "another tool's manifest":
        assert (out / "manifest.json").read_text() == '{"mine": 1}'  # left as it was
    if case == "not UTF-8":
        assert "latin.jsonl: not UTF-8 text: byte 0xe9 at offset 15 (line 1)" in err and "re-encode" in err
    if case == "past the context":
        assert "prompts.jsonl:4 has 11 tokens, and 11 + 4 exceeds the context of 14 tokens" in err
        assert "<= 3 " in err
    if case == "a prompt as long as the context":  # the fix names the prompt, never a --max-new-tokens of 0 or less
        assert "shorten it to at most 13 tokens" in err and "--max-new-tokens <=" not in err


def test_files_a_store_never_writes_are_left_in_out(tmp_path, checkpoints):
    """As every precompute: --out may hold other files (notes); the store is written beside them, they stay."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(_command(checkpoints, out)) == 0
    assert (out / "notes.txt").read_text() == "mine" and len(TeacherLogprobsDataset(out)) == 8


def test_rollout_options_without_rollouts_from_are_refused(tmp_path, checkpoints, capsys):
    argv = ["precompute", "--teacher", str(checkpoints / "teacher"), "--data", str(checkpoints / "prompts.jsonl"),
            "--out", str(tmp_path / "out"), "--num-generations", "2"]  # fmt: skip
    assert main(argv) == 2
    assert "--num-generations samples rollouts" in capsys.readouterr().err


@pytest.mark.parametrize("estimator", ["k1", "k3", "pg"])
def test_the_stored_estimator_loss_matches_the_reference_on_materialised_logits(estimator):
    from liger_patch_kd import reference
    from liger_patch_kd.config import KDLossConfig
    from liger_patch_kd.losses.stored_estimators import linear_estimator_kd

    torch.manual_seed(0)
    n, h, v = 41, 16, 37
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    labels[::5] = -100

    def at_labels(logits):
        return torch.log_softmax(logits, -1).gather(1, labels.clamp(min=0)[:, None])[:, 0]

    teacher = at_labels(torch.randn(n, v, dtype=torch.float64))
    behaviour = at_labels(torch.randn(n, v, dtype=torch.float64)) if estimator == "pg" else None
    cfg = KDLossConfig(estimator=estimator, hard_weight=0.25, importance_cap=3.0 if estimator == "pg" else None)
    loss, _, _ = linear_estimator_kd(hidden, weight, None, labels, teacher, cfg, 30, behaviour)
    grads = torch.autograd.grad(loss, (hidden, weight))
    log_q = torch.log_softmax(hidden @ weight.T, -1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
    scored = labels != -100
    if behaviour is None:
        terms = reference.kl_estimator_terms(log_q, teacher, estimator)
    else:
        terms = reference.policy_gradient_terms(log_q, teacher, behaviour, importance_cap=3.0)
    expected = torch.where(scored, terms - 0.25 * log_q, 0.0).sum() / 30
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, torch.autograd.grad(expected, (hidden, weight))):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_behaviour_log_probs_are_the_sampling_distribution_of_a_head_padded_past_the_vocabulary(tmp_path, tokenizer):
    """A student head with rows past the tokenizer's ids (the teacher's head is the tokenizer's) samples only the real
    ids, so its behaviour log-prob of a token is normalised over them: the sampler trained on its own store, at its
    own weights, has importance ratio 1 and kd_behaviour_kl 0; the head's extra rows must not enter the normaliser
    (a random head gives them a fifth of the mass: ratios of ~1.2 and a KL far from 0 otherwise)."""
    vocab = len(tokenizer)
    student = tiny_model("llama", dtype=torch.float32, seed=1, vocab=vocab + 41)
    teacher = tiny_model("llama", dtype=torch.float32, seed=2, vocab=vocab)
    data = TeacherLogprobsDataset(_store(tmp_path / "s", (student, teacher), tokenizer))
    for i in range(len(data)):
        item = data[i]
        ids, p = item["input_ids"].tolist(), int((item["labels"] != -100).nonzero()[0])
        with torch.no_grad():
            logits = student(input_ids=torch.tensor([ids])).logits[0].double()
        real = torch.log_softmax(logits[:, :vocab], -1)[p - 1 : -1].gather(1, item["input_ids"][p:, None])[:, 0]
        torch.testing.assert_close(item["behaviour_logprobs"][p:].double(), real, atol=1e-5, rtol=0)  # float32 store
    # without kd_vocab_size the student would be normalised over its whole head, the behaviour over the ids sampled
    with pytest.raises(ValueError, match=rf"set kd_vocab_size={vocab}") as e:
        KDTrainer(model=copy.deepcopy(student), processing_class=tokenizer, train_dataset=data,
                  args=_args(tmp_path / "t", kd_onpolicy_loss="pg"))  # fmt: skip
    assert "\n" not in str(e.value)
    trainer = KDTrainer(model=copy.deepcopy(student), teacher_model=teacher, processing_class=tokenizer,
                        train_dataset=data, args=_args(tmp_path / "t", kd_onpolicy_loss="pg", kd_vocab_size=vocab,
                                                       max_steps=1, learning_rate=0.0, kd_store_refresh_steps=1,
                                                       kd_store_refresh_fraction=1.0))  # fmt: skip
    trainer.train()
    assert _losses(trainer, "kd_behaviour_kl")[0] < 1e-6  # float32 log-probs of the same weights
    refreshed = trainer.offline.refreshed([trainer.offline.collator([data[0], data[1]])], trainer.model,
                                          trainer.teacher_model, tokenizer=tokenizer, step=1, vocab_size=vocab)[0]
    for row in range(2):
        n, p = int(refreshed["attention_mask"][row].sum()), int((refreshed["labels"][row] != -100).nonzero()[0])
        ids = refreshed["input_ids"][row, :n]
        with torch.no_grad():
            logits = student(input_ids=ids[None]).logits[0].double()
        real = torch.log_softmax(logits[:, :vocab], -1)[p - 1 : -1].gather(1, ids[p:, None])[:, 0]
        torch.testing.assert_close(refreshed["kd_behaviour_logprobs"][row, p:n].double(), real, atol=1e-5, rtol=0)


@pytest.mark.parametrize("loss", ["k1", "k3", "pg"])
def test_kd_temperature_beside_a_sampled_token_estimator_on_a_store_is_refused(tmp_path, models, tokenizer, loss):
    """Every batch of a rollout store is scored by the estimator at temperature 1 (the stored teacher and behaviour
    log-probs are at 1, the tokens were drawn at 1): a kd_temperature would never be used, so it is refused rather
    than silently trained at 1."""
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    with pytest.raises(ValueError, match=rf"kd_temperature=2.0 .* kd_onpolicy_loss='{loss}'") as e:
        KDTrainer(model=copy.deepcopy(models[0]), processing_class=tokenizer, train_dataset=data,
                  args=_args(tmp_path / "t", kd_onpolicy_loss=loss, kd_temperature=2.0))  # fmt: skip
    assert "\n" not in str(e.value)


def test_a_store_made_in_python_names_its_tokenizer_and_another_is_refused(tmp_path, models, tokenizer):
    """precompute_rollouts is given the student's tokenizer (its EOS / pad ids): the manifest records its
    fingerprint, so training with another tokenizer (whose ids mean other tokens) is refused, as for the command."""
    from liger_patch_kd.teacher import tokenizer_fingerprint

    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    assert read_manifest(tmp_path / "s")["tokenizer_fingerprint"] == tokenizer_fingerprint(tokenizer)
    other = _tokenizer(300, "lorem ipsum dolor sit amet. " * 20)
    with pytest.raises(ValueError, match="precomputed with a tokenizer of fingerprint"):
        KDTrainer(model=copy.deepcopy(models[0]), processing_class=other, train_dataset=data,
                  args=_args(tmp_path / "t"))  # fmt: skip


@pytest.mark.parametrize("use_kd_patch", [True, False])
def test_bf16_autocast_scores_the_stored_tokens_to_the_rounding_of_the_products_inputs(tmp_path, models, tokenizer,
                                                                                        use_kd_patch):  # fmt: skip
    """bf16=True with fp32 weights (accelerate's autocast around the forward), the sampler training on its own store:
    its log-probs now are the stored behaviour log-probs up to bf16's rounding of the products (|d| < 1e-3 nats on
    these logits), so kd_behaviour_kl (~d^2 / 2) logs 0 at step 0 and the pg loss is the float64 one to 1e-3. A
    log-sum-exp over logits rounded to bf16 (errors of ~2e-2 nats) logged a staleness of 1e-4 before any step."""
    student, _ = models
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    terms = []
    for i in range(len(data)):
        item = data[i]
        p = int((item["labels"] != -100).nonzero()[0])
        log_q = _logprobs(student, item["input_ids"].tolist())[p - 1 : -1].gather(1, item["input_ids"][p:, None])[:, 0]
        # pg's value at ratio 1 (the sampler's own weights): -(log p - log q), the k1 estimate
        terms.append(log_q - item["teacher_token_logprobs"][p:].double())
    expected = float(torch.cat(terms).mean())
    trainer = KDTrainer(model=copy.deepcopy(student), processing_class=tokenizer, train_dataset=data,
                        args=_args(tmp_path / "t", kd_onpolicy_loss="pg", bf16=True, use_kd_patch=use_kd_patch,
                                   gradient_accumulation_steps=4, max_steps=1, learning_rate=0.0))  # fmt: skip
    trainer.train()
    assert _losses(trainer, "kd_behaviour_kl")[0] < 1e-5
    assert _losses(trainer)[0] == pytest.approx(expected, abs=1e-3)


def test_a_join_of_rollout_stores_is_refused_not_trained_as_plain_teacher_rows(tmp_path, models, tokenizer):
    """A ConcatDataset of two rollout stores (under a Subset too) has no one manifest: it trained as plain top-k
    rows, the divergence in place of kd_onpolicy_loss='pg', no kd_behaviour_kl, no teacher checked. Refused in one
    line, naming the fix."""
    from torch.utils.data import ConcatDataset, Subset

    first = TeacherLogprobsDataset(_store(tmp_path / "a", models, tokenizer))
    second = TeacherLogprobsDataset(_store(tmp_path / "b", models, tokenizer, settings=RolloutSettings(
        max_new_tokens=5, num_generations=2, seed=4)))  # fmt: skip
    for joined in (ConcatDataset([first, second]), Subset(ConcatDataset([first, second]), range(10))):
        with pytest.raises(ValueError, match=r"train_dataset joins 2 rollout stores .*one store") as e:
            KDTrainer(model=copy.deepcopy(models[0]), processing_class=tokenizer, train_dataset=joined,
                      args=_args(tmp_path / "t", kd_onpolicy_loss="pg"))  # fmt: skip
        assert "\n" not in str(e.value)


def test_an_evaluation_store_scored_by_another_teacher_or_sampled_otherwise_is_refused(tmp_path, models, tokenizer):
    """eval_loss is the run's estimator on held-out rollouts against their stored teacher log-probs: a store scored by
    another teacher than training's reported the distance to that teacher as the run's eval_loss (and beside a
    teacher_model, whose check covered only the training store, mixed two teachers in one run); one sampled at
    another temperature fed the sampled-token estimators tokens they do not assume. Each refused in one line."""
    student, teacher = models
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    other = TeacherLogprobsDataset(_store(tmp_path / "o", (student, tiny_model("llama", dtype=torch.float32, seed=7)),
                                          tokenizer))  # fmt: skip
    for teacher_model, extra in ((None, {}), (teacher, {"kd_store_refresh_steps": 2})):
        with pytest.raises(ValueError, match=r"eval_dataset's rollout store was scored by teacher .* train_dataset's "
                                             r"by .*fingerprint") as e:  # fmt: skip
            KDTrainer(model=copy.deepcopy(student), teacher_model=teacher_model, processing_class=tokenizer,
                      train_dataset=data, eval_dataset=other, args=_args(tmp_path / "t", kd_onpolicy_loss="pg",
                                                                         **extra))  # fmt: skip
        assert "\n" not in str(e.value)
    hot = TeacherLogprobsDataset(_store(tmp_path / "hot", models, tokenizer, settings=RolloutSettings(
        max_new_tokens=5, num_generations=1, seed=5, temperature=0.7)))  # fmt: skip
    with pytest.raises(ValueError, match=r"eval_dataset\['hot'\]: kd_onpolicy_loss='k1' .* sampled with") as e:
        KDTrainer(model=copy.deepcopy(student), processing_class=tokenizer, train_dataset=data,
                  eval_dataset={"hot": hot}, args=_args(tmp_path / "t", kd_onpolicy_loss="k1"))  # fmt: skip
    assert "\n" not in str(e.value)
    # the divergence on a hot store, and a store of the same teacher, evaluate as before
    KDTrainer(model=copy.deepcopy(student), processing_class=tokenizer, train_dataset=data, eval_dataset=hot,
              args=_args(tmp_path / "t"))  # fmt: skip


@pytest.mark.parametrize("loss", ["k1", "pg"])
def test_a_sampled_token_estimator_on_a_store_of_teacher_samples_needs_no_kd_beta(tmp_path, models, tokenizer, loss):
    """The estimators score a rollout store's sampled tokens against the stored teacher log-probs; its teacher samples
    (--samples) go unused, so the samples' beta-0 rule does not apply: the default kd_beta 0.5 was refused with "set
    beta=0", an option pg never reads. The divergence, which trains on the samples, keeps the rule."""
    score = ScoreOptions(top_k=0, samples=4)
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer, score=score))
    trainer = KDTrainer(model=copy.deepcopy(models[0]), processing_class=tokenizer, train_dataset=data,
                        args=_args(tmp_path / "t", kd_onpolicy_loss=loss, max_steps=1))  # fmt: skip
    trainer.train()
    assert _losses(trainer, "kd_behaviour_kl")[0] < 1e-6  # the sampler's own store: ratio 1
    with pytest.raises(ValueError, match="kd_beta: the training store holds sampled teacher tokens"):
        KDTrainer(model=copy.deepcopy(models[0]), processing_class=tokenizer, train_dataset=data,
                  args=_args(tmp_path / "t"))  # fmt: skip


def test_the_scoring_teacher_in_another_dtype_is_refused_saying_so(tmp_path, models, tokenizer):
    """The fingerprint covers every weight in its dtype, so the very checkpoint that scored the store, loaded in
    bfloat16 for the refresh (its rescored rows would be another teacher's, to bf16's rounding), is refused; the
    message says the dtype is what may differ, not just two fingerprints."""
    student, teacher = models
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    with pytest.raises(ValueError, match=r"teacher_model has fingerprint .* torch\.bfloat16.* another dtype") as e:
        KDTrainer(model=copy.deepcopy(student), teacher_model=copy.deepcopy(teacher).to(torch.bfloat16),
                  processing_class=tokenizer, train_dataset=data,
                  args=_args(tmp_path / "t", kd_store_refresh_steps=1))  # fmt: skip
    assert "\n" not in str(e.value)


def test_a_resume_in_the_second_pass_with_a_refresh_due_continues_as_the_uninterrupted_run(tmp_path, models,
                                                                                           tokenizer):  # fmt: skip
    """Three passes over an 8-row store (4 steps each), a refresh every 3 steps, a checkpoint at step 6 (the middle
    of the second pass, a refresh due at its first step): the resumed run skips the rows step 4-5 trained, regenerates
    the rows step 6 regenerated (seeded from seed and step, not the global RNG) and ends on the same weights, its
    steps' losses and kd_behaviour_kl those of the run that never stopped."""
    student, teacher = models
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    options = dict(kd_onpolicy_loss="pg", max_steps=-1, num_train_epochs=3, learning_rate=3e-2, save_strategy="steps",
                   save_steps=6, kd_store_refresh_steps=3, kd_store_refresh_fraction=0.5)  # fmt: skip

    def run(out, resume=None):
        trainer = KDTrainer(model=copy.deepcopy(student), teacher_model=teacher, processing_class=tokenizer,
                            train_dataset=data, args=_args(out, **options))  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        logged = {h["step"]: (h["loss"], h["kd_behaviour_kl"]) for h in trainer.state.log_history if "loss" in h}
        return trainer, logged

    whole, logged = run(tmp_path / "whole")
    assert whole.state.global_step == 12 and whole.offline.refresh.refreshed_steps == [3, 6, 9]
    resumed, logged_after = run(tmp_path / "cut", resume=str(tmp_path / "whole" / "out" / "checkpoint-6"))
    assert resumed.offline.refresh.refreshed_steps == [6, 9]
    # the same computation replayed on this machine: equal but for nondeterministic reduction order
    for step in range(7, 13):
        assert logged_after[step] == pytest.approx(logged[step], rel=1e-6, abs=1e-9), step
    for name, p in whole.model.named_parameters():
        torch.testing.assert_close(dict(resumed.model.named_parameters())[name], p, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("loss", ["pg", "divergence"])
def test_passes_over_a_refreshed_store_train_each_row_once_a_pass_on_the_float64_loss(tmp_path, models, tokenizer,
                                                                                     loss):  # fmt: skip
    """Three passes over an 8-row store in steps of 2 x 2 accumulated rows, half of each micro-batch refreshed every
    second step: each pass trains every stored row once (a refreshed row in place of its own prompt's, never carried
    into the next pass), and each step's logged loss is the float64 loss of its rows at the step's starting weights,
    from the stored top-k / teacher / behaviour log-probs (a refreshed row: the teacher's and the student's own, in
    float64), normalised by the step's completion tokens, and its kd_behaviour_kl the float64 staleness of those rows
    (a refreshed row's behaviour is the student's own). float32 products of O(1) logits: 1e-5."""
    from transformers import TrainerCallback

    student, teacher = models
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    trainer = KDTrainer(model=copy.deepcopy(student), teacher_model=teacher, processing_class=tokenizer,
                        train_dataset=data, args=_args(tmp_path / "t", kd_onpolicy_loss=loss, max_steps=-1,
                                                       num_train_epochs=3, gradient_accumulation_steps=2,
                                                       learning_rate=3e-2, kd_store_refresh_steps=2,
                                                       kd_store_refresh_fraction=0.5))  # fmt: skip
    weights, seen, real = [], [], trainer.offline.refreshed

    class Weights(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **_):
            weights.append({k: v.detach().double().clone() for k, v in model.state_dict().items()})

    def refreshed(batches, *a, **k):
        out = real(batches, *a, **k)
        seen.append([(before, after) for b, o in zip(batches, out) for before, after in zip(rows_of(b), rows_of(o))])
        return out

    from liger_patch_kd.batch.rollout_store import rows_of

    trainer.add_callback(Weights())
    trainer.offline.refreshed = refreshed
    trainer.train()
    stored = {tuple(data[i]["input_ids"].tolist()): data[i] for i in range(len(data))}
    assert len(stored) == len(data) and len(seen) == 6  # distinct rows; 2 steps a pass
    for epoch in (0, 1, 2):  # every stored row once a pass, before any refresh
        trained = sorted(tuple(before["input_ids"].tolist()) for step in seen[2 * epoch : 2 * epoch + 2]
                         for before, _ in step)  # fmt: skip
        assert trained == sorted(stored)
    logged, staleness, fresh = _losses(trainer), _losses(trainer, "kd_behaviour_kl"), []
    for step, rows in enumerate(seen):
        model = copy.deepcopy(student).double()
        model.load_state_dict(weights[step])
        total, count, stale = 0.0, 0, 0.0
        for before, after in rows:
            ids = after["input_ids"].tolist()
            p = int((after["labels"] != -100).nonzero()[0])
            assert ids[:p] == before["input_ids"][:p].tolist()  # the same prompt
            item = stored.get(tuple(ids))
            with torch.no_grad():
                log_q = _logprobs(model, ids)[p - 1 : -1]
                log_t = _logprobs(teacher, ids)[p - 1 : -1]
            own = torch.tensor(ids[p:])
            if item is None:  # refreshed: the teacher's top-k and the student's own behaviour, float64
                assert step in (2, 4), step  # the steps due (every second, the first never)
                fresh.append(step)
                top_p, top_i = log_t.topk(8, -1)
                teacher_token, behaviour = log_t.gather(1, own[:, None])[:, 0], log_q.gather(1, own[:, None])[:, 0]
            else:
                top_p, top_i = item["teacher_logprobs"][p - 1 : -1].double(), item["teacher_token_ids"][p - 1 : -1]
                teacher_token = item["teacher_token_logprobs"][p:].double()
                behaviour = item["behaviour_logprobs"][p:].double()
            q = log_q.gather(1, own[:, None])[:, 0]
            stale += float(((q - behaviour).exp() - 1 - (q - behaviour)).sum())  # a refreshed row's behaviour: q itself
            if loss == "pg":  # value: -min(q / b, 3) (log p - log q)
                total += float((-(q - behaviour).exp().clamp(max=3.0) * (teacher_token - q)).sum())
            else:  # beta 0.5 JSD over the top-8 and the tail bucket
                pk, sk = top_p.exp(), log_q.gather(1, top_i.long()).exp()
                pa = torch.cat([pk, (1 - pk.sum(-1, keepdim=True)).clamp(min=0)], -1)
                sa = torch.cat([sk, 1 - sk.sum(-1, keepdim=True)], -1)
                m = (pa + sa) / 2
                kl = lambda a, b: torch.where(a > 0, a * (a.clamp(min=1e-300).log() - b.log()), 0.0).sum()  # noqa: E731
                total += float(0.5 * kl(pa, m) + 0.5 * kl(sa, m))
            count += len(own)
        assert logged[step] == pytest.approx(total / count, rel=1e-5, abs=1e-7), step
        assert staleness[step] == pytest.approx(stale / count, rel=1e-4, abs=1e-6), step  # logged to 6 decimals
    assert sorted(set(fresh)) == [2, 4] and len(fresh) == 4  # the first row of each micro-batch of those steps


def test_the_train_command_resumes_the_second_pass_over_a_store_from_latest(tmp_path, checkpoints):
    """`liger-kd train --dataset_name STORE --num_train_epochs 2`, rows held out for evaluation and a refresh every 2
    steps rescored by the scoring teacher: stopped after step 4 (the second pass's first, of 3 a pass), `latest`
    resumes it to the weights, losses and evaluations of the run that never stopped."""
    import shutil

    from liger_patch_kd.models import revert_kd_patch
    from liger_patch_kd.train_cli import run as train_run

    assert main(_command(checkpoints, tmp_path / "store")) == 0
    options = ["--model_name_or_path", str(checkpoints / "student"), "--teacher_model_name_or_path",
               str(checkpoints / "teacher"), "--dataset_name", str(tmp_path / "store"), "--eval_fraction", "0.25",
               "--use_kd_patch", "--kd_onpolicy_loss", "pg", "--kd_store_refresh_steps", "2",
               "--kd_store_refresh_fraction", "0.5", "--learning_rate", "3e-2", "--per_device_train_batch_size", "2",
               "--num_train_epochs", "2", "--logging_steps", "1", "--eval_strategy", "steps", "--eval_steps", "3",
               "--save_strategy", "steps", "--save_steps", "4", "--report_to", "none", "--use_cpu",
               "--disable_tqdm", "true", "--seed", "5"]  # fmt: skip
    whole = train_run.train([*options, "--output_dir", str(tmp_path / "whole")])
    revert_kd_patch()
    assert whole.state.global_step == 6 and whole.offline.refresh.refreshed_steps == [2, 4]  # 6 rows: 3 steps a pass
    shutil.copytree(tmp_path / "whole" / "checkpoint-4", tmp_path / "cut" / "checkpoint-4")
    resumed = train_run.train([*options, "--output_dir", str(tmp_path / "cut"), "--resume_from_checkpoint", "latest"])
    assert resumed.state.global_step == 6 and resumed.offline.refresh.refreshed_steps == [4]
    for key in ("loss", "eval_loss"):
        seen = [[(h["step"], h[key]) for h in t.state.log_history if key in h] for t in (whole, resumed)]
        assert len(seen[0]) == len(seen[1]) and all(a == pytest.approx(b, rel=1e-6) for a, b in zip(*seen)), key
    for name, p in whole.model.named_parameters():
        torch.testing.assert_close(dict(resumed.model.named_parameters())[name], p, rtol=1e-6, atol=1e-8)


def test_the_refreshed_share_is_of_the_steps_rows_whatever_the_micro_batches(tmp_path, models, tokenizer):
    """kd_store_refresh_fraction f regenerates ceil(f x the step's rows) rows, the first rows of its micro-batches:
    per_device_train_batch_size 1 with 4 accumulated micro-batches and f = 0.25 refreshed every row (ceil(0.25 x 1)
    in each), four times the share asked; 2 micro-batches of 3 and f = 0.5 refreshed 4 of 6."""
    from liger_patch_kd.batch.rollout_store import rows_of

    student, teacher = models
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    for size, micro, fraction, counts in ((1, 4, 0.25, [1, 0, 0, 0]), (3, 2, 0.5, [2, 1]), (2, 2, 0.5, [1, 1])):
        trainer = KDTrainer(model=copy.deepcopy(student), teacher_model=teacher, processing_class=tokenizer,
                            train_dataset=data, args=_args(tmp_path / "t", kd_store_refresh_steps=1,
                                                           kd_store_refresh_fraction=fraction))  # fmt: skip
        offline = trainer.offline
        batches = [offline.collator([data[size * b + r] for r in range(size)]) for b in range(micro)]
        out = offline.refreshed(batches, trainer.model, trainer.teacher_model, tokenizer=tokenizer, step=1,
                                vocab_size=None)  # fmt: skip
        changed = []
        for before, after in zip(batches, out):
            rows = zip(rows_of(before), rows_of(after))
            changed.append(sum(not torch.equal(b["input_ids"], a["input_ids"]) for b, a in rows))
        assert changed == counts, (size, micro, fraction, changed)


def test_a_bf16_pair_stores_log_probs_of_fp32_logits_as_training_reads_them(tmp_path, tokenizer):
    """bf16 weights (the usual GPU store): the behaviour and teacher log-probs of the sampled tokens are the log-softmax
    of the products' fp32 output, as the fused losses compute the student's log-probs in training, not of logits
    rounded to bf16 first (2^-9 of each logit: ~1e-3 nats on these tiny models' logits, a staleness before any
    step). Reference: the models' own bf16 hidden states and heads, multiplied and normalised in float64."""
    student = tiny_model("llama", dtype=torch.bfloat16, seed=1)
    teacher = tiny_model("llama", dtype=torch.bfloat16, seed=2)
    data = TeacherLogprobsDataset(_store(tmp_path / "s", (student, teacher), tokenizer))

    def reference(model, ids):
        with torch.no_grad():
            hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            return torch.log_softmax(hidden.double() @ model.lm_head.weight.double().T, -1)

    worst = {"behaviour_logprobs": 0.0, "teacher_token_logprobs": 0.0}
    for i in range(len(data)):
        item = data[i]
        ids = item["input_ids"].tolist()
        p = int((item["labels"] != -100).nonzero()[0])
        for key, model in (("behaviour_logprobs", student), ("teacher_token_logprobs", teacher)):
            want = reference(model, ids)[p - 1 : -1].gather(1, item["input_ids"][p:, None])[:, 0]
            worst[key] = max(worst[key], float((item[key][p:].double() - want).abs().max()))
    # fp32 products of bf16 operands, stored as fp32: a few fp32 ulps of the log-probs, far under bf16's 2^-9
    assert worst["behaviour_logprobs"] < 1e-5 and worst["teacher_token_logprobs"] < 1e-5, worst


def test_prompt_rows_are_read_in_tokenizer_batches_as_one_by_one_and_a_bad_line_is_named(tmp_path, tokenizer,
                                                                                         caplog):  # fmt: skip
    """read_prompt_lines encodes many rows per tokenizer call: the ids are one-by-one's (a completion ignored, and
    said once, a conversation through the chat path), and a bad row in a later batch is still named by its line."""
    rows = [*PROMPTS, {"prompt": "the park", "completion": " is warm"}, {"prompt": ""}] * 3
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    expected = [tokenize_prompt_row(tokenizer, {"prompt": r["prompt"]})[0] for r in rows]
    with caplog.at_level(logging.WARNING, logger="liger_patch_kd"):
        prompts, lines = rollout_store.read_prompt_lines(data, tokenizer, rows_per_call=4)
        assert prompts == expected and lines == list(range(1, len(rows) + 1))  # the line each came from
    said = [r.getMessage() for r in caplog.records if "'completion'" in r.getMessage()]
    first = rows.index({"prompt": "the park", "completion": " is warm"}) + 1
    assert said == [f"{data}: 3 of {len(rows)} rows carry a 'completion' (the first at line {first}), which a rollout "
                    f"store does not read: the student samples its own after each prompt"]  # fmt: skip
    assert rollout_store.read_prompt_lines(data, tokenizer)[0] == expected
    data.write_text("\n".join(json.dumps(r) for r in [*rows, {"prompt": 5}]))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(data))}:{len(rows) + 1}: 'prompt' must be a string"):
        rollout_store.read_prompt_lines(data, tokenizer, rows_per_call=4)


def test_eval_fraction_holds_out_whole_prompts_of_a_rollout_store(tmp_path, models, tokenizer):
    """--eval_fraction on a store of 2 completions a prompt: both completions of a prompt on one side (else the
    evaluation scores completions of prompts the student trains on); a plain split is row by row as before."""
    from liger_patch_kd.train_cli.arguments import ScriptArguments
    from liger_patch_kd.train_cli.data import load_splits

    folder = _store(tmp_path / "s", models, tokenizer)
    for seed in range(6):
        splits = load_splits(ScriptArguments(dataset_name=str(folder), eval_fraction=0.5), seed=seed,
                             store_dataset=TeacherLogprobsDataset)  # fmt: skip
        train, held = set(splits.train.indices), set(splits.evaluation.indices)
        assert train | held == set(range(8)) and not train & held and len(held) == 4
        assert all((i in held) == (i ^ 1 in held) for i in range(8)), (seed, sorted(held))
        assert splits.description.endswith("held out of 'train' (2 of 4 prompts, their 2 completions each)")
    with pytest.raises(ValueError, match=r"holds out 4 of the train split's 4 prompts \(2 completions each\)"):
        load_splits(ScriptArguments(dataset_name=str(folder), eval_fraction=0.99), seed=0,
                    store_dataset=TeacherLogprobsDataset)  # fmt: skip


def test_length_options_beside_a_tokenized_evaluation_set_are_refused(tmp_path, models, tokenizer):
    """The evaluation rows are checked as the training rows are: a store given as eval_dataset (alone or in a
    dict) beside kd_max_length, which would not cut it, is refused naming it."""
    from liger_patch_kd import teacher as TD

    TD.precompute(models[1], [[3, 4, 5, 6, 7, 8]] * 2, tmp_path / "plain", top_k=4, progress=False)
    store = TeacherLogprobsDataset(tmp_path / "plain")
    text = [{"text": "the cat sat on the mat. a dog ran to the park."}] * 2
    for evaluation, name in ((store, "eval_dataset"), ({"held": store}, "eval_dataset['held']")):
        with pytest.raises(ValueError, match=re.escape(f"{name} holds a teacher store's rows") + ".*kd_max_length=4"):
            KDTrainer(model=copy.deepcopy(models[0]), teacher_model=models[1], processing_class=tokenizer,
                      train_dataset=text, eval_dataset=evaluation, args=_args(tmp_path / "t", kd_max_length=4))


def test_a_teacher_url_beside_a_rollout_store_is_refused(tmp_path, models, tokenizer):
    """A rollout store carries the scores of the teacher that made it, and a refresh rescores with teacher_model:
    a kd_teacher_url beside one would never be asked (a run trained on the stored scores, an unreachable URL
    unnoticed, an adversarial pass), so it is refused when the Trainer is built."""
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    with pytest.raises(ValueError, match=re.escape("kd_teacher_url='http://127.0.0.1:9' would never be asked")):
        KDTrainer(model=copy.deepcopy(models[0]), processing_class=tokenizer, train_dataset=data,
                  args=_args(tmp_path, kd_teacher_url="http://127.0.0.1:9"))  # fmt: skip


def test_a_refresh_samples_in_calls_of_kd_rollout_batch_size(tmp_path, models, tokenizer, monkeypatch):
    """kd_rollout_batch_size bounds the prompts of one generation call (its KV cache) on-policy; a refresh took all
    of a step's rows in one call whatever it said (an adversarial pass)."""
    from liger_patch_kd.trainer.offline_onpolicy import refresh as refresh_module

    student, teacher = models
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    trainer = KDTrainer(model=copy.deepcopy(student), teacher_model=teacher, processing_class=tokenizer,
                        train_dataset=data, args=_args(tmp_path, per_device_train_batch_size=4,
                                                       kd_store_refresh_steps=1, kd_rollout_batch_size=1))  # fmt: skip
    seen, real = [], refresh_module.generate_rollouts

    def spy(generator, prompts, settings, **options):
        seen.append((len(prompts), settings.batch_size))
        return real(generator, prompts, settings, **options)

    monkeypatch.setattr(refresh_module, "generate_rollouts", spy)
    batches = [trainer.offline.collator([data[i] for i in range(4)])]
    trainer.offline.refreshed(batches, trainer.model, trainer.teacher_model, tokenizer=tokenizer, step=1,
                              vocab_size=None)  # fmt: skip
    assert seen == [(4, 1)]


def test_heads_of_two_sizes_sample_the_tokenizers_ids_and_train(tmp_path, tokenizer):
    """Heads padded past the tokenizer by different amounts (Qwen2.5-0.5B's 151936 rows beside Qwen2.5-7B's 152064,
    tokenizer 151665), the student's the smaller: the store samples, and normalises the behaviour over, the
    tokenizer's ids, as KDTrainer normalises such a pair (kd_vocab_size = len(tokenizer)); it sampled the student's
    padding rows and the first training step died on an index past the vocabulary (an adversarial pass)."""
    vocab = len(tokenizer)
    student = tiny_model("llama", dtype=torch.float32, seed=1, vocab=vocab + 41)
    teacher = tiny_model("llama", dtype=torch.float32, seed=2, vocab=vocab + 80)
    settings = RolloutSettings(max_new_tokens=8, num_generations=2, seed=3)
    data = TeacherLogprobsDataset(_store(tmp_path / "s", (student, teacher), tokenizer, settings=settings,
                                         score=ScoreOptions(top_k=4)))  # fmt: skip
    assert read_manifest(tmp_path / "s")["rollouts"]["sampled_vocab_size"] == vocab
    scored = torch.cat([item["input_ids"][item["labels"] != -100] for item in data])
    assert scored.numel() and int(scored.max()) < vocab
    for item in data:  # the behaviour: the student's log-softmax over the tokenizer's ids at each sampled token
        logits = student(input_ids=item["input_ids"][None]).logits[0, :-1, :vocab].double()
        want = torch.log_softmax(logits, -1).gather(-1, item["input_ids"][1:, None])[:, 0]
        where = item["labels"][1:] != -100
        torch.testing.assert_close(item["behaviour_logprobs"][1:][where].double(), want[where], rtol=0, atol=2e-5)
    trainer = KDTrainer(model=copy.deepcopy(student), teacher_model=teacher, processing_class=tokenizer,
                        train_dataset=data, args=_args(tmp_path, kd_onpolicy_loss="pg", kd_max_new_tokens=8,
                                                       kd_store_refresh_steps=1, max_steps=2))  # fmt: skip
    trainer.train()
    assert all(math.isfinite(v) for v in _losses(trainer))


@pytest.mark.parametrize("change", [["--seed", "5"], ["--num-generations", "3"], ["--generation-temperature", "0.7"]])
def test_a_resume_with_other_sampling_is_refused_before_any_model_loads(tmp_path, checkpoints, capsys, monkeypatch,
                                                                         change):  # fmt: skip
    """The store's manifest and the command line alone decide that a resume would mix two stores: said before the
    student and the teacher load (minutes for large models), in the words StoreWriter.open uses later."""
    import transformers

    out = tmp_path / "out"
    assert main(_command(checkpoints, out)) == 0
    capsys.readouterr()

    def never(*_, **__):
        raise AssertionError("a model loaded before the resume's other inputs were refused")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    assert main([*_command(checkpoints, out), *change]) == 2
    err = capsys.readouterr().err
    assert "started with other inputs" in err and f"set by {change[0]}" in err


def test_a_set_of_teachers_beside_a_rollout_store_is_refused_when_the_trainer_is_built(tmp_path, models, tokenizer):
    """A rollout store's rows carry the scores of its one teacher: a set of teachers beside it was refused only at
    the first batch, by the routing or the live mixture (an adversarial pass); now when the Trainer is built."""
    student, teacher = models
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    with pytest.raises(ValueError, match=re.escape("teacher_model is a set of 2 (['a', 'b'])")):
        KDTrainer(model=copy.deepcopy(student), teacher_model={"a": teacher, "b": copy.deepcopy(teacher)},
                  processing_class=tokenizer, train_dataset=data,
                  args=_args(tmp_path, kd_teacher_weights={"a": 0.5, "b": 0.5}))  # fmt: skip


@pytest.mark.parametrize("kd_vocab_size", [252, 250])
def test_a_kd_vocab_size_below_the_stores_sampled_ids_is_refused(tmp_path, models, tokenizer, kd_vocab_size):
    """A store of equal heads (257 rows) was sampled from, and its behaviour normalised over, all 257 ids: a
    kd_vocab_size of 252 would put every k1 / pg ratio off by the mass of ids 252..256 (it trained, silently), one
    of 250 stopped at the first step on an index past it (an adversarial pass). Refused when the Trainer is built,
    naming what to do."""
    data = TeacherLogprobsDataset(_store(tmp_path / "s", models, tokenizer))
    with pytest.raises(ValueError, match=re.escape("leave kd_vocab_size unset")):
        KDTrainer(model=copy.deepcopy(models[0]), processing_class=tokenizer, train_dataset=data,
                  args=_args(tmp_path, kd_onpolicy_loss="k1", kd_vocab_size=kd_vocab_size, max_steps=1))  # fmt: skip


def test_rollouts_into_a_plain_teacher_store_say_it_is_not_a_rollout_store(tmp_path, checkpoints, capsys):
    """--out holding a plain teacher store: refused before any model loads as another kind of store, not as a
    resume whose every sampling flag changed (an adversarial pass)."""
    out = tmp_path / "plain"
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("the cat sat on the mat", "a dog ran")))
    assert main(["precompute", "--teacher", str(checkpoints / "teacher"), "--data", str(text), "--out", str(out),
                 "--top-k", "4", "--dtype", "float32"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(_command(checkpoints, out)) == 2
    err = capsys.readouterr().err
    assert "without a 'rollouts' section" in err and "set by --" not in err, err
