"""Per-teacher figures of offline routed data (teacher.RoutedTeacherData: a store per teacher): on logging steps
kd_soft_loss/<name> is the KD term of that teacher's rows alone and kd_top1_agreement/<name> how often the
student's most likely token is that teacher's top-1, each against a hand computation on materialised logits."""

import pytest
import torch

import liger_patch_kd.models as M
from liger_patch_kd import reference
from liger_patch_kd import teacher as TD
from liger_patch_kd.models.kd_io import shift_labels
from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments
from liger_patch_kd.trainer.teachers.routes import teacher_names_of

from .tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")
NAMES = ("math", "code")
ATOL = 2e-6  # see the parity test


def _args(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=1, learning_rate=1e-3,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0, kd_beta=0.3, kd_temperature=2.0, kd_hard_weight=0.2, use_kd_patch=True,
        kd_patch_config={"rope": False, "swiglu": False, "rms_norm": False},
    )  # fmt: skip
    return KDTrainingArguments(**{**base, **overrides})


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """RoutedTeacherData over two float64 stores (top-8), each precomputed by its own teacher on its own rows."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, VOCAB, (int(torch.randint(6, 11, (1,), generator=g)),), generator=g).tolist()
            for _ in range(4)]  # fmt: skip
    stores = {}
    for j, name in enumerate(NAMES):
        # 'math' is the student sharpened (its argmax: agreement 1), 'code' another model (agreement ~1/V)
        teacher = tiny_model("llama", seed=1) if name == "math" else tiny_model("llama", seed=3, hidden=96)
        with torch.no_grad():
            teacher.lm_head.weight.mul_(20)
        path = tmp_path_factory.mktemp(name)
        TD.precompute(teacher, seqs[j::2], path, top_k=8, logprob_dtype="float32", progress=False)
        stores[name] = TD.TeacherLogprobsDataset(path, vocab_size=VOCAB)
    return TD.RoutedTeacherData(stores)


def _with_labels(row):
    labels = row["input_ids"].clone()
    labels[:2] = -100
    return {**row, "labels": labels}


def _hand_figures(student, rows, cfg):
    """(top-k KD term, top-1 agreement) of `rows` alone, each row unpadded: reference.topk_kd_loss over their
    scored positions (soft part only, mean over those tokens); agreement of the student's argmax with the top-1."""
    logits, ids, values, targets = [], [], [], []
    for r in rows:
        scored = shift_labels(r["labels"][None], -100)[0] != -100
        logits.append(student(input_ids=r["input_ids"][None]).logits[0][scored])
        ids.append(r["teacher_token_ids"][scored].long())
        values.append(r["teacher_logprobs"][scored].double())
        targets.append(shift_labels(r["labels"][None], -100)[0][scored])
    z, i, v, t = torch.cat(logits), torch.cat(ids), torch.cat(values), torch.cat(targets)
    soft = reference.topk_kd_loss(z, i, v, t, cfg.replace(hard_weight=0.0, soft_weight=1.0))
    return soft, (z.argmax(-1) == i[:, 0]).double().mean()


@pytest.mark.parametrize("use_kd_patch", [True, False], ids=["fused", "materialised"])
def test_each_stored_teachers_figures_come_from_its_own_rows(tmp_path, routed, use_kd_patch):
    student = tiny_model("llama", seed=1)  # float64
    rows = [_with_labels(routed[i]) for i in range(len(routed))]
    args = _args(tmp_path, use_kd_patch=use_kd_patch)
    trainer = KDTrainer(model=student.train(), args=args, train_dataset=rows, data_collator=TD.TeacherDataCollator())
    assert trainer.teacher_set.names == NAMES and trainer.teacher_set.models is None  # names only: no models
    batch = trainer.data_collator(rows)
    loss = trainer.compute_loss(student, batch)
    figures = trainer._kd_teacher_metrics
    assert sorted(figures) == sorted(f"{k}/{n}" for k in ("kd_soft_loss", "kd_top1_agreement") for n in NAMES)
    if use_kd_patch:
        M.revert_kd_patch(model=student)
    for name in NAMES:
        own = [r for r in rows if r["teacher"] == name]
        soft, agreement = _hand_figures(student, own, trainer.kd_config)
        # the loss's softmax math is float32 (docs/loss-contract.md), so each token's term carries an absolute error of
        # about eps32 * sum_k p_k |log p_k - log q_k| (~1e-6 here, the log-ratios being O(10)), whatever the term's size
        torch.testing.assert_close(figures[f"kd_soft_loss/{name}"].double(), soft.detach(), rtol=0, atol=ATOL)
        torch.testing.assert_close(figures[f"kd_top1_agreement/{name}"].double(), agreement, rtol=1e-6, atol=0)
    # each figure is its own rows': the two teachers' differ, and neither is the whole batch's loss
    assert abs(float(figures["kd_soft_loss/math"] - figures["kd_soft_loss/code"])) > 100 * ATOL
    assert all(abs(float(figures[f"kd_soft_loss/{n}"]) - float(loss.detach())) > 100 * ATOL for n in NAMES)
    assert float(figures["kd_top1_agreement/math"]) == 1 and float(figures["kd_top1_agreement/code"]) < 0.5


def test_train_logs_the_per_teacher_figures(tmp_path, routed):
    """train() with bf16 and gradient accumulation: every logged step has both teachers' figures beside the usual
    kd_soft_loss (those of the step's last micro-batch, here one row of each teacher: rows in order), finite; a
    teacher with no row in that micro-batch would log 0, as the live and served teacher sets do."""
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    data = [_with_labels(routed[i]) for i in (0, 2, 1, 3)] * 2  # math, code, math, code, ...
    args = _args(tmp_path, bf16=True, gradient_accumulation_steps=2, per_device_train_batch_size=2, max_steps=2,
                 train_sampling_strategy="sequential")  # fmt: skip
    trainer = KDTrainer(model=student, args=args, train_dataset=data, data_collator=TD.TeacherDataCollator())
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2
    for h in logged:
        for name in NAMES:
            assert 0 <= h[f"kd_top1_agreement/{name}"] <= 1  # bf16 logits of a near-uniform student: argmax is noise
            assert 0 < h[f"kd_soft_loss/{name}"] < float("inf")


def test_the_names_come_from_the_dataset_or_are_not_logged(routed):
    datasets = pytest.importorskip("datasets")
    assert teacher_names_of(routed) == list(NAMES)
    assert teacher_names_of([{"teacher": "b"}, {"teacher": "a"}, {"teacher": "b"}]) == ["b", "a"]
    assert teacher_names_of(datasets.Dataset.from_list([{"teacher": "b"}, {"teacher": "a"}])) == ["a", "b"]
    assert teacher_names_of([{"teacher": 0}]) is None  # indices name no teacher: no figures, a warning
    assert teacher_names_of(iter([{"teacher": "a"}])) is None


def test_rows_naming_no_teacher_collate_as_without_the_names(tmp_path, routed):
    """An evaluation store without the column trains / evaluates as before (no figures); a batch mixing named and
    unnamed rows is refused naming the column."""
    rows = [_with_labels(routed[i]) for i in range(len(routed))]
    trainer = KDTrainer(model=tiny_model("llama", seed=1), args=_args(tmp_path), train_dataset=rows,
                        data_collator=TD.TeacherDataCollator())  # fmt: skip
    plain = [{k: v for k, v in r.items() if k != "teacher"} for r in rows]
    batch = trainer.data_collator(plain)
    assert "teacher_mixture" not in batch and batch["teacher_token_ids"].shape[0] == len(rows)
    with pytest.raises(ValueError, match="neither a 'teacher'"):
        trainer.data_collator([rows[0], plain[1]])
