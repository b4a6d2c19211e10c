"""Writing a store: shards written to a temporary name and renamed, the manifest rewritten atomically after each
one, so an interrupted precompute resumes from the last finished shard and never leaves a half-written one (the
layout is manifest.py's docstring)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from .compact import codec_from_manifest, codec_from_spec
from .manifest import FORMAT_VERSION, LOGPROB_DTYPES, MANIFEST, TeacherStoreError, read_manifest, write_manifest
from .shard import index_checksum, read_header, sequence_checksums, sha256_file

# Manifest keys that describe a store but do not shape its contents: a resume may differ in them.
_DESCRIPTIVE = {"teacher", "shards", "max_id", "max_input_id"}


def _mismatch_message(out_dir: Path, changed: dict) -> str:
    parts = [f"{key} (store: {old!r}, now: {new!r})" for key, (old, new) in changed.items()]
    return (
        f"{out_dir} holds a store started with other inputs: {'; '.join(parts)}. Resuming would mix two datasets "
        f"in one store: rerun with the original inputs, or use another --out (or delete it)"
    )


@dataclass
class StoreWriter:
    """Writes shards of (sequences, top-k) into `out_dir`; `done_shards()` tells a resuming caller where to start."""

    out_dir: Path
    meta: dict

    @classmethod
    def open(cls, out_dir: str | Path, *, encoding: str = "plain", **meta: Any) -> StoreWriter:
        """Start a store, or reopen an interrupted one after checking that every input that shapes it is the same.

        encoding: "plain" (int32 ids, log-probs in `logprob_dtype`) or "packed<bits>" (compact.py, e.g. packed10).
        """
        out_dir = Path(out_dir)
        codec = codec_from_spec(encoding, meta["vocab_size"], meta["top_k"])
        meta = {"format_version": FORMAT_VERSION, **meta, "encoding": codec.describe() if codec else {"name": "plain"}}
        out_dir.mkdir(parents=True, exist_ok=True)
        if (out_dir / MANIFEST).exists():
            existing = read_manifest(out_dir)
            keys = (set(meta) | set(existing)) - _DESCRIPTIVE
            changed = {k: (existing.get(k), meta.get(k)) for k in sorted(keys) if existing.get(k) != meta.get(k)}
            inputs = changed.pop("inputs", None)
            if inputs is not None:  # name the input that differs, not the whole fingerprint dict
                old, new = inputs[0] or {}, inputs[1] or {}
                changed.update(
                    {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}
                )
            if changed:
                raise TeacherStoreError(_mismatch_message(out_dir, changed))
            meta = existing
        else:
            meta["shards"] = []
            write_manifest(out_dir, meta)
        for stale in out_dir.glob("*.tmp"):  # a shard or manifest interrupted mid-write
            stale.unlink()
        return cls(out_dir, meta)

    def done_shards(self) -> int:
        return len(self.meta["shards"])

    def write_shard(
        self, sequences: Sequence[torch.Tensor], topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
        packed_rows: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        """One shard: `sequences` (token id tensors), and the positions' top-k concatenated in the same order.

        packed_rows: for a packed store, rows already encoded with this store's codec (e.g. copied from another
        packed store); they replace encoding `topk_logprobs`, and `topk_ids` is still checked against the vocab.
        """
        index = self.done_shards()
        lengths = np.array([len(s) for s in sequences], dtype=np.int64)
        offsets = np.concatenate([np.zeros(1, dtype=np.int64), lengths.cumsum()])
        k, vocab = self.meta["top_k"], self.meta["vocab_size"]
        if tuple(topk_ids.shape) != (int(offsets[-1]), k) or topk_logprobs.shape != topk_ids.shape:
            raise ValueError(
                f"shard arrays {tuple(topk_ids.shape)} / {tuple(topk_logprobs.shape)} != ({int(offsets[-1])}, {k})"
            )
        max_id = int(topk_ids.max()) if topk_ids.numel() else -1
        if max_id >= vocab or (topk_ids.numel() and int(topk_ids.min()) < -1):
            raise ValueError(f"teacher ids outside [-1, vocab_size {vocab}): wrong vocab_size for this teacher")
        if torch.isnan(topk_logprobs.float()).any():
            raise ValueError("teacher log-probs contain NaN; check the teacher's dtype and inputs")
        input_ids = (
            torch.cat([torch.as_tensor(s).to(torch.int32) for s in sequences])
            if len(sequences)
            else torch.zeros(0, dtype=torch.int32)
        )
        tensors = {"input_ids": input_ids, "offsets": torch.from_numpy(offsets)}
        codec = codec_from_manifest(self.meta)
        if codec is None:
            tensors["topk_ids"] = topk_ids.to(torch.int32).contiguous()
            tensors["topk_logprobs"] = topk_logprobs.to(LOGPROB_DTYPES[self.meta["logprob_dtype"]]).contiguous()
        else:
            rows = (
                packed_rows
                if packed_rows is not None
                else codec.encode(topk_ids.numpy(), topk_logprobs.float().numpy())
            )
            tensors["topk_packed"] = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.uint8))
        as_bytes = {name: _byte_rows(t) for name, t in tensors.items() if name != "offsets"}
        tensors["checksums"] = torch.from_numpy(sequence_checksums(offsets, as_bytes))
        name = f"shard-{index:05d}.safetensors"
        tmp = self.out_dir / (name + ".tmp")
        save_file(tensors, str(tmp))
        fd = os.open(tmp, os.O_RDONLY)
        try:
            header, _ = read_header(fd)
        finally:
            os.close(fd)
        entry = {
            "file": name,
            "num_sequences": len(sequences),
            "sha256": sha256_file(tmp),
            "index_crc32": index_checksum(header, offsets, tensors["checksums"].numpy()),
            "max_id": max_id,
            "max_input_id": int(input_ids.max()) if input_ids.numel() else -1,
        }
        os.replace(tmp, self.out_dir / name)
        self.meta["shards"].append(entry)
        write_manifest(self.out_dir, self.meta)


def _byte_rows(t: torch.Tensor) -> np.ndarray:
    """A tensor's rows as raw bytes (rows x row_bytes uint8), bf16 included (numpy has no bf16)."""
    flat = t.contiguous().reshape(t.shape[0], -1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.zeros((t.shape[0], 0), dtype=np.uint8)
