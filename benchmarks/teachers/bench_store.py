"""Shuffled reading from a teacher store: tokens/s, resident memory and first-batch latency, before and after.

    python -m benchmarks.teachers.bench_store [--tokens 50e6] [--top-k 64] [--dir /tmp] [--out FILE.json]

Makes synthetic stores (random ids below a Qwen-sized vocabulary, sorted random log-probs; random lengths
128-1024) of `--tokens` tokens, plain bf16 and packed10, and a 10x smaller plain one (memory must not grow with
the store), reads them through TeacherLogprobsDataset + TeacherDataCollator with a shuffling DataLoader (0 and 2
workers) and deletes them. "before" is the 0.1.0 reader (kept below as OldTeacherLogprobsDataset: one shard in
memory, a whole-shard sha256 per shard switch, a linear shard scan), timed on a few batches since it is slow.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from liger_patch_kd.teacher import StoreWriter, TeacherDataCollator, TeacherLogprobsDataset
from liger_patch_kd.teacher.store.compact import PackedCodec
from liger_patch_kd.teacher.store.shard import sha256_file

VOCAB = 151936


class OldTeacherLogprobsDataset(torch.utils.data.Dataset):
    """The 0.1.0 reader's reading path, unchanged in substance (validation trimmed): the 'before' row."""

    def __init__(self, store_dir):
        self.dir = Path(store_dir)
        self.meta = json.loads((self.dir / "manifest.json").read_text())
        self._starts = [0]
        for s in self.meta["shards"]:
            self._starts.append(self._starts[-1] + s["num_sequences"])
        self._cache = {}

    def __len__(self):
        return self._starts[-1]

    def _shard(self, index):
        if index not in self._cache:
            entry = self.meta["shards"][index]
            path = self.dir / entry["file"]
            if sha256_file(path) != entry["sha256"]:
                raise ValueError("checksum")
            self._cache = {index: load_file(str(path))}
        return self._cache[index]

    def __getitem__(self, i):
        shard = max(s for s in range(len(self._starts) - 1) if self._starts[s] <= i)
        data = self._shard(shard)
        j = i - self._starts[shard]
        lo, hi = int(data["offsets"][j]), int(data["offsets"][j + 1])
        return {
            "input_ids": data["input_ids"][lo:hi].long(),
            "teacher_token_ids": data["topk_ids"][lo:hi],
            "teacher_logprobs": data["topk_logprobs"][lo:hi],
        }


def make_store(out: Path, tokens: int, k: int, encoding: str, shard_sequences: int = 256, seed: int = 0) -> float:
    """A synthetic store of about `tokens` tokens; returns seconds taken. Rows come from one random pool
    (rolled per shard) so that making 50M tokens is bound by writing, not by the random generator."""
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    pool_rows = shard_sequences * 1024
    pool_ids = torch.from_numpy(rng.integers(0, VOCAB, (pool_rows, k), dtype=np.int32))
    pool_lp = torch.from_numpy(-np.sort(rng.exponential(2.0, (pool_rows, k)).cumsum(1), axis=1).astype(np.float32))
    pool_lp = (pool_lp - 0.05).to(torch.bfloat16).float()
    codec = PackedCodec(VOCAB, k, int(encoding[6:])) if encoding.startswith("packed") else None
    pool_packed = codec.encode(pool_ids.numpy(), pool_lp.numpy()) if codec else None
    writer = StoreWriter.open(out, teacher="synthetic", vocab_size=VOCAB, top_k=k, tokenizer_fingerprint=None,
                              logprob_dtype="bfloat16", temperature=1.0, shard_size=shard_sequences,
                              num_sequences=None, encoding=encoding)  # fmt: skip
    written = 0
    while written < tokens:
        lengths = rng.integers(128, 1025, shard_sequences)
        n = int(lengths.sum())
        shift = int(rng.integers(0, pool_rows - n))
        seqs = [torch.from_numpy(rng.integers(0, VOCAB, int(t), dtype=np.int32)) for t in lengths]
        ids, lp = pool_ids[shift : shift + n], pool_lp[shift : shift + n]
        writer.write_shard(seqs, ids, lp, packed_rows=None if codec is None else pool_packed[shift : shift + n])
        written += n
    return time.perf_counter() - start


def _rss_mib(proc: psutil.Process) -> float:
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def read_benchmark(dataset, workers: int, seconds: float, max_batches: int | None = None, batch_size: int = 8):
    proc = psutil.Process()
    rss_before = _rss_mib(proc)
    start = time.perf_counter()
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                        collate_fn=TeacherDataCollator(), prefetch_factor=4 if workers else None,
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    it = iter(loader)
    first = next(it)
    first_latency = time.perf_counter() - start
    tokens, batches, t0, peak = 0, 0, time.perf_counter(), 0.0
    for batch in it:
        tokens += int(batch["attention_mask"].sum())
        batches += 1
        if batches % 16 == 0:
            peak = max(peak, _rss_mib(proc))
        if time.perf_counter() - t0 > seconds or (max_batches and batches >= max_batches):
            break
    elapsed = time.perf_counter() - t0
    peak = max(peak, _rss_mib(proc))
    del it
    assert first["teacher_token_ids"].shape[-1] == dataset[0]["teacher_token_ids"].shape[-1]
    return dict(workers=workers, tokens_per_s=tokens / elapsed, first_batch_s=first_latency, batches=batches,
                rss_mib=peak, rss_before_mib=rss_before)  # fmt: skip


def _store_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=float, default=50e6, help="tokens in the large stores (default 50e6)")
    parser.add_argument("--top-k", type=int, default=64, help="slots per token (default 64)")
    parser.add_argument("--seconds", type=float, default=8.0, help="timed reading per row (default 8)")
    parser.add_argument("--old-batches", type=int, default=4, help="batches timed on the old reader (default 4)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the stores go (default: the temp dir)")
    parser.add_argument("--out", default="benchmarks/results/bench_store.json", help="JSON output path")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench_store_", dir=args.dir))
    rows, stores = [], {}
    try:
        for label, tokens, encoding in [
            ("plain bf16, small", args.tokens / 10, "plain"),
            ("plain bf16", args.tokens, "plain"),
            ("packed10", args.tokens, "packed10"),
        ]:
            path = root / label.replace(" ", "_").replace(",", "")
            seconds = make_store(path, int(tokens), args.top_k, encoding)
            size = _store_bytes(path)
            t0 = time.perf_counter()
            data = TeacherLogprobsDataset(path, vocab_size=VOCAB)
            open_s = time.perf_counter() - t0
            n_tokens = sum(int(r.shape[0]) for r in (data[i]["input_ids"] for i in range(0, len(data), 997)))
            stores[label] = dict(
                tokens_approx=int(tokens),
                bytes=size,
                make_s=seconds,
                open_s=open_s,
                bytes_per_token=size / tokens,
                sequences=len(data),
                sampled_tokens=n_tokens,
            )
            print(f"made {label}: {size / 1e9:.2f} GB, {size / tokens:.0f} B/token, {seconds:.0f} s", flush=True)
            if encoding == "plain" and tokens == args.tokens:
                rows.append(dict(reader="before (0.1.0)", store=label, **read_benchmark(
                    OldTeacherLogprobsDataset(path), 0, args.seconds * 4, max_batches=args.old_batches)))  # fmt: skip
                print(rows[-1], flush=True)
            for workers in (0, 2):
                rows.append(dict(reader="after", store=label, **read_benchmark(data, workers, args.seconds)))
                print(rows[-1], flush=True)
            shutil.rmtree(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'reader':16}{'store':20}{'workers':>8}{'tokens/s':>12}{'first batch s':>15}{'RSS MiB':>10}")
    for r in rows:
        print(f"{r['reader']:16}{r['store']:20}{r['workers']:8d}{r['tokens_per_s']:12.0f}{r['first_batch_s']:15.3f}"
              f"{r['rss_mib']:10.0f}")  # fmt: skip
    result = dict(command=" ".join([sys.executable, "-m", "benchmarks.teachers.bench_store", *(argv or sys.argv[1:])]),
                  environment=dict(python=platform.python_version(), torch=torch.__version__, numpy=np.__version__,
                                   cpu_count=os.cpu_count(), machine=platform.machine(), platform=platform.platform()),
                  top_k=args.top_k, vocab=VOCAB, batch_size=8, stores=stores, rows=rows)  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    assert math.isfinite(main()["rows"][-1]["tokens_per_s"])
