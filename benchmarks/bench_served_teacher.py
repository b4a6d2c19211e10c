"""The student's training throughput with its teacher behind a server, against the teacher in process and an offline
store, in one run.

    python -m benchmarks.bench_served_teacher --out $OUT/bench_served_teacher.json     # 2 GPUs: server on GPU 1

Shapes as benchmarks/bench_train_step.py builds them (random weights from configs): a Llama-3.2-1B-shaped student
and a Llama-3.1-8B-shaped teacher, bf16, sequence 4096, top-64, gradient checkpointing. Rows:
  online (in process)   bench_train_step's liger_patch_kd row: the patched student with teacher_model=
  offline top-64        bench_train_step's offline row: top-64 log-probs from host memory, no teacher
  served 8B teacher     `liger-kd serve --random-weights` (GPU 1 when there are two, else the student's GPU) asked
                        through TeacherPrefetcher + TeacherClient (binary replies), batches fetched ahead
  served 1B teacher     the same with a teacher faster than the student: the prefetch should hide it
  offline (store)       the same top-64 written to a store and read back through TeacherLogprobsDataset with a
                        shuffling 2-worker DataLoader: the data path offline training really takes
wait_frac is the fraction of the served rows' step time spent waiting for the teacher's replies.
`--tiny` runs the same code on CPU with tiny shapes (a smoke test, no figures).
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from liger_patch_kd.teacher import (
    TeacherClient,
    TeacherDataCollator,
    TeacherPrefetcher,
)

from .common import environment, print_table, write_json
from .common.offline import random_sequences, store_row, train_rows
from .common.train_step import SHAPES, TOP_K, build, run_one


def start_server(shape: dict, device: str, gpu: int | None, port: int, workdir: Path) -> subprocess.Popen:
    """`liger-kd serve` on a config with random weights; on `gpu` (CUDA_VISIBLE_DEVICES) when given."""
    from transformers import LlamaConfig

    config_dir = workdir / f"teacher-{shape['hidden_size']}"
    LlamaConfig(max_position_embeddings=8192, **shape).save_pretrained(config_dir)
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    cmd = [sys.executable, "-m", "liger_patch_kd.cli", "serve", "--teacher", str(config_dir), "--random-weights",
           "--top-k", str(TOP_K), "--host", "127.0.0.1", "--port", str(port), "--device", device,
           "--dtype", "float32" if device == "cpu" else "bfloat16", "--attn-implementation", "sdpa"]  # fmt: skip
    return subprocess.Popen(cmd, env=env)






def served_row(name, shapes, teacher_shape, micro_batch, seq, device, dtype, warmup, reps, args, workdir) -> dict:
    two_gpus = device.type == "cuda" and torch.cuda.device_count() >= 2
    server = start_server(teacher_shape, "cpu" if device.type == "cpu" else "cuda", 1 if two_gpus else None,
                          args.port, workdir)  # fmt: skip
    try:
        vocab = shapes[0]["vocab_size"]
        client = TeacherClient(f"http://127.0.0.1:{args.port}", "liger", top_k=TOP_K, vocab_size=vocab,
                               timeout=600, sequences_per_request=micro_batch)  # fmt: skip
        client.wait_until_ready(timeout=600)
        data = random_sequences((warmup + reps) * micro_batch, seq, vocab)
        loader = torch.utils.data.DataLoader(data, batch_size=micro_batch, collate_fn=TeacherDataCollator())
        prefetcher = TeacherPrefetcher(loader, client, depth=args.depth)
        row = train_rows(name, prefetcher, shapes, micro_batch, seq, device, dtype, warmup, reps,
                         waited=lambda: prefetcher.wait_seconds)  # fmt: skip
        client.close()
    finally:
        server.terminate()
        server.wait(timeout=60)
    row["server"] = "GPU 1" if two_gpus else ("same GPU" if device.type == "cuda" else "CPU")
    return row




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_served_teacher.json")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--depth", type=int, default=4, help="batches fetched ahead")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with tiny shapes")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shapes = SHAPES["tiny" if args.tiny else "llama"]
    seq = 32 if args.tiny else args.seq
    mb = args.micro_batch
    rows = []
    teacher = build(shapes[1], device, dtype, seed=2).eval().requires_grad_(False)
    teacher.config.use_cache = False
    for name in ("liger_patch_kd", f"offline top-{TOP_K}"):
        row = run_one(name, shapes, mb, seq, device, dtype, teacher, args.warmup, args.reps)
        row["method"] = "online (in process)" if name == "liger_patch_kd" else row["method"]
        rows.append(row)
    del teacher
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # the rows below need no teacher on this GPU
    with tempfile.TemporaryDirectory() as workdir:
        rows.append(store_row(shapes, mb, seq, device, dtype, args.warmup, args.reps, Path(workdir)))
        for name, teacher_shape in (("served 8B teacher", shapes[1]), ("served 1B teacher", shapes[0])):
            if args.tiny:
                name = name.replace("8B", "tiny-large").replace("1B", "tiny-small")
            rows.append(served_row(name, shapes, teacher_shape, mb, seq, device, dtype, args.warmup, args.reps, args,
                                   Path(workdir)))  # fmt: skip
    online = next(r["tokens_per_s"] for r in rows if r["method"].startswith("online"))
    offline = next(r["tokens_per_s"] for r in rows if r["method"] == f"offline top-{TOP_K}")
    for r in rows:
        if isinstance(r.get("tokens_per_s"), float):
            r["x_online"], r["of_offline"] = r["tokens_per_s"] / online, r["tokens_per_s"] / offline
    print(f"\nsequence {seq}, micro-batch {mb}, bf16, AdamW, student gradient checkpointing, top-{TOP_K}")
    table = print_table(rows, ["method", "server", "tokens_per_s", "x_online", "of_offline", "wait_frac", "peak_GiB"])
    write_json(args.out, dict(environment=environment(), rows=rows, table=table))


if __name__ == "__main__":
    main()
