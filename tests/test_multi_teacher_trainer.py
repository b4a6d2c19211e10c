"""KDTrainer(teacher_model={"math": m1, "code": m2}): routing by row, mixtures, logging, against the reference."""

import copy

import pytest
import torch

import liger_patch_kd.models as M
from liger_patch_kd import reference
from liger_patch_kd import teacher as TD
from liger_patch_kd.models.kd_io import shift_labels
from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments

from .tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")

# one row of each kind: routed by name, routed by index, its own mixture, the run's default mixture
ROUTES = [{"teacher": "math"}, {"teacher": 1}, {"teacher_weights": {"math": 0.25, "code": 0.75}}, {}]
DEFAULT = {"math": 0.4, "code": 0.6}
ROW_WEIGHTS = [[1.0, 0.0], [0.0, 1.0], [0.25, 0.75], [0.4, 0.6]]


def _rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for route in ROUTES:
        ids = torch.randint(1, VOCAB, (int(torch.randint(6, 11, (1,), generator=g)),), generator=g)
        labels = ids.clone()
        labels[:2] = -100
        rows.append({"input_ids": ids, "labels": labels, **route})
    return rows


def _models(dtype):
    teachers = {
        "math": tiny_model("llama", dtype=dtype, seed=2, hidden=96),
        "code": tiny_model("qwen2", dtype=dtype, seed=3, vocab=VOCAB + 7),  # another hidden size and head
    }
    return tiny_model("llama", dtype=dtype, seed=1), teachers


def _args(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=1, learning_rate=1e-3,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0, kd_beta=0.3, kd_temperature=2.0, kd_hard_weight=0.2, kd_teacher_weights=DEFAULT,
        kd_vocab_size=VOCAB,
    )  # fmt: skip
    return KDTrainingArguments(**{**base, **overrides})


def _reference(student, teachers, rows, mixture="distribution", dtype=torch.float64):
    """Each row on its own (no padding), every model's own logits, reference.multi_teacher_kd_loss summed over
    rows and divided by the step's token count: what the whole step's logged loss must be."""
    count = sum(int((shift_labels(r["labels"][None], -100) != -100).sum()) for r in rows)
    total = 0.0
    for row, weights in zip(rows, ROW_WEIGHTS):
        ids = row["input_ids"][None]
        logits = [m(input_ids=ids).logits.to(dtype) for m in (student, *teachers.values())]
        total = total + reference.multi_teacher_kd_loss(
            logits[0], [z.detach() for z in logits[1:]], torch.tensor(weights, dtype=dtype),
            shift_labels(row["labels"][None], -100), None, count, beta=0.3, temperature=2.0, hard_weight=0.2,
            vocab_size=VOCAB, mixture=mixture,
        )  # fmt: skip
    return total


def _batch_reference(student, teachers, batch, mixture):
    """The same padded batch through every model's own forward, scored by reference.multi_teacher_kd_loss."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    logits = [m(**inputs).logits for m in (student, *teachers.values())]
    targets = shift_labels(batch["labels"], -100)
    return reference.multi_teacher_kd_loss(
        logits[0], [z.detach() for z in logits[1:]], torch.tensor(ROW_WEIGHTS, dtype=torch.float64)[:, None, :],
        targets, None, (targets != -100).sum(), beta=0.3, temperature=2.0, hard_weight=0.2, vocab_size=VOCAB,
        mixture=mixture,
    )  # fmt: skip


@pytest.mark.parametrize("use_kd_patch,mixture", [(True, "distribution"), (False, "distribution"), (True, "loss")])
def test_compute_loss_and_gradients_equal_the_reference_in_float64(tmp_path, use_kd_patch, mixture):
    student, teachers = _models(torch.float64)
    rows = _rows()
    reference_model = copy.deepcopy(student)
    args = _args(tmp_path, use_kd_patch=use_kd_patch, kd_teacher_mixture=mixture)
    trainer = KDTrainer(model=student, teacher_model=teachers, args=args, data_collator=TD.TeacherDataCollator())
    batch = trainer.data_collator(rows)
    torch.testing.assert_close(batch["teacher_mixture"], torch.tensor(ROW_WEIGHTS))
    expected = _batch_reference(reference_model, teachers, batch, mixture)
    expected.backward()
    num_items = (shift_labels(batch["labels"], -100) != -100).sum()
    loss = trainer.compute_loss(student, batch, num_items_in_batch=num_items)
    loss.backward()
    # float64 throughout; the fused path sums the vocabulary in chunks, the reference in one pass
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-10, atol=0)
    for p, q in zip(student.parameters(), reference_model.parameters()):
        assert (p.grad - q.grad).norm() <= 1e-9 * q.grad.norm()


def test_rows_routed_to_one_teacher_equal_the_single_teacher_loss(tmp_path):
    student, teachers = _models(torch.float64)
    plain = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in _rows()]
    losses = []
    for teacher in (teachers, teachers["math"]):
        model = copy.deepcopy(student)
        several = teacher is teachers  # one teacher takes no kd_teacher_weights (refused: it would be unused)
        args = _args(tmp_path, use_kd_patch=True, **({} if several else {"kd_teacher_weights": None}))
        trainer = KDTrainer(model=model, teacher_model=teacher, args=args)
        rows = [{**r, "teacher": "math"} for r in plain] if several else plain
        losses.append(trainer.compute_loss(model, trainer.data_collator(rows)).detach())
        M.revert_kd_patch(model=model)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-10, atol=0)


@pytest.mark.parametrize("use_kd_patch", [True, False])
def test_train_bf16_accumulated_logs_the_reference_loss_and_each_teacher(tmp_path, use_kd_patch):
    """One optimizer step of 2 x 2 accumulated micro-batches under bf16 autocast: the logged loss is the float64
    reference of the same four rows to bf16's rounding of the products' inputs (8 bits: ~0.4 % per logit,
    averaging down over the vocabulary; 2 % bounds it with room)."""
    student, teachers = _models(torch.float32)
    rows = _rows()
    with torch.no_grad():
        expected = float(
            _reference(
                copy.deepcopy(student).double(), {k: copy.deepcopy(m).double() for k, m in teachers.items()}, rows
            )
        )
    args = _args(tmp_path, use_kd_patch=use_kd_patch, bf16=True, per_device_train_batch_size=2,
                 gradient_accumulation_steps=2)  # fmt: skip
    trainer = KDTrainer(
        model=student, teacher_model=teachers, args=args, train_dataset=rows, data_collator=TD.TeacherDataCollator()
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged[0]["loss"] == pytest.approx(expected, rel=2e-2)
    for name in ("math", "code"):
        assert f"kd_soft_loss/{name}" in logged[0] and 0 <= logged[0][f"kd_top1_agreement/{name}"] <= 1
        assert logged[0][f"kd_soft_loss/{name}"] > 0


def test_bad_routing_and_arguments_are_clear_errors(tmp_path):
    student, teachers = _models(torch.float32)
    trainer = KDTrainer(model=student, teacher_model=teachers, args=_args(tmp_path, kd_teacher_weights=None))
    with pytest.raises(ValueError, match="not one of the teachers"):
        trainer.data_collator([{**_rows()[0], "teacher": "physics"}])
    with pytest.raises(ValueError, match=r"index in \[0, 2\)"):
        trainer.data_collator([{**_rows()[0], "teacher": 2}])
    with pytest.raises(ValueError, match="sum to 1"):
        trainer.data_collator([{**_rows()[3], "teacher_weights": [0.5, 0.7]}])
    import numpy as np

    assert trainer.data_collator([{**_rows()[0], "teacher": np.int64(1)}])["teacher_mixture"].tolist() == [[0, 1]]
    batch = trainer.data_collator([_rows()[0]])
    with pytest.raises(ValueError, match="teacher_input_ids"):
        trainer.compute_loss(student, {**batch, "teacher_input_ids": batch["input_ids"]})
    with pytest.raises(ValueError, match="neither a 'teacher' nor a 'teacher_weights'"):
        trainer.data_collator([_rows()[3]])
    with pytest.raises(ValueError, match="give one"):
        trainer.data_collator([{**_rows()[2], "teacher": "math"}])
    with pytest.raises(ValueError, match="unknown teacher"):
        KDTrainer(model=student, teacher_model=teachers, args=_args(tmp_path, kd_teacher_weights={"art": 1.0}))
    with pytest.raises(ValueError, match="kd_teacher_weights must be finite weights"):
        _args(tmp_path, kd_teacher_weights={"math": 0.5, "code": 0.6})
    with pytest.raises(ValueError, match="kd_teacher_url as a dict names"):
        _args(tmp_path, kd_teacher_url={"math": 3})
    served = _args(tmp_path, kd_teacher_url={"math": "http://127.0.0.1:1", "code": "http://127.0.0.1:2"})
    with pytest.raises(ValueError, match="mixes served teachers"):
        KDTrainer(model=student, args=served)
    with pytest.raises(ValueError, match="not supported with"):
        KDTrainer(model=student, teacher_model=teachers, args=_args(tmp_path, kd_lmbda=0.5))


def test_packed_rows_take_their_own_examples_weights(tmp_path):
    """DataCollatorWithFlattening lays the four examples end to end in one row: each token keeps its example's
    teacher, and the loss is the padded batch's (float64; positions restart, so nothing attends across)."""
    from transformers import DataCollatorWithFlattening

    student, teachers = _models(torch.float64)
    rows = _rows()
    losses = []
    for collator in (TD.TeacherDataCollator(), DataCollatorWithFlattening()):
        trainer = KDTrainer(model=student, teacher_model=teachers, args=_args(tmp_path, use_kd_patch=True),
                            data_collator=collator)  # fmt: skip
        batch = trainer.data_collator([dict(r) for r in rows])
        if isinstance(collator, DataCollatorWithFlattening):
            assert batch["input_ids"].shape[0] == 1 and batch["teacher_mixture"].shape[:2] == batch["input_ids"].shape
        losses.append(trainer.compute_loss(student, batch).detach())
        M.revert_kd_patch(model=student)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-10, atol=0)


def test_a_peft_student_with_lora_on_the_head_matches_the_materialised_loss(tmp_path):
    """LoRA on q/v and on lm_head: the fused loss reads W + scaling B A; fused and materialised agree in float64."""
    peft = pytest.importorskip("peft")
    _, teachers = _models(torch.float64)
    rows, losses = _rows(), []
    for use_kd_patch in (True, False):
        base = tiny_model("llama", seed=1)
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
        student = peft.get_peft_model(base, config)
        trainer = KDTrainer(model=student, teacher_model=teachers, args=_args(tmp_path, use_kd_patch=use_kd_patch))
        loss = trainer.compute_loss(student, trainer.data_collator(rows))
        loss.backward()
        grads = [p.grad.clone() for p in student.parameters() if p.requires_grad]
        losses.append((loss.detach(), grads))
        M.revert_kd_patch()
    torch.testing.assert_close(losses[0][0], losses[1][0], rtol=1e-10, atol=0)
    for a, b in zip(losses[0][1], losses[1][1]):
        assert (a - b).norm() <= 1e-8 * b.norm()


def test_one_store_per_teacher_trains_as_routed_offline_data(tmp_path):
    """RoutedTeacherData({"math": store1, "code": store2}): each row keeps its own store's top-k and names it."""
    _, teachers = _models(torch.float32)
    rows = [r["input_ids"].tolist() for r in _rows()]
    stores = {}
    for j, (name, teacher) in enumerate(teachers.items()):
        TD.precompute(teacher, rows[j::2], tmp_path / name, top_k=8, progress=False)
        stores[name] = TD.TeacherLogprobsDataset(tmp_path / name, vocab_size=VOCAB)
    data = TD.RoutedTeacherData(stores)
    assert len(data) == len(rows) and [data[i]["teacher"] for i in range(len(data))] == ["math", "math", "code", "code"]
    assert torch.equal(data[2]["teacher_logprobs"], stores["code"][0]["teacher_logprobs"])
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    args = _args(tmp_path, use_kd_patch=True, max_steps=2, per_device_train_batch_size=2, kd_teacher_weights=None)
    trainer = KDTrainer(model=student, args=args, train_dataset=data, data_collator=TD.TeacherDataCollator())
    trainer.train()
    assert all(torch.isfinite(torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])))
    TD.precompute(teachers["math"], rows[:2], tmp_path / "k4", top_k=4, progress=False)
    with pytest.raises(ValueError, match="different top-k sizes"):
        TD.RoutedTeacherData({"math": stores["math"], "other": TD.TeacherLogprobsDataset(tmp_path / "k4")})


def test_served_rows_log_each_teachers_figures_from_its_own_rows(tmp_path):
    """kd_teacher_url={name: url}: batches arrive as offline top-k plus the one-hot teacher_mixture; a logging
    step's kd_soft_loss/<name> is the KD term of that teacher's rows alone (here: against a batch of only them).
    No server is contacted: the batch is made by hand, as the routed prefetcher would make it."""
    student = tiny_model("llama", seed=1)
    served = {"a": tiny_model("llama", seed=2, hidden=96), "b": tiny_model("qwen2", seed=3)}
    rows = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in _rows()]
    for r, name in zip(rows, ("a", "b", "a", "b")):
        ids = r["input_ids"][None]
        top_ids, top_lp = TD.teacher_topk(served[name], ids, torch.ones_like(ids), k=8)
        r.update(teacher_token_ids=top_ids[0], teacher_logprobs=top_lp[0], teacher=name)
    urls = {"a": "http://127.0.0.1:9", "b": "http://127.0.0.1:10"}
    args = _args(tmp_path, use_kd_patch=True, kd_teacher_url=urls, kd_teacher_weights=None, kd_teacher_top_k=8)
    trainer = KDTrainer(model=student.train(), args=args, data_collator=TD.TeacherDataCollator())
    trainer.compute_loss(student, trainer.data_collator(rows))
    figures = trainer._kd_teacher_metrics
    for name in ("a", "b"):
        own = [{k: v for k, v in r.items() if k != "teacher"} for r in rows if r["teacher"] == name]
        alone = student(**TD.TeacherDataCollator()(own), kd_config=trainer.kd_config).kd_soft_loss
        torch.testing.assert_close(figures[f"kd_soft_loss/{name}"], alone.float(), rtol=1e-6, atol=0)
    M.revert_kd_patch(model=student)


def test_the_command_line_still_parses_one_teacher_url():
    """kd_teacher_url takes a dict in Python, but its annotation stays `str | None`: HfArgumentParser reads a URL."""
    from transformers import HfArgumentParser

    argv = ["--output_dir", "unused", "--use_cpu", "True", "--kd_teacher_url", "http://127.0.0.1:8000"]
    (args,) = HfArgumentParser(KDTrainingArguments).parse_args_into_dataclasses(argv)
    assert args.kd_teacher_url == "http://127.0.0.1:8000" and args.kd_teacher_mixture == "distribution"
