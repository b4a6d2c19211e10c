"""The compact top-k encoding: ids in the fewest bits that cover the vocabulary, log-probs quantised per row.

One token's K slots become one fixed-width byte row, so a sequence is one contiguous read and a batch decodes
with a handful of vectorised numpy operations (no Python loop per token or slot):

    [top: float32][step: float32][K fields of (id_bits + logprob_bits) bits, little-endian, packed]

- ids: `id_bits = vocab_size.bit_length()`, the fewest bits holding ids 0 .. vocab_size - 1 plus one spare code
  (all ones) for the padding id -1 (151936 -> 18 bits, 128256 -> 17, 262144 -> 19). Ids round-trip exactly.
- log-probs: code c = round((top - logprob) / step), with top the row's largest finite log-prob (stored exactly)
  and step = (top - row minimum) / (2**logprob_bits - 2); the all-ones code is -inf (padding). The error on a
  kept slot is at most step / 2: below 1e-2 whenever a row's kept log-probs span less than
  0.02 * (2**logprob_bits - 2) nats (10 bits: 20.4 nats; 12 bits: 81.9 nats). The top slot is exact.

Why fixed width and not entropy coding: decoding must keep up with a GPU's training step under shuffled reads
on 2 CPU cores.
An unordered top-64 set from 151936 ids carries log2(C(151936, 64)) / 64 = 12.6 bits per slot at best
(Elias-Fano reaches 13.2), so with a 1e-2 log-prob bound no fixed-rate code gets below ~2.8 bytes per slot on
that vocabulary; this one spends 3.4-3.7.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

HEADER_BYTES = 8  # top and step, float32 each
_SPEC = re.compile(r"^packed(\d+)$")


@dataclass(frozen=True)
class PackedCodec:
    """Encodes (T, K) ids + log-probs into (T, row_bytes) uint8 and back, for one vocabulary size and K."""

    vocab_size: int
    top_k: int
    logprob_bits: int = 10

    def __post_init__(self) -> None:
        if not 4 <= self.logprob_bits <= 16:
            raise ValueError(f"logprob_bits must be in [4, 16] (8-12 are sensible); got {self.logprob_bits}")
        if self.field_bits > 56:  # one unaligned 8-byte load must hold a field
            raise ValueError(f"encoding packed{self.logprob_bits}: id_bits {self.id_bits} (vocab_size "
                             f"{self.vocab_size}) + logprob_bits {self.logprob_bits} = {self.field_bits} > 56; "
                             f"use fewer bits (e.g. --encoding packed10) or 'plain'")  # fmt: skip

    @property
    def id_bits(self) -> int:
        return int(self.vocab_size).bit_length()

    @property
    def field_bits(self) -> int:
        return self.id_bits + self.logprob_bits

    @property
    def padded_k(self) -> int:  # fields are laid out in groups of eight (eight fields fill a whole number of bytes)
        return 8 * math.ceil(self.top_k / 8)

    @property
    def row_bytes(self) -> int:
        return HEADER_BYTES + self.padded_k * self.field_bits // 8

    def describe(self) -> dict:
        return {"name": "packed", "id_bits": self.id_bits, "logprob_bits": self.logprob_bits}

    # --------------------------------------------------------------------------------------------- encode
    def encode(self, ids: np.ndarray, logprobs: np.ndarray) -> np.ndarray:
        """(T, K) int ids (-1 = padding) and float log-probs (-inf = padding) -> (T, row_bytes) uint8."""
        ids = np.asarray(ids, dtype=np.int64)
        lp = np.asarray(logprobs, dtype=np.float64)
        rows = ids.shape[0]
        finite = np.isfinite(lp)
        top = np.where(finite, lp, -np.inf).max(axis=1, initial=-np.inf)
        low = np.where(finite, lp, np.inf).min(axis=1, initial=np.inf)
        top32 = np.where(np.isfinite(top), top, 0.0).astype(np.float32)
        span = np.where(np.isfinite(top), top32.astype(np.float64) - low, 0.0)
        pad_code = (1 << self.logprob_bits) - 1
        step = np.where(span > 0, span / (pad_code - 1), 1.0).astype(np.float32)
        codes = np.rint((top32[:, None].astype(np.float64) - lp) / step[:, None].astype(np.float64))
        codes = np.where(finite, np.clip(codes, 0, pad_code - 1), pad_code).astype(np.uint64)
        id_codes = np.where(ids < 0, (1 << self.id_bits) - 1, ids).astype(np.uint64)
        fields = np.zeros((rows, self.padded_k), dtype=np.uint64)
        fields[:, : self.top_k] = id_codes | (codes << np.uint64(self.id_bits))
        out = np.zeros((rows, self.row_bytes + 8), dtype=np.uint8)  # 8 spare bytes for the last window
        out[:, :4] = top32.view(np.uint8).reshape(rows, 4)
        out[:, 4:8] = step.view(np.uint8).reshape(rows, 4)
        # the mirror of decode: field m of each group of eight is OR-ed into its 8-byte window, one m at a time
        # (windows of one m lie fb >= 8 bytes apart, so they never overlap within one operation)
        fb, groups = self.field_bits, self.padded_k // 8
        grouped = fields.reshape(rows, groups, 8)
        for m in range(8):
            window = np.lib.stride_tricks.as_strided(
                out[:, HEADER_BYTES + (m * fb) // 8 :], shape=(rows, groups, 8), strides=(out.strides[0], fb, 1)
            )
            shifted = np.ascontiguousarray(grouped[:, :, m] << np.uint64((m * fb) % 8))
            window |= shifted.view(np.uint8).reshape(rows, groups, 8)
        return np.ascontiguousarray(out[:, : self.row_bytes])

    # --------------------------------------------------------------------------------------------- decode
    def decode(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(T, row_bytes) uint8 -> (T, K) int32 ids and float32 log-probs (padding: -1, -inf)."""
        rows = np.ascontiguousarray(rows, dtype=np.uint8).reshape(-1, self.row_bytes)
        t, fb = rows.shape[0], self.field_bits
        top = rows[:, :4].copy().view(np.float32)
        step = rows[:, 4:8].copy().view(np.float32)
        body = np.zeros((t, self.row_bytes - HEADER_BYTES + 8), dtype=np.uint8)  # 8 spare bytes for the last load
        body[:, : self.row_bytes - HEADER_BYTES] = rows[:, HEADER_BYTES:]
        # Eight consecutive fields fill exactly fb bytes, so field m of every group of eight starts at the same
        # byte and bit of its group: one strided 8-byte window per m reads that field for all groups at once.
        groups = self.padded_k // 8
        fields = np.empty((t, groups, 8), dtype=np.uint64)
        for m in range(8):
            window = np.lib.stride_tricks.as_strided(
                body[:, (m * fb) // 8 :], shape=(t, groups, 8), strides=(body.strides[0], fb, 1)
            )
            fields[:, :, m] = np.ascontiguousarray(window).view(np.uint64)[..., 0] >> np.uint64((m * fb) % 8)
        fields = fields.reshape(t, groups * 8)[:, : self.top_k] & np.uint64((1 << fb) - 1)  # t may be 0
        ids = (fields & np.uint64((1 << self.id_bits) - 1)).astype(np.int32)
        codes = (fields >> np.uint64(self.id_bits)).astype(np.int32)
        ids[ids == (1 << self.id_bits) - 1] = -1
        lp = top - codes.astype(np.float32) * step
        lp[codes == (1 << self.logprob_bits) - 1] = -np.inf
        return ids, lp


VALID_ENCODINGS = "'plain' or 'packed4' .. 'packed16' (packed10 or packed12 are the usual choices)"


def codec_from_spec(spec: str, vocab_size: int, top_k: int) -> PackedCodec | None:
    """'plain' -> None (int32 ids, float log-probs as given); 'packed10' etc. -> a PackedCodec. Anything else is a
    ValueError naming the valid encodings (--encoding)."""
    if spec == "plain":
        return None
    match = _SPEC.match(spec) if isinstance(spec, str) else None
    if not match or not 4 <= int(match.group(1)) <= 16:
        raise ValueError(f"encoding (--encoding) must be {VALID_ENCODINGS}; got {spec!r}")
    codec = PackedCodec(vocab_size, top_k, int(match.group(1)))  # bits in range: only the field width can fail
    return codec


def codec_from_manifest(meta: dict) -> PackedCodec | None:
    """The codec a manifest's `encoding` names (None: plain); ValueError when it is malformed or does not fit the
    manifest's vocab_size (read_manifest turns that into a TeacherStoreError naming the file)."""
    enc = meta.get("encoding", {"name": "plain"})
    if not isinstance(enc, dict) or enc.get("name") not in ("plain", "packed"):
        raise ValueError(f"encoding {enc!r} is neither plain nor packed")
    if enc["name"] == "plain":
        return None
    bits, id_bits = enc.get("logprob_bits"), enc.get("id_bits")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (bits, id_bits)):
        raise ValueError(f"packed encoding needs integer logprob_bits and id_bits; got {enc!r}")
    codec = PackedCodec(meta["vocab_size"], meta["top_k"], bits)
    if codec.id_bits != id_bits:
        raise ValueError(f"manifest encoding {enc} does not match vocab_size {meta['vocab_size']}")
    return codec
