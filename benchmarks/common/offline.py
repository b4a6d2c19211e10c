"""Offline rows the step benchmarks share (bench_served_teacher, bench_train_step's store row): the patched student
trained on teacher top-k batches, from a prefetcher or a store on disk."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from liger_patch_kd.models import revert_kd_patch
from liger_patch_kd.teacher import (
    StoreWriter,
    TeacherDataCollator,
    TeacherLogprobsDataset,
)

from .train_step import TOP_K, build, make_optimizer, prepare_student


def topk_signal(batch: dict, device) -> dict:
    """A batch's top-k teacher rows as the patched forward takes them."""
    return {k: batch[k].to(device, non_blocking=True) for k in ("teacher_token_ids", "teacher_logprobs")}


def train_rows(name, batches, shapes, micro_batch, seq, device, dtype, warmup, reps, waited=None, signal=topk_signal):
    """Train the patched student on `batches` (dicts with teacher_token_ids / teacher_logprobs, or what `signal`
    reads) and time the last `reps` steps; `waited()` (optional) gives the seconds spent waiting for teacher data
    so far. first_loss: the fresh student's loss on the first batch."""
    row = dict(method=name, micro_batch=micro_batch, seq=seq)
    student = build(shapes[0], device, dtype, seed=1)
    if device.type == "cuda":  # this row's own peak, not one left by whatever ran before it in the process
        torch.cuda.reset_peak_memory_stats()
    try:
        prepare_student("offline", student)
        opt = make_optimizer(student)
        for i, batch in enumerate(batches):
            if i == warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start, waited_before = time.perf_counter(), waited() if waited else 0.0
            ids, labels = (batch[k].to(device, non_blocking=True) for k in ("input_ids", "labels"))
            loss = student(input_ids=ids, labels=labels, **signal(batch, device)).loss
            if i == 0:
                row["first_loss"] = float(loss.detach())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / reps
        row.update(tokens_per_s=micro_batch * seq / seconds, step_s=seconds, loss=float(loss.detach()))
        if waited:
            row["wait_frac"] = (waited() - waited_before) / (seconds * reps)
        if device.type == "cuda":
            row["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    except Exception as e:  # reported in the table, not fatal: the other rows still run
        import traceback

        traceback.print_exc()
        row["tokens_per_s"] = f"error: {type(e).__name__}: {str(e)[:80]}"
    finally:
        del student
        revert_kd_patch()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    print(row, flush=True)
    return row


def random_sequences(n: int, seq: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, vocab, (seq,), generator=g)} for _ in range(n)]


def store_row(shapes, micro_batch, seq, device, dtype, warmup, reps, workdir: Path) -> dict:
    """Offline top-k the way training reads it: a store on disk, a shuffling DataLoader with workers."""
    vocab = shapes[0]["vocab_size"]
    n = (warmup + reps) * micro_batch
    writer = StoreWriter.open(workdir / "store", teacher="synthetic", vocab_size=vocab, tokenizer_fingerprint=None,
                              top_k=TOP_K, logprob_dtype="bfloat16", temperature=1.0, shard_size=n,
                              num_sequences=n)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    sequences = [row["input_ids"] for row in random_sequences(n, seq, vocab)]
    logits = torch.randn(n * seq, TOP_K, generator=g).sort(-1, descending=True).values
    start = torch.randint(0, vocab, (n * seq, 1), generator=g)
    ids = ((start + torch.arange(TOP_K) * (vocab // TOP_K - 1)) % vocab).int()  # distinct ids per row
    writer.write_shard(sequences, ids, torch.log_softmax(logits, -1) - 0.5)
    data = TeacherLogprobsDataset(workdir / "store", vocab_size=vocab)
    pin = device.type == "cuda"
    loader = torch.utils.data.DataLoader(
        data, batch_size=micro_batch, shuffle=True, num_workers=2, collate_fn=TeacherDataCollator(), pin_memory=pin
    )
    name = f"offline top-{TOP_K} (store, shuffled, 2 workers)"
    return train_rows(name, loader, shapes, micro_batch, seq, device, dtype, warmup, reps)
