"""`liger-kd`: demo, precompute, serve, bench."""

from __future__ import annotations

import argparse
import json
import sys


def _demo(args) -> None:
    from .demo import run_demo

    run_demo(quick=args.quick, device=args.device)


def _precompute(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .teacher import precompute, tokenizer_fingerprint

    with open(args.data) as f:
        records = [(n, json.loads(line)) for n, line in enumerate(f, 1) if line.strip()]
    tokenizer = None
    needs_tokenizer = any("input_ids" not in r for _, r in records)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.teacher)
    except (OSError, ValueError) as e:
        if needs_tokenizer:
            raise ValueError(
                f"{args.data} has 'text' lines but no tokenizer loads from {args.tokenizer or args.teacher}: {e}"
            )
    sequences = []
    for line_no, record in records:
        if "input_ids" in record:
            ids = list(record["input_ids"])
        elif "text" in record:
            ids = tokenizer(record["text"], add_special_tokens=True)["input_ids"]
        else:
            raise ValueError(f"{args.data}:{line_no}: each line needs 'text' or 'input_ids'")
        sequences.append(ids[: args.max_length] if args.max_length else ids)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype="auto")
    teacher.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = precompute(
        teacher, sequences, args.out, top_k=args.top_k, batch_size=args.batch_size, shard_size=args.shard_size,
        logprob_dtype=args.dtype, temperature=args.temperature, teacher_name=args.teacher,
        tokenizer_fp=tokenizer_fingerprint(tokenizer) if tokenizer is not None else None,
    )  # fmt: skip
    print(f"wrote {out}")


def _serve(args) -> None:
    from .teacher.server import serve

    serve(args.teacher, top_k=args.top_k, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
          max_batch_tokens=args.max_batch_tokens, log_level=args.log_level,
          attn_implementation=args.attn_implementation, random_weights=args.random_weights)  # fmt: skip


def _bench(args) -> None:
    import torch

    from .demo import loss_memory_demo

    loss_memory_demo(torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="liger-kd", description="Knowledge distillation without materialised logits.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a tiny teacher and distil it four ways; print a table")
    demo.add_argument("--quick", action="store_true", help="fewer steps (CI)")
    demo.add_argument("--device", default=None)
    demo.set_defaults(func=_demo)

    pre = sub.add_parser("precompute", help="write a teacher's top-k log-probs to a store")
    pre.add_argument("--teacher", required=True, help="HF model path or name")
    pre.add_argument("--data", required=True, help="JSONL with 'text' or 'input_ids' per line")
    pre.add_argument("--out", required=True)
    pre.add_argument("--top-k", type=int, default=64)
    pre.add_argument("--temperature", type=float, default=1.0, help="keep 1: tempering later is exact")
    pre.add_argument("--max-length", type=int, default=None)
    pre.add_argument("--batch-size", type=int, default=8)
    pre.add_argument("--shard-size", type=int, default=1024)
    pre.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    pre.add_argument("--tokenizer", default=None)
    pre.add_argument("--device", default=None)
    pre.set_defaults(func=_precompute)

    srv = sub.add_parser("serve", help="serve a teacher's prompt log-probs (vLLM's /v1/completions protocol)")
    srv.add_argument("--teacher", required=True, help="HF model path or name")
    srv.add_argument("--top-k", type=int, default=64, help="the most log-probs per position a request may ask")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--device", default=None)
    srv.add_argument("--dtype", default="auto", help="auto (the checkpoint's), bfloat16, float32, ...")
    srv.add_argument("--max-batch-tokens", type=int, default=16384, help="padded tokens per teacher forward")
    srv.add_argument("--attn-implementation", default=None, help="sdpa, eager, flash_attention_2, ...")
    srv.add_argument("--log-level", default="warning")
    srv.add_argument("--random-weights", action="store_true", help="the config's model, random weights (benchmarks)")
    srv.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="the fused loss against materialised logits on this device")
    bench.add_argument("--device", default=None)
    bench.set_defaults(func=_bench)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
