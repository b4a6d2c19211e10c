"""Teacher log-probs as data: precompute (or import) once, train against them many times.

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

import bisect
import hashlib
import json
import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from .compact import codec_from_manifest, codec_from_spec
from .shard import ShardDamaged, ShardReader, index_checksum, read_header, sequence_checksums, sha256_file

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
LOGPROB_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_TORCH_OF_SAFETENSORS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# Manifest keys that describe a store but do not shape its contents: a resume may differ in them.
_DESCRIPTIVE = {"teacher", "shards", "max_id", "max_input_id"}


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


def _atomic_write_json(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)


def _mismatch_message(out_dir: Path, changed: dict) -> str:
    parts = [f"{key} (store: {old!r}, now: {new!r})" for key, (old, new) in changed.items()]
    return (
        f"{out_dir} holds a store started with other inputs: {'; '.join(parts)}. Resuming would mix two datasets "
        f"in one store: rerun with the original inputs, or use another --out (or delete it)"
    )


# ------------------------------------------------------------------------------------------------- writing
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
            _atomic_write_json(out_dir / MANIFEST, meta)
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
        _atomic_write_json(self.out_dir / MANIFEST, self.meta)


def _byte_rows(t: torch.Tensor) -> np.ndarray:
    """A tensor's rows as raw bytes (rows x row_bytes uint8), bf16 included (numpy has no bf16)."""
    flat = t.contiguous().reshape(t.shape[0], -1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.zeros((t.shape[0], 0), dtype=np.uint8)


# ------------------------------------------------------------------------------------------------- reading
class TeacherLogprobsDataset(torch.utils.data.Dataset):
    """Sequences with their teacher top-k, checked against the student's vocabulary and tokenizer.

    Items: {"input_ids": (T,), "teacher_token_ids": (T, k) int32, "teacher_logprobs": (T, k)}; log-probs have
    the store's dtype ("plain") or float32 (a packed store, decoded here).

    vocab_size: the student's real vocabulary (e.g. len(tokenizer), or KDLossConfig.vocab_size). Any store whose
        ids are all below it is accepted, whatever the teacher's head size (a 152064-row teacher serves a
        151936-row student); an id at or above it is a TeacherStoreError. The tokenizer fingerprint, not the
        head size, is what says that ids mean the same tokens.
    tokenizer: checked against the store's tokenizer fingerprint when both exist.

    Reading is random-access and cheap: the shard is found by bisection, a sequence is read with positioned
    reads and checked against its own crc32 (see shard.py), and at most `max_open_shards` descriptors are
    held per process. Nothing is cached, so memory is flat in the store's size, and DataLoader workers (forked or
    spawned) each open what they read.
    """

    def __init__(
        self, store_dir: str | Path, *, vocab_size: int | None = None, tokenizer: Any = None,
        max_open_shards: int = 64,
    ) -> None:  # fmt: skip
        self.dir = Path(store_dir)
        self.meta = read_manifest(self.dir)
        self.vocab_size = vocab_size
        self._check_ids_per_item = False
        if vocab_size is not None:
            self._check_vocab(vocab_size)
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
        self._codec = codec_from_manifest(self.meta)
        self._max_open = max_open_shards
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()

    def _check_vocab(self, vocab_size: int) -> None:
        shards = self.meta["shards"]
        if shards and all("max_id" in s for s in shards):
            max_id = max(max(s["max_id"], s["max_input_id"]) for s in shards)
            if max_id >= vocab_size:
                raise TeacherStoreError(
                    f"the store holds token id {max_id} but the student's vocabulary has {vocab_size} tokens "
                    f"(vocab_size={vocab_size}): the teacher's top-k reaches ids the student does not have; "
                    f"pass the student's real vocabulary (len(tokenizer)) or precompute with a matching teacher"
                )
        elif vocab_size < self.meta["vocab_size"]:  # format 1 records no maximum: check each item as it is read
            self._check_ids_per_item = True

    def __getstate__(self) -> dict:  # descriptors are per process: a spawned worker opens its own
        state = self.__dict__.copy()
        state["_readers"] = OrderedDict()
        return state

    @property
    def top_k(self) -> int:
        return self.meta["top_k"]

    def __len__(self) -> int:
        return self._starts[-1]

    def _reader(self, index: int) -> ShardReader:
        reader = self._readers.get(index)
        if reader is not None:
            self._readers.move_to_end(index)
            return reader
        entry = self.meta["shards"][index]
        path = self.dir / entry["file"]
        if not path.exists():
            raise TeacherStoreError(f"shard {entry['file']} listed in the manifest is missing from {self.dir}")
        try:
            reader = ShardReader(path, entry)
        except ShardDamaged as e:
            raise TeacherStoreError(f"shard {entry['file']} in {self.dir} is damaged: {e}; recompute it") from None
        self._readers[index] = reader
        if len(self._readers) > self._max_open:
            self._readers.popitem(last=False)[1].close()
        return reader

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        shard = bisect.bisect_right(self._starts, i) - 1
        reader = self._reader(shard)
        try:
            raw = reader.sequence(i - self._starts[shard])
        except ShardDamaged as e:
            name = self.meta["shards"][shard]["file"]
            raise TeacherStoreError(f"shard {name} in {self.dir} is damaged: {e}; recompute it") from None
        n, k = raw["input_ids"].shape[0], self.top_k
        item = {"input_ids": torch.from_numpy(raw["input_ids"].view(np.int32).reshape(n)).long()}
        if self._codec is None:
            item["teacher_token_ids"] = torch.from_numpy(raw["topk_ids"].view(np.int32).reshape(n, k))
            dtype = _TORCH_OF_SAFETENSORS[reader.dtype_name("topk_logprobs")]
            item["teacher_logprobs"] = torch.from_numpy(raw["topk_logprobs"]).view(dtype).reshape(n, k)
        else:
            ids, lp = self._codec.decode(raw["topk_packed"])
            item["teacher_token_ids"], item["teacher_logprobs"] = torch.from_numpy(ids), torch.from_numpy(lp)
        if self._check_ids_per_item and n and int(item["teacher_token_ids"].max()) >= self.vocab_size:
            raise TeacherStoreError(
                f"item {i} holds teacher id {int(item['teacher_token_ids'].max())} >= vocab_size {self.vocab_size}: "
                f"the teacher's top-k reaches ids the student does not have"
            )
        return item


def iter_store(store_dir: str | Path) -> Any:
    """(input_ids, teacher_token_ids, teacher_logprobs) of every sequence in order, as tensors; for converters."""
    data = TeacherLogprobsDataset(store_dir)
    for i in range(len(data)):
        item = data[i]
        yield item["input_ids"], item["teacher_token_ids"], item["teacher_logprobs"]


def verify_store(store_dir: str | Path) -> int:
    """Check every shard's whole-file sha256 against the manifest (a full pass: run it after copying a store)."""
    meta = read_manifest(store_dir)
    for entry in meta["shards"]:
        path = Path(store_dir) / entry["file"]
        if not path.exists():
            raise TeacherStoreError(f"shard {entry['file']} listed in the manifest is missing from {store_dir}")
        if sha256_file(path) != entry["sha256"]:
            raise TeacherStoreError(f"shard {entry['file']} fails its checksum: the file is corrupted; recompute it")
    return len(meta["shards"])


def padding_rows(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, k) padding slots: id -1, log-prob -inf."""
    return torch.full((n, k), -1, dtype=torch.int32), torch.full((n, k), -math.inf)
