"""What the on-policy benchmarks share (bench_onpolicy, bench_engine, bench_rollouts, bench_train_step's on-policy
rows): the shapes, the models, the step options and the driver that runs each row in its own process."""

from __future__ import annotations

import argparse
import json

from . import environment, print_table, run_row_in_child, write_json
from .train_step import build as build_llama

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


SHAPE_KEYS = ("prompt", "completion", "micro_batch", "accumulation", "steps")


def models_and_rows(a: argparse.Namespace):
    """(device, student, teacher, vocabulary, rows) of a row's run: the models at --tiny or Llama shapes (bf16 on
    CUDA), and --steps + 1 optimizer steps' rows of a --prompt-token prompt (ignored) and a --completion-token
    completion (scored), random ids above the special ones; generated steps keep the prompt and sample the rest."""
    import torch

    device = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    s_kw, t_kw, vocab = SHAPES["tiny" if a.tiny else "llama"]
    student = build(s_kw, vocab, device, dtype, seed=0)
    teacher = build(t_kw, vocab, device, dtype, seed=1).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(a.micro_batch * a.accumulation * (a.steps + 1)):  # the first step warms up and is not timed
        ids = torch.randint(3, vocab, (a.prompt + a.completion,), generator=g)
        labels = ids.clone()
        labels[: a.prompt] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return device, student, teacher, vocab, rows


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
    tokens/s beside each (and the ratio to the fastest TRL row, where one ran), a printed table and the JSON;
    `extra`: options the children take beyond the shape's."""
    if a.tiny:
        a.prompt, a.completion, a.micro_batch, a.accumulation, a.steps = 8, 8, 2, 2, 1
    if a.row:
        print("ROW " + json.dumps(run_row(a.row, a)), flush=True)
        return
    keys = (*SHAPE_KEYS, *extra)
    results = [run_row_in_child(module, name, a, keys) for name in a.only or list(rows)]
    off = next((r for r in results if r["name"] == "off-policy" and "error" not in r), None)
    trl = max((r["scored_tokens_per_s"] for r in results if r["name"].startswith("trl-") and "error" not in r),
              default=None)  # fmt: skip  # the competitor in its best configuration
    for r in results:
        if off and "scored_tokens_per_s" in r:
            r["of_off_policy"] = r["scored_tokens_per_s"] / off["scored_tokens_per_s"]
        if trl and "scored_tokens_per_s" in r:
            r["x_trl"] = r["scored_tokens_per_s"] / trl
    print_table(results, columns)
    shape = {k: getattr(a, k) for k in (*keys, "tiny")}
    write_json(a.out, {"environment": environment(), "shape": shape, "rows": results})
