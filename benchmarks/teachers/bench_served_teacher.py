"""The student's training throughput with its teacher behind a server, against the teacher in process and an offline
store, in one run.

    python -m benchmarks.teachers.bench_served_teacher --out $OUT/bench_served_teacher.json  # 2 GPUs: server on GPU 1

Shapes as benchmarks/training/bench_train_step.py builds them (random weights from configs): a Llama-3.2-1B-shaped
student and a Llama-3.1-8B-shaped teacher, bf16, sequence 4096, top-64, gradient checkpointing. Rows:
  online (in process)   bench_train_step's liger_patch_kd row: the patched student with teacher_model=
  offline top-64        bench_train_step's offline row: top-64 log-probs from host memory, no teacher
  served 8B top-64     `liger-kd serve` (GPU 1 when there are two, else the student's GPU) asked through
    liger               TeacherPrefetcher + TeacherClient (binary replies), batches fetched ahead
  served 1B teacher     the same with a 1B teacher (--random-weights) faster than the student: the prefetch should
                        hide it
  served 8B hidden      the exact teacher: `liger-kd serve` of the in-process teacher's own weights
                        (saved), its final hidden states (bf16, or fp8 with a scale per row) and head, through
                        HiddenClient and the fused loss on the full vocabulary; beside it top-64 from the same server
                        as liger binary and as vLLM JSON. bytes_per_token: the wire's hidden-state / top-k reply
                        bytes per token; loss_err: |first step's loss - the in-process teacher's| / the latter, on
                        the same batch and student (forward KL, beta 0, as the offline rows): 0 up to rounding for
                        the hidden states, the top-k tail's approximation for the others.
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
import time
from pathlib import Path

import torch

from liger_patch_kd.batch.columns import TEACHER_HEAD as HEAD_KEY
from liger_patch_kd.batch.columns import TEACHER_HIDDEN_STATES as HIDDEN_KEY
from liger_patch_kd.models import apply_kd_patch_to_llama, revert_kd_patch
from liger_patch_kd.teacher import (
    TeacherClient,
    TeacherDataCollator,
    TeacherPrefetcher,
    TeacherServerError,
)
from liger_patch_kd.teacher.client.hidden_client import HiddenClient
from liger_patch_kd.trainer.teachers.served_hidden import HiddenPrefetcher
from liger_patch_kd.wire.protocols import PROTOCOLS

from ..common import environment, print_table, write_json
from ..common.offline import random_sequences, store_row, topk_signal, train_rows
from ..common.train_step import SHAPES, TOP_K, build, prepare_student, run_one


def start_server(
    shape: dict, device: str, gpu: int | None, port: int, workdir: Path, saved: Path | None = None
) -> subprocess.Popen:
    """`liger-kd serve` on a config with random weights, or on the teacher `saved` there; on `gpu`
    (CUDA_VISIBLE_DEVICES) when given."""
    from transformers import LlamaConfig

    config_dir = workdir / f"teacher-{shape['hidden_size']}"
    if saved is None:
        LlamaConfig(max_position_embeddings=8192, **shape).save_pretrained(config_dir)
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    source = [str(saved)] if saved is not None else [str(config_dir), "--random-weights"]
    cmd = [sys.executable, "-m", "liger_patch_kd.cli", "serve", "--teacher", *source,
           "--top-k", str(TOP_K), "--host", "127.0.0.1", "--port", str(port), "--device", device,
           "--dtype", "float32" if device == "cpu" else "bfloat16", "--attn-implementation", "sdpa"]  # fmt: skip
    return subprocess.Popen(cmd, env=env)


def wait_for(client, server: subprocess.Popen, timeout: float = 600) -> None:
    """The client's readiness poll, a few seconds at a time, while the server process lives: a server that exits
    at start (a missing dependency, a bad flag) ends the run at once with its exit code, not after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        if server.poll() is not None:
            raise SystemExit(f"liger-kd serve exited with code {server.returncode} before answering (see its output)")
        try:
            return client.wait_until_ready(timeout=5)
        except TeacherServerError:
            if time.monotonic() >= deadline:
                raise


def served_row(name, shapes, teacher_shape, micro_batch, seq, device, dtype, warmup, reps, args, workdir) -> dict:
    two_gpus = device.type == "cuda" and torch.cuda.device_count() >= 2
    server = start_server(teacher_shape, "cpu" if device.type == "cpu" else "cuda", 1 if two_gpus else None,
                          args.port, workdir)  # fmt: skip
    try:
        vocab = shapes[0]["vocab_size"]
        client = TeacherClient(f"http://127.0.0.1:{args.port}", "liger", top_k=TOP_K, vocab_size=vocab,
                               timeout=600, sequences_per_request=micro_batch)  # fmt: skip
        wait_for(client, server)
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


def hidden_signal(batch: dict, device) -> dict:
    """The served hidden states and their head as the patched forward takes them (the head moved once per
    version, as trainer/teachers/served_hidden.py does)."""
    head = batch[HEAD_KEY]
    if getattr(hidden_signal, "version", None) != (id(head), device):
        hidden_signal.version, hidden_signal.head = (id(head), device), head.weight.to(device)
    return {"teacher_hidden_states": batch[HIDDEN_KEY].to(device, head.weight.dtype, non_blocking=True),
            "teacher_weight": hidden_signal.head}  # fmt: skip


def wire_bytes_per_token(url: str, protocol: str, sequences: list[list[int]], model: str) -> float:
    """Bytes of one top-k reply per token, as the protocol's client receives it (binary for liger, JSON for vllm)."""
    import json
    import urllib.request

    wire = PROTOCOLS[protocol]
    body = json.dumps(wire.request(sequences, TOP_K, lambda: model)).encode()
    request = urllib.request.Request(url + wire.path, body, method="POST",
                                     headers={"Content-Type": "application/json", "Accept": wire.accept})  # fmt: skip
    with urllib.request.urlopen(request, timeout=600) as reply:
        return len(reply.read()) / sum(map(len, sequences))


def exact_rows(shapes, micro_batch, seq, device, dtype, warmup, reps, args, workdir: Path, saved: Path) -> list:
    """The saved teacher behind one server: its hidden states (the teacher's dtype: bf16 on GPU, float32 in --tiny;
    and fp8), and its
    top-64 as liger binary and vLLM JSON, each trained on; bytes per token on the wire beside each (and, for the hidden
    states, the bound 2·H + 16)."""
    two_gpus = device.type == "cuda" and torch.cuda.device_count() >= 2
    server = start_server(shapes[1], "cpu" if device.type == "cpu" else "cuda", 1 if two_gpus else None,
                          args.port, workdir, saved=saved)  # fmt: skip
    url, rows = f"http://127.0.0.1:{args.port}", []
    vocab = shapes[0]["vocab_size"]
    data = random_sequences((warmup + reps) * micro_batch, seq, vocab)
    try:
        size = "tiny-large" if args.tiny else "8B"
        for name, protocol, wire_dtype in ((f"served {size} hidden (teacher dtype)", "hidden", "auto"),
                                           (f"served {size} hidden (fp8)", "hidden", "fp8"),
                                           (f"served {size} top-{TOP_K} liger", "liger", None),
                                           (f"served {size} top-{TOP_K} vllm JSON", "vllm", None)):  # fmt: skip
            loader = torch.utils.data.DataLoader(data, batch_size=micro_batch, collate_fn=TeacherDataCollator())
            options = dict(timeout=600, sequences_per_request=micro_batch)
            if protocol == "hidden":
                client = HiddenClient(url, dtype=wire_dtype, **options)
                prefetcher, signal = HiddenPrefetcher(loader, client, depth=args.depth), hidden_signal
            else:
                client = TeacherClient(url, protocol, top_k=TOP_K, vocab_size=vocab, **options)
                prefetcher, signal = TeacherPrefetcher(loader, client, depth=args.depth), topk_signal
            wait_for(client, server)
            row = train_rows(name, prefetcher, shapes, micro_batch, seq, device, dtype, warmup, reps,
                             waited=lambda: prefetcher.wait_seconds, signal=signal)  # fmt: skip
            if protocol == "hidden":
                row["bytes_per_token"] = client.bytes_received / max(1, client.tokens_received)
                # the target for the exact teacher: 2 bytes a hidden value plus a small per-token overhead
                row["hidden_size"] = shapes[1]["hidden_size"]
                row["bytes_bound"] = 2 * row["hidden_size"] + 16
            else:
                sequences = [r["input_ids"].tolist() for r in data[:micro_batch]]
                row["bytes_per_token"] = wire_bytes_per_token(url, protocol, sequences, str(saved))
            row["server"] = "GPU 1" if two_gpus else ("same GPU" if device.type == "cuda" else "CPU")
            rows.append(row)
            client.close()
    finally:
        server.terminate()
        server.wait(timeout=60)
    return rows


def reference_loss(teacher, shapes, micro_batch, seq, device, dtype) -> float:
    """The fresh student's loss (forward KL, as the offline rows) on the served rows' first batch against the
    in-process teacher, its kernels patched as the server patches them: what loss_err compares with."""
    student = build(shapes[0], device, dtype, seed=1)
    try:
        prepare_student("offline", student)
        apply_kd_patch_to_llama(model=teacher)
        batch = TeacherDataCollator()(random_sequences(micro_batch, seq, shapes[0]["vocab_size"]))
        ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        with torch.no_grad():
            return float(student(input_ids=ids, labels=labels, teacher_model=teacher).loss)
    finally:
        del student
        revert_kd_patch(model=teacher)
        revert_kd_patch()
        gc.collect()


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
    reference = reference_loss(teacher, shapes, mb, seq, device, dtype)
    workdir_handle = tempfile.TemporaryDirectory()
    saved = Path(workdir_handle.name) / "teacher"
    teacher.save_pretrained(saved)  # the served exact rows serve these very weights
    del teacher
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # the rows below need no teacher on this GPU
    with tempfile.TemporaryDirectory() as workdir:
        rows.append(store_row(shapes, mb, seq, device, dtype, args.warmup, args.reps, Path(workdir)))
        exact = exact_rows(shapes, mb, seq, device, dtype, args.warmup, args.reps, args, Path(workdir), saved)
        for row in exact:
            if "first_loss" in row:
                row["loss_err"] = abs(row["first_loss"] - reference) / abs(reference)
        rows += exact
        for name, teacher_shape in (("served 1B teacher", shapes[0]),):
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
    workdir_handle.cleanup()
    columns = ["method", "server", "tokens_per_s", "x_online", "of_offline", "wait_frac", "bytes_per_token",
               "bytes_bound", "loss_err", "peak_GiB"]  # fmt: skip
    table = print_table(rows, columns)
    write_json(args.out, dict(environment=environment(), rows=rows, table=table))


if __name__ == "__main__":
    main()
