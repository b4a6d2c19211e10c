"""Sampled teacher tokens in a store (teacher/sampling.py makes them, losses.fused_linear_sampled_kd
reads them). A store that holds them has the manifest key `samples` (m, the draws per position and the slots
per row), `sample_seed`, and `temperature`, the temperature the draws were made at (every log-prob of such a
store, the hybrid's top-k included, is at that temperature); `top_k` is 0 for draws alone, else the hybrid's
exact top-k. Each shard then also holds, per position, m slots:
    sample_ids (int32) + sample_logprobs (the store's dtype)   ("plain"), or
    sample_packed (uint8, the top-k's PackedCodec for m slots)  ("packed<bits>"), and
    sample_counts (uint8: m <= 255 draws)
Padding slots: id -1, log-prob -inf, count 0. Such stores are format 3: a reader that knows only format 2 refuses
them instead of silently training on their top-k alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...batch.columns import TEACHER_SAMPLE_COUNTS, TEACHER_SAMPLE_IDS, TEACHER_SAMPLE_LOGPROBS
from ...wire.sampled_tokens import MAX_SAMPLES
from .compact import PackedCodec
from .ids import token_ids

SAMPLED_FORMAT_VERSION = 3


def samples_of(meta: dict) -> int:
    """m, the draws per position of a store (0: a top-k store without samples)."""
    return meta.get("samples") or 0


def min_top_k(meta: dict) -> int:
    """The least top_k a manifest may hold: 0 with samples (draws alone), else 1."""
    return 0 if samples_of(meta) else 1


def sample_option_problem(meta: dict) -> str | None:
    """What is wrong with a manifest's sample options (the fix included), or None."""
    m = meta.get("samples")
    if m is None:
        return None
    if not isinstance(m, int) or isinstance(m, bool) or not 1 <= m <= MAX_SAMPLES:
        return f"samples must be an integer in [1, {MAX_SAMPLES}] (draws per position, --samples); got {m!r}"
    seed = meta.get("sample_seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        return f"sample_seed must be an integer >= 0 (--seed); got {seed!r}"
    if meta["top_k"] + m > meta["vocab_size"]:
        return f"top_k {meta['top_k']} + samples {m} exceed vocab_size {meta['vocab_size']}"
    return None


def sample_codec(meta: dict, codec: PackedCodec | None) -> PackedCodec | None:
    """The samples' codec: the store's packed encoding for m slots (None: plain)."""
    return None if codec is None else PackedCodec(meta["vocab_size"], samples_of(meta), codec.logprob_bits)


def sample_tensors(
    meta: dict, codec: PackedCodec | None, positions: int, samples: Any, logprob_dtype: torch.dtype, where: str
) -> dict:
    """The shard arrays of `samples` = (ids, counts, logprobs), each (positions, m); ValueError naming the problem."""
    m = samples_of(meta)
    if samples is None:
        raise ValueError(f"{where}: this store holds {m} sampled teacher tokens per position: pass samples=...")
    ids, counts, logprobs = (torch.as_tensor(t) for t in samples)
    for name, t in (("ids", ids), ("counts", counts), ("logprobs", logprobs)):
        if tuple(t.shape) != (positions, m):
            raise ValueError(f"{where}: sample {name} {tuple(t.shape)} != (positions {positions}, samples {m})")
    checked = token_ids(ids, f"{where}: sampled teacher ids", vocab_size=meta["vocab_size"], padding=True)
    if counts.numel() and (int(counts.min()) < 0 or int(counts.max()) > MAX_SAMPLES):
        raise ValueError(f"{where}: sample counts must be in [0, {MAX_SAMPLES}]")
    lp = logprobs.float()
    if torch.isnan(lp).any() or torch.isposinf(lp).any():
        raise ValueError(f"{where}: sampled teacher log-probs contain NaN or +inf; check the teacher's dtype")
    out = {"sample_counts": counts.to(torch.uint8).contiguous()}
    scodec = sample_codec(meta, codec)
    if scodec is None:
        out["sample_ids"] = torch.from_numpy(checked.astype(np.int32))
        out["sample_logprobs"] = logprobs.to(logprob_dtype).contiguous()
    else:
        out["sample_packed"] = torch.from_numpy(scodec.encode(checked, lp.numpy()))
    return out


def sample_layout(meta: dict, codec: PackedCodec | None, positions: int) -> dict:
    """{array: (allowed safetensors dtypes, shape)} the samples of a shard must have (empty without samples)."""
    m = samples_of(meta)
    if not m:
        return {}
    want = {"sample_counts": (("U8",), (positions, m))}
    scodec = sample_codec(meta, codec)
    if scodec is None:
        want["sample_ids"] = (("I32",), (positions, m))
        want["sample_logprobs"] = (("BF16", "F16", "F32"), (positions, m))
    else:
        want["sample_packed"] = (("U8",), (positions, scodec.row_bytes))
    return want


def sample_item(meta: dict, codec: PackedCodec | None, raw: dict, dtype: torch.dtype | None, n: int) -> dict:
    """A store item's sample columns from a sequence's raw rows: teacher_sample_ids (int32), _counts (int32),
    _logprobs (the store's dtype, or float32 when packed)."""
    m = samples_of(meta)
    counts = torch.from_numpy(raw["sample_counts"].reshape(n, m).astype(np.int32))
    scodec = sample_codec(meta, codec)
    if scodec is None:
        ids = torch.from_numpy(raw["sample_ids"].view(np.int32).reshape(n, m))
        lp = torch.from_numpy(raw["sample_logprobs"]).view(dtype).reshape(n, m)
    else:
        ids, lp = (torch.from_numpy(a) for a in scodec.decode(raw["sample_packed"]))
    return {TEACHER_SAMPLE_IDS: ids, TEACHER_SAMPLE_COUNTS: counts, TEACHER_SAMPLE_LOGPROBS: lp}
