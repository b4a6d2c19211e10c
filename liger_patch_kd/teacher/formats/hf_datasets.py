"""A store as a Hugging Face `datasets.Dataset` (Arrow, memory-mapped) and back; table files for converters.

Columns: input_ids (list of int32), teacher_token_ids (list of K int32 per position), teacher_logprobs (list of K
float32 per position; padding -1 / -inf as in the store). A store of sampled teacher tokens (store/samples.py) adds
teacher_sample_ids / teacher_sample_counts (m int32 per position) / teacher_sample_logprobs (m float32; padding -1,
0, -inf) and teacher_sample_temperature (the draws' temperature, on every row, so that .jsonl keeps it); K is then
the hybrid's top-k (0: empty lists), and the way back writes a sampled store again. `map` / `filter` / `to_parquet`
/ streaming then work on teacher data; `dataset_to_store` writes any such dataset (or a filtered one) back. The
round trip is exact for float32 stores, and for bf16 / fp16 stores (their values are exact in float32). `datasets`
and `pyarrow` are optional: pip install "liger_patch_kd[formats]" (from a clone: pip install -e ".[formats]").
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...batch.columns import (
    SAMPLE_COLUMNS,
    TEACHER_LOGPROBS,
    TEACHER_SAMPLE_IDS,
    TEACHER_SAMPLE_TEMPERATURE,
    TEACHER_TOKEN_IDS,
)
from ..store import TeacherLogprobsDataset, TeacherStoreError, read_manifest
from ..store.samples import samples_of
from .common import converting, field, flush_rows, import_datasets, open_conversion, rows_to_arrays

COLUMNS = ("input_ids", TEACHER_TOKEN_IDS, TEACHER_LOGPROBS)
SAMPLE_DTYPES = (torch.int32, torch.int32, torch.float32)


def store_items(store_dir: str | Path) -> Iterator[dict]:
    """Every sequence of a store, in order, as a row of this layout (numpy arrays), the samples' columns included."""
    data = TeacherLogprobsDataset(store_dir)
    m, k = samples_of(data.meta), data.top_k
    for i in range(len(data)):
        item = data[i]
        n = len(item["input_ids"])
        row = {
            "input_ids": item["input_ids"].to(torch.int32).numpy(),
            TEACHER_TOKEN_IDS: item.get(TEACHER_TOKEN_IDS, torch.zeros(n, k, dtype=torch.int32)).numpy(),
            TEACHER_LOGPROBS: item.get(TEACHER_LOGPROBS, torch.zeros(n, k)).float().numpy(),
        }
        if m:
            row.update({name: item[name].to(dtype).numpy() for name, dtype in zip(SAMPLE_COLUMNS, SAMPLE_DTYPES)})
            row[TEACHER_SAMPLE_TEMPERATURE] = float(data.meta.get("temperature", 1.0))
        yield row


def store_to_dataset(store_dir: str | Path, cache_dir: str | Path | None = None):
    """The store as a `datasets.Dataset` (written once to Arrow files, then memory-mapped)."""
    datasets = import_datasets()

    def lists(dtype: str):
        return datasets.Sequence(datasets.Sequence(datasets.Value(dtype)))

    columns = {"input_ids": datasets.Sequence(datasets.Value("int32")), TEACHER_TOKEN_IDS: lists("int32"),
               TEACHER_LOGPROBS: lists("float32")}  # fmt: skip
    if samples_of(read_manifest(store_dir)):
        columns.update({name: lists(str(dtype).removeprefix("torch.")) for name, dtype in
                        zip(SAMPLE_COLUMNS, SAMPLE_DTYPES)})  # fmt: skip
        columns[TEACHER_SAMPLE_TEMPERATURE] = datasets.Value("float64")
    return datasets.Dataset.from_generator(
        store_items,
        gen_kwargs={"store_dir": str(store_dir)},
        features=datasets.Features(columns),
        cache_dir=None if cache_dir is None else str(cache_dir),
    )


def load_table(path: str | Path):
    """A dataset from a `save_to_disk` folder, or a .parquet / .jsonl / .json / .arrow file (or folder of them)."""
    datasets = import_datasets()
    path = Path(path)
    if path.is_dir() and (path / "dataset_info.json").exists():
        return datasets.load_from_disk(str(path))
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    kinds = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow"}
    kind = {kinds.get(f.suffix) for f in files} - {None}
    if len(kind) != 1:
        raise ValueError(
            f"{path}: expected a save_to_disk folder or .parquet / .jsonl / .arrow files; found {kind or 'none'}"
        )
    return datasets.load_dataset(kind.pop(), data_files=[str(f) for f in files if f.suffix in kinds], split="train")


def dataset_to_store(
    rows: Iterable[dict], out_dir: str | Path, *, vocab_size: int, top_k: int, columns: dict[str, str] | None = None,
    logprob_dtype: str = "float32", encoding: str = "plain", shard_size: int = 1024, **meta: Any,
) -> Path:  # fmt: skip
    """Write rows with (input_ids, teacher_token_ids, teacher_logprobs) into a store; `columns` renames them
    ({"teacher_token_ids": "my_ids", ...}). Rows with fewer than top_k slots are padded (-1, -inf)."""
    names = {c: c for c in (*COLUMNS, *SAMPLE_COLUMNS, TEACHER_SAMPLE_TEMPERATURE)} | (columns or {})
    rows = iter(rows)
    first = next(rows, None)
    sampled = isinstance(first, dict) and names[TEACHER_SAMPLE_IDS] in first
    drawn = sample_options(first, names, meta) if sampled else {}  # m and the draws' temperature, from the rows
    meta |= drawn
    writer = open_conversion(
        out_dir, "datasets", meta, vocab_size=vocab_size, top_k=top_k, logprob_dtype=logprob_dtype,
        temperature=meta.pop("temperature", 1.0), shard_size=shard_size, encoding=encoding,
    )  # fmt: skip
    with converting(writer):
        pending: list[tuple] = []
        for n, row in enumerate(itertools.chain([] if first is None else [first], rows)):
            where = f"row {n}"
            got = [field(row, names[c], where) for c in COLUMNS]
            arrays = rows_to_arrays(*got, top_k, vocab_size, where=where)
            if sampled:
                arrays = (*arrays, sample_arrays(row, names, len(arrays[0]), drawn, where))
            pending.append(arrays)
            if len(pending) == shard_size:
                flush_rows(writer, pending)
        flush_rows(writer, pending)
    return writer.out_dir


def sample_options(row: dict, names: dict[str, str], meta: dict) -> dict:
    """The store options of a dataset of sampled tokens, from its first row: samples (m) and temperature."""
    ids = field(row, names[TEACHER_SAMPLE_IDS], "row 0")
    m = len(ids[0]) if len(ids) else 0
    t = float(field(row, names[TEACHER_SAMPLE_TEMPERATURE], "row 0 (the draws' temperature)"))
    if "temperature" in meta and meta["temperature"] != t:
        raise TeacherStoreError(f"temperature {meta['temperature']} given, but the rows' draws were made at {t}")
    return {"samples": m, "temperature": t}


def sample_arrays(row: dict, names: dict[str, str], n: int, drawn: dict, where: str) -> tuple:
    """One row's (ids, counts, log-probs) (n, m) tensors (checked further by the store's writer); every row's draws
    at the first row's temperature."""
    m, t = drawn["samples"], float(field(row, names[TEACHER_SAMPLE_TEMPERATURE], where))
    if t != drawn["temperature"]:
        raise TeacherStoreError(f"{where}: draws at temperature {t}, the first row's at {drawn['temperature']}: "
                                f"one store holds one temperature")  # fmt: skip
    out = []
    for name, dtype in zip(SAMPLE_COLUMNS, SAMPLE_DTYPES):
        try:  # float64 holds every int32 id and count exactly, and -inf
            array = np.asarray([np.asarray(v, dtype=np.float64) for v in field(row, names[name], where)])
        except (ValueError, TypeError):
            array = None
        if array is None or array.shape != (n, m):
            got = "ragged" if array is None else array.shape
            raise TeacherStoreError(f"{where}: {names[name]} is {got}, not {n} positions of the first row's {m} slots")
        out.append(torch.from_numpy(array).to(dtype))
    return tuple(out)
