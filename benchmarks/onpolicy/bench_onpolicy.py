"""On-policy distillation through KDTrainer: scored tokens/s and peak memory, against the same step off-policy.

    python -m benchmarks.onpolicy.bench_onpolicy --out runs/bench_onpolicy.json          # every row, one process each
    python -m benchmarks.onpolicy.bench_onpolicy --tiny                                   # CPU smoke test, no figures

A Llama-3.2-1B-shaped student and a Llama-3.1-8B-shaped teacher (random weights, bf16, sdpa), the patched forward
with every kernel, gradient checkpointing; each optimizer step takes `--micro-batch` rows of a `--prompt`-token
prompt and a `--completion`-token completion (scored) per micro-batch, `--accumulation` micro-batches. Random
weights rarely sample EOS (one 64-row step of an H200 run lost 2.7 % of its tokens to it), so generated
completions run to nearly their full length and scored tokens are counted as rows x --completion. Rows (each in its
own process, so one row's compiled graphs and allocator state cannot help
another):

  off-policy                 kd_lmbda=0: the dataset's completions
  on-policy per micro-batch  kd_lmbda=1, one generate() per micro-batch with the dynamic cache (0.2's way)
  on-policy batched          one generate() for the whole optimizer step, dynamic cache
  on-policy static           the same with the static cache (transformers compiles the decode step)
  on-policy graph            kd_generation_cache="graph": the decode step captured as one CUDA graph (generation/)
  on-policy                  kd_generation_cache="auto": what a user gets by default
  trl-distillation           TRL's DistillationTrainer (trl>=1.16) on the same models, rows and options (beta 0.5,
                             bf16, gradient checkpointing, sdpa): it generates every optimizer step with transformers'
                             generate, dynamic cache (its default), and scores the teacher's full vocabulary in chunks
  trl-distillation static    the same with cache_implementation="static" (TRL turns generate's compile off)

TRL reads text prompts: they are written in a word-level tokenizer over the same vocabulary (one word per id, no
special tokens added), so its prompts are the same `--prompt` ids as ours.
At 8 rows per step with micro-batch 8: `--micro-batch 8 --accumulation 1`.

Each row: step_s (mean over the timed steps, after one warm-up step that compiles), generate_s (time inside
generate() per step), scored_tokens_per_s, peak_GiB (reset at the row's start).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from ..common.onpolicy import drive_rows, models_and_rows, step_parser

ROWS = {  # name -> KDTrainingArguments overrides
    "off-policy": dict(kd_lmbda=0.0),
    "on-policy per micro-batch": dict(kd_lmbda=1.0, kd_rollout_batch_size="micro", kd_generation_cache="dynamic"),
    "on-policy batched": dict(kd_lmbda=1.0, kd_generation_cache="dynamic"),
    "on-policy static": dict(kd_lmbda=1.0, kd_generation_cache="static"),
    "on-policy graph": dict(kd_lmbda=1.0, kd_generation_cache="graph"),
    "on-policy": dict(kd_lmbda=1.0, kd_generation_cache="auto"),
    "trl-distillation": dict(cache_implementation=None),
    "trl-distillation static": dict(cache_implementation="static"),
}


def run_row(name: str, a: argparse.Namespace) -> dict:
    from liger_patch_kd import KDTrainer, KDTrainingArguments

    device, student, teacher, vocab, rows = models_and_rows(a)
    steps = a.steps + 1  # the first step warms up (and compiles) and is not timed
    if name.startswith("trl-"):
        return trl_row(name, a, student, teacher, rows, device, vocab)
    overrides = dict(ROWS[name])
    if overrides.get("kd_rollout_batch_size") == "micro":
        overrides["kd_rollout_batch_size"] = a.micro_batch
    stamps: list[float] = []
    args = KDTrainingArguments(
        output_dir=tempfile.mkdtemp(), use_kd_patch=True, kd_beta=0.5, bf16=device == "cuda", use_cpu=device == "cpu",
        kd_max_new_tokens=a.completion, per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=a.accumulation, max_steps=steps, report_to=[], save_strategy="no",
        logging_steps=1, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        learning_rate=1e-5, dataloader_num_workers=0, **overrides,
    )  # fmt: skip
    trainer = KDTrainer(
        model=student, teacher_model=teacher, args=args, train_dataset=rows, callbacks=[step_clock(device, stamps)]
    )
    return timed_train(trainer, name, a, stamps, device)


def step_clock(device: str, stamps: list[float]):
    """A callback stamping the end of each optimizer step (after the GPU's queue drains)."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())

    return Clock()


def timed_train(trainer, name: str, a: argparse.Namespace, stamps: list[float], device: str) -> dict:
    """train() from a fresh peak-memory count; mean seconds per timed step (the first, which compiles, left out),
    seconds inside generate() per step (KDTrainer's; None for TRL's) and rows x --completion tokens per second
    (random weights rarely sample EOS: see the module's docstring)."""
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    generate_s = None
    if hasattr(trainer, "kd_rollout_seconds"):
        timed = trainer.kd_rollout_seconds[1:]  # generate() seconds per generated step, warm-up dropped
        generate_s = sum(timed) / len(timed) if timed else 0.0
    step_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    scored = a.micro_batch * a.accumulation * a.completion
    return {
        "name": name,
        "step_s": step_s,
        "generate_s": generate_s,
        "scored_tokens_per_s": scored / step_s,
        "peak_GiB": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
    }


def word_tokenizer(vocab: int):
    """A tokenizer with one word per id ("t3" ... "t{vocab-1}"; ids 0/1/2 are pad/bos/eos as the models have them,
    named so that no word contains them): text prompts for TRL that tokenize back to exactly our prompt ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    core = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def trl_row(name: str, a: argparse.Namespace, student, teacher, rows: list[dict], device: str, vocab: int) -> dict:
    """TRL's DistillationTrainer on the same models and prompts (each row's first --prompt ids, as text)."""
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    tokenizer = word_tokenizer(vocab)
    prompts = [" ".join(f"t{i}" for i in r["input_ids"][: a.prompt].tolist()) for r in rows]
    assert tokenizer(text=prompts[:1])["input_ids"][0] == rows[0]["input_ids"][: a.prompt].tolist()
    stamps: list[float] = []
    args = DistillationConfig(
        output_dir=tempfile.mkdtemp(), beta=0.5, temperature=1.0, max_completion_length=a.completion,
        bf16=device == "cuda", use_cpu=device == "cpu", per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=a.accumulation, max_steps=a.steps + 1, report_to=[], save_strategy="no",
        logging_steps=1, gradient_checkpointing=True, learning_rate=1e-5, dataloader_num_workers=0,
        **ROWS[name],
    )  # fmt: skip
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args, processing_class=tokenizer,
                                  train_dataset=Dataset.from_dict({"prompt": prompts}),
                                  callbacks=[step_clock(device, stamps)])  # fmt: skip
    return timed_train(trainer, name, a, stamps, device)


def main() -> None:
    a = step_parser(__doc__, "runs/bench_onpolicy.json", ROWS, steps=2).parse_args()
    columns = ["name", "step_s", "generate_s", "scored_tokens_per_s", "of_off_policy", "x_trl", "peak_GiB", "error"]
    drive_rows("benchmarks.onpolicy.bench_onpolicy", a, ROWS, run_row, columns)


if __name__ == "__main__":
    main()
