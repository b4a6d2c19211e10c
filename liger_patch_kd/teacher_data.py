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
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .reference import LOGPROB_PLACEHOLDER

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


def topk_of_logits(logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, log-probs) of the k most likely tokens of each row, log_softmax in fp32."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    values, ids = logprobs.topk(k, dim=-1)
    return ids, values


@torch.no_grad()
def teacher_topk(
    teacher: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, k: int, temperature: float = 1.0,
    rows_per_chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Top-k of a teacher batch (B, T) -> (B, T, k) ids and log-probs, from last hidden states a chunk of rows
    at a time, so the (B x T x V) logits are never held at once. Soft-capping is applied as the model does."""
    from .models.kd_forward import output_head, unwrap_model
    from .models.registry import softcap_of
    from .reference import apply_softcap

    model = unwrap_model(teacher)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    head = output_head(model, "teacher")
    flat = hidden.reshape(-1, hidden.shape[-1])
    ids, values = [], []
    for start in range(0, flat.shape[0], rows_per_chunk):
        logits = apply_softcap(head(flat[start : start + rows_per_chunk]).float(), softcap_of(model.config))
        i, v = topk_of_logits(logits, k, temperature)
        ids.append(i)
        values.append(v)
    shape = (*input_ids.shape, k)
    return torch.cat(ids).reshape(shape), torch.cat(values).reshape(shape)


def precompute(
    teacher: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    out_dir: str | Path,
    *,
    top_k: int = 64,
    batch_size: int = 8,
    shard_size: int = 1024,
    logprob_dtype: str = "bfloat16",
    temperature: float = 1.0,
    teacher_name: str = "",
    tokenizer_fp: str | None = None,
    progress: bool = True,
) -> Path:
    """Run `teacher` over `sequences` (lists of token ids) and write a store; resumes an interrupted one.

    Shard i always holds sequences [i * shard_size, (i + 1) * shard_size), so a resumed run writes exactly
    the shards a complete run would (the test checks byte-identical files).
    """
    from tqdm.auto import tqdm

    if logprob_dtype not in LOGPROB_DTYPES:
        raise ValueError(f"logprob_dtype must be one of {sorted(LOGPROB_DTYPES)}; got {logprob_dtype!r}")
    vocab = teacher.get_output_embeddings().weight.shape[0]
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be in [1, vocab_size={vocab}]; got {top_k}")
    writer = StoreWriter.open(
        out_dir, teacher=teacher_name, vocab_size=vocab, tokenizer_fingerprint=tokenizer_fp, top_k=top_k,
        logprob_dtype=logprob_dtype, temperature=temperature, shard_size=shard_size, num_sequences=len(sequences),
    )  # fmt: skip
    device = next(teacher.parameters()).device
    n_shards = math.ceil(len(sequences) / shard_size)
    was_training = teacher.training
    teacher.eval()
    with tqdm(total=len(sequences), initial=min(len(sequences), writer.done_shards() * shard_size),
              desc="teacher top-k", unit="seq", disable=not progress) as bar:  # fmt: skip
        for shard in range(writer.done_shards(), n_shards):
            shard_seqs = [
                torch.as_tensor(s, dtype=torch.long) for s in sequences[shard * shard_size : (shard + 1) * shard_size]
            ]
            ids, values = [], []
            for start in range(0, len(shard_seqs), batch_size):
                batch = shard_seqs[start : start + batch_size]
                padded = torch.nn.utils.rnn.pad_sequence(batch, batch_first=True).to(device)
                mask = (
                    torch.arange(padded.shape[1], device=device)[None]
                    < torch.tensor([len(s) for s in batch], device=device)[:, None]
                ).long()
                b_ids, b_values = teacher_topk(teacher, padded, mask, top_k, temperature)
                for row, seq in enumerate(batch):
                    i, v = b_ids[row, : len(seq)].cpu(), b_values[row, : len(seq)].cpu()
                    i[-1], v[-1] = -1, -math.inf  # the last position predicts nothing in this sequence
                    ids.append(i)
                    values.append(v)
                bar.update(len(batch))
            writer.write_shard(shard_seqs, torch.cat(ids), torch.cat(values))
    teacher.train(was_training)
    return writer.out_dir


# ----------------------------------------------------------------------------------------- vLLM import
def import_vllm_logprobs(
    records: Iterable[dict], out_dir: str | Path, *, vocab_size: int, top_k: int, **meta: Any
) -> Path:
    """Convert vLLM / OpenAI-style prompt log-probs into a store.

    Each record: {"prompt_token_ids": [...], "prompt_logprobs": [null, {"<id>": {"logprob": x, ...} or x, ...},
    ...]} and optionally the completion: {"output_token_ids": [...], "output_logprobs": [{...}, ...]} (vLLM's
    outputs[0].token_ids / .logprobs). Entry t of prompt_logprobs scores token t given the tokens before it,
    so it becomes row t - 1 here. Rows with fewer than top_k entries are padded (-1, -inf); rows with more
    (vLLM adds the actual token) keep the top_k most likely.
    """
    writer = StoreWriter.open(
        out_dir, teacher=meta.get("teacher", "vllm"), vocab_size=vocab_size, top_k=top_k,
        tokenizer_fingerprint=meta.get("tokenizer_fingerprint"), logprob_dtype=meta.get("logprob_dtype", "float32"),
        temperature=1.0, shard_size=meta.get("shard_size", 1024), num_sequences=None,
    )  # fmt: skip
    sequences, ids, values = [], [], []

    def flush():
        if sequences:
            writer.write_shard(sequences, torch.cat(ids), torch.cat(values))
            sequences.clear(), ids.clear(), values.clear()

    for record in records:
        tokens = list(record["prompt_token_ids"]) + list(record.get("output_token_ids", []))
        per_position = list(record["prompt_logprobs"])[1:] + list(record.get("output_logprobs", []))
        rows_i = torch.full((len(tokens), top_k), -1, dtype=torch.int32)
        rows_v = torch.full((len(tokens), top_k), -math.inf)
        for t, entry in enumerate(per_position[: len(tokens) - 1]):
            if not entry:
                continue
            pairs = sorted(((int(tok), _logprob(val)) for tok, val in entry.items()), key=lambda p: -p[1])[:top_k]
            for j, (tok, lp) in enumerate(pairs):
                if not 0 <= tok < vocab_size:
                    raise TeacherStoreError(
                        f"token id {tok} in record {len(sequences)} is outside vocab_size {vocab_size}"
                    )
                rows_i[t, j], rows_v[t, j] = tok, lp
        sequences.append(torch.tensor(tokens, dtype=torch.int32))
        ids.append(rows_i)
        values.append(rows_v)
        if len(sequences) == writer.meta["shard_size"]:
            flush()
    flush()
    return writer.out_dir


def _logprob(value: Any) -> float:
    lp = float(value["logprob"] if isinstance(value, dict) else value)
    return -math.inf if lp <= LOGPROB_PLACEHOLDER else lp


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


@dataclass
class TeacherDataCollator:
    """Right-pads a batch: input_ids (pad_token_id), attention_mask, labels (given labels, else input_ids;
    ignore_index on padding) and, when the features carry them, the teacher's top-k (id -1, log-prob -inf on
    padding), row-aligned with the positions. Works for plain {"input_ids", "labels"} features too."""

    pad_token_id: int = 0
    ignore_index: int = -100

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        seqs = [torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features]
        length, batch = max(len(s) for s in seqs), len(features)
        out = {
            "input_ids": torch.full((batch, length), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros((batch, length), dtype=torch.long),
            "labels": torch.full((batch, length), self.ignore_index, dtype=torch.long),
        }
        has_teacher = "teacher_token_ids" in features[0]
        if has_teacher:
            k = features[0]["teacher_token_ids"].shape[-1]
            out["teacher_token_ids"] = torch.full((batch, length, k), -1, dtype=torch.int32)
            out["teacher_logprobs"] = torch.full(
                (batch, length, k), -math.inf, dtype=features[0]["teacher_logprobs"].dtype
            )
        for row, (f, seq) in enumerate(zip(features, seqs)):
            n = len(seq)
            out["input_ids"][row, :n] = seq
            out["attention_mask"][row, :n] = 1
            out["labels"][row, :n] = torch.as_tensor(f.get("labels", seq), dtype=torch.long)
            if has_teacher:
                out["teacher_token_ids"][row, :n] = f["teacher_token_ids"]
                out["teacher_logprobs"][row, :n] = f["teacher_logprobs"]
        return out
