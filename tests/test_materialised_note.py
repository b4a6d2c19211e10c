"""use_kd_patch=False (the default) trains on materialised logits: KDTrainer says so once, at the first step, with
what they cost and the flag that removes them; the patched run says nothing of it."""

import pytest
import torch
from transformers.testing_utils import CaptureLogger

from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments
from liger_patch_kd.trainer import trainer as trainer_module

from .tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")


def run(tmp_path, use_kd_patch: bool) -> str:
    args = KDTrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3, report_to="none", use_cpu=True,
        save_strategy="no", disable_tqdm=True, use_kd_patch=use_kd_patch,
    )  # fmt: skip
    rows = [{"input_ids": list(range(3, 3 + 6))} for _ in range(6)]
    teacher = tiny_model("llama", dtype=torch.float32)
    trainer = KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1), teacher_model=teacher, args=args,
                        train_dataset=rows)  # fmt: skip
    with CaptureLogger(trainer_module.logger) as captured:
        trainer.train()
    return captured.out


def test_materialised_logits_are_named_once_with_their_cost_and_the_flag(tmp_path):
    out = run(tmp_path, use_kd_patch=False)
    assert out.count("use_kd_patch=False") == 1, out  # once, though three steps ran
    mib = 2 * 6 * VOCAB * 4 / 2**20  # this batch: 2 rows of 6 tokens
    assert f"{2 * 6} x {VOCAB} x 4 = {mib:.1f} MiB" in out and "of the teacher" in out
    assert "set use_kd_patch=True (KDTrainingArguments; --use_kd_patch" in out  # the fix, in Python and on the CLI
    assert "use_kd_patch=False" not in run(tmp_path, use_kd_patch=True)
