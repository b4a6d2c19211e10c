"""Teacher log-probs as data: precompute (or import from vLLM) once, train against them many times.

A store is a directory:
    manifest.json             teacher, vocab size, tokenizer fingerprint, k, dtypes, one entry per finished shard
    shard-00000.safetensors   input_ids (int32, sequences concatenated), offsets (int64, S + 1 boundaries),
                              topk_ids (int32, positions x k), topk_logprobs (bf16 / fp16 / fp32, positions x k)
Row t of a sequence holds the teacher's top-k for the token after position t (aligned like logits); the last
position of each sequence has no target and is stored as padding (id -1, log-prob -inf). Log-probs are taken
at temperature 1 over the full vocabulary (tempering them later is exact; see losses.fused_linear_topk_kd).

Shards are written to a temporary name and renamed, and the manifest is rewritten atomically after each one,
so an interrupted precompute resumes from the last finished shard and never leaves a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LOGPROB_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's class and vocabulary: two tokenizers with one fingerprint map text to the same ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    digest.update(json.dumps(vocab, ensure_ascii=False).encode())
    return digest.hexdigest()[:16]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _atomic_write_json(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)


class TeacherStoreError(ValueError):
    """A store that does not match the student or is damaged; the message says which and what to do."""


# ------------------------------------------------------------------------------------------------- writing
@dataclass
class StoreWriter:
    """Writes shards of (sequences, top-k) into `out_dir`; `done_shards()` tells a resuming caller where to start."""

    out_dir: Path
    meta: dict

    @classmethod
    def open(cls, out_dir: str | Path, **meta: Any) -> StoreWriter:
        """Start a store, or reopen an interrupted one after checking that it was started with the same settings."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        manifest_path = out_dir / MANIFEST
        meta = {"format_version": FORMAT_VERSION, **meta}
        if manifest_path.exists():
            existing = json.loads(manifest_path.read_text())
            changed = {k: (existing.get(k), v) for k, v in meta.items() if existing.get(k) != v}
            if changed:
                raise TeacherStoreError(
                    f"{out_dir} holds a store made with other settings {changed} (existing, requested); "
                    f"use another --out or delete it"
                )
            meta = existing
        else:
            meta["shards"] = []
            _atomic_write_json(manifest_path, meta)
        for stale in out_dir.glob("*.tmp"):  # a shard interrupted mid-write
            stale.unlink()
        return cls(out_dir, meta)

    def done_shards(self) -> int:
        return len(self.meta["shards"])

    def write_shard(
        self, sequences: Sequence[torch.Tensor], topk_ids: torch.Tensor, topk_logprobs: torch.Tensor
    ) -> None:
        """One shard: `sequences` (token id tensors), and the positions' top-k concatenated in the same order."""
        index = self.done_shards()
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        k, vocab = self.meta["top_k"], self.meta["vocab_size"]
        if topk_ids.shape != (int(offsets[-1]), k) or topk_logprobs.shape != topk_ids.shape:
            raise ValueError(
                f"shard arrays {tuple(topk_ids.shape)} / {tuple(topk_logprobs.shape)} != ({int(offsets[-1])}, {k})"
            )
        if topk_ids.numel() and int(topk_ids.max()) >= vocab:
            raise ValueError(f"teacher ids >= vocab_size {vocab}: wrong vocab_size for this teacher")
        if torch.isnan(topk_logprobs.float()).any():
            raise ValueError("teacher log-probs contain NaN; check the teacher's dtype and inputs")
        name = f"shard-{index:05d}.safetensors"
        tensors = {
            "input_ids": torch.cat([s.to(torch.int32) for s in sequences])
            if sequences
            else torch.zeros(0, dtype=torch.int32),
            "offsets": offsets,
            "topk_ids": topk_ids.to(torch.int32).contiguous(),
            "topk_logprobs": topk_logprobs.to(LOGPROB_DTYPES[self.meta["logprob_dtype"]]).contiguous(),
        }
        tmp = self.out_dir / (name + ".tmp")
        save_file(tensors, str(tmp))
        checksum = _sha256(tmp)
        os.replace(tmp, self.out_dir / name)
        self.meta["shards"].append({"file": name, "num_sequences": len(sequences), "sha256": checksum})
        _atomic_write_json(self.out_dir / MANIFEST, self.meta)


# ------------------------------------------------------------------------------------------------- reading
class TeacherLogprobsDataset(torch.utils.data.Dataset):
    """Sequences with their teacher top-k, checked against the student's vocabulary and tokenizer.

    Items: {"input_ids": (T,), "teacher_token_ids": (T, k), "teacher_logprobs": (T, k)}. Each shard's checksum
    is verified the first time it is read.
    """

    def __init__(self, store_dir: str | Path, *, vocab_size: int | None = None, tokenizer: Any = None) -> None:
        self.dir = Path(store_dir)
        path = self.dir / MANIFEST
        if not path.exists():
            raise TeacherStoreError(
                f"{self.dir} has no {MANIFEST}: not a teacher store (make one with `liger-kd precompute`)"
            )
        self.meta = json.loads(path.read_text())
        if vocab_size is not None and vocab_size != self.meta["vocab_size"]:
            raise TeacherStoreError(
                f"the store was made for vocab_size {self.meta['vocab_size']} but the student has {vocab_size}; "
                f"precompute with a teacher that shares the student's vocabulary"
            )
        if tokenizer is not None and self.meta.get("tokenizer_fingerprint"):
            fp = tokenizer_fingerprint(tokenizer)
            if fp != self.meta["tokenizer_fingerprint"]:
                raise TeacherStoreError(
                    f"tokenizer fingerprint {fp} differs from the store's {self.meta['tokenizer_fingerprint']}: the "
                    f"ids in the store mean other tokens for this student"
                )
        counts = [s["num_sequences"] for s in self.meta["shards"]]
        expected = self.meta.get("num_sequences")
        if expected is not None and sum(counts) != expected:
            raise TeacherStoreError(
                f"the store holds {sum(counts)} of {expected} sequences: the precompute was interrupted; rerun it "
                f"with the same arguments to resume"
            )
        self._starts = [0]
        for c in counts:
            self._starts.append(self._starts[-1] + c)
        self._cache: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def top_k(self) -> int:
        return self.meta["top_k"]

    def __len__(self) -> int:
        return self._starts[-1]

    def _shard(self, index: int) -> dict[str, torch.Tensor]:
        if index not in self._cache:
            entry = self.meta["shards"][index]
            path = self.dir / entry["file"]
            if not path.exists():
                raise TeacherStoreError(f"shard {entry['file']} listed in the manifest is missing from {self.dir}")
            if _sha256(path) != entry["sha256"]:
                raise TeacherStoreError(
                    f"shard {entry['file']} fails its checksum: the file is corrupted; recompute it"
                )
            self._cache = {index: load_file(str(path))}  # one shard in memory at a time
        return self._cache[index]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        shard = max(s for s in range(len(self._starts) - 1) if self._starts[s] <= i)
        data = self._shard(shard)
        j = i - self._starts[shard]
        lo, hi = int(data["offsets"][j]), int(data["offsets"][j + 1])
        return {
            "input_ids": data["input_ids"][lo:hi].long(),
            "teacher_token_ids": data["topk_ids"][lo:hi],
            "teacher_logprobs": data["topk_logprobs"][lo:hi],
        }
