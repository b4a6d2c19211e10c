"""Token ids checked before any cast: every writer and converter turns ids into int32 through `token_ids`, so an id
outside the store's range, a fractional id or a non-number is an error naming where it is, never a wrapped,
truncated or dropped value."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

ID_LIMIT = 2**31  # ids are stored as int32


def token_ids(values: Any, where: str, *, vocab_size: int | None = None, padding: bool = False) -> np.ndarray:
    """`values` (a list, numpy array or tensor of any shape) as int64, after checking each is an integer in
    [0, min(vocab_size, 2**31)) — or -1 when `padding` (the store's empty slot). Raises ValueError naming `where`,
    the offending value and its position; nothing is cast, wrapped or rounded before the check."""
    limit = ID_LIMIT if vocab_size is None else min(int(vocab_size), ID_LIMIT)
    low = -1 if padding else 0
    if torch.is_tensor(values):
        values = values.detach().cpu()
        values = values.double() if values.is_floating_point() else values
        arr = values.numpy()
    else:
        try:
            arr = np.asarray(values)
        except (ValueError, TypeError, OverflowError) as e:  # ragged nesting, unconvertible objects
            raise ValueError(f"{where}: token ids are not a regular array of integers ({_first_line(e)})") from None
    if arr.dtype.kind == "O":  # Python ints beyond int64, or mixed objects
        arr = _object_ids(arr, where)
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"{where}: token ids must be integers; got {arr.dtype} values (e.g. {_example(arr)!r}); "
                         f"fix the column's type")  # fmt: skip
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.floor(arr))
        if bad.any():
            at = np.argwhere(bad)[0]
            value = arr[tuple(at)].item()
            raise ValueError(f"{where}: token id {value!r} at {_pos(at)} is not an integer; ids must be "
                             f"whole numbers (is this a log-prob column?)")  # fmt: skip
    if arr.size:
        out_of_range = (arr < low) | (arr >= limit)
        if out_of_range.any():
            at = np.argwhere(out_of_range)[0]
            value = arr[tuple(at)]
            value = int(value) if arr.dtype.kind != "f" else value.item()
            what = f"vocab_size {vocab_size}" if vocab_size is not None and vocab_size < ID_LIMIT else "2**31"
            allowed = f"[{low}, {limit})" + (" (-1: padding)" if padding else "")
            raise ValueError(f"{where}: token id {value} at {_pos(at)} is outside {allowed}: ids must be below {what}; "
                             f"check --vocab-size and that the data was tokenized for this teacher")  # fmt: skip
    return arr.astype(np.int64)


def _object_ids(arr: np.ndarray, where: str) -> np.ndarray:
    flat = arr.reshape(-1)
    for n, v in enumerate(flat):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer, float, np.floating)):
            raise ValueError(f"{where}: token id {v!r} at {_pos(np.unravel_index(n, arr.shape))} is not an integer")
        if not -(2**63) <= v < 2**63:
            raise ValueError(f"{where}: token id {v} at {_pos(np.unravel_index(n, arr.shape))} is outside [0, 2**31)")
    return np.asarray(flat.tolist(), dtype=np.float64 if any(isinstance(v, float) for v in flat) else np.int64
                      ).reshape(arr.shape)  # fmt: skip


def _pos(at: Any) -> str:
    at = [int(i) for i in np.atleast_1d(at)]
    return "index " + ", ".join(map(str, at)) if at else "index ()"


def _example(arr: np.ndarray) -> Any:
    return arr.reshape(-1)[0].item() if arr.size else None


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
