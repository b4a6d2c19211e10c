"""Batching sequences with their teacher top-k."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .columns import (
    POSITION_IDS,
    TEACHER_LOGPROBS,
    TEACHER_SAMPLE_COUNTS,
    TEACHER_SAMPLE_IDS,
    TEACHER_SAMPLE_LOGPROBS,
    TEACHER_TOKEN_IDS,
)

# numpy has no bfloat16: bf16 rows are copied as their 16-bit patterns (the pattern of -inf is 0xFF80)
_BITS_OF = {torch.bfloat16: np.uint16}


@dataclass
class TeacherDataCollator:
    """Right-pads a batch: input_ids (pad_token_id), attention_mask, labels (given labels, else input_ids;
    ignore_index on padding) and, when the features carry them, the teacher's top-k (id -1, log-prob -inf on
    padding) and its sampled tokens (teacher_sample_ids / _counts / _logprobs: id -1, count 0, log-prob -inf),
    row-aligned with the positions. Works for plain {"input_ids", "labels"} features too.

    The teacher arrays are filled with numpy copies: a few large memcpys per batch, on one thread. (torch's
    element-wise copies on CPU use every intra-op thread and, on a busy 2-core host, made this collator the
    slowest step of reading a store in the main process.) A column whose rows are all tensors (a store's items)
    leaves torch in one concatenation, not row by row: each tensor -> numpy conversion is several dispatched ops,
    which at hundreds of rows a step cost more than the copies.
    """

    pad_token_id: int = 0
    ignore_index: int = -100

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if features and POSITION_IDS in features[0]:  # dropping them would attend across the packed sequences
            raise ValueError(
                "TeacherDataCollator: the rows carry position_ids (sequences packed into one row); it pads rows "
                "one sequence each and would attend across the packed ones: give unpacked rows with data_collator="
                "DataCollatorWithFlattening(return_position_ids=True) (it packs them), or drop the column"
            )
        joined = joined_rows([f["input_ids"] for f in features])
        if joined is not None and joined.values.dtype.kind == "i":  # a store's items: whole columns at once
            seqs, lengths = joined, joined.lengths
        else:
            given_ids = joined.split() if joined is not None else [f["input_ids"] for f in features]
            seqs = [token_ids_of(ids, "input_ids", row) for row, ids in enumerate(given_ids)]
            lengths = np.array([len(s) for s in seqs], dtype=np.int64)
        length, batch = int(lengths.max()), len(features)
        input_ids = _filled(seqs, length, self.pad_token_id, np.int64, ndim=1)
        attention = (np.arange(length) < lengths[:, None]).astype(np.int64)
        # a row without labels is trained on its input ids; rows that have them are read together when all do
        if all("labels" in f for f in features):
            given = joined_rows([f["labels"] for f in features])
            if given is not None and given.values.dtype.kind == "i" and np.array_equal(given.lengths, lengths):
                labels = _filled(given, length, self.ignore_index, np.int64, ndim=1)
            else:
                rows = given.split() if given is not None else [f["labels"] for f in features]
                refuse_other_lengths("labels", rows, lengths)
                labels = _filled([token_ids_of(own, "labels", row) for row, own in enumerate(rows)], length,
                                 self.ignore_index, np.int64, ndim=1)  # fmt: skip
        else:
            labels = np.full((batch, length), self.ignore_index, dtype=np.int64)
            ids = seqs.split() if isinstance(seqs, JoinedRows) else seqs
            for row, (f, own) in enumerate(zip(features, ids)):  # a row without labels is scored on its ids
                if "labels" in f:
                    own = token_ids_of(f["labels"], "labels", row)
                    refuse_other_lengths("labels", [own], lengths[row : row + 1], first_row=row)
                labels[row, : len(own)] = own
        out = {"input_ids": input_ids, "attention_mask": attention, "labels": labels}
        out = {name: torch.from_numpy(a) for name, a in out.items()}
        if TEACHER_TOKEN_IDS in features[0]:
            for name in (TEACHER_TOKEN_IDS, TEACHER_LOGPROBS):
                refuse_other_lengths(name, [f[name] for f in features], lengths)
            out[TEACHER_TOKEN_IDS] = _pad_ids([f[TEACHER_TOKEN_IDS] for f in features], length, -1, TEACHER_TOKEN_IDS)
            dtype = torch.as_tensor(features[0][TEACHER_LOGPROBS]).dtype
            out[TEACHER_LOGPROBS] = pad_rows([f[TEACHER_LOGPROBS] for f in features], length, -math.inf, dtype)
        if TEACHER_SAMPLE_IDS in features[0]:  # sampled teacher tokens (store/samples.py): id -1, count 0 padding
            for name in (TEACHER_SAMPLE_IDS, TEACHER_SAMPLE_COUNTS, TEACHER_SAMPLE_LOGPROBS):
                refuse_other_lengths(name, [f[name] for f in features], lengths)
            for name, fill in ((TEACHER_SAMPLE_IDS, -1), (TEACHER_SAMPLE_COUNTS, 0)):
                out[name] = _pad_ids([f[name] for f in features], length, fill, name)
            dtype = torch.as_tensor(features[0][TEACHER_SAMPLE_LOGPROBS]).dtype
            out[TEACHER_SAMPLE_LOGPROBS] = pad_rows([f[TEACHER_SAMPLE_LOGPROBS] for f in features], length,
                                                     -math.inf, dtype)  # fmt: skip
        return out


def refuse_other_lengths(column: str, rows: list[Any], lengths: np.ndarray, first_row: int = 0) -> None:
    """ValueError naming the first row whose `column` has another number of positions than its input_ids
    (`lengths`): padded as given, it would sit beside the wrong positions (labels of the completion alone score the
    prompt's positions; a teacher row one short scores every position against its neighbour's top-k)."""
    given = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    if np.array_equal(given, lengths):
        return
    row = int(np.flatnonzero(given != lengths)[0])
    fix = "compute the row's teacher data on the very input_ids it is given with"
    if column == "labels":
        fix = "give ignore_index on the positions not scored (e.g. the prompt's) rather than the scored tokens alone"
    raise ValueError(f"row {first_row + row} of this batch: {column} has {given[row]} positions and input_ids "
                     f"{lengths[row]}, so its entries would sit beside the wrong positions; {fix}")  # fmt: skip


def token_ids_of(values: Any, column: str, row: int) -> np.ndarray:
    """A row's ids as int64, never wrapped nor truncated: an id past int64, a fraction or a non-number is a ValueError
    naming the column, the row (of this batch) and the value (the vocabulary check runs on the collated batch)."""
    array = np.asarray(values)
    if array.dtype.kind == "i" or array.size == 0:
        return array.astype(np.int64, copy=False)
    if array.dtype.kind == "u" and int(array.max()) < 2**63:
        return array.astype(np.int64)
    if array.dtype.kind == "f" and np.isfinite(array).all() and (array == np.round(array)).all() \
            and np.abs(array).max() < 2**53:  # whole numbers stored as floats: exact
        return array.astype(np.int64)
    flat = list(values) if isinstance(values, (list, tuple)) else array.ravel().tolist()  # as given, not as cast
    bad = next((v for v in flat if isinstance(v, bool) or not isinstance(v, (int, float, np.number))
                or not math.isfinite(v) or v != round(v) or not -(2**63) <= int(v) < 2**63), flat[0])  # fmt: skip
    raise ValueError(f"row {row} of this batch: {column} holds {bad!r}, which is not a token id (an integer in [0, "
                     f"the vocabulary size)); tokenize the row with the student's tokenizer")


@dataclass(frozen=True)
class JoinedRows:
    """A column's rows as one array, end to end along its first dim: row i is the `lengths[i]` values after the
    rows before it."""

    values: np.ndarray
    lengths: np.ndarray  # (rows,) int64

    def split(self) -> list[np.ndarray]:
        return np.split(self.values, np.cumsum(self.lengths)[:-1])


def joined_rows(rows: list[Any], dtype: torch.dtype | None = None) -> JoinedRows | None:
    """`rows` as one numpy array when every row is a tensor with the same trailing dims: one torch.cat, one
    conversion (bfloat16 as its 16-bit patterns), cast to `dtype` first when given; None for any other rows (lists,
    numpy, mixed), which are read row by row."""
    if not rows or not all(torch.is_tensor(r) and r.dim() >= 1 and r.shape[1:] == rows[0].shape[1:] for r in rows):
        return None
    joined = torch.cat(rows).detach().cpu()
    if dtype is not None:
        joined = joined.to(dtype)
    bits = _BITS_OF.get(joined.dtype)
    array = joined.view(torch.int16).numpy().view(bits) if bits else joined.numpy()
    return JoinedRows(array, np.fromiter((r.shape[0] for r in rows), dtype=np.int64, count=len(rows)))


def _pad_ids(rows: list[Any], length: int, fill: int, column: str) -> torch.Tensor:
    """(batch, length, k) int32: each item's (n, k) ids or counts, then `fill`; whole numbers within int32 only (a
    cast would wrap a larger one, or truncate a fraction, into some valid-looking id)."""
    joined = joined_rows(rows)
    kind = joined.values.dtype.kind if joined is not None else None
    if kind == "i" or (kind == "u" and joined.values.dtype.itemsize < 8):  # uint64 would wrap in the int64 fill
        arrays = joined
    else:  # lists, or float tensors: each row checked
        given = joined.split() if joined is not None else rows
        arrays = [token_ids_of(a, column, row) for row, a in enumerate(given)]
    out = _filled(arrays, length, fill, np.int64)
    info = np.iinfo(np.int32)
    if out.size and (out.max() > info.max or out.min() < info.min):
        bad = int(out.max()) if out.max() > info.max else int(out.min())
        raise ValueError(f"{column} holds {bad}, outside int32: not a token id (or count) of any vocabulary; check "
                         f"the rows' {column} column")  # fmt: skip
    return torch.from_numpy(out.astype(np.int32))


def pad_rows(rows: list[Any], length: int, fill: float, dtype: torch.dtype, *, ndim: int = 2) -> torch.Tensor:
    """(batch, length, k) of `dtype` from each item's (n, k) rows (ndim 1: (batch, length) from (n,) rows), then
    `fill`; rows may be tensors (any dtype, device, grad), numpy arrays or lists."""
    bits = _BITS_OF.get(dtype)
    np_dtype = bits or _numpy_dtype(dtype)
    arrays = joined_rows(rows, dtype)
    if arrays is None:  # not all tensors of one shape: row by row
        arrays = [(t.view(torch.int16) if bits else t).numpy().view(np_dtype)
                  for t in (torch.as_tensor(r).detach().to("cpu", dtype) for r in rows)]  # fmt: skip
    fill_bits = torch.tensor(fill, dtype=dtype).view(torch.int16).item() & 0xFFFF if bits else None
    result = torch.from_numpy(_filled(arrays, length, fill_bits if bits else fill, np_dtype, ndim))
    return result.view(dtype) if bits else result


@functools.lru_cache(maxsize=None)
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """numpy's dtype for a torch dtype numpy has (asked once: a torch op per batch otherwise)."""
    return torch.empty(0, dtype=dtype).numpy().dtype


def positions_in_rows(lengths: np.ndarray) -> np.ndarray:
    """For rows of `lengths` joined end to end, each value's position within its own row (0 at each row's start)."""
    return np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def pad_joined(rows: JoinedRows, length: int, fill: float, np_dtype) -> np.ndarray:
    """(rows, length, *per position) of `np_dtype`: each row's values at the start of its own, `fill` after, in one
    masked assignment (row-major, as the rows were joined)."""
    values = rows.values
    out = np.full((len(rows.lengths), length, *values.shape[1:]), fill, dtype=np_dtype)
    out[np.arange(length) < rows.lengths[:, None]] = values
    return out


def _filled(arrays: list[np.ndarray] | JoinedRows, length: int, fill: float, np_dtype, ndim: int = 2) -> np.ndarray:
    """(batch, length, *per position) of `np_dtype`: each array's rows at the start of its own, `fill` after (an
    empty row given as a list is shape (0,), whatever the column's per-position shape); joined rows by pad_joined."""
    if isinstance(arrays, JoinedRows):
        return pad_joined(arrays, length, fill, np_dtype)
    per_position = next((a.shape[1:] for a in arrays if a.ndim == ndim), (0,) * (ndim - 1))
    out = np.full((len(arrays), length, *per_position), fill, dtype=np_dtype)
    for row, a in enumerate(arrays):
        if a.size:
            out[row, : a.shape[0]] = a
    return out
