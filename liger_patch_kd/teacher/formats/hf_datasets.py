"""A store as a Hugging Face `datasets.Dataset` (Arrow, memory-mapped) and back; table files for converters.

Columns: input_ids (list of int32), teacher_token_ids (list of K int32 per position), teacher_logprobs (list of
K float32 per position; padding -1 / -inf as in the store). `map` / `filter` / `to_parquet` / streaming then work
on teacher data; `dataset_to_store` writes any such dataset (or a filtered one) back. The round trip is exact for
float32 stores, and for bf16 / fp16 stores (their values are exact in float32).
`datasets` and `pyarrow` are optional: pip install "liger-patch-kd[formats]".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..store import iter_store
from .common import converting, field, flush_rows, import_datasets, open_conversion, rows_to_arrays

COLUMNS = ("input_ids", "teacher_token_ids", "teacher_logprobs")


def store_to_dataset(store_dir: str | Path, cache_dir: str | Path | None = None):
    """The store as a `datasets.Dataset` (written once to Arrow files, then memory-mapped)."""
    datasets = import_datasets()
    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "teacher_token_ids": datasets.Sequence(datasets.Sequence(datasets.Value("int32"))),
        "teacher_logprobs": datasets.Sequence(datasets.Sequence(datasets.Value("float32"))),
    })  # fmt: skip

    def rows(store: str) -> Iterator[dict]:
        for ids, top_ids, top_lp in iter_store(store):
            yield {"input_ids": ids.to(torch.int32).numpy(), "teacher_token_ids": top_ids.numpy(),
                   "teacher_logprobs": top_lp.float().numpy()}  # fmt: skip

    return datasets.Dataset.from_generator(
        rows,
        gen_kwargs={"store": str(store_dir)},
        features=features,
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
    names = {c: c for c in COLUMNS} | (columns or {})
    writer = open_conversion(
        out_dir, "datasets", meta, vocab_size=vocab_size, top_k=top_k, logprob_dtype=logprob_dtype,
        temperature=meta.pop("temperature", 1.0), shard_size=shard_size, encoding=encoding,
    )  # fmt: skip
    with converting(writer):
        pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for n, row in enumerate(rows):
            where = f"row {n}"
            got = [field(row, names[c], where) for c in COLUMNS]
            pending.append(rows_to_arrays(*got, top_k, vocab_size, where=where))
            if len(pending) == shard_size:
                flush_rows(writer, pending)
        flush_rows(writer, pending)
    return writer.out_dir
