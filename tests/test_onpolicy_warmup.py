"""kd_onpolicy_warmup_steps through KDTrainer.train(): which optimizer steps train on generated completions. The
warm-up steps train on the dataset's completions; after it, kd_lmbda's schedule is the one of a run without a
warm-up."""

import pytest
import torch

from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments
from liger_patch_kd.trainer.rollouts.onpolicy import GENERATED

from .tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")

TEXT = "the cat sat on the mat. a dog ran to the park. the sun is warm today. " * 20
ROWS = [{"prompt": p, "completion": " sat on the mat."} for p in ("the cat", "a dog ran", "the sun is", "the")] * 4


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    from liger_patch_kd.demo.cross_tokenizer import train_bpe_tokenizer

    tok = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe_tokenizer(TEXT, 200), pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)  # the tiny models' ids
    return tok


def make_args(tmp_path, **overrides) -> KDTrainingArguments:
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=6, learning_rate=1e-3,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0, use_kd_patch=True, kd_lmbda=1.0, kd_max_new_tokens=3, remove_unused_columns=False,
    )  # fmt: skip
    return KDTrainingArguments(**{**base, **overrides})


def generated_steps(tmp_path, tokenizer, rows=ROWS, **overrides) -> list[int]:
    """The optimizer steps of a KDTrainer.train() whose batches were generated (compute_loss sees the mark)."""
    trainer = KDTrainer(
        model=tiny_model("llama", dtype=torch.float32, seed=1), teacher_model=tiny_model("llama", seed=2),
        processing_class=tokenizer, args=make_args(tmp_path, **overrides), train_dataset=rows,
    )  # fmt: skip
    seen: dict[int, bool] = {}
    inner = trainer.compute_loss

    def spy(model, inputs, *args, **kwargs):
        seen[trainer.state.global_step] = bool(inputs.get(GENERATED, False))
        return inner(model, inputs, *args, **kwargs)

    trainer.compute_loss = spy
    trainer.train()
    assert sorted(seen) == list(range(trainer.state.max_steps)), seen  # every step trained, once
    assert len(trainer.kd_rollout_seconds) == sum(seen.values())
    return [step for step, generated in sorted(seen.items()) if generated]


def test_the_warmup_steps_train_on_the_data_then_every_step_generates(tmp_path, tokenizer):
    assert generated_steps(tmp_path, tokenizer) == [0, 1, 2, 3, 4, 5]  # kd_lmbda=1 alone: every step
    assert generated_steps(tmp_path, tokenizer, kd_onpolicy_warmup_steps=3) == [3, 4, 5]
    # a fraction of the run's steps, rounded up as warmup_steps is: ceil(0.4 * 6) = 3
    assert generated_steps(tmp_path, tokenizer, kd_onpolicy_warmup_steps=0.4) == [3, 4, 5]


def test_after_the_warmup_the_lmbda_schedule_is_the_one_without_it(tmp_path, tokenizer):
    plain = generated_steps(tmp_path, tokenizer, kd_lmbda=0.5, max_steps=8, seed=3)
    assert any(s < 4 for s in plain) and any(s >= 4 for s in plain)  # the seed draws steps on both sides
    warmed = generated_steps(tmp_path, tokenizer, kd_lmbda=0.5, max_steps=8, seed=3, kd_onpolicy_warmup_steps=4)
    assert warmed == [s for s in plain if s >= 4]


def test_warmup_arguments_are_checked(tmp_path, tokenizer):
    for bad in (-1, 1.5, float("nan"), float("inf"), "3"):
        with pytest.raises(ValueError, match="kd_onpolicy_warmup_steps"):
            make_args(tmp_path, kd_onpolicy_warmup_steps=bad)
    with pytest.raises(ValueError, match="kd_lmbda=0 without kd_seq_kd makes none"):
        make_args(tmp_path, kd_lmbda=0.0, kd_onpolicy_warmup_steps=2)
    # prompt-only rows: the warm-up's steps would train on completions they do not have; refused before training
    prompts = [{"prompt": r["prompt"]} for r in ROWS]
    trainer_args = make_args(tmp_path, kd_onpolicy_warmup_steps=2)
    with pytest.raises(ValueError, match="kd_onpolicy_warmup_steps=2"):
        KDTrainer(model=tiny_model("llama"), teacher_model=tiny_model("llama", seed=2), processing_class=tokenizer,
                  args=trainer_args, train_dataset=prompts)  # fmt: skip
