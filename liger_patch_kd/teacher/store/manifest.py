"""The store's on-disk format: teacher log-probs as data, precomputed (or imported) once, trained against many
times.

A store is a directory:
    manifest.json             teacher, vocab size, tokenizer fingerprint, k, encoding, the fingerprint of every
                              input that shaped it, one entry per finished shard
    shard-00000.safetensors   input_ids (int32, sequences concatenated), offsets (int64, S + 1 boundaries),
                              checksums (int64, one crc32 per sequence, see shard.py) and either
                              topk_ids (int32, positions x k) + topk_logprobs (bf16 / fp16 / fp32, positions x k)
                              ("plain"), or topk_packed (uint8, positions x row bytes; "packed<bits>", compact.py),
                              and with the manifest key labels: true, labels (int32, positions; labels.py)
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
import re
from pathlib import Path
from typing import Any

import torch

from .compact import codec_from_manifest
from .labels import LABELLED_FORMAT_VERSION, label_option_problem
from .samples import min_top_k, sample_option_problem

FORMAT_VERSION = 2
NEWEST_FORMAT_VERSION = LABELLED_FORMAT_VERSION  # the newest format this version reads (labels.py)
MANIFEST = "manifest.json"
LOGPROB_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_SHARD_NAME = re.compile(r"^[A-Za-z0-9_.-]+\.safetensors$")  # a file of the store's own folder, no path


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
        raise TeacherStoreError(f"{path} lacks {sorted(missing)}: not a teacher store's manifest (another tool's "
                                f"{MANIFEST}?); give a folder `liger-kd precompute` wrote, or, for a new store, a "
                                f"folder without this file")  # fmt: skip
    problem = _manifest_problem(meta)
    if problem:
        raise TeacherStoreError(f"{path}: {problem}")
    return meta


def _is_int(x: Any, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _manifest_problem(meta: dict) -> str | None:
    """What is wrong with a parsed manifest (the fix included), or None."""
    version = meta["format_version"]
    if not _is_int(version, 1):
        return f"format_version {version!r} is not a store format (1 .. {FORMAT_VERSION}): the manifest is damaged"
    if version > NEWEST_FORMAT_VERSION:
        return f"store format {version}; this version reads up to {NEWEST_FORMAT_VERSION}: upgrade liger-patch-kd"
    edited = "the manifest was edited or is damaged; restore it or recompute the store"
    if not _is_int(meta["vocab_size"], 1) or meta["vocab_size"] >= 2**31:
        return f"vocab_size {meta['vocab_size']!r} is not a vocabulary size: {edited}"
    if not _is_int(meta["top_k"], min_top_k(meta)):
        return f"top_k {meta['top_k']!r} is not a slot count >= {min_top_k(meta)}: {edited}"
    if sample_option_problem(meta):
        return f"{sample_option_problem(meta)}: {edited}"
    if label_option_problem(meta):
        return f"{label_option_problem(meta)}: {edited}"
    if meta.get("num_sequences") is not None and not _is_int(meta["num_sequences"]):
        return f"num_sequences {meta['num_sequences']!r} is not a count: {edited}"
    dtype = meta.get("logprob_dtype", "float32")
    if not isinstance(dtype, str) or dtype not in LOGPROB_DTYPES:
        return f"logprob_dtype {dtype!r} is not one of {sorted(LOGPROB_DTYPES)}: {edited}"
    t = meta.get("temperature", 1.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
        return f"temperature {t!r} is not a number > 0: {edited}"
    enc = meta.get("encoding", {"name": "plain"})
    try:
        codec_from_manifest(meta)
    except (ValueError, TypeError, KeyError) as e:
        return f"encoding {str(enc)[:80]} is not valid for vocab_size {meta['vocab_size']}, top_k {meta['top_k']} " \
               f"({str(e).splitlines()[0][:120]}): {edited}"  # fmt: skip
    if not isinstance(meta["shards"], list):
        return f"shards is a {type(meta['shards']).__name__}, not a list: {edited}"
    for n, entry in enumerate(meta["shards"]):
        problem = _entry_problem(entry)
        if problem:
            return f"shards[{n}] {problem}: {edited}"
        if entry.get("max_id", -1) >= meta["vocab_size"]:
            return f"shards[{n}] holds teacher id {entry['max_id']} >= vocab_size {meta['vocab_size']}: {edited}"
    return None


def _entry_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return "is not an object"
    name = entry.get("file")
    if not isinstance(name, str) or not _SHARD_NAME.match(name):
        return f"names file {str(name)[:60]!r}, not a shard file of this folder"
    if not _is_int(entry.get("num_sequences")):
        return f"({name}) has num_sequences {entry.get('num_sequences')!r}, not a count"
    if not isinstance(entry.get("sha256"), str):
        return f"({name}) has no sha256"
    for key, low in (("index_crc32", 0), ("max_id", -1), ("max_input_id", -1)):
        if key in entry and not _is_int(entry[key], low):
            return f"({name}) has {key} {entry[key]!r}, not an integer >= {low}"
    return None


def write_manifest(store_dir: str | Path, meta: dict) -> None:
    """Rewrite the manifest atomically (a temporary file, then a rename): a reader never sees half of one."""
    path = Path(store_dir) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, path)
