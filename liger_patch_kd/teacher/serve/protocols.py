"""Inference-engine replies -> row-aligned teacher top-k, and the requests that ask for them. Pure functions, no I/O.

Every parser returns (ids (T, K) int32, log-probs (T, K) float32) for a sequence of T tokens, aligned like logits:
row t scores token t + 1; the last row, which predicts nothing in the sequence, is padding (id -1, log-prob -inf).
Engines report log-probs at temperature 1 (tempering them is exact and done by the loss). Each reply is checked:
its number of positions, every id in [0, vocab_size), no NaN; errors name the request.

- vLLM (and `trl vllm-serve`, which runs vLLM's own server): POST /v1/completions {"prompt": [[ids], ...],
  "max_tokens": 1, "prompt_logprobs": K}; choices[i].prompt_logprobs is a list over prompt positions, the first
  null, of {"<token id>": {"logprob", "rank", "decoded_token"}}, with K + 1 entries where the prompt token itself
  is outside the top K (it is dropped here: the K most likely are kept).
- SGLang: POST /generate {"input_ids": [[ids], ...], "return_logprob": true, "logprob_start_len": 0,
  "top_logprobs_num": K}; meta_info.input_top_logprobs is a list over prompt positions, the first null, of
  [logprob, token id, text or null] triples.
- liger: the vLLM request with `Accept: application/octet-stream`, answered by `liger-kd serve` with the arrays
  themselves (see encode_binary); a few hundred times cheaper to decode than the JSON.

`PROTOCOLS` is the registry of these wire formats (name -> WireFormat) the client and the Trainer's checks read.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...conventions import LOGPROB_PLACEHOLDER

TopK = tuple[torch.Tensor, torch.Tensor]
BINARY_MEDIA_TYPE = "application/octet-stream"
_MAGIC = b"LKD1"
_HEADER = struct.Struct("<4sII")  # magic, number of sequences, K


class TeacherReplyError(ValueError):
    """A reply that does not fit the request (length, ids, NaN, shape); the message names the request."""


# ------------------------------------------------------------------------------------------------ requests
def vllm_request(sequences: Sequence[Sequence[int]], top_k: int, model: str) -> dict[str, Any]:
    """The /v1/completions body scoring `sequences` (token ids), one choice per sequence, at temperature 1."""
    return {
        "model": model, "prompt": [list(map(int, s)) for s in sequences], "max_tokens": 1, "temperature": 1.0,
        "prompt_logprobs": top_k,
    }  # fmt: skip


def sglang_request(sequences: Sequence[Sequence[int]], top_k: int) -> dict[str, Any]:
    """The /generate body: log-probs of every prompt position (logprob_start_len 0), raw ids, no text."""
    return {
        "input_ids": [list(map(int, s)) for s in sequences], "return_logprob": True, "logprob_start_len": 0,
        "top_logprobs_num": top_k, "return_text_in_logprobs": False,
        "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------- parsers
def parse_vllm_prompt_logprobs(
    prompt_logprobs: Sequence[dict | None] | None, num_tokens: int, *, top_k: int, vocab_size: int, request: str,
) -> TopK:  # fmt: skip
    """One vLLM choice's prompt_logprobs for a prompt of `num_tokens` tokens -> (T, K) ids and log-probs."""
    entries = _prompt_positions(prompt_logprobs, num_tokens, request, "prompt_logprobs")
    return rows_from_entries([vllm_entry(e, t, request) for t, e in enumerate(entries, 1)], num_tokens,
                             top_k=top_k, vocab_size=vocab_size, request=request)  # fmt: skip


def parse_vllm_reply(
    reply: dict, sequences: Sequence[Sequence[int]], *, top_k: int, vocab_size: int, request: str
) -> list[TopK]:
    """A whole /v1/completions reply (choices in any order, matched by their index) -> one TopK per sequence."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or len(choices) != len(sequences):
        got = len(choices) if isinstance(choices, list) else "no"
        raise TeacherReplyError(f"{request}: the reply has {got} choices for {len(sequences)} prompts")
    by_index = sorted(choices, key=lambda c: c.get("index", 0))
    return [
        parse_vllm_prompt_logprobs(
            c.get("prompt_logprobs"), len(seq), top_k=top_k, vocab_size=vocab_size, request=f"{request} prompt {i}"
        )  # fmt: skip
        for i, (c, seq) in enumerate(zip(by_index, sequences))
    ]


def parse_sglang_input_top_logprobs(
    input_top_logprobs: Sequence[Sequence | None] | None, num_tokens: int, *, top_k: int, vocab_size: int,
    request: str,
) -> TopK:  # fmt: skip
    """One SGLang meta_info.input_top_logprobs for a prompt of `num_tokens` tokens -> (T, K) ids and log-probs."""
    entries = _prompt_positions(input_top_logprobs, num_tokens, request, "input_top_logprobs")
    return rows_from_entries([sglang_entry(e, t, request) for t, e in enumerate(entries, 1)], num_tokens,
                             top_k=top_k, vocab_size=vocab_size, request=request)  # fmt: skip


def parse_sglang_reply(
    reply: Any, sequences: Sequence[Sequence[int]], *, top_k: int, vocab_size: int, request: str
) -> list[TopK]:
    """A /generate reply (one object, or a list for a batch of prompts) -> one TopK per sequence."""
    items = reply if isinstance(reply, list) else [reply]
    if len(items) != len(sequences):
        raise TeacherReplyError(f"{request}: the reply has {len(items)} results for {len(sequences)} prompts")
    out = []
    for i, (item, seq) in enumerate(zip(items, sequences)):
        meta = item.get("meta_info") if isinstance(item, dict) else None
        if not isinstance(meta, dict) or "input_top_logprobs" not in meta:
            raise TeacherReplyError(
                f"{request} prompt {i}: no meta_info.input_top_logprobs in the reply; the server needs "
                f"return_logprob, logprob_start_len 0 and top_logprobs_num"
            )
        out.append(parse_sglang_input_top_logprobs(meta["input_top_logprobs"], len(seq), top_k=top_k,
                                                   vocab_size=vocab_size, request=f"{request} prompt {i}"))  # fmt: skip
    return out


def rows_from_entries(
    rows: Sequence[Iterable[tuple[int, float, int | None]] | None], num_tokens: int, *, top_k: int, vocab_size: int,
    request: str, pad_short_rows: bool = False,
) -> TopK:  # fmt: skip
    """Per scoring position t (scores token t + 1), its (token id, log-prob, rank or None) entries -> (T, K) arrays.

    The top_k most likely entries are kept (ties broken by rank). A row with fewer than top_k entries is an error
    (the server was asked for top_k), unless `pad_short_rows`, which pads it (-1, -inf) as imports of partial
    data need. `rows` may be shorter than T - 1 only when `pad_short_rows`; log-probs at or below
    LOGPROB_PLACEHOLDER (vLLM writes -9999.0 for -inf) become -inf.
    """
    if len(rows) > num_tokens - 1 or (len(rows) < num_tokens - 1 and not pad_short_rows):
        raise TeacherReplyError(f"{request}: {len(rows)} scored positions for a sequence of {num_tokens} tokens")
    ids = [[-1] * top_k for _ in range(num_tokens)]
    values = [[-math.inf] * top_k for _ in range(num_tokens)]
    for t, entry in enumerate(rows):
        kept = sorted(entry or (), key=_by_logprob_then_rank)[:top_k]
        if len(kept) < top_k and not pad_short_rows:
            raise TeacherReplyError(
                f"{request}: position {t + 1} has {len(kept)} log-probs, fewer than top_k={top_k}; ask the server "
                f"for at least {top_k} (vLLM: --max-logprobs)"
            )
        for j, (tok, lp, _) in enumerate(kept):
            ids[t][j] = tok
            values[t][j] = -math.inf if lp <= LOGPROB_PLACEHOLDER else lp
    out_ids = torch.tensor(ids, dtype=torch.int32).reshape(num_tokens, top_k)
    out_values = torch.tensor(values, dtype=torch.float32).reshape(num_tokens, top_k)
    check_topk(out_ids, out_values, vocab_size=vocab_size, request=request)
    return out_ids, out_values


def check_topk(ids: torch.Tensor, values: torch.Tensor, *, vocab_size: int, request: str) -> None:
    """ids < vocab_size (negative: padding), no NaN."""
    bad = (ids >= vocab_size) | (ids < -1)
    if bad.any():
        t, j = bad.nonzero()[0].tolist()
        raise TeacherReplyError(
            f"{request}: token id {int(ids[t, j])} at row {t} is outside vocab_size {vocab_size}: the teacher has "
            f"another vocabulary than the student"
        )
    if torch.isnan(values).any():
        t = int(torch.isnan(values).any(-1).nonzero()[0])
        raise TeacherReplyError(f"{request}: NaN log-prob at row {t}; check the teacher's dtype and inputs")


def _prompt_positions(entries: Sequence | None, num_tokens: int, request: str, field: str) -> Sequence:
    if not isinstance(entries, list):
        raise TeacherReplyError(f"{request}: {field} is {type(entries).__name__}, not a list over prompt positions")
    if len(entries) != num_tokens:
        raise TeacherReplyError(f"{request}: {field} has {len(entries)} positions for a prompt of {num_tokens} tokens")
    if num_tokens and entries[0] is not None:
        raise TeacherReplyError(f"{request}: {field}[0] should be null (nothing scores the first token)")
    for t, entry in enumerate(entries[1:], 1):
        if entry is None:
            raise TeacherReplyError(f"{request}: {field}[{t}] is null; only the first position may be")
    return entries[1:]


def vllm_entry(entry: Any, t: int, request: str) -> list[tuple[int, float, int | None]]:
    """One position of vLLM's prompt_logprobs ({"<id>": {"logprob", "rank", ...}} or {"<id>": logprob})."""
    if not isinstance(entry, dict):
        raise TeacherReplyError(f"{request}: prompt_logprobs[{t}] is {type(entry).__name__}, not {{token_id: ...}}")
    try:
        return [
            (int(tok), float(v["logprob"]), v.get("rank")) if isinstance(v, dict) else (int(tok), float(v), None)
            for tok, v in entry.items()
        ]
    except (KeyError, TypeError, ValueError) as err:
        raise TeacherReplyError(f"{request}: prompt_logprobs[{t}] is malformed: {err!r}") from err


def sglang_entry(entry: Any, t: int, request: str) -> list[tuple[int, float, int | None]]:
    """One position of SGLang's input/output_top_logprobs: [[logprob, token id, text or null], ...]."""
    if not isinstance(entry, (list, tuple)):
        raise TeacherReplyError(f"{request}: top_logprobs[{t}] is {type(entry).__name__}, not a list")
    try:
        return [(int(e[1]), float(e[0]), None) for e in entry]
    except (TypeError, ValueError, IndexError) as err:
        raise TeacherReplyError(
            f"{request}: top_logprobs[{t}] holds {list(entry)[:2]!r}..., not [logprob, token id, text] triples"
        ) from err


def _by_logprob_then_rank(entry: tuple[int, float, int | None]) -> tuple[float, float]:
    lp = entry[1]
    # NaN sorts first so check_topk sees it; a missing rank sorts after any given one
    return (-math.inf if math.isnan(lp) else -lp, math.inf if entry[2] is None else entry[2])


# ------------------------------------------------------------------------------------------- binary replies
def encode_binary(topks: Sequence[TopK]) -> bytes:
    """Row-aligned top-k of several sequences -> bytes: header (magic, n, K), n uint32 lengths, then all ids (int32)
    and all log-probs (float32), little-endian, sequences concatenated."""
    k = topks[0][0].shape[-1] if topks else 0
    lengths = [int(i.shape[0]) for i, _ in topks]
    ids = torch.cat([i.to(torch.int32) for i, _ in topks]) if topks else torch.zeros(0, k, dtype=torch.int32)
    values = torch.cat([v.to(torch.float32) for _, v in topks]) if topks else torch.zeros(0, k)
    return b"".join([
        _HEADER.pack(_MAGIC, len(topks), k), struct.pack(f"<{len(lengths)}I", *lengths),
        ids.contiguous().numpy().tobytes(), values.contiguous().numpy().tobytes(),
    ])  # fmt: skip


def decode_binary(
    blob: bytes, sequences: Sequence[Sequence[int]], *, top_k: int, vocab_size: int, request: str
) -> list[TopK]:
    """encode_binary's bytes -> one TopK per sequence, checked against the request like the JSON replies."""
    if len(blob) < _HEADER.size or blob[:4] != _MAGIC:
        raise TeacherReplyError(f"{request}: not a liger binary reply (starts {blob[:16]!r})")
    _, n, k = _HEADER.unpack_from(blob)
    if n != len(sequences) or k != top_k:
        raise TeacherReplyError(
            f"{request}: binary reply for {n} sequences of top-{k}; asked {len(sequences)}, {top_k}"
        )
    lengths = struct.unpack_from(f"<{n}I", blob, _HEADER.size)
    want = [len(s) for s in sequences]
    if list(lengths) != want:
        raise TeacherReplyError(f"{request}: binary reply lengths {list(lengths)} != the prompts' {want}")
    rows, start = sum(lengths), _HEADER.size + 4 * n
    if len(blob) != start + 8 * rows * k:
        raise TeacherReplyError(f"{request}: binary reply of {len(blob)} bytes; expected {start + 8 * rows * k}")
    buffer = bytearray(blob)  # torch.frombuffer wants a writable buffer
    ids = torch.frombuffer(buffer, dtype=torch.int32, count=rows * k, offset=start).reshape(rows, k)
    values = torch.frombuffer(buffer, dtype=torch.float32, count=rows * k, offset=start + 4 * rows * k)
    values = values.reshape(rows, k)
    check_topk(ids, values, vocab_size=vocab_size, request=request)
    return list(zip(ids.split(list(lengths)), values.split(list(lengths))))


# ------------------------------------------------------------------------------------------------ registry
@dataclass(frozen=True)
class WireFormat:
    """One server protocol: the path to POST to, the media type to accept, the request body for (sequences, top_k,
    a function giving the served model's name, called only by protocols that need it) and the JSON reply's parser
    (replies in BINARY_MEDIA_TYPE are decode_binary's, whatever the protocol)."""

    path: str
    accept: str
    request: Callable[[Sequence[Sequence[int]], int, Callable[[], str]], dict[str, Any]]
    parse_reply: Callable[..., list[TopK]]


def _vllm_body(sequences: Sequence[Sequence[int]], top_k: int, model_name: Callable[[], str]) -> dict[str, Any]:
    return vllm_request(sequences, top_k, model_name())


def _sglang_body(sequences: Sequence[Sequence[int]], top_k: int, model_name: Callable[[], str]) -> dict[str, Any]:
    return sglang_request(sequences, top_k)


PROTOCOLS: dict[str, WireFormat] = {
    "vllm": WireFormat("/v1/completions", "application/json", _vllm_body, parse_vllm_reply),
    "sglang": WireFormat("/generate", "application/json", _sglang_body, parse_sglang_reply),
    "liger": WireFormat("/v1/completions", BINARY_MEDIA_TYPE, _vllm_body, parse_vllm_reply),
}
