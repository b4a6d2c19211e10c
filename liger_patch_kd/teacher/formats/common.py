"""What the converters share: opening the store a conversion writes, ragged rows to store arrays, writing the
pending sequences as a shard, and the optional `datasets` import."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..store import StoreWriter, TeacherStoreError


def import_datasets():
    """The `datasets` package, or an ImportError saying how to install it."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError('this needs the `datasets` package: pip install "liger-patch-kd[formats]"') from e
    return datasets


def rows_to_arrays(
    input_ids, ids, logprobs, top_k: int, vocab_size: int, where: str, mask=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's (T,), (T, top_k) int32 and (T, top_k) float32 arrays from ragged per-position lists.

    Positions past the lists' end and slots past a row's end (or with mask 0) become padding (-1, -inf); a row
    longer than top_k keeps its top_k largest log-probs."""
    seq = torch.as_tensor(np.asarray(input_ids, dtype=np.int64))
    n = len(seq)
    if len(ids) != len(logprobs) or len(ids) > n:
        raise TeacherStoreError(
            f"{where}: {len(ids)} id rows and {len(logprobs)} log-prob rows for {n} tokens; expected equal counts, "
            f"at most one per token"
        )
    out_ids = np.full((n, top_k), -1, dtype=np.int32)
    out_lp = np.full((n, top_k), -np.inf, dtype=np.float32)
    for t in range(len(ids)):  # per position, vectorised over the slots
        i = np.asarray(ids[t], dtype=np.int64).reshape(-1)
        v = np.asarray(logprobs[t], dtype=np.float32).reshape(-1)
        keep = (i >= 0) & np.isfinite(v) if mask is None else np.asarray(mask[t], dtype=bool).reshape(-1) & (i >= 0)
        i, v = i[keep], v[keep]
        if len(i) > top_k:
            order = np.argsort(-v, kind="stable")[:top_k]
            i, v = i[order], v[order]
        if len(i) and (i.max() >= vocab_size):
            raise TeacherStoreError(f"{where}, position {t}: token id {int(i.max())} >= vocab_size {vocab_size}")
        out_ids[t, : len(i)], out_lp[t, : len(i)] = i, v
    return seq, torch.from_numpy(out_ids), torch.from_numpy(out_lp)


def open_conversion(out_dir: str | Path, default_teacher: str, meta: dict, **store: Any) -> StoreWriter:
    """A new store for a converter (`meta` may name the teacher and the tokenizer's fingerprint). A folder that
    already holds shards is refused: a conversion is not resumed, it is run again into a new folder."""
    writer = StoreWriter.open(
        out_dir, teacher=meta.pop("teacher", default_teacher),
        tokenizer_fingerprint=meta.pop("tokenizer_fingerprint", None), num_sequences=None, **store, **meta,
    )  # fmt: skip
    if writer.done_shards():
        raise TeacherStoreError(f"{out_dir} already holds shards: convert into a new folder")
    return writer


def flush_rows(writer: StoreWriter, pending: list) -> None:
    """Write the pending (input_ids, ids, log-probs) sequences as one shard, then empty the list."""
    if pending:
        writer.write_shard(
            [p[0] for p in pending], torch.cat([p[1] for p in pending]), torch.cat([p[2] for p in pending])
        )
        pending.clear()
