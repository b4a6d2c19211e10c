"""Token ids past the student's vocabulary, or negative, in any batch (not only the first row): a one-line
ValueError naming the column, the id and the vocabulary, raised as the batch is collated (before it moves to the
device), not the embedding's IndexError inside a step."""

import pytest
import torch

from liger_patch_kd import teacher as TD
from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments

from .tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")


def _rows(bad_row=None, column="input_ids", bad=VOCAB):
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(1, VOCAB, (6,), generator=g)} for _ in range(6)]
    if bad_row is not None:
        ids = rows[bad_row]["input_ids"].clone()
        if column == "labels":
            rows[bad_row]["labels"] = ids.clone()
            rows[bad_row]["labels"][3] = bad
        else:
            ids[3] = bad
        rows[bad_row]["input_ids"] = ids
    for row in rows:
        row.setdefault("labels", row["input_ids"].clone())
    return rows


def _trainer(tmp_path, train, evaluation=None, **overrides):
    args = KDTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=3,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, use_kd_patch=True,
        kd_patch_config={"rope": False, "swiglu": False, "rms_norm": False}, dataloader_num_workers=0, **overrides,
    )  # fmt: skip
    return KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1),
                     teacher_model=tiny_model("llama", dtype=torch.float32), args=args, train_dataset=train,
                     eval_dataset=evaluation, data_collator=TD.TeacherDataCollator())  # fmt: skip


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 1000, -1])
def test_an_input_id_outside_the_vocabulary_is_one_line_before_its_step(tmp_path, bad):
    trainer = _trainer(tmp_path, _rows(bad_row=5, bad=bad), data_seed=0, seed=0)
    with pytest.raises(ValueError, match=rf"train_dataset: a batch's input_ids holds id {bad} .* embedding has "
                                         rf"{VOCAB} rows .*processing_class") as e:  # fmt: skip
        trainer.train()
    assert "\n" not in str(e.value)
    assert trainer.state.global_step < 3  # the step with that batch never ran


def test_evaluation_rows_and_labels_are_checked_too(tmp_path):
    trainer = _trainer(tmp_path, _rows(), {"held": _rows(bad_row=2)})
    with pytest.raises(ValueError, match=rf"eval_dataset\['held'\]: a batch's input_ids holds id {VOCAB} "):
        trainer.evaluate()
    trainer = _trainer(tmp_path, _rows(bad_row=1, column="labels", bad=-5))
    with pytest.raises(ValueError, match=r"train_dataset: a batch's labels holds id -5, neither ignored \(-100\)"):
        trainer.train()
    good = _trainer(tmp_path, _rows(), _rows())  # in range: trains and evaluates
    good.train()
    assert good.evaluate()["eval_loss"] > 0


@pytest.mark.parametrize("column, bad", [("input_ids", 10**20), ("input_ids", 2**63 + 1), ("labels", 2.5),
                                         ("input_ids", "7")])  # fmt: skip
def test_an_id_that_is_no_int64_is_one_line_naming_the_column_the_row_and_the_value(column, bad):
    """An id past int64 (or a fraction, or text) is refused as it is collated, before any vocabulary check could
    see it: never wrapped to another id, nor numpy's OverflowError."""
    rows = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6]}]
    rows[1][column] = [4, bad, 6]
    with pytest.raises(ValueError, match=rf"row 1 of this batch: {column} holds {bad!r}, which is not a token id") as e:
        TD.TeacherDataCollator()(rows)
    assert "\n" not in str(e.value)
    whole = TD.TeacherDataCollator()([{"input_ids": [1.0, 2.0]}, {"input_ids": torch.tensor([3], dtype=torch.int32)}])
    assert whole["input_ids"].tolist() == [[1, 2], [3, 0]]  # whole numbers of any dtype are ids


def test_an_id_past_int64_in_a_training_row_is_one_line(tmp_path):
    rows = [{"input_ids": [1, 2, 3]}, {"input_ids": [1, 2, 10**20]}]
    with pytest.raises(ValueError, match=r"row 1 of this batch: input_ids holds 100000000000000000000"):
        _trainer(tmp_path, rows).train()
