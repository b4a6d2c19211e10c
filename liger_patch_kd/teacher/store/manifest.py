"""The store's on-disk format: teacher log-probs as data, precomputed (or imported) once, trained against many
times.

A store is a directory:
    manifest.json             teacher, vocab size, tokenizer fingerprint, k, encoding, the fingerprint of every
                              input that shaped it, one entry per finished shard
    shard-00000.safetensors   input_ids (int32, sequences concatenated), offsets (int64, S + 1 boundaries),
                              checksums (int64, one crc32 per sequence, see shard.py) and either
                              topk_ids (int32, positions x k) + topk_logprobs (bf16 / fp16 / fp32, positions x k)
                              ("plain"), or topk_packed (uint8, positions x row bytes; "packed<bits>", compact.py)
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
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
LOGPROB_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class TeacherStoreError(ValueError):
    """A store that does not match the student or is damaged; the message says which and what to do."""


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's class and vocabulary: two tokenizers with one fingerprint map text to the same ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    digest.update(json.dumps(vocab, ensure_ascii=False).encode())
    return digest.hexdigest()[:16]


def read_manifest(store_dir: str | Path) -> dict:
    """The manifest as a dict; a missing, truncated or foreign one is a TeacherStoreError saying what to do."""
    path = Path(store_dir) / MANIFEST
    if not path.exists():
        raise TeacherStoreError(
            f"{path.parent} has no {MANIFEST}: not a teacher store (make one with `liger-kd precompute`)"
        )
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        raise TeacherStoreError(
            f"{path} is not valid JSON ({e}): the manifest is truncated or damaged; restore it or recompute the store"
        ) from None
    missing = {"format_version", "vocab_size", "top_k", "shards"} - set(meta) if isinstance(meta, dict) else {"all"}
    if missing:
        raise TeacherStoreError(f"{path} lacks {sorted(missing)}: not a teacher store manifest")
    if meta["format_version"] > FORMAT_VERSION:
        raise TeacherStoreError(
            f"{path} is store format {meta['format_version']}; this version reads up to {FORMAT_VERSION}: upgrade"
        )
    return meta


def write_manifest(store_dir: str | Path, meta: dict) -> None:
    """Rewrite the manifest atomically (a temporary file, then a rename): a reader never sees half of one."""
    path = Path(store_dir) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, path)
