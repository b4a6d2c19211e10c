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

from ..conventions import LOGPROB_PLACEHOLDER

TopK = tuple[torch.Tensor, torch.Tensor]
BINARY_MEDIA_TYPE = "application/octet-stream"
_MAGIC = b"LKD1"
_MAGIC_OWN = b"LKD2"  # LKD1 plus each row's own token (the one it scores), checked against the prompt
_HEADER = struct.Struct("<4sII")  # magic, number of sequences, K


# A reply's top-k probabilities may sum above 1 by rounding only. Float32 log-softmax over logits of magnitude
# <= ~100 is off by ~1e-5 nats at most (the logsumexp's rounding, shared by the row); 1e-3 nats (mass 1.001)
# leaves 100x that, and still refuses everything that is not log-probs at temperature 1: logits, tempered
# log-probs, a row repeated or shifted into a peaked one (e.g. eight log-probs of -0.01: logsumexp 2.07).
MASS_TOLERANCE_NATS = 1e-3


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
    sequence: Sequence[int] | None = None,
) -> TopK:  # fmt: skip
    """One vLLM choice's prompt_logprobs for a prompt of `num_tokens` tokens -> (T, K) ids and log-probs.
    With `sequence` (the prompt), each position must hold the prompt token's own entry (vLLM always sends it)."""
    entries = _prompt_positions(prompt_logprobs, num_tokens, request, "prompt_logprobs")
    rows = [vllm_entry(e, t, request) for t, e in enumerate(entries, 1)]
    if sequence is not None:
        for t, row in enumerate(rows, 1):
            if all(tok != sequence[t] for tok, _, _ in row):
                raise TeacherReplyError(
                    f"{request}: prompt_logprobs[{t}] has no entry for the prompt token {sequence[t]} at that position "
                    f"(ids {[tok for tok, _, _ in row][:8]}): the reply is not aligned with the prompt"
                )
    return rows_from_entries(rows, num_tokens, top_k=top_k, vocab_size=vocab_size, request=request)


def parse_vllm_reply(
    reply: Any, sequences: Sequence[Sequence[int]], *, top_k: int, vocab_size: int, request: str
) -> list[TopK]:
    """A whole /v1/completions reply (choices in any order, matched by their index) -> one TopK per sequence."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or len(choices) != len(sequences):
        got = len(choices) if isinstance(choices, list) else "no"
        raise TeacherReplyError(f"{request}: the reply has {got} choices for {len(sequences)} prompts")
    for n, c in enumerate(choices):
        if not isinstance(c, dict):
            what = type(c).__name__
            raise TeacherReplyError(f"{request}: choices[{n}] is {what}, not an object with prompt_logprobs")
    indices = [c.get("index", n) for n, c in enumerate(choices)]
    if sorted(i if _is_int(i) else -1 for i in indices) != list(range(len(choices))):
        raise TeacherReplyError(f"{request}: the choices' indices {indices[:8]} are not 0 .. {len(choices) - 1}")
    by_index = sorted(zip(indices, choices), key=lambda pair: pair[0])
    return [
        parse_vllm_prompt_logprobs(c.get("prompt_logprobs"), len(seq), top_k=top_k, vocab_size=vocab_size,
                                   request=f"{request} prompt {i}", sequence=seq)  # fmt: skip
        for i, ((_, c), seq) in enumerate(zip(by_index, sequences))
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
    """A /generate reply (one object, or a list for a batch of prompts) -> one TopK per sequence. Where the reply
    holds meta_info.input_token_logprobs (SGLang sends it with return_logprob), its ids must be the prompt's."""
    items = reply if isinstance(reply, list) else [reply]
    if len(items) != len(sequences):
        raise TeacherReplyError(f"{request}: the reply has {len(items)} results for {len(sequences)} prompts")
    out = []
    for i, (item, seq) in enumerate(zip(items, sequences)):
        name = f"{request} prompt {i}"
        meta = item.get("meta_info") if isinstance(item, dict) else None
        if not isinstance(meta, dict) or "input_top_logprobs" not in meta:
            raise TeacherReplyError(
                f"{name}: no meta_info.input_top_logprobs in the reply; the server needs "
                f"return_logprob, logprob_start_len 0 and top_logprobs_num"
            )
        if meta.get("input_token_logprobs") is not None:
            own = _prompt_positions(meta["input_token_logprobs"], len(seq), name, "input_token_logprobs", first=False)
            for t, e in enumerate(own[1:], 1):
                tok = e[1] if isinstance(e, (list, tuple)) and len(e) >= 2 else None
                if not _is_int(tok) or tok != seq[t]:
                    raise TeacherReplyError(
                        f"{name}: input_token_logprobs[{t}] is {str(e)[:60]}, not the prompt token {seq[t]}: the reply "
                        f"is not aligned with the prompt"
                    )
        out.append(parse_sglang_input_top_logprobs(meta["input_top_logprobs"], len(seq), top_k=top_k,
                                                   vocab_size=vocab_size, request=name))  # fmt: skip
    return out


def rows_from_entries(
    rows: Sequence[Iterable[tuple[int, float, int | None]] | None], num_tokens: int, *, top_k: int, vocab_size: int,
    request: str, pad_short_rows: bool = False,
) -> TopK:  # fmt: skip
    """Per scoring position t (scores token t + 1), its (token id, log-prob, rank or None) entries -> (T, K) arrays.

    The top_k most likely entries are kept (ties broken by rank). A row with fewer than top_k entries is an error
    (the server was asked for top_k), unless `pad_short_rows`, which pads it (-1, -inf) as imports of partial
    data need. `rows` may be shorter than T - 1 only when `pad_short_rows`; log-probs at or below
    LOGPROB_PLACEHOLDER (vLLM writes -9999.0 for -inf) become -inf. Without `pad_short_rows` (a server's reply)
    the result must also be a distribution: check_distribution.
    """
    if len(rows) > num_tokens - 1 or (len(rows) < num_tokens - 1 and not pad_short_rows):
        raise TeacherReplyError(f"{request}: {len(rows)} scored positions for a sequence of {num_tokens} tokens")
    ids = [[-1] * top_k for _ in range(num_tokens)]
    values = [[-math.inf] * top_k for _ in range(num_tokens)]
    for t, entry in enumerate(rows):
        entry = list(entry or ())
        if len({tok for tok, _, _ in entry}) != len(entry):
            raise TeacherReplyError(f"{request}: position {t + 1} lists a token id twice: not a distribution")
        kept = sorted(entry, key=_by_logprob_then_rank)[:top_k]
        if len(kept) < top_k and not pad_short_rows:
            raise TeacherReplyError(
                f"{request}: position {t + 1} has {len(kept)} log-probs, fewer than top_k={top_k}; ask the server "
                f"for at least {top_k} (vLLM: --max-logprobs)"
            )
        for j, (tok, lp, _) in enumerate(kept):
            if not 0 <= tok < vocab_size:  # before the int32 tensor, which a huge id would overflow
                raise TeacherReplyError(
                    f"{request}: token id {tok} at row {t} is outside vocab_size {vocab_size}: the teacher has "
                    f"another vocabulary than the student"
                )
            ids[t][j] = tok
            values[t][j] = -math.inf if lp <= LOGPROB_PLACEHOLDER else lp
    out_ids = torch.tensor(ids, dtype=torch.int32).reshape(num_tokens, top_k)
    out_values = torch.tensor(values, dtype=torch.float32).reshape(num_tokens, top_k)
    check_topk(out_ids, out_values, vocab_size=vocab_size, request=request)
    if not pad_short_rows:
        check_distribution(out_ids, out_values, request=request)
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


def check_distribution(ids: torch.Tensor, values: torch.Tensor, *, request: str) -> None:
    """Row-aligned (T, K) top-k of one sequence that must be a distribution's top K: every scoring row (all but the
    last) has a real slot (id >= 0, finite log-prob above LOGPROB_PLACEHOLDER), the last row is padding, no row
    names a token twice, and no row's probabilities sum above 1: logsumexp <= MASS_TOLERANCE_NATS."""
    real = (ids >= 0) & torch.isfinite(values) & (values > LOGPROB_PLACEHOLDER)
    if values.shape[0] and real[-1].any():
        raise TeacherReplyError(f"{request}: the last row predicts no token of the sequence but holds log-probs")
    empty = ~real[:-1].any(-1)
    if empty.any():
        t = int(empty.nonzero()[0])
        raise TeacherReplyError(
            f"{request}: row {t} (scoring token {t + 1}) is all padding: the KD loss would silently be 0 there"
        )
    if ids.shape[-1] > 1:
        s = torch.where(real, ids, -1 - torch.arange(ids.shape[-1])).sort(-1).values  # padding: distinct negatives
        twice = (s[:, 1:] == s[:, :-1]).any(-1)
        if twice.any():
            t = int(twice.nonzero()[0])
            raise TeacherReplyError(f"{request}: row {t} lists a token id twice: not a distribution")
    mass = torch.where(real, values.double(), -math.inf).logsumexp(-1)
    if (mass > MASS_TOLERANCE_NATS).any():
        t = int((mass > MASS_TOLERANCE_NATS).nonzero()[0])
        raise TeacherReplyError(
            f"{request}: row {t}'s top-k probabilities sum to {math.exp(min(float(mass[t]), 700)):.4g} > 1 "
            f"(logsumexp {float(mass[t]):.3g} nats > {MASS_TOLERANCE_NATS}): these are not log-probs at "
            f"temperature 1 (logits? tempered?)"
        )


def _prompt_positions(entries: Any, num_tokens: int, request: str, field: str, first: bool = True) -> Sequence:
    """The positions of a per-prompt-position list (the first null), without the first (with it if not `first`)."""
    if not isinstance(entries, list):
        raise TeacherReplyError(f"{request}: {field} is {type(entries).__name__}, not a list over prompt positions")
    if len(entries) != num_tokens:
        raise TeacherReplyError(f"{request}: {field} has {len(entries)} positions for a prompt of {num_tokens} tokens")
    if first and num_tokens and entries[0] is not None:
        raise TeacherReplyError(f"{request}: {field}[0] should be null (nothing scores the first token)")
    for t, entry in enumerate(entries[1:], 1):
        if entry is None:
            raise TeacherReplyError(f"{request}: {field}[{t}] is null; only the first position may be")
    return entries[1:] if first else entries


def vllm_entry(entry: Any, t: int, request: str) -> list[tuple[int, float, int | None]]:
    """One position of vLLM's prompt_logprobs ({"<id>": {"logprob", "rank", ...}} or {"<id>": logprob})."""
    if not isinstance(entry, dict):
        raise TeacherReplyError(f"{request}: prompt_logprobs[{t}] is {type(entry).__name__}, not {{token_id: ...}}")
    out = []
    for tok, v in entry.items():
        lp, rank = (v.get("logprob"), v.get("rank")) if isinstance(v, dict) else (v, None)
        tok_id, lp = _token_id(tok), _number(lp)
        if tok_id is None or lp is None or not (rank is None or _is_int(rank)):
            raise TeacherReplyError(
                f"{request}: prompt_logprobs[{t}] is malformed at {str(tok)[:20]!r}: {str(v)[:80]}; want "
                f'{{"<token id>": {{"logprob": number, "rank": int}}}}'
            )
        out.append((tok_id, lp, rank))
    return out


def sglang_entry(entry: Any, t: int, request: str) -> list[tuple[int, float, int | None]]:
    """One position of SGLang's input/output_top_logprobs: [[logprob, token id, text or null], ...]."""
    if not isinstance(entry, (list, tuple)):
        raise TeacherReplyError(f"{request}: top_logprobs[{t}] is {type(entry).__name__}, not a list")
    out = []
    for e in entry:
        ok = isinstance(e, (list, tuple)) and len(e) >= 2 and _is_int(e[1]) and _number(e[0]) is not None
        if not ok:
            raise TeacherReplyError(
                f"{request}: top_logprobs[{t}] holds {str(list(entry)[:2])[:80]}..., not [logprob, token id, text] "
                f"triples"
            )
        out.append((int(e[1]), _number(e[0]), None))
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x: Any) -> float | None:
    """A JSON number as float (bools and numbers beyond float are not), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        return float(x)
    except OverflowError:
        return None


def _token_id(tok: Any) -> int | None:
    if _is_int(tok):
        return tok
    if isinstance(tok, str) and 0 < len(tok) <= 12 and tok.isascii() and tok.isdigit():
        return int(tok)
    return None


def _by_logprob_then_rank(entry: tuple[int, float, int | None]) -> tuple[float, float]:
    lp = entry[1]
    # NaN sorts first so check_topk sees it; a missing rank sorts after any given one
    return (-math.inf if math.isnan(lp) else -lp, math.inf if entry[2] is None else entry[2])


def own_token_logprobs(
    protocol: str, reply: Any, sequences: Sequence[Sequence[int]], *, request: str
) -> list[torch.Tensor]:  # fmt: skip
    """Per sequence, (T,) float32 log-probs of each sequence's own next token, row-aligned like a TopK (row t: the
    log-prob of token t + 1; the last row -inf), from a JSON reply already checked by the protocol's parse_reply:
    vLLM's prompt_logprobs always hold the prompt token's own entry (vllm_request; `liger-kd serve` answers the
    JSON request alike), SGLang's meta_info.input_token_logprobs its [logprob, id, text]. The binary top-k reply
    names each row's token but not its log-prob: ask these in JSON."""
    if protocol == "sglang":
        items = reply if isinstance(reply, list) else [reply]
        entries = [
            _prompt_positions((item.get("meta_info") or {}).get("input_token_logprobs"), len(seq),
                              f"{request} prompt {i}", "input_token_logprobs", first=False)[1:]
            for i, (item, seq) in enumerate(zip(items, sequences))
        ]  # fmt: skip
        values = [[e[0] if isinstance(e, (list, tuple)) and e else None for e in row] for row in entries]
    else:
        choices = sorted(reply["choices"], key=lambda c: c.get("index", 0))
        values = []
        for choice, seq in zip(choices, sequences):
            positions = choice["prompt_logprobs"][1:]
            row = []
            for t, entry in enumerate(positions, 1):
                v = entry.get(str(seq[t]))
                row.append(v.get("logprob") if isinstance(v, dict) else v)
            values.append(row)
    out = []
    for n, (row, seq) in enumerate(zip(values, sequences)):
        numbers = [_number(v) for v in row]
        bad = next((t for t, v in enumerate(numbers) if v is None or math.isnan(v) or v > 0), None)
        if bad is not None:
            raise TeacherReplyError(f"{request} prompt {n}: the log-prob of token {bad + 1} ({seq[bad + 1]}) is "
                                    f"{str(row[bad])[:40]!r}, not a log-prob <= 0")  # fmt: skip
        lp = [-math.inf if v <= LOGPROB_PLACEHOLDER else v for v in numbers]
        out.append(torch.tensor([*lp, -math.inf], dtype=torch.float32))
    return out


# ------------------------------------------------------------------------------------------- binary replies
def encode_binary(topks: Sequence[TopK], sequences: Sequence[Sequence[int]] | None = None) -> bytes:
    """Row-aligned top-k of several sequences -> bytes: header (magic, n, K), n uint32 lengths, then all ids (int32)
    and all log-probs (float32), little-endian, sequences concatenated. With `sequences` (magic LKD2) each row's
    own token follows (int32: the token the row scores, -1 on the last row), which decode_binary checks against
    the prompt, as the JSON's own-token entries are."""
    k = topks[0][0].shape[-1] if topks else 0
    lengths = [int(i.shape[0]) for i, _ in topks]
    ids = torch.cat([i.to(torch.int32) for i, _ in topks]) if topks else torch.zeros(0, k, dtype=torch.int32)
    values = torch.cat([v.to(torch.float32) for _, v in topks]) if topks else torch.zeros(0, k)
    parts = [_HEADER.pack(_MAGIC if sequences is None else _MAGIC_OWN, len(topks), k),
             struct.pack(f"<{len(lengths)}I", *lengths), ids.contiguous().numpy().tobytes(),
             values.contiguous().numpy().tobytes()]  # fmt: skip
    if sequences is not None:
        own = [tok for s in sequences for tok in (*s[1:], -1)]
        parts.append(struct.pack(f"<{len(own)}i", *own))
    return b"".join(parts)


def decode_binary(
    blob: bytes, sequences: Sequence[Sequence[int]], *, top_k: int, vocab_size: int, request: str
) -> list[TopK]:
    """encode_binary's bytes -> one TopK per sequence, checked against the request like the JSON replies."""
    if not isinstance(blob, (bytes, bytearray)) or len(blob) < _HEADER.size or blob[:4] not in (_MAGIC, _MAGIC_OWN):
        raise TeacherReplyError(f"{request}: not a liger binary reply (starts {bytes(blob[:16])!r})")
    magic, n, k = _HEADER.unpack_from(blob)
    if n != len(sequences) or k != top_k:
        raise TeacherReplyError(
            f"{request}: binary reply for {n} sequences of top-{k}; asked {len(sequences)}, {top_k}"
        )
    if len(blob) < _HEADER.size + 4 * n:
        raise TeacherReplyError(f"{request}: binary reply cut short: {len(blob)} bytes, too few for {n} lengths")
    lengths = struct.unpack_from(f"<{n}I", blob, _HEADER.size)
    want = [len(s) for s in sequences]
    if list(lengths) != want:
        raise TeacherReplyError(f"{request}: binary reply lengths {list(lengths)} != the prompts' {want}")
    rows, start = sum(lengths), _HEADER.size + 4 * n
    size = start + 8 * rows * k + (4 * rows if magic == _MAGIC_OWN else 0)
    if len(blob) != size:
        raise TeacherReplyError(f"{request}: binary reply of {len(blob)} bytes; expected {size} (cut short?)")
    buffer = bytearray(blob)  # torch.frombuffer wants a writable buffer
    ids = torch.frombuffer(buffer, dtype=torch.int32, count=rows * k, offset=start).reshape(rows, k)
    values = torch.frombuffer(buffer, dtype=torch.float32, count=rows * k, offset=start + 4 * rows * k)
    values = values.reshape(rows, k)
    check_topk(ids, values, vocab_size=vocab_size, request=request)
    if magic == _MAGIC_OWN:
        own = torch.frombuffer(buffer, dtype=torch.int32, count=rows, offset=start + 8 * rows * k)
        want_own = torch.tensor([tok for s in sequences for tok in (*s[1:], -1)], dtype=torch.int64)
        off = (own.long() != want_own).nonzero()
        if off.numel():
            r = int(off[0])
            raise TeacherReplyError(
                f"{request}: binary reply row {r} scores token {int(own[r])}, the prompt has {int(want_own[r])} "
                f"there: the reply is not aligned with the prompt"
            )
    out = list(zip(ids.split(list(lengths)), values.split(list(lengths))))
    for n_seq, (i, v) in enumerate(out):
        check_distribution(i, v, request=f"{request} prompt {n_seq}")
    return out


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
