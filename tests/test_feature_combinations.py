"""Combinations of the features (several teachers, privileged rows, sampled teacher tokens, FP8 logits) that must
either train the objective asked or be refused with a ValueError naming the option: none may be silently ignored."""

import pytest
import torch

from liger_patch_kd import teacher as TD
from liger_patch_kd.batch.privileged import PrivilegedCollator
from liger_patch_kd.config import KDLossConfig
from liger_patch_kd.losses import multi_teacher, sampled_teacher
from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments

from .tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")


def _args(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=1, learning_rate=1e-3,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0, kd_beta=0.0, kd_vocab_size=VOCAB,
    )  # fmt: skip
    return KDTrainingArguments(**{**base, **overrides})


def _rows(extra=lambda ids: {}, n=2):
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (8,), generator=g)
        labels = ids.clone()
        labels[:3] = -100
        rows.append({"input_ids": ids, "labels": labels, **extra(ids)})
    return rows


def _samples(ids, k=4):
    g = torch.Generator().manual_seed(1)
    return {
        "teacher_sample_ids": torch.randint(0, VOCAB, (len(ids), k), generator=g),
        "teacher_sample_counts": torch.ones(len(ids), k, dtype=torch.int32),
        "teacher_sample_logprobs": -3 * torch.rand(len(ids), k, generator=g),
    }


def _models(several):
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    if not several:
        return student, tiny_model("llama", dtype=torch.float32, seed=2)
    return student, {"a": tiny_model("llama", dtype=torch.float32, seed=2), "b": tiny_model("llama", seed=3)}


def _trainer(tmp_path, teacher, rows, student=None, **overrides):
    return KDTrainer(
        model=student or tiny_model("llama", dtype=torch.float32, seed=1), teacher_model=teacher,
        args=_args(tmp_path, **overrides), train_dataset=rows, data_collator=TD.TeacherDataCollator(),
    )  # fmt: skip


def test_several_live_teachers_refuse_sampled_teacher_columns(tmp_path):
    """The sampled draws would be dropped and the live teachers scored instead."""
    student, teachers = _models(several=True)
    trainer = _trainer(tmp_path, teachers, _rows(_samples), student, kd_teacher_weights={"a": 0.5, "b": 0.5})
    with pytest.raises(ValueError, match="teacher_sample_ids"):
        trainer.train()


@pytest.mark.parametrize(
    "overrides,rows",
    [
        (dict(kd_teacher_weights={"a": 1.0}), None),  # a mixture of one teacher, silently unused
        ({}, _rows(lambda ids: {"teacher": "zzz"})),  # a route to an unknown teacher, silently dropped
        ({}, _rows(lambda ids: {"teacher_weights": [0.5, 0.5]})),
    ],
)
def test_several_teacher_options_with_one_teacher_are_refused(tmp_path, overrides, rows):
    student, teacher = _models(several=False)
    with pytest.raises(ValueError, match="kd_teacher_weights|teacher"):
        _trainer(tmp_path, teacher, rows or _rows(), student, **overrides)


def test_offline_rows_naming_their_teacher_still_train_without_a_teacher_model(tmp_path):
    """teacher.RoutedTeacherData's rows: each row's top-k is its own teacher's; the `teacher` column names it."""
    offline = lambda ids: {"teacher": "a", "teacher_token_ids": torch.zeros(len(ids), 2, dtype=torch.long),  # noqa: E731
                       "teacher_logprobs": torch.full((len(ids), 2), -0.7)}  # fmt: skip
    setup = _trainer(tmp_path, None, _rows(offline)).teacher_set  # the names, for per-teacher logs only
    assert setup.names == ("a",) and setup.models is None


def test_teacher_logits_fp8_with_several_teachers_is_refused(tmp_path):
    student, teachers = _models(several=True)
    with pytest.raises(ValueError, match="kd_teacher_logits_fp8"):
        _trainer(tmp_path, teachers, _rows(), student, kd_teacher_weights={"a": 0.5, "b": 0.5},
                 kd_teacher_logits_fp8=True, use_kd_patch=True)  # fmt: skip


@pytest.mark.parametrize("option", ["kd_teacher_logits_fp8", "kd_student_logits_fp8"])
def test_fp8_logits_without_the_fused_loss_are_refused(tmp_path, option):
    with pytest.raises(ValueError, match=option):
        _args(tmp_path, use_kd_patch=False, **{option: True})


def test_teacher_logits_fp8_is_refused_by_the_losses_without_a_teacher_product():
    """Sampled teacher tokens have no teacher product, and the several-teacher loss quantises none."""
    n, h, v, k = 6, 8, 32, 3
    x, w = torch.randn(n, h), torch.randn(v, h)
    cfg = KDLossConfig(beta=0.0, teacher_logits_fp8=True)
    ids, counts = torch.randint(0, v, (n, k)), torch.ones(n, k, dtype=torch.int32)
    with pytest.raises(ValueError, match="teacher_logits_fp8"):
        sampled_teacher.fused_linear_sampled_kd(x, w, ids, counts, -torch.rand(n, k), config=cfg)
    with pytest.raises(ValueError, match="teacher_logits_fp8"):
        multi_teacher.fused_linear_multi_teacher_jsd(x, w, [x], [w], torch.ones(1), config=cfg)


def test_engine_rollouts_of_privileged_rows_keep_the_behaviour_logprobs(tmp_path):
    """kd_onpolicy_loss='pg' importance-corrects with the engine's log-probs; rows with a teacher prompt of their own
    took another batch builder, which dropped them (the stale rollouts then weighed as on-policy)."""
    from liger_patch_kd.batch.privileged import PrivilegedCollator
    from liger_patch_kd.trainer.rollouts.generate import BEHAVIOUR, Rollout
    from liger_patch_kd.trainer.rollouts.onpolicy import OnPolicySteps

    args = _args(tmp_path, kd_lmbda=1.0, kd_onpolicy_loss="pg", kd_num_generations=1, kd_max_new_tokens=8)
    steps = OnPolicySteps(args)  # 8 new tokens: prompt + 128 (the default) is past the tiny model's 128 positions
    steps.behaviour = True  # what kd_generation_url + kd_onpolicy_loss='pg' set (no engine runs here)
    made = []

    def source(generator, prompts, settings, **kw):
        made.extend(Rollout(p, [7, 8, 9][: 1 + i], True, tuple(-0.5 * (j + 1) for j in range(1 + i)))
                    for i, p in enumerate(prompts))  # fmt: skip
        return made

    steps.source = source
    rows = [{"input_ids": [3, 4, 5], "labels": [-100, -100, 5], "teacher_input_ids": [1, 2, 3, 4, 5]},
            {"input_ids": [6, 4], "labels": [-100, 4], "teacher_input_ids": [2, 6, 4]}]  # fmt: skip
    batch = PrivilegedCollator()(rows)
    model = tiny_model("llama", dtype=torch.float32)
    (out,) = steps.replace(model, [batch], tokenizer=None, step=0, device=torch.device("cpu"))
    assert out["teacher_input_ids"] is not None and BEHAVIOUR in out
    for row, r in enumerate(made):
        start = len(r.prompt)
        torch.testing.assert_close(out[BEHAVIOUR][row, start : start + len(r.completion)], torch.tensor(r.logprobs))
        assert (out["labels"][row, start : start + len(r.completion)] == torch.tensor(r.completion)).all()


def test_cross_tokenizer_rows_with_a_teacher_prompt_are_refused():
    """Both tokenizers read the row's one text: the teacher_prompt column was silently dropped."""
    from liger_patch_kd.align import CrossTokenizerCollator
    from liger_patch_kd.demo import load_corpus
    from liger_patch_kd.demo.cross_tokenizer import CharTokenizerWithOffsets, train_bpe_tokenizer

    text = load_corpus()[:2000]
    collator = CrossTokenizerCollator(train_bpe_tokenizer(text, 120), CharTokenizerWithOffsets(text))
    row = {"prompt": "At dawn, ", "completion": "the fox sees a cat."}
    assert collator([row])["teacher_input_ids"].shape[0] == 1  # the same row without it is fine
    with pytest.raises(ValueError, match="teacher_prompt"):
        collator([row, {**row, "teacher_prompt": "Hint: a fox. At dawn, "}])


@pytest.mark.parametrize("mixture", ["distribution", "loss"])
def test_mixture_weights_within_the_tolerance_are_normalised(mixture):
    """Weights summing to 0.9995 are accepted (rounded decimals); mixture='loss' scaled the loss by their sum."""
    from liger_patch_kd import reference

    g = torch.Generator().manual_seed(0)
    n, h, v = 5, 8, 16
    x, w = torch.randn(n, h, dtype=torch.float64, generator=g), torch.randn(v, h, dtype=torch.float64, generator=g)
    hs = [torch.randn(n, h, dtype=torch.float64, generator=g) for _ in range(2)]
    ws = [torch.randn(v, h, dtype=torch.float64, generator=g) for _ in range(2)]
    labels = torch.randint(0, v, (n,), generator=g)
    rounded = torch.tensor([0.5, 0.4995], dtype=torch.float64)
    exact = rounded / rounded.sum()
    fused = [multi_teacher.fused_linear_multi_teacher_jsd(x, w, hs, ws, m, labels, config=KDLossConfig(beta=0.5),
                                                        mixture=mixture)
             for m in (rounded, exact)]  # fmt: skip
    cfg = KDLossConfig(beta=0.5)
    ref = [reference.multi_teacher_kd_loss(x @ w.T, [t @ u.T for t, u in zip(hs, ws)], m, labels, cfg, None,
                                           mixture=mixture) for m in (rounded, exact)]  # fmt: skip
    torch.testing.assert_close(fused[0], fused[1], rtol=1e-12, atol=0)  # 5e-4 apart when the sum scales the loss
    torch.testing.assert_close(ref[0], ref[1], rtol=1e-12, atol=0)
    torch.testing.assert_close(fused[0], ref[1], rtol=1e-10, atol=0)


@pytest.mark.parametrize("option", ["kd_teacher_logits_fp8", "kd_student_logits_fp8"])
def test_fp8_logits_across_tokenizers_are_refused(tmp_path, option):
    """The cross-tokenizer loss takes both models' logits as they are: the flag was silently unused."""
    from liger_patch_kd.trainer.teachers.other_tokenizer import check_cross_tokenizer_args

    with pytest.raises(ValueError, match=option):
        check_cross_tokenizer_args(_args(tmp_path, use_kd_patch=True, **{option: True}))


def _own_prompt(ids):
    return {"teacher_input_ids": torch.cat([torch.tensor([5, 6]), ids])}


@pytest.mark.parametrize(
    "columns,keeps,drops",
    [(_own_prompt, PrivilegedCollator, "flattening"), (_own_prompt, PrivilegedCollator, "padding"),
     (_samples, TD.TeacherDataCollator, "flattening")],
)  # fmt: skip
def test_a_collator_that_drops_the_teacher_columns_is_refused(tmp_path, columns, keeps, drops):
    """DataCollatorWithFlattening keeps input_ids / labels only, TeacherDataCollator no teacher_input_ids: the
    teacher then scored the student's own prompt (privileged rows), or the live teacher replaced the sampled data,
    with no word."""
    from transformers import DataCollatorWithFlattening

    dropping = DataCollatorWithFlattening() if drops == "flattening" else TD.TeacherDataCollator()
    student, teacher = _models(several=False)
    teacher = None if columns is _samples else teacher  # sampled rows are the teacher (a live one is refused)
    with pytest.raises(ValueError, match="drops the rows'"):
        KDTrainer(model=student, teacher_model=teacher, args=_args(tmp_path), train_dataset=_rows(columns),
                  data_collator=dropping)  # fmt: skip
    KDTrainer(model=student, teacher_model=teacher, args=_args(tmp_path), train_dataset=_rows(columns),
              data_collator=keeps())  # a collator that keeps them is fine  # fmt: skip


def test_rollouts_never_sample_a_padded_heads_extra_rows():
    """A head padded past kd_vocab_size: generate() sampled its extra rows, ids no teacher embedding holds (an
    IndexError in the teacher, or ids scored outside the loss's vocabulary)."""
    from liger_patch_kd.trainer.rollouts.generate import RolloutSettings, generate_rollouts

    student = tiny_model("llama", dtype=torch.float32, seed=1, vocab=VOCAB + 7)
    with torch.no_grad():  # the padding rows dominate every position's logits
        student.lm_head.weight[VOCAB:] = 50 * student.model.norm.weight
    run = dict(pad_id=0, eos_ids=set(), start_id=1)
    free = generate_rollouts(student, [[3, 4], [5]], RolloutSettings(max_new_tokens=4, cache="dynamic"), **run)
    assert any(t >= VOCAB for r in free for t in r.completion)  # without vocab_size they are what it samples
    kept = generate_rollouts(student, [[3, 4], [5]], RolloutSettings(max_new_tokens=4, cache="dynamic",
                                                                      vocab_size=VOCAB), **run)  # fmt: skip
    assert all(t < VOCAB for r in kept for t in r.completion) and all(len(r.completion) == 4 for r in kept)


def test_kdtrainer_rollouts_take_the_losses_vocabulary(tmp_path):
    student = tiny_model("llama", dtype=torch.float32, seed=1, vocab=VOCAB + 7)
    teacher = tiny_model("llama", dtype=torch.float32, seed=2)
    trainer = _trainer(tmp_path, teacher, _rows(), student, kd_lmbda=1.0)
    assert trainer.onpolicy.settings.vocab_size == VOCAB == trainer.kd_config.vocab_size


def test_a_struct_columns_missing_teacher_weighs_zero(tmp_path):
    """datasets stores {"a": 1.0} beside {"a": 0.3, "b": 0.7} as {"a": 1.0, "b": None}: a TypeError before."""
    from liger_patch_kd.trainer.teachers.routes import TeacherRoutes as TeacherSetSetup

    setup = TeacherSetSetup({"a": None, "b": None}, _args(tmp_path))
    assert setup.weights_from("a row's teacher_weights", {"a": 1.0, "b": None}) == [1.0, 0.0]
    with pytest.raises(ValueError, match="sum to 1"):
        setup.weights_from("a row's teacher_weights", {"a": 0.3, "b": None})


def _topk(ids, k=4):
    g = torch.Generator().manual_seed(2)
    return {"teacher_token_ids": torch.randint(0, VOCAB, (len(ids), k), generator=g),
            "teacher_logprobs": -3 * torch.rand(len(ids), k, generator=g)}  # fmt: skip


@pytest.mark.parametrize("columns", [_topk, _samples], ids=["top-k", "sampled"])
def test_a_live_teacher_beside_offline_rows_it_would_never_score_is_refused(tmp_path, columns):
    with pytest.raises(ValueError, match="teacher_model would never be used.*kd_lmbda=0"):
        _trainer(tmp_path, tiny_model("llama", dtype=torch.float32, seed=2), _rows(columns))
    _trainer(tmp_path, None, _rows(columns))  # the rows' data alone is the teacher: fine


def test_a_live_teacher_that_scores_the_evaluation_rows_is_not_refused(tmp_path):
    """Offline training rows, and an eval_dataset of plain rows the live teacher scores: a legitimate run."""
    teacher = tiny_model("llama", dtype=torch.float32, seed=2)
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    for evaluation in (_rows(), {"held_out": _rows()}):
        trainer = KDTrainer(model=student, teacher_model=teacher, args=_args(tmp_path), train_dataset=_rows(_topk),
                            eval_dataset=evaluation, data_collator=TD.TeacherDataCollator())  # fmt: skip
        assert trainer.evaluate(_rows())["eval_loss"] > 0
    with pytest.raises(ValueError, match="teacher_model would never be used"):  # evaluation rows with their own data
        KDTrainer(model=student, teacher_model=teacher, args=_args(tmp_path), train_dataset=_rows(_topk),
                  eval_dataset=_rows(_topk), data_collator=TD.TeacherDataCollator())  # fmt: skip


def test_a_subset_of_a_sampled_store_is_checked_against_the_stores_draw_temperature(tmp_path):
    teacher = tiny_model("llama", dtype=torch.float32, seed=2)
    TD.precompute(teacher, [[1, 5, 6, 7], [1, 8, 9]], tmp_path / "s", top_k=4, temperature=2.0, samples=4,
                  progress=False)  # fmt: skip
    subset = torch.utils.data.Subset(TD.TeacherLogprobsDataset(tmp_path / "s"), [1, 0])
    with pytest.raises(ValueError, match="kd_temperature=1.0 but the store's teacher tokens were drawn at .*2.0"):
        _trainer(tmp_path, None, subset, kd_beta=0.0, kd_temperature=1.0)
    _trainer(tmp_path, None, subset, kd_beta=0.0, kd_temperature=2.0)


@pytest.mark.parametrize("lmbda", [0.0, 0.9])
def test_prompt_only_rows_with_off_policy_steps_are_refused_before_training(tmp_path, lmbda):
    """kd_lmbda < 1 trains some steps on the dataset's completions: prompt-only rows have none. Refused when the
    trainer is made, not at the first off-policy step (with kd_lmbda=0.9 that can come after many steps)."""
    from .test_onpolicy import tokenizer as tokenizer_fixture

    tokenizer = tokenizer_fixture.__wrapped__()
    rows = [{"prompt": p} for p in ("the cat", "a dog ran")]

    def make(**overrides):
        return KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1), processing_class=tokenizer,
                         teacher_model=tiny_model("llama", dtype=torch.float32, seed=2), train_dataset=rows,
                         args=_args(tmp_path, **overrides))  # fmt: skip

    with pytest.raises(ValueError, match=f"kd_lmbda={lmbda}.*prompts without a completion"):
        make(kd_lmbda=lmbda)
    make(kd_lmbda=lmbda, kd_seq_kd=True)  # every step generated: from the teacher off-policy
    make(kd_lmbda=1.0)


def test_sampled_rows_without_a_store_train_only_at_their_declared_temperature(tmp_path):
    rows = _rows(_samples)
    with pytest.raises(ValueError, match="kd_temperature=2.0 on rows of sampled teacher tokens without a store"):
        _trainer(tmp_path, None, rows, kd_temperature=2.0)
    with pytest.raises(ValueError, match="kd_temperature=2.0 but the rows' teacher tokens were drawn at temp.* 1.5"):
        _trainer(tmp_path, None, rows, kd_temperature=2.0, kd_teacher_sample_temperature=1.5)
    with pytest.raises(ValueError, match="kd_temperature=1.0 but the rows' teacher tokens were drawn at temp.* 2.0"):
        _trainer(tmp_path, None, rows, kd_teacher_sample_temperature=2.0)
    _trainer(tmp_path, None, rows, kd_temperature=2.0, kd_teacher_sample_temperature=2.0).train()
