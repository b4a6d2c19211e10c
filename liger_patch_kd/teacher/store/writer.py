"""Writing a store: shards written to a temporary name and renamed, the manifest rewritten atomically after each
one, so an interrupted precompute resumes from the last finished shard and never leaves a half-written one (the
layout is manifest.py's docstring)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from .compact import codec_from_manifest, codec_from_spec
from .folder import MARK, check_store_folder, leftovers, write_pending
from .ids import ID_LIMIT, token_ids
from .labels import LABELLED_FORMAT_VERSION, label_option_problem, label_tensor, labels_of
from .manifest import FORMAT_VERSION, LOGPROB_DTYPES, MANIFEST, TeacherStoreError, read_manifest, write_manifest
from .rollouts import ROLLOUT_FORMAT_VERSION, rollout_tensors, rollouts_of
from .samples import SAMPLED_FORMAT_VERSION, min_top_k, sample_option_problem, sample_tensors, samples_of
from .shard import index_checksum, read_header, sequence_checksums, sha256_file

# Manifest keys that describe a store but do not shape its contents: a resume may differ in them.
_DESCRIPTIVE = {"teacher", "generator", "shards", "max_id", "max_input_id"}


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_store_options(meta: dict) -> None:
    """The options that shape a store, checked before anything is written (ValueError naming the option)."""
    vocab, k = meta.get("vocab_size"), meta.get("top_k")
    if not _is_int(vocab) or not 1 <= vocab < ID_LIMIT:
        raise ValueError(f"vocab_size must be an integer in [1, 2**31) (the teacher's vocabulary, --vocab-size); "
                         f"got {vocab!r}")  # fmt: skip
    if not _is_int(k) or k < min_top_k(meta):
        raise ValueError(f"top_k must be an integer >= {min_top_k(meta)} (slots kept per position, --top-k); got {k!r}")
    if sample_option_problem(meta):
        raise ValueError(sample_option_problem(meta))
    if label_option_problem(meta):
        raise ValueError(label_option_problem(meta))
    dtype = meta.get("logprob_dtype", "float32")
    if not isinstance(dtype, str) or dtype not in LOGPROB_DTYPES:
        raise ValueError(f"logprob_dtype (--dtype) must be one of {sorted(LOGPROB_DTYPES)}; got {dtype!r}")
    shard_size = meta.get("shard_size", 1)
    if not _is_int(shard_size) or shard_size < 1:
        raise ValueError(f"shard_size (--shard-size) must be an integer >= 1; got {shard_size!r}")
    t = meta.get("temperature", 1.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
        raise ValueError(f"temperature (--temperature) must be a finite number > 0; got {t!r}")


# the precompute flag that sets a store input, by its place in the manifest (a dotted path into nested sections)
SET_BY = {"rollouts.teacher_fingerprint": "--teacher", "rollouts.generator_fingerprint": "--rollouts-from",
          "rollouts.generator_engine.url": "--rollouts-from", "rollouts.generator_engine.model": "--rollouts-from",
          "rollouts.teacher_server.url": "--teacher-url", "rollouts.teacher_server.model": "--teacher-url",
          "rollouts.teacher_server.protocol": "--teacher-protocol",
          "rollouts.max_new_tokens": "--max-new-tokens", "rollouts.num_generations": "--num-generations",
          "rollouts.prompts_per_call": "--batch-size", "rollouts.num_prompts": "--data",
          "rollouts.sampling.temperature": "--generation-temperature", "rollouts.sampling.top_p": "--top-p",
          "rollouts.sampling.top_k": "--generation-top-k", "rollouts.sampling.seed": "--seed",
          "rollouts.score.top_k": "--top-k", "rollouts.score.samples": "--samples",
          "rollouts.score.temperature": "--temperature", "rollouts.score.seed": "--seed", "top_k": "--top-k",
          "temperature": "--temperature", "logprob_dtype": "--dtype", "encoding": "--encoding",
          "data file": "--data", "max_length": "--max-length", "skip_bad_lines": "--skip-bad-lines",
          "max_prompt_length": "--max-prompt-length"}  # fmt: skip


def _differences(old: Any, new: Any, where: str = "") -> dict[str, tuple[Any, Any]]:
    """Dotted path -> (old, new) of the leaves that differ (a section's other fields are not news)."""
    if isinstance(old, dict) and isinstance(new, dict):
        found: dict[str, tuple[Any, Any]] = {}
        for key in sorted(set(old) | set(new), key=str):
            found.update(_differences(old.get(key), new.get(key), f"{where}.{key}" if where else str(key)))
        return found
    return {} if old == new else {where: (old, new)}


def _mismatch_message(out_dir: Path, changed: dict) -> str:
    leaves = {path: pair for key, (old, new) in changed.items() for path, pair in _differences(old, new, key).items()}
    parts = [f"{key} (store: {old!r}, now: {new!r}){f', set by {SET_BY[key]}' if key in SET_BY else ''}"
             for key, (old, new) in leaves.items()]  # fmt: skip
    return (
        f"{out_dir} holds a store started with other inputs: {'; '.join(parts)}. Resuming would mix two datasets "
        f"in one store: rerun with the original inputs, or use another --out (or delete it)"
    )


def _projected(existing: Any, shape: Any) -> Any:
    """`existing` cut to the keys of `shape` (nested dicts), None where it lacks one."""
    if not isinstance(shape, dict):
        return existing
    return {k: _projected(existing.get(k) if isinstance(existing, dict) else None, v) for k, v in shape.items()}


def _inputs_flattened(meta: dict) -> dict:
    """A manifest with its "inputs" fingerprints named by their own keys, as open() names them in its message."""
    return {**{k: v for k, v in meta.items() if k != "inputs"}, **(meta.get("inputs") or {})}


def check_resumable(out_dir: str | Path, expected: dict) -> None:
    """Refuse, before any long work, to resume a store in `out_dir` whose manifest differs from `expected` at any
    leaf `expected` has: a partial manifest of what is known before any model loads (a rollout store's sampling and
    score options, the data file's fingerprint under "inputs"). StoreWriter.open compares the whole manifest later;
    this says the same sooner. Nothing to compare where out_dir holds no manifest."""
    out_dir = Path(out_dir)
    if not (out_dir / MANIFEST).exists():
        return
    existing = read_manifest(out_dir)
    missing = [k for k, v in expected.items() if isinstance(v, dict) and k != "inputs" and k not in existing]
    if missing:  # another kind of store (a plain teacher store where a rollout store is asked for)
        raise TeacherStoreError(
            f"{out_dir} holds a store without a {missing[0]!r} section, another kind of store than this run writes: "
            f"use another --out"
        )
    existing, expected = _inputs_flattened(existing), _inputs_flattened(expected)
    changed = _differences(_projected(existing, expected), expected)
    if changed:
        raise TeacherStoreError(_mismatch_message(out_dir, changed))


@dataclass
class StoreWriter:
    """Writes shards of (sequences, top-k) into `out_dir`; `done_shards()` tells a resuming caller where to start."""

    out_dir: Path
    meta: dict
    manifest_last: bool = False
    created_dir: bool = False
    created_manifest: bool = False
    created_files: list[Path] = field(default_factory=list)
    pending: dict[str, str] = field(default_factory=dict)  # shards renamed into place that no manifest lists yet

    @classmethod
    def open(cls, out_dir: str | Path, *, encoding: str = "plain", manifest_last: bool = False, **meta: Any
             ) -> StoreWriter:  # fmt: skip
        """Start a store, or reopen an interrupted one after checking that every input that shapes it is the same.

        encoding: "plain" (int32 ids, log-probs in `logprob_dtype`) or "packed<bits>" (compact.py, e.g. packed10).
        The manifest of a new store is first written with its first shard (or by `finish()`), so a run that fails
        before any shard leaves no manifest behind; manifest_last=True (converters) writes it only in `finish()`,
        so an interrupted conversion never looks like a finished store. Only what a run of this tool left in the
        folder is ever removed or replaced (folder.py): its temporaries and the shards it recorded there.
        """
        out_dir = Path(out_dir)
        _check_store_options(meta)
        codec = codec_from_spec(encoding, meta["vocab_size"], meta["top_k"])
        version = SAMPLED_FORMAT_VERSION if samples_of(meta) else FORMAT_VERSION
        version = ROLLOUT_FORMAT_VERSION if rollouts_of(meta) is not None else version
        version = LABELLED_FORMAT_VERSION if labels_of(meta) else version
        meta = {"format_version": version, **meta, "encoding": codec.describe() if codec else {"name": "plain"}}
        check_store_folder(out_dir)
        created_dir = not out_dir.exists()
        out_dir.mkdir(parents=True, exist_ok=True)
        resumed = (out_dir / MANIFEST).exists()
        if resumed:
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
        for stale in leftovers(out_dir)[0]:  # an interrupted run's, started over (check_store_folder: none else)
            stale.unlink()
        writer = cls(out_dir, meta)
        writer.manifest_last = manifest_last
        writer.created_dir, writer.created_manifest = created_dir, not resumed
        return writer

    def finish(self) -> Path:
        """Write the manifest (a store with no shard yet, or a `manifest_last` one, gets it only here)."""
        write_manifest(self.out_dir, self.meta)
        self.pending.clear()
        write_pending(self.out_dir, self.pending)
        return self.out_dir

    def abort(self) -> None:
        """Remove what this writer created and nothing else: the shards it wrote, its temporaries, the manifest
        when it started the store, and the folder when it made it and it is left empty."""
        for shard in self.created_files:
            shard.unlink(missing_ok=True)
            shard.with_name(shard.name + ".tmp").unlink(missing_ok=True)
        (self.out_dir / (MANIFEST + ".tmp")).unlink(missing_ok=True)
        self.pending.clear()
        write_pending(self.out_dir, self.pending)
        if self.created_manifest:
            (self.out_dir / MANIFEST).unlink(missing_ok=True)
            self.meta["shards"] = []
        self.created_files.clear()
        if self.created_dir and self.out_dir.is_dir() and not any(self.out_dir.iterdir()):
            self.out_dir.rmdir()

    def done_shards(self) -> int:
        return len(self.meta["shards"])

    def write_shard(
        self, sequences: Sequence[torch.Tensor], topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
        packed_rows: np.ndarray | None = None, samples: tuple | None = None, rollouts: dict | None = None,
        labels: Sequence[Sequence[int]] | None = None,
    ) -> None:  # fmt: skip
        """One shard: `sequences` (token id tensors), and the positions' top-k concatenated in the same order.

        packed_rows: for a packed store, rows already encoded with this store's codec (e.g. copied from another
        packed store); they replace encoding `topk_logprobs`, and `topk_ids` is still checked against the vocab.
        samples: (ids, counts, logprobs), each (positions, m), for a store of sampled teacher tokens (samples.py);
        with top_k 0 the top-k arrays are (positions, 0) and not written.
        rollouts: {labels, behaviour_logprobs, teacher_token_logprobs}, each (positions,), for a store of the
        student's rollouts (rollouts.py).
        labels: one list per sequence, each token itself or -100 (not scored), for a store opened with labels=True
        (labels.py).
        """
        index = self.done_shards()
        k, vocab = self.meta["top_k"], self.meta["vocab_size"]
        where = f"shard {index}"
        seqs = _checked_sequences(sequences, where, vocab)
        if any(s.ndim != 1 for s in seqs):
            raise ValueError(f"{where}: every sequence must be a flat list of token ids")
        lengths = np.array([len(s) for s in seqs], dtype=np.int64)
        offsets = np.concatenate([np.zeros(1, dtype=np.int64), lengths.cumsum()])
        if tuple(topk_ids.shape) != (int(offsets[-1]), k) or tuple(topk_logprobs.shape) != tuple(topk_ids.shape):
            raise ValueError(
                f"{where}: top-k arrays {tuple(topk_ids.shape)} / {tuple(topk_logprobs.shape)} != (positions "
                f"{int(offsets[-1])}, top_k {k}): pass one row of top_k slots per token"
            )
        try:
            checked = token_ids(topk_ids, f"{where}: teacher ids", vocab_size=vocab, padding=True)
        except ValueError as e:
            raise ValueError(f"{e} (wrong vocab_size for this teacher?)") from None
        topk_ids = torch.from_numpy(checked.astype(np.int32))
        max_id = int(checked.max()) if checked.size else -1
        if not torch.is_tensor(topk_logprobs) or not topk_logprobs.is_floating_point():
            raise ValueError(f"{where}: teacher log-probs must be a float tensor; got {type(topk_logprobs).__name__}")
        lp = topk_logprobs.float()
        if torch.isnan(lp).any():
            raise ValueError(f"{where}: teacher log-probs contain NaN; check the teacher's dtype and inputs")
        if torch.isposinf(lp).any():
            raise ValueError(f"{where}: teacher log-probs contain +inf; a log-prob is at most 0")
        input_ids = torch.from_numpy(np.concatenate(seqs).astype(np.int32) if seqs else np.zeros(0, np.int32))
        tensors = {"input_ids": input_ids, "offsets": torch.from_numpy(offsets)}
        codec = codec_from_manifest(self.meta)
        logprob_dtype = LOGPROB_DTYPES[self.meta.get("logprob_dtype", "float32")]  # _check_store_options' default
        if samples_of(self.meta):
            tensors.update(sample_tensors(self.meta, codec, int(offsets[-1]), samples, logprob_dtype, where))
            sampled = torch.as_tensor(samples[0])
            max_id = max(max_id, int(sampled.max()) if sampled.numel() else -1)
        elif samples is not None:
            raise ValueError(f"{where}: samples given, but this store holds none: open it with samples=m")
        if rollouts_of(self.meta) is not None:
            tensors.update(rollout_tensors(self.meta, rollouts, int(offsets[-1]), where))
        elif rollouts is not None:
            raise ValueError(f"{where}: rollouts given, but this store holds none: open it with rollouts={{...}}")
        if labels_of(self.meta):
            tensors["labels"] = label_tensor(labels, seqs, where)
        elif labels is not None:
            raise ValueError(f"{where}: labels given, but this store holds none: open it with labels=True")
        if k == 0:
            pass  # sampled tokens alone: no top-k arrays
        elif codec is None:
            tensors["topk_ids"] = topk_ids.to(torch.int32).contiguous()
            tensors["topk_logprobs"] = topk_logprobs.to(logprob_dtype).contiguous()
        else:
            rows = codec.encode(topk_ids.numpy(), lp.numpy()) if packed_rows is None else np.asarray(packed_rows)
            if rows.shape != (int(offsets[-1]), codec.row_bytes):
                raise ValueError(f"{where}: packed_rows {rows.shape} != (positions {int(offsets[-1])}, row bytes "
                                 f"{codec.row_bytes} of this store's encoding): encode them with this store's codec")
            tensors["topk_packed"] = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.uint8))
        as_bytes = {name: _byte_rows(t) for name, t in tensors.items() if name != "offsets"}
        tensors["checksums"] = torch.from_numpy(sequence_checksums(offsets, as_bytes))
        name = f"shard-{index:05d}.safetensors"
        tmp = self.out_dir / (name + ".tmp")
        save_file(tensors, str(tmp), metadata=MARK)
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
        self.pending[name] = entry["sha256"]  # recorded before the rename: a rerun after a kill knows it as its own
        write_pending(self.out_dir, self.pending)
        os.replace(tmp, self.out_dir / name)
        self.created_files.append(self.out_dir / name)
        self.meta["shards"].append(entry)
        if not self.manifest_last:
            write_manifest(self.out_dir, self.meta)
            self.pending.clear()  # the manifest lists it now
            write_pending(self.out_dir, self.pending)


_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _checked_sequences(sequences: Sequence[Any], where: str, vocab: int) -> list[np.ndarray]:
    """Each sequence's ids as int64 (token_ids), checked in one pass when all are 1-d integer tensors (what the
    rollout writer passes: no work per sequence), else one by one; an error names the sequence either way."""
    if len(sequences) and all(torch.is_tensor(s) and s.ndim == 1 and s.dtype in _INTEGER_DTYPES for s in sequences):
        try:
            flat = token_ids(torch.cat(list(sequences)), where, vocab_size=vocab)
        except ValueError:
            pass  # the check one sequence at a time names the sequence
        else:
            return np.split(flat, np.cumsum([len(s) for s in sequences])[:-1])
    return [token_ids(s, f"{where}, sequence {j}: input_ids", vocab_size=vocab) for j, s in enumerate(sequences)]


def _byte_rows(t: torch.Tensor) -> np.ndarray:
    """A tensor's rows as raw bytes (rows x row_bytes uint8), bf16 included (numpy has no bf16)."""
    flat = t.contiguous().reshape(t.shape[0], math.prod(t.shape[1:]))  # not -1: a shard may hold no positions
    return flat.view(torch.uint8).numpy() if flat.numel() else np.zeros((t.shape[0], 0), dtype=np.uint8)
