"""On-policy distillation through KDTrainer: scored tokens/s and peak memory, against the same step off-policy.

    python -m benchmarks.bench_onpolicy --out runs/bench_onpolicy.json          # every row, one process each
    python -m benchmarks.bench_onpolicy --tiny                                   # CPU smoke test, no figures

A Llama-3.2-1B-shaped student and a Llama-3.1-8B-shaped teacher (random weights, bf16, sdpa), the patched forward
with every kernel, gradient checkpointing; each optimizer step takes `--micro-batch` rows of a `--prompt`-token
prompt and a `--completion`-token completion (scored) per micro-batch, `--accumulation` micro-batches. Random
weights never sample EOS, so every completion runs to its full length: on-policy rows score as many tokens as
off-policy ones. Rows (each in its own process, so one row's compiled graphs and allocator state cannot help
another):

  off-policy                 kd_lmbda=0: the dataset's completions
  on-policy per micro-batch  kd_lmbda=1, one generate() per micro-batch with the dynamic cache (0.2's way)
  on-policy batched          one generate() for the whole optimizer step, dynamic cache
  on-policy static           the same with the static cache (transformers compiles the decode step)
  on-policy graph            kd_generation_cache="graph": the decode step captured as one CUDA graph (generation/)
  on-policy                  kd_generation_cache="auto": what a user gets by default

At 8 rows per step with micro-batch 8: `--micro-batch 8 --accumulation 1`.

Each row: step_s (mean over the timed steps, after one warm-up step that compiles), generate_s (time inside
generate() per step), scored_tokens_per_s, peak_GiB (reset at the row's start).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from .bench_train_step import build as build_llama
from .common import environment, print_table, run_row_in_child, write_json

ROWS = {  # name -> KDTrainingArguments overrides
    "off-policy": dict(kd_lmbda=0.0),
    "on-policy per micro-batch": dict(kd_lmbda=1.0, kd_rollout_batch_size="micro", kd_generation_cache="dynamic"),
    "on-policy batched": dict(kd_lmbda=1.0, kd_generation_cache="dynamic"),
    "on-policy static": dict(kd_lmbda=1.0, kd_generation_cache="static"),
    "on-policy graph": dict(kd_lmbda=1.0, kd_generation_cache="graph"),
    "on-policy": dict(kd_lmbda=1.0, kd_generation_cache="auto"),
}
SHAPES = {
    "llama": (
        dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, tie_word_embeddings=True),
        dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8),
        128256,
    ),
    "tiny": (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=True),
        dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2),
        512,
    ),
}  # fmt: skip


def build(kwargs: dict, vocab: int, device, dtype, seed: int):
    """bench_train_step's Llama builder, with this vocabulary and the special ids generation needs."""
    special = dict(vocab_size=vocab, rope_theta=500000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return build_llama({**kwargs, **special}, device, dtype, seed)


def run_row(name: str, a: argparse.Namespace) -> dict:
    from transformers import TrainerCallback

    from liger_patch_kd import KDTrainer, KDTrainingArguments

    device = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    s_kw, t_kw, vocab = SHAPES["tiny" if a.tiny else "llama"]
    student = build(s_kw, vocab, device, dtype, seed=0)
    teacher = build(t_kw, vocab, device, dtype, seed=1).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    steps = a.steps + 1  # the first step warms up (and compiles) and is not timed
    rows = []
    for _ in range(a.micro_batch * a.accumulation * steps):
        ids = torch.randint(3, vocab, (a.prompt + a.completion,), generator=g)
        labels = ids.clone()
        labels[: a.prompt] = -100
        rows.append({"input_ids": ids, "labels": labels})
    overrides = dict(ROWS[name])
    if overrides.get("kd_rollout_batch_size") == "micro":
        overrides["kd_rollout_batch_size"] = a.micro_batch
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())

    args = KDTrainingArguments(
        output_dir=tempfile.mkdtemp(), use_kd_patch=True, kd_beta=0.5, bf16=device == "cuda", use_cpu=device == "cpu",
        kd_max_new_tokens=a.completion, per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=a.accumulation, max_steps=steps, report_to=[], save_strategy="no",
        logging_steps=1, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        learning_rate=1e-5, dataloader_num_workers=0, **overrides,
    )  # fmt: skip
    trainer = KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows, callbacks=[Clock()])
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    step_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    timed = trainer.kd_rollout_seconds[1:]  # generate() seconds per generated step, warm-up dropped
    scored = a.micro_batch * a.accumulation * a.completion
    return {
        "name": name,
        "step_s": step_s,
        "generate_s": sum(timed) / len(timed) if timed else 0.0,
        "scored_tokens_per_s": scored / step_s,
        "peak_GiB": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
    }


SHAPE_KEYS = ("prompt", "completion", "micro_batch", "accumulation", "steps")


def step_parser(doc: str, out: str, rows: dict, steps: int) -> argparse.ArgumentParser:
    """The options bench_onpolicy and bench_engine share: the output, the rows, the step's shape."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=out)
    parser.add_argument("--row", choices=sorted(rows), help="run one row in this process (the driver's child)")
    parser.add_argument("--only", nargs="*", choices=sorted(rows), help="rows to run (default: all)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--completion", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=8)
    parser.add_argument("--steps", type=int, default=steps, help="timed optimizer steps (after one warm-up step)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with tiny shapes")
    return parser


def drive_rows(module: str, a: argparse.Namespace, rows: dict, run_row, columns: list[str], extra=()) -> None:
    """Each row in its own process (or, with --row, the one row here), the fraction of the off-policy row's scored
    tokens/s beside each, a printed table and the JSON; `extra`: options the children take beyond the shape's."""
    if a.tiny:
        a.prompt, a.completion, a.micro_batch, a.accumulation, a.steps = 8, 8, 2, 2, 1
    if a.row:
        print("ROW " + json.dumps(run_row(a.row, a)), flush=True)
        return
    keys = (*SHAPE_KEYS, *extra)
    results = [run_row_in_child(module, name, a, keys) for name in a.only or list(rows)]
    off = next((r for r in results if r["name"] == "off-policy" and "error" not in r), None)
    for r in results:
        if off and "scored_tokens_per_s" in r:
            r["of_off_policy"] = r["scored_tokens_per_s"] / off["scored_tokens_per_s"]
    print_table(results, columns)
    shape = {k: getattr(a, k) for k in (*keys, "tiny")}
    write_json(a.out, {"environment": environment(), "shape": shape, "rows": results})


def main() -> None:
    a = step_parser(__doc__, "runs/bench_onpolicy.json", ROWS, steps=2).parse_args()
    columns = ["name", "step_s", "generate_s", "scored_tokens_per_s", "of_off_policy", "peak_GiB", "error"]
    drive_rows("benchmarks.bench_onpolicy", a, ROWS, run_row, columns)


if __name__ == "__main__":
    main()
