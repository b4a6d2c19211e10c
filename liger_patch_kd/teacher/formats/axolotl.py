"""axolotl's knowledge-distillation datasets, into a store and out of one.

Two layouts, both with `input_ids`:
- current: `target_token_ids` (per position, K ids), `target_logprobs` (K log-probs), `target_mask` (K 0/1);
  row j describes input_ids[j + 1], as the store's row j does (logit alignment), so rows copy across unchanged.
- older: one column (default `logprobs`) holding, per position, a list of {"token": "token_id:N", "logprob": x}
  (vLLM's OpenAI-style entries), aligned the same way.

Temperature. The data may have been made at a temperature T (axolotl's `kd_temperature` at capture time); the
store holds temperature-1 log-probs, because only those can be re-tempered exactly. Going back from T to 1 is
exact only when each row holds the full distribution: then log_softmax(T * logprob_T) is the T = 1 row. With top-k
rows the normaliser of the T = 1 distribution over the other tokens is unknown, so the conversion is refused
unless `keep_temperature=True`, which stores the log-probs as they are and records T in the manifest (the
loss then sees a teacher already tempered at T: use kd temperature 1 to avoid tempering twice).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..store import TeacherStoreError, iter_store, read_manifest, refuse_samples
from .common import converting, field, flush_rows, import_datasets, open_conversion, rows_to_arrays

_TOKEN = re.compile(r"^token_id:(\d+)$")


def axolotl_to_store(
    rows: Iterable[dict], out_dir: str | Path, *, vocab_size: int, top_k: int, temperature: float = 1.0,
    keep_temperature: bool = False, logprobs_field: str = "logprobs", logprob_dtype: str = "float32",
    encoding: str = "plain", shard_size: int = 1024, **meta: Any,
) -> Path:  # fmt: skip
    """Convert axolotl KD rows (either layout, see the module docstring) made at `temperature` into a store."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (the temperature the data was made at); got {temperature}")
    full_vocab = top_k >= vocab_size
    if temperature != 1.0 and not full_vocab and not keep_temperature:
        raise TeacherStoreError(
            f"the data was made at temperature {temperature} with top-{top_k} of {vocab_size} tokens: going back to "
            f"temperature 1 is exact only with the full distribution (the T=1 normaliser of the other tokens is "
            f"unknown). Pass keep_temperature=True (--keep-temperature) to store them as tempered log-probs, and "
            f"train with kd temperature 1"
        )
    stored_t = temperature if keep_temperature else 1.0
    writer = open_conversion(
        out_dir, "axolotl", meta, vocab_size=vocab_size, top_k=top_k, logprob_dtype=logprob_dtype,
        temperature=stored_t, shard_size=shard_size, encoding=encoding,
    )  # fmt: skip
    with converting(writer):
        pending = []
        for n, row in enumerate(rows):
            where = f"row {n}"
            seq = field(row, "input_ids", where)
            if "target_token_ids" in row:
                seq, ids, lp = rows_to_arrays(
                    seq, row["target_token_ids"], field(row, "target_logprobs", where), top_k, vocab_size, where,
                    mask=row.get("target_mask"),
                )  # fmt: skip
            elif logprobs_field in row:
                ids_rows, lp_rows = _parse_token_entries(row[logprobs_field], where)
                seq, ids, lp = rows_to_arrays(seq, ids_rows, lp_rows, top_k, vocab_size, where)
            else:
                raise TeacherStoreError(
                    f"{where} has neither target_token_ids nor {logprobs_field!r}; columns: {sorted(row)}; pass "
                    f"logprobs_field= (--logprobs-field) for the older layout"
                )
            if temperature != 1.0 and not keep_temperature:  # full rows: exact
                filled = (ids >= 0).any(-1)  # positions without a target (the last) stay padding
                if not bool((ids[filled] >= 0).all()):
                    raise TeacherStoreError(f"{where}: a row is not the full distribution; cannot undo temperature")
                lp[filled] = torch.log_softmax(lp[filled].double() * temperature, dim=-1).float()
            pending.append((seq, ids, lp))
            if len(pending) == shard_size:
                flush_rows(writer, pending)
        flush_rows(writer, pending)
    return writer.out_dir


def _parse_token_entries(positions: Any, where: str) -> tuple[list[list[int]], list[list[float]]]:
    """vLLM-style [{"token": "token_id:N", "logprob": x}, ...] per position -> ids and log-probs per position."""
    if not isinstance(positions, (list, tuple, np.ndarray)):
        raise TeacherStoreError(f"{where}: the log-prob column must be a list of positions; got "
                                f"{type(positions).__name__}")  # fmt: skip
    ids_rows, lp_rows = [], []
    for t, entries in enumerate(positions):
        ids, lps = [], []
        if entries is not None and not isinstance(entries, (list, tuple, np.ndarray)):
            raise TeacherStoreError(f"{where}, position {t}: expected a list of entries; got {type(entries).__name__}")
        for e, entry in enumerate(entries if entries is not None else []):
            at = f"{where}, position {t}, entry {e}"
            if not isinstance(entry, dict) or "token" not in entry or "logprob" not in entry:
                raise TeacherStoreError(f"{at}: expected {{'token': 'token_id:N', 'logprob': x}}; got "
                                        f"{str(entry)[:80]}")  # fmt: skip
            match = _TOKEN.match(str(entry["token"]))
            if not match:
                raise TeacherStoreError(f"{at}: token {entry['token']!r} is not 'token_id:N'")
            value = entry["logprob"]
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise TeacherStoreError(f"{at}: logprob {value!r} is not a number")
            ids.append(int(match.group(1)))
            lps.append(float(value))
        ids_rows.append(ids)
        lp_rows.append(lps)
    return ids_rows, lp_rows


def store_to_axolotl(store_dir: str | Path):
    """The store as a `datasets.Dataset` in axolotl's current layout (input_ids, labels, target_token_ids,
    target_logprobs, target_mask; padding slots: id 0, log-prob 0, mask 0). Refuses a store whose manifest
    records temperature != 1 being passed off as temperature 1: the temperature is kept in the dataset's info."""
    datasets = import_datasets()
    refuse_samples(store_dir, "axolotl's layout")  # now, not inside the dataset's generator
    meta = read_manifest(store_dir)
    if meta.get("temperature", 1.0) != 1.0:
        warnings.warn(f"{store_dir} holds log-probs at temperature {meta['temperature']}; axolotl must be told so",
                      stacklevel=2)  # fmt: skip

    def rows(store: str):
        for seq, ids, lp in iter_store(store):
            mask = (ids >= 0).numpy()
            yield {
                "input_ids": seq.numpy(),
                "labels": seq.numpy(),
                "target_token_ids": np.where(mask, ids.numpy(), 0).astype(np.int64),
                "target_logprobs": np.where(mask, lp.float().numpy(), 0.0).astype(np.float32),
                "target_mask": mask.astype(np.int64),
            }

    return datasets.Dataset.from_generator(rows, gen_kwargs={"store": str(store_dir)})
