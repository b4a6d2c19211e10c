"""One batch's journey through KDTrainer.compute_loss stays short: the Trainer's markers, the teacher source's
check and its loss, the logged figures. Traced with sys.setprofile on a tiny patched Llama, with a live teacher and
with a store batch: every call into liger_patch_kd outside the model's forward (which has its own kernels and
tests) is counted, and no module is entered (called from another module) more than twice."""

import collections
import sys

import pytest
import torch

from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments

from .tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")

MOST_CALLS = 20  # the journey's calls into the package, outside the forward
MOST_ENTRIES = 2  # times one module is entered from another


def _rows(n=4, top_k=None):
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (8,), generator=g)
        row = {"input_ids": ids, "labels": ids.clone()}
        if top_k:
            row["teacher_token_ids"] = torch.randint(0, VOCAB, (8, top_k), generator=g).int()
            row["teacher_logprobs"] = torch.log_softmax(torch.randn(8, top_k, generator=g), -1)
        rows.append(row)
    return rows


def _inside_forward(frame) -> bool:
    """Whether `frame` runs inside a module's forward (the patched model, the teacher): its own layers' calls."""
    frame = frame.f_back
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith(("liger_patch_kd.models", "torch.nn.modules")):
            return True
        frame = frame.f_back
    return False


def _journey(trainer, batch):
    """(module, function, caller's module) of every call into liger_patch_kd during one compute_loss, outside
    the forward."""
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_globals.get("__name__", "").startswith("liger_patch_kd"):
            if not _inside_forward(frame):
                calls.append((frame.f_globals["__name__"], frame.f_code.co_name,
                              frame.f_back.f_globals.get("__name__", "")))  # fmt: skip

    trainer.model.train()
    batch = trainer._prepare_inputs(batch)
    sys.setprofile(profile)
    try:
        trainer.compute_loss(trainer.model, batch)
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("teacher", ["live", "store"])
def test_a_batch_takes_a_short_journey_through_compute_loss(tmp_path, teacher):
    live = teacher == "live"
    rows = _rows() if live else _rows(top_k=4)
    args = KDTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to="none", use_cpu=True,
        save_strategy="no", disable_tqdm=True, logging_steps=1, use_kd_patch=True,
    )  # fmt: skip
    trainer = KDTrainer(
        model=tiny_model("llama", dtype=torch.float32, seed=1), args=args, train_dataset=rows,
        teacher_model=tiny_model("llama", dtype=torch.float32, seed=2) if live else None,
    )  # fmt: skip
    calls = _journey(trainer, trainer.data_collator(rows))
    entries = collections.Counter(module for module, _, caller in calls if caller != module)
    shown = "\n".join(f"{m}.{f} <- {c}" for m, f, c in calls)
    assert any(f == "compute_loss" for _, f, _ in calls), shown  # the trace saw the journey at all
    assert len(calls) < MOST_CALLS, shown
    assert max(entries.values()) <= MOST_ENTRIES, f"{entries}\n{shown}"
