"""Reading a store: random access to its sequences (each read checked against its crc32), in order for
converters, and a full sha256 pass (the layout is manifest.py's docstring)."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...batch.columns import TEACHER_LOGPROBS, TEACHER_TOKEN_IDS
from .compact import codec_from_manifest
from .labels import label_item, label_layout
from .manifest import TeacherStoreError, read_manifest, tokenizer_fingerprint
from .rollouts import rollout_item, rollout_layout
from .samples import sample_item, sample_layout, samples_of
from .shard import ShardDamaged, ShardReader, sha256_file

_TORCH_OF_SAFETENSORS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_NUMPY_BITS = {torch.bfloat16: np.int16, torch.float16: np.int16, torch.float32: np.int32}  # viewed as the dtype


class TeacherLogprobsDataset(torch.utils.data.Dataset):
    """Sequences with their teacher top-k, checked against the student's vocabulary and tokenizer.

    Items: {"input_ids": (T,), "teacher_token_ids": (T, k) int32, "teacher_logprobs": (T, k)}; log-probs have
    the store's dtype ("plain") or float32 (a packed store, decoded here). A store of prompt rows adds "labels"
    (T,), -100 on the prompt (labels.py), and a rollout store its own columns (rollouts.py).

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
                    f"ids in the store mean other tokens for this student; precompute the store again with the "
                    f"student's tokenizer (liger-kd precompute --tokenizer), or train a student of the tokenizer "
                    f"that made it (the store's teacher: {self.meta.get('teacher', 'not recorded')})"
                )
        counts = [s["num_sequences"] for s in self.meta["shards"]]
        expected = self.meta.get("num_sequences")
        if expected is not None and sum(counts) != expected:
            raise TeacherStoreError(
                f"the store holds {sum(counts)} of {expected} sequences: the precompute was interrupted; rerun it "
                f"with the same arguments to resume"
            )
        listed = {s["file"] for s in self.meta["shards"]}
        unlisted = sorted(p.name for p in self.dir.glob("shard-*.safetensors") if p.name not in listed)
        if unlisted:
            raise TeacherStoreError(
                f"{self.dir} holds {unlisted[0]}, which its manifest does not list ({len(listed)} shards listed): "
                f"the manifest is stale or was edited; restore it, or recompute the store"
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
        layout = {"top_k": self.top_k, "row_bytes": None if self._codec is None else self._codec.row_bytes,
                  "samples": lambda n: sample_layout(self.meta, self._codec, n),
                  "rollouts": lambda n: {**rollout_layout(self.meta, n), **label_layout(self.meta, n)}}  # fmt: skip
        try:
            reader = ShardReader(path, entry, layout)
        except ShardDamaged as e:
            raise TeacherStoreError(f"shard {entry['file']} in {self.dir} is damaged: {e}; recompute it") from None
        except OSError as e:
            why = e.strerror or e
            raise TeacherStoreError(f"shard {entry['file']} in {self.dir} cannot be opened ({why})") from None
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
        # each column built in numpy and handed to torch once: a step reads hundreds of items, and every torch op
        # on one is a dispatch
        item = {"input_ids": torch.from_numpy(raw["input_ids"].view(np.int32).reshape(n).astype(np.int64))}
        if samples_of(self.meta):
            dtype = _TORCH_OF_SAFETENSORS[reader.dtype_name("sample_logprobs")] if self._codec is None else None
            item.update(sample_item(self.meta, self._codec, raw, dtype, n))
        item.update(rollout_item(self.meta, raw, n))  # a rollout store's labels and log-probs (rollouts.py)
        item.update(label_item(self.meta, raw, n))  # completion-only labels of prompt rows (labels.py)
        if k == 0:
            pass  # sampled tokens alone: no top-k columns
        elif self._codec is None:
            item[TEACHER_TOKEN_IDS] = torch.from_numpy(raw["topk_ids"].view(np.int32).reshape(n, k))
            dtype = _TORCH_OF_SAFETENSORS[reader.dtype_name("topk_logprobs")]
            logprobs = raw["topk_logprobs"].view(_NUMPY_BITS[dtype]).reshape(n, k)
            item[TEACHER_LOGPROBS] = torch.from_numpy(logprobs).view(dtype)  # bf16: its 16-bit patterns
        else:
            ids, lp = self._codec.decode(raw["topk_packed"])
            item[TEACHER_TOKEN_IDS], item[TEACHER_LOGPROBS] = torch.from_numpy(ids), torch.from_numpy(lp)
        if self._check_ids_per_item and n and k and int(item[TEACHER_TOKEN_IDS].max()) >= self.vocab_size:
            raise TeacherStoreError(
                f"item {i} holds teacher id {int(item[TEACHER_TOKEN_IDS].max())} >= vocab_size {self.vocab_size}: "
                f"the teacher's top-k reaches ids the student does not have"
            )
        return item


def iter_store(store_dir: str | Path, target: str = "this format") -> Any:
    """(input_ids, teacher_token_ids, teacher_logprobs) of every sequence in order, as tensors; for converters.
    A store of sampled teacher tokens is refused (refuse_samples): dropping its draws (or the hybrid's) would
    change the objective silently; formats/hf_datasets.py carries them."""
    refuse_samples(store_dir, target)
    data = TeacherLogprobsDataset(store_dir)
    for i in range(len(data)):
        item = data[i]
        yield item["input_ids"], item[TEACHER_TOKEN_IDS], item[TEACHER_LOGPROBS]


def refuse_samples(store_dir: str | Path, target: str) -> None:
    """TeacherStoreError when the store holds sampled teacher tokens, which `target` (a format) cannot hold."""
    m = samples_of(read_manifest(store_dir))
    if m:
        raise TeacherStoreError(
            f"{store_dir} holds sampled teacher tokens (samples={m}), which {target} cannot hold (it has top-k "
            f"columns only, and dropping the draws would change the objective): convert it with --to hf (datasets) "
            f"or --to store, or train on the store itself"
        )


class VerifiedStore(int):
    """What `verify_store` returns: an int, the number of shards checked (as it always was), with the details as
    attributes: `shards`, `sequences` (their total) and `bytes` (the shard bytes hashed)."""

    shards: int
    sequences: int
    bytes: int

    def __new__(cls, shards: int, sequences: int, nbytes: int) -> VerifiedStore:
        self = super().__new__(cls, shards)
        self.shards, self.sequences, self.bytes = shards, sequences, nbytes
        return self

    def __repr__(self) -> str:
        return f"VerifiedStore(shards={self.shards}, sequences={self.sequences}, bytes={self.bytes})"


def verify_store(store_dir: str | Path) -> VerifiedStore:
    """Check every shard's whole-file sha256 against the manifest (a full pass: run it after copying a store).

    Returns the number of shards checked, as a `VerifiedStore`: an int (so `verify_store(d) == 3` and `int(...)`
    work as before) that also carries `.shards`, `.sequences` and `.bytes`. A missing or damaged shard, or a
    damaged manifest, is a TeacherStoreError naming it; nothing is returned then.
    """
    meta = read_manifest(store_dir)
    total = 0
    for entry in meta["shards"]:
        path = Path(store_dir) / entry["file"]
        if not path.is_file():
            raise TeacherStoreError(f"shard {entry['file']} listed in the manifest is missing from {store_dir}")
        if sha256_file(path) != entry["sha256"]:
            raise TeacherStoreError(f"shard {entry['file']} fails its checksum: the file is corrupted; recompute it")
        total += path.stat().st_size
    return VerifiedStore(len(meta["shards"]), sum(e["num_sequences"] for e in meta["shards"]), total)


def store_meta(dataset: Any) -> dict | None:
    """The manifest of the store under `dataset` (a TeacherLogprobsDataset, or a torch Subset / a join of one:
    their `dataset` / `meta`), or None: where KDTrainer reads the draw temperature of sampled teacher tokens."""
    for _ in range(8):
        meta = getattr(dataset, "meta", None)
        if meta is not None or not hasattr(dataset, "dataset"):
            return meta if isinstance(meta, dict) else None
        dataset = dataset.dataset
    return None
