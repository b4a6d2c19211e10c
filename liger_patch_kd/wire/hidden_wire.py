"""The exact served teacher's wire format: final hidden states and the lm_head, binary. Pure functions.

A teacher's distribution is softmax(cap(h Wᵀ + b) / T): its last hidden states h (after its final norm, what its
lm_head multiplies; a logit scale (Cohere, Granite) folded into h and b, as the in-process fused loss folds it) and
its head (W, b, the soft-cap) determine it exactly. The hidden states cost H x 2 bytes a token in bf16, against
V x 4 for fp32 logits; the head is sent once per weight version.

    POST /v1/hidden_states  {"prompt": [ids] or [[ids], ...], "dtype": "auto" | "bf16" | "fp32" | "fp8"}
    GET  /v1/head

"auto" sends the teacher's own dtype (bf16 for a bf16 teacher; a float32 teacher's float32); "fp8" sends e4m3
with one float32 scale per row (x ≈ x₈ · s, s = max|x| / 448: a relative rounding of at most 2⁻⁴ per element),
H + 8 bytes a token. Replies, little-endian (the framing of the liger top-k replies, protocols.encode_binary):

    hidden ("LKH1"): n sequences (uint32), H (uint32), dtype code (uint8, 3 pad bytes), weights version (uint64),
        n lengths (uint32), each row's own token (int32: the input id at that position, checked against the prompt),
        then all rows x H values of the sequences concatenated, then (fp8 only) one float32 scale per row.
        Per token: 4 + H x itemsize bytes (bf16: 2H + 4), plus 4 per sequence and 24 per reply.
    head ("LKHD"): weights version (uint64), rows V and hidden H of the weight (uint32), the config's vocab_size
        (uint32; 0 unknown), dtype code (uint8), has bias (uint8), 2 pad bytes, soft-cap (float64, NaN: none), the
        logit scale folded into the hidden states and bias (float64, 1: none; for reference), then the weight
        (V x H) and the bias (V) in the teacher's dtype.

Every hidden reply names the weights version it was computed with, so a client holding the head of another version
fetches the head again before using the hidden states (teacher/client/hidden_client.py). `liger-kd serve` sends its
weights_id as that version (server/generation.py: a random id per server start x 2**32 + its weight version), so a
server restarted with other weights (at version 0 again) never matches a head cached from the one before; the
client compares versions for equality only, so a plain version counter (an older server) is still read as before.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..ops.fp8 import FP8_DTYPE, quantize_rows_torch
from .protocols import TeacherReplyError

HIDDEN_PATH, HEAD_PATH = "/v1/hidden_states", "/v1/head"
WIRE_DTYPES = ("auto", "bf16", "fp32", "fp8")  # what a request may ask for
FP8 = "fp8"
# wire code -> (torch dtype on the wire, bytes per element); fp8 rows carry a float32 scale each besides
_CODES = {1: torch.float32, 2: torch.bfloat16, 3: torch.float16, 4: FP8_DTYPE, 5: torch.float64}
_CODE_OF = {dtype: code for code, dtype in _CODES.items()}
_NAMED = {"bf16": torch.bfloat16, "fp32": torch.float32, FP8: FP8_DTYPE}
_HIDDEN = struct.Struct("<4sIIBxxxQ")  # magic, sequences, H, dtype code, weights version
_HEAD = struct.Struct("<4sQIIIBBxxdd")  # magic, version, rows, H, vocab_size, dtype code, has bias, softcap, scale
_HIDDEN_MAGIC, _HEAD_MAGIC = b"LKH1", b"LKHD"


@dataclass(frozen=True)
class TeacherHead:
    """The served teacher's lm_head at one weights version (the server's weights_id): weight (V, H), bias (V) or
    None, soft-cap (None: none), the config's vocab_size (None: unknown; V may be larger: padded rows) and the logit
    scale already folded into the hidden states and the bias (1.0: none)."""

    version: int
    weight: torch.Tensor
    bias: torch.Tensor | None
    softcap: float | None
    vocab_size: int | None
    logit_scale: float = 1.0

    def to(self, *args, **kwargs) -> TeacherHead:
        """Itself: code moving a batch's values with .to(device) leaves the head where it is (on the CPU); the
        trainer moves it once per version (trainer/teachers/served_hidden.py)."""
        return self


def wire_dtype(name: str, teacher_dtype: torch.dtype) -> torch.dtype:
    """A request's dtype name -> the dtype on the wire ("auto": the teacher's; float64 stays float64)."""
    return teacher_dtype if name == "auto" else _NAMED[name]


def _code(dtype: torch.dtype) -> int:
    if dtype not in _CODE_OF:
        raise ValueError(f"no wire code for {dtype}; the served teacher must be float32, float64, bf16 or fp16")
    return _CODE_OF[dtype]


def _raw(t: torch.Tensor) -> bytes:
    """The tensor's bytes (float8 and bfloat16 have no numpy dtype: their bytes are read as uint8)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def encode_hidden(
    states: Sequence[torch.Tensor], sequences: Sequence[Sequence[int]], dtype: torch.dtype, version: int
) -> bytes:
    """One (T, H) hidden-state tensor per sequence -> the reply's bytes, cast to `dtype` (FP8_DTYPE: quantised
    per row, a float32 scale each)."""
    hidden = states[0].shape[-1]
    rows = torch.cat([s.reshape(-1, hidden) for s in states]).cpu()
    own, lengths = [tok for s in sequences for tok in s], [len(s) for s in sequences]
    parts = [_HIDDEN.pack(_HIDDEN_MAGIC, len(states), hidden, _code(dtype), version),
             struct.pack(f"<{len(lengths)}I", *lengths), struct.pack(f"<{len(own)}i", *own)]  # fmt: skip
    if dtype == FP8_DTYPE:
        data, scale = quantize_rows_torch(rows)
        parts += [_raw(data), _raw(scale.to(torch.float32))]
    else:
        parts.append(_raw(rows.to(dtype)))
    return b"".join(parts)


def decode_hidden(blob: bytes, sequences: Sequence[Sequence[int]], *, request: str) -> tuple[list[torch.Tensor], int]:
    """encode_hidden's bytes -> (one (T, H) tensor per sequence, the weight version), checked against the request:
    the header, the lengths, each row's own token, the size, and every value finite. FP8 rows come back dequantised
    to float32; other dtypes as sent."""
    if len(blob) < _HIDDEN.size or blob[:4] != _HIDDEN_MAGIC:
        raise TeacherReplyError(f"{request}: not a liger hidden-state reply (starts {bytes(blob[:16])!r}); is the "
                                f"server `liger-kd serve` of this version?")  # fmt: skip
    _, n, hidden, code, version = _HIDDEN.unpack_from(blob)
    if n != len(sequences) or code not in _CODES:
        raise TeacherReplyError(f"{request}: hidden-state reply for {n} sequences in dtype code {code}; asked "
                                f"{len(sequences)}")  # fmt: skip
    dtype, want = _CODES[code], [len(s) for s in sequences]
    rows, start = sum(want), _HIDDEN.size + 4 * n
    item = dtype.itemsize
    size = start + 4 * rows + rows * hidden * item + (4 * rows if dtype == FP8_DTYPE else 0)
    if len(blob) != size or list(struct.unpack_from(f"<{n}I", blob, _HIDDEN.size)) != want:
        raise TeacherReplyError(f"{request}: hidden-state reply of {len(blob)} bytes; expected {size} for lengths "
                                f"{want} and H={hidden}")  # fmt: skip
    buffer = bytearray(blob)  # torch.frombuffer wants a writable buffer
    own = torch.frombuffer(buffer, dtype=torch.int32, count=rows, offset=start)
    want_own = torch.tensor([tok for s in sequences for tok in s], dtype=torch.int32)
    if not torch.equal(own, want_own):
        r = int((own != want_own).nonzero()[0])
        raise TeacherReplyError(f"{request}: hidden-state row {r} is of token {int(own[r])}, the prompt has "
                                f"{int(want_own[r])} there: the reply is not aligned with the prompt")  # fmt: skip
    start += 4 * rows
    data = torch.frombuffer(buffer, dtype=torch.uint8, count=rows * hidden * item, offset=start).view(dtype)
    data = data.reshape(rows, hidden)
    if dtype == FP8_DTYPE:
        scale = torch.frombuffer(buffer, dtype=torch.float32, count=rows, offset=start + rows * hidden)
        data = data.float() * scale[:, None]
    bad = ~torch.isfinite(data).all(-1)
    if bad.any():
        raise TeacherReplyError(f"{request}: hidden-state row {int(bad.nonzero()[0])} holds NaN or inf; check the "
                                f"teacher's dtype and inputs")  # fmt: skip
    return list(data.split(want)), version


def encode_head(head: TeacherHead) -> bytes:
    """The head route's reply bytes (weight and bias in their own dtype)."""
    rows, hidden = head.weight.shape
    cap = math.nan if head.softcap is None else float(head.softcap)
    parts = [_HEAD.pack(_HEAD_MAGIC, head.version, rows, hidden, head.vocab_size or 0, _code(head.weight.dtype),
                        head.bias is not None, cap, float(head.logit_scale)), _raw(head.weight.cpu())]  # fmt: skip
    if head.bias is not None:
        parts.append(_raw(head.bias.cpu().to(head.weight.dtype)))
    return b"".join(parts)


def decode_head(blob: bytes, *, request: str) -> TeacherHead:
    """encode_head's bytes -> TeacherHead (CPU tensors), checked: header, size, every value finite."""
    if len(blob) < _HEAD.size or blob[:4] != _HEAD_MAGIC:
        raise TeacherReplyError(f"{request}: not a liger head reply (starts {bytes(blob[:16])!r})")
    _, version, rows, hidden, vocab, code, has_bias, cap, scale = _HEAD.unpack_from(blob)
    if code not in _CODES or _CODES[code] == FP8_DTYPE:
        raise TeacherReplyError(f"{request}: head in dtype code {code}, not a float dtype")
    dtype = _CODES[code]
    size = _HEAD.size + (rows * hidden + (rows if has_bias else 0)) * dtype.itemsize
    if len(blob) != size:
        raise TeacherReplyError(f"{request}: head reply of {len(blob)} bytes; expected {size} for a ({rows}, "
                                f"{hidden}) {dtype} weight{' and bias' if has_bias else ''}")  # fmt: skip
    buffer = bytearray(blob)
    values = torch.frombuffer(buffer, dtype=torch.uint8, offset=_HEAD.size).view(dtype)
    weight, bias = values[: rows * hidden].reshape(rows, hidden), values[rows * hidden :] if has_bias else None
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and not torch.isfinite(t).all():
            raise TeacherReplyError(f"{request}: the head's {name} holds NaN or inf")
    return TeacherHead(version, weight, bias, None if math.isnan(cap) else cap, vocab or None, scale)
