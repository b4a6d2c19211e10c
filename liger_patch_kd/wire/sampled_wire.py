"""Sampled teacher tokens over the liger protocol (teacher/sampling.py draws them): the request fields,
the client's check of them, and the binary reply both ends read (the server checks a request's fields in
server/validation.py). Pure functions, no I/O.

A /v1/completions scoring body (protocols.vllm_request) asks for draws with
    "samples": m (1 .. 255 draws per position), "sample_seed": s (int >= 0, default 0),
    "sample_temperature": T (number > 0; default the server's --sample-temperature): the draws' temperature,
and then prompt_logprobs K is the hybrid's exact top-K at T (0: draws alone; K + m <= the vocabulary). Each
prompt draws from a generator seeded from (s, its token ids) (sampling.sequence_generator), so its draws do not
depend on what else the request or the server's batch holds, and are what `precompute(samples=m, seed=s,
temperature=T)` writes for it. The reply (Accept: application/octet-stream only) is, little-endian:
    magic "LKD3", n sequences (uint32), K (uint32), m (uint32), T (float64), n lengths (uint32),
    then over all rows of the sequences concatenated: the token each row scores (int32, -1 on a sequence's last
    row), top-K ids (int32) and log-probs (float32), sample ids (int32, -1 padding), counts (uint8), log-probs
    (float32, -inf padding); the last row of each sequence is padding (it predicts nothing).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .conventions import is_int, is_number
from .protocols import MASS_TOLERANCE_NATS, TeacherReplyError, check_distribution, check_topk
from .sampled_tokens import MAX_SAMPLES, SampledTokens

_MAGIC = b"LKD3"
_HEADER = struct.Struct("<4sIIId")  # magic, sequences, K, m, temperature


@dataclass(frozen=True)
class SampleAsk:
    """What a request asks to be drawn: m draws per position after the exact top_k, at `temperature`, seeded."""

    samples: int
    top_k: int = 0
    seed: int = 0
    temperature: float = 1.0

    def fields(self) -> dict[str, Any]:
        """The body fields asking for these draws (prompt_logprobs, the top_k, is the body's own)."""
        return {"samples": self.samples, "sample_seed": self.seed, "sample_temperature": self.temperature}


def checked_ask(samples: Any, top_k: int, seed: Any, temperature: Any) -> SampleAsk:
    """The client's SampleAsk, or ValueError naming the argument (before any request is sent)."""
    if not is_int(samples) or not 1 <= samples <= MAX_SAMPLES:
        raise ValueError(f"samples must be an int in [1, {MAX_SAMPLES}] (draws per position); got {samples!r}")
    if not is_int(seed) or seed < 0:
        raise ValueError(f"sample_seed must be an int >= 0; got {seed!r}")
    if not is_number(temperature) or temperature <= 0:
        raise ValueError(f"sample_temperature must be a number > 0; got {temperature!r}")
    return SampleAsk(samples, top_k, seed, float(temperature))


def encode_sampled(draws: Sequence[SampledTokens], sequences: Sequence[Sequence[int]], ask: SampleAsk) -> bytes:
    """One SampledTokens per sequence ((T, m) draws and (T, K) top-K, its last row padding) -> the reply's bytes."""
    k, m = ask.top_k, ask.samples
    lengths = [len(s) for s in sequences]
    own = [tok for s in sequences for tok in (*s[1:], -1)]

    def cat(name: str, width: int, dtype: torch.dtype) -> bytes:
        parts = [getattr(d, name) if width else None for d in draws]
        joined = torch.cat([p.to(dtype) for p in parts]) if width and parts else torch.zeros(0, dtype=dtype)
        return joined.contiguous().numpy().tobytes()

    return b"".join([
        _HEADER.pack(_MAGIC, len(sequences), k, m, ask.temperature), struct.pack(f"<{len(lengths)}I", *lengths),
        struct.pack(f"<{len(own)}i", *own), cat("topk_ids", k, torch.int32), cat("topk_logprobs", k, torch.float32),
        cat("ids", m, torch.int32), cat("counts", m, torch.uint8), cat("logprobs", m, torch.float32),
    ])  # fmt: skip


def decode_sampled(
    blob: bytes, sequences: Sequence[Sequence[int]], ask: SampleAsk, *, vocab_size: int, request: str
) -> list[SampledTokens]:
    """encode_sampled's bytes -> one SampledTokens per sequence (counts int32), checked against the request: the
    header, the lengths, each row's own token, the top-K as a distribution's, and the draws (check_samples)."""
    if len(blob) < _HEADER.size or blob[:4] != _MAGIC:
        raise TeacherReplyError(f"{request}: not a liger sampled reply (starts {bytes(blob[:16])!r}); is the server "
                                f"`liger-kd serve` of this version?")  # fmt: skip
    _, n, k, m, t = _HEADER.unpack_from(blob)
    if (n, k, m, t) != (len(sequences), ask.top_k, ask.samples, ask.temperature):
        raise TeacherReplyError(
            f"{request}: sampled reply for {n} sequences, top-{k}, {m} draws at T={t}; asked {len(sequences)}, "
            f"{ask.top_k}, {ask.samples}, {ask.temperature}"
        )
    want = [len(s) for s in sequences]
    rows, start = sum(want), _HEADER.size + 4 * n
    size = start + 4 * rows + 8 * rows * k + 9 * rows * m
    if len(blob) != size or list(struct.unpack_from(f"<{n}I", blob, _HEADER.size)) != want:
        raise TeacherReplyError(f"{request}: sampled reply of {len(blob)} bytes; expected {size} for lengths {want}")
    buffer, arrays = bytearray(blob), []
    for width, dtype, item in ((1, torch.int32, 4), (k, torch.int32, 4), (k, torch.float32, 4),
                               (m, torch.int32, 4), (m, torch.uint8, 1), (m, torch.float32, 4)):  # fmt: skip
        count = rows * width  # frombuffer refuses count 0 (draws alone carry no top-K)
        empty = torch.zeros(0, dtype=dtype)
        flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=start) if count else empty
        arrays.append(flat.reshape(rows, width))
        start += count * item
    own, top_ids, top_lp, ids, counts, lp = arrays
    want_own = torch.tensor([tok for s in sequences for tok in (*s[1:], -1)], dtype=torch.int32)
    if not torch.equal(own[:, 0], want_own):
        r = int((own[:, 0] != want_own).nonzero()[0])
        raise TeacherReplyError(f"{request}: sampled reply row {r} scores token {int(own[r, 0])}, the prompt has "
                                f"{int(want_own[r])} there: the reply is not aligned with the prompt")  # fmt: skip
    check_topk(top_ids, top_lp, vocab_size=vocab_size, request=request)
    out = []
    for s, parts in enumerate(zip(*(a.split(want) for a in (ids, counts, lp, top_ids, top_lp)))):
        drawn = SampledTokens(parts[0], parts[1].to(torch.int32), parts[2], parts[3], parts[4])
        name = f"{request} prompt {s}"
        if k:
            check_distribution(drawn.topk_ids, drawn.topk_logprobs, request=name)
        check_samples(drawn, m, vocab_size=vocab_size, request=name)
        out.append(drawn)
    return out


def check_samples(drawn: SampledTokens, samples: int, *, vocab_size: int, request: str) -> None:
    """One sequence's draws: ids in [-1, vocab), drawn iff their count > 0, distinct in a row and outside its top-K;
    every scoring row's counts sum to m (or to 0 in a hybrid row whose top-K holds all the mass), the last row's
    to 0; the drawn ids' log-probs finite and <= 0 (to MASS_TOLERANCE_NATS)."""
    ids, counts, lp = drawn.ids.long(), drawn.counts.long(), drawn.logprobs
    hybrid = drawn.topk_ids is not None and drawn.topk_ids.shape[-1] > 0
    present, total = counts > 0, counts.sum(-1, keepdim=True)
    scoring = total[:-1]
    problems = (
        ((ids < -1) | (ids >= vocab_size), f"an id outside [0, vocab_size {vocab_size})"),
        (present != (ids >= 0), "a drawn id without a count, or a count on padding"),
        ((scoring != samples) & ((scoring != 0) | (not hybrid)), f"counts that do not sum to the {samples} draws"),
        (total[-1:] != 0, "draws on the last row, which predicts nothing"),
        (present & ~(torch.isfinite(lp) & (lp <= MASS_TOLERANCE_NATS)), "a drawn id's log-prob not finite or > 0"),
        (torch.isnan(lp), "a NaN log-prob"),
    )
    for bad, what in problems:
        if bad.any():
            raise TeacherReplyError(f"{request}: row {int(bad.any(-1).nonzero()[0])} holds {what}")
    marked = torch.where(present, ids, -1)
    if hybrid:
        marked = torch.cat([marked, drawn.topk_ids.long().clamp(min=-1)], -1)
    s = marked.sort(-1).values
    twice = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any(-1)
    if twice.any():
        raise TeacherReplyError(f"{request}: row {int(twice.nonzero()[0])} draws an id twice or one of its top-K")
