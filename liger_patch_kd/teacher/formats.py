"""Teacher log-probs in other tools' formats, converted into a store."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..reference import LOGPROB_PLACEHOLDER
from .store import StoreWriter, TeacherStoreError


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
