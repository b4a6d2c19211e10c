"""Inference engines' dumped log-probs (vLLM, SGLang) converted into a store. The per-position parsing is
wire/protocols.py's, shared with the client that asks live servers."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...wire.protocols import TeacherReplyError, rows_from_entries, sglang_entry, vllm_entry
from ..store import StoreWriter, TeacherStoreError
from ..store.ids import token_ids
from .common import converting


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

    def split(record: dict) -> tuple[list[int], list]:
        tokens = list(record["prompt_token_ids"]) + list(record.get("output_token_ids", []))
        return tokens, list(record["prompt_logprobs"])[1:] + list(record.get("output_logprobs", []))

    return _import(records, out_dir, split, vllm_entry, vocab_size=vocab_size, top_k=top_k, source="vllm", **meta)


def import_sglang_logprobs(
    records: Iterable[dict], out_dir: str | Path, *, vocab_size: int, top_k: int, **meta: Any
) -> Path:
    """Convert SGLang /generate replies into a store.

    Each record: {"input_ids": [...], "meta_info": {"input_top_logprobs": [null, [[logprob, id, text], ...], ...]}}
    (a /generate reply with its input_ids, asked with return_logprob, logprob_start_len 0, top_logprobs_num) and
    optionally the completion: "output_ids" with meta_info.output_top_logprobs. Entry t scores token t, so it
    becomes row t - 1; short rows are padded, long ones keep the top_k most likely.
    """

    def split(record: dict) -> tuple[list[int], list]:
        info = record["meta_info"]
        tokens = list(record["input_ids"]) + list(record.get("output_ids", []))
        return tokens, list(info["input_top_logprobs"])[1:] + list(info.get("output_top_logprobs") or [])

    return _import(records, out_dir, split, sglang_entry, vocab_size=vocab_size, top_k=top_k, source="sglang", **meta)


def _import(
    records: Iterable[dict], out_dir: str | Path, split: Callable[[dict], tuple[list[int], list]],
    parse_entry: Callable, *, vocab_size: int, top_k: int, source: str, **meta: Any,
) -> Path:  # fmt: skip
    """records -> (tokens, per-position entries scoring tokens 1..) -> a store, shard by shard."""
    writer = StoreWriter.open(
        out_dir, teacher=meta.get("teacher", source), vocab_size=vocab_size, top_k=top_k, manifest_last=True,
        tokenizer_fingerprint=meta.get("tokenizer_fingerprint"), logprob_dtype=meta.get("logprob_dtype", "float32"),
        temperature=1.0, shard_size=meta.get("shard_size", 1024), num_sequences=None,
    )  # fmt: skip
    if writer.done_shards():
        raise TeacherStoreError(f"{out_dir} already holds shards: import into a new folder")
    sequences, ids, values = [], [], []

    def flush():
        if sequences:
            writer.write_shard(sequences, torch.cat(ids), torch.cat(values))
            sequences.clear(), ids.clear(), values.clear()

    with converting(writer):
        for n, record in enumerate(records):
            try:
                tokens, per_position = split(record)
            except (KeyError, TypeError, AttributeError) as e:
                raise TeacherStoreError(f"record {n} is not a {source} record (missing or malformed field: "
                                        f"{str(e)[:80]}); see import_{source}_logprobs for the layout") from None
            try:
                checked = token_ids(tokens, f"record {n}: token ids", vocab_size=vocab_size).reshape(-1)
            except ValueError as e:
                raise TeacherStoreError(str(e)) from None
            try:
                entries = [parse_entry(e, t, f"record {n}") if e else None for t, e in enumerate(per_position, 1)]
                rows_i, rows_v = rows_from_entries(
                    entries[: max(len(tokens) - 1, 0)], len(tokens), top_k=top_k, vocab_size=vocab_size,
                    request=f"record {n}", pad_short_rows=True,
                )  # fmt: skip
            except TeacherReplyError as e:
                raise TeacherStoreError(str(e)) from e
            sequences.append(torch.from_numpy(checked.astype(np.int32)))
            ids.append(rows_i)
            values.append(rows_v)
            if len(sequences) == writer.meta["shard_size"]:
                flush()
        flush()
    return writer.out_dir
