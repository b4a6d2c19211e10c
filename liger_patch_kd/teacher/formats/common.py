"""What the converters share: opening the store a conversion writes, ragged rows to store arrays, writing the
pending sequences as a shard, and the optional `datasets` import."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..store import StoreWriter, TeacherStoreError
from ..store.ids import token_ids

# the formats extra, from the package index and from a clone
INSTALL_FORMATS = 'pip install "liger_patch_kd[formats]" (from a clone: pip install -e ".[formats]")'


def import_datasets():
    """The `datasets` package, or an ImportError saying how to install it."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"this needs the `datasets` package: {INSTALL_FORMATS}") from e
    return datasets


def rows_to_arrays(
    input_ids, ids, logprobs, top_k: int, vocab_size: int, where: str, mask=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's (T,), (T, top_k) int32 and (T, top_k) float32 arrays from ragged per-position lists.

    Positions past the lists' end and slots past a row's end (or with mask 0) become padding (-1, -inf); a row
    longer than top_k keeps its top_k largest log-probs. Every id is checked (an integer in [0, vocab_size), or
    -1 for padding) and every log-prob (a number <= 0, or -inf for padding) before anything is cast: a row that
    breaks a rule is a TeacherStoreError naming the row, the position and the field."""
    try:
        seq = torch.from_numpy(token_ids(input_ids, f"{where}: input_ids", vocab_size=vocab_size))
        if seq.dim() != 1:
            raise ValueError(f"{where}: input_ids must be a flat list of token ids; got shape {tuple(seq.shape)}")
    except ValueError as e:
        raise TeacherStoreError(str(e)) from None
    n = len(seq)
    for name, value in (("ids", ids), ("log-probs", logprobs), ("mask", mask)):
        if value is not None and (isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__")):
            raise TeacherStoreError(f"{where}: the per-position {name} must be a list (one entry per token); got "
                                    f"{type(value).__name__}")  # fmt: skip
    if len(ids) != len(logprobs) or len(ids) > n or (mask is not None and len(mask) != len(ids)):
        raise TeacherStoreError(
            f"{where}: {len(ids)} id rows, {len(logprobs)} log-prob rows"
            + ("" if mask is None else f" and {len(mask)} mask rows")
            + f" for {n} tokens; expected equal counts, at most one per token"
        )
    out_ids = np.full((n, top_k), -1, dtype=np.int32)
    out_lp = np.full((n, top_k), -np.inf, dtype=np.float32)
    for t in range(len(ids)):  # per position, vectorised over the slots
        at = f"{where}, position {t}"
        try:
            i = token_ids(ids[t] if ids[t] is not None else [], f"{at}: ids", vocab_size=vocab_size, padding=True)
        except ValueError as e:
            raise TeacherStoreError(str(e)) from None
        i = i.reshape(-1)
        v = _logprobs(logprobs[t], at)
        if len(i) != len(v):
            raise TeacherStoreError(f"{at}: {len(i)} token ids but {len(v)} log-probs; each id needs its log-prob")
        if mask is None:
            keep = (i >= 0) & np.isfinite(v)
        else:
            m = _mask(mask[t], at)
            if len(m) != len(i):
                raise TeacherStoreError(f"{at}: {len(m)} mask entries for {len(i)} token ids")
            keep = m & (i >= 0)
        i, v = i[keep], v[keep]
        if len(i) > top_k:
            order = np.argsort(-v, kind="stable")[:top_k]
            i, v = i[order], v[order]
        out_ids[t, : len(i)], out_lp[t, : len(i)] = i, v
    return seq, torch.from_numpy(out_ids), torch.from_numpy(out_lp)


LOGPROB_SLACK = 1e-3  # rounding may leave a top log-prob a hair above 0; beyond this it is no log-prob


def _logprobs(values, where: str) -> np.ndarray:
    """A position's log-probs as float32, each a number <= 0 or -inf (padding); TeacherStoreError otherwise."""
    try:
        raw = np.asarray(values if values is not None else [])
    except (ValueError, TypeError) as e:
        raise TeacherStoreError(f"{where}: log-probs are not a list of numbers ({str(e).splitlines()[0]})") from None
    if raw.dtype.kind not in "iuf" and not (raw.dtype.kind == "O" and raw.size == 0):
        raise TeacherStoreError(f"{where}: log-probs must be numbers; got {raw.dtype} values")
    v = raw.astype(np.float64).reshape(-1)
    if np.isnan(v).any() or (v > LOGPROB_SLACK).any():
        bad = v[np.isnan(v) | (v > LOGPROB_SLACK)][0]
        raise TeacherStoreError(f"{where}: log-prob {bad} at slot {int(np.argmax(np.isnan(v) | (v > LOGPROB_SLACK)))}"
                                f" is not a log-prob (a number <= 0, -inf for padding): is this column "
                                f"probabilities or logits?")  # fmt: skip
    return v.astype(np.float32)


def _mask(values, where: str) -> np.ndarray:
    raw = np.asarray(values if values is not None else [])
    if raw.dtype.kind not in "iub" or not np.isin(raw, (0, 1)).all():
        raise TeacherStoreError(f"{where}: target_mask entries must be 0 or 1")
    return raw.astype(bool).reshape(-1)


def open_conversion(out_dir: str | Path, default_teacher: str, meta: dict, **store: Any) -> StoreWriter:
    """A new store for a converter (`meta` may name the teacher and the tokenizer's fingerprint). A folder that
    already holds shards is refused: a conversion is not resumed, it is run again into a new folder. The manifest
    is written last (`finish_conversion`), so a failed or killed conversion never leaves a store that reads as
    finished; use `with converting(writer):` to have a failure remove what it wrote."""
    writer = StoreWriter.open(
        out_dir, teacher=meta.pop("teacher", default_teacher), manifest_last=True,
        tokenizer_fingerprint=meta.pop("tokenizer_fingerprint", None), num_sequences=None, **store, **meta,
    )  # fmt: skip
    if writer.done_shards():
        raise TeacherStoreError(f"{out_dir} already holds shards: convert into a new folder")
    return writer


@contextmanager
def converting(writer: StoreWriter):
    """Run a conversion into `writer`: on success the manifest is written (last); on any failure everything this
    conversion wrote (and only that) is removed, and the error propagates."""
    try:
        yield writer
    except BaseException:
        writer.abort()
        raise
    writer.finish()


def flush_rows(writer: StoreWriter, pending: list) -> None:
    """Write the pending (input_ids, ids, log-probs[, (sample ids, counts, log-probs)]) sequences as one shard,
    then empty the list."""
    if pending:
        samples = tuple(torch.cat(part) for part in zip(*(p[3] for p in pending))) if len(pending[0]) > 3 else None
        writer.write_shard(
            [p[0] for p in pending], torch.cat([p[1] for p in pending]), torch.cat([p[2] for p in pending]),
            samples=samples,
        )  # fmt: skip
        pending.clear()


def field(row: Any, name: str, where: str) -> Any:
    """row[name], or a TeacherStoreError naming the row, the field and the fields it has."""
    if not isinstance(row, dict):
        try:
            row = dict(row)
        except (TypeError, ValueError):
            raise TeacherStoreError(f"{where} is a {type(row).__name__}, not a record of named fields") from None
    if name not in row:
        raise TeacherStoreError(f"{where} has no field {name!r}; it has {sorted(map(str, row))[:12]}")
    return row[name]
