"""DistillKit's compressed teacher data (arcee-ai/DistillKit, `DistributionQuantizationConfig`), into a store and
out of one.

Files: parquet with `input_ids` (list<uint64>), `compressed_logprobs` and `bytepacked_indices` (list<list<uint8>>,
one byte row per position), plus `compression_config.yaml` beside them (DistillKit's capture writes it; its
settings must be the ones the data was written with). Row j holds the teacher's top-k for the token after
input_ids[j], sorted by log-prob, descending: temperature-1 log-probs (vLLM `raw_logprobs`). A capture has
len(input_ids) - 1 rows; DistillKit's packing trims input_ids to the row count and marks packed examples with
`attention_mask` = 1, 2, ... (split back into sequences here).
The byte rows are decoded and encoded by distillkit_codec.py. The older "legacy" layout (`packed_indices`,
`exact_values`, `coeffs`) is refused. `pyarrow` (and `pyyaml`) are imported lazily.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..store import TeacherStoreError, iter_store, read_manifest, refuse_samples
from ..store.ids import token_ids
from .common import INSTALL_FORMATS, converting, flush_rows, open_conversion
from .distillkit_codec import (
    CONFIG_FILE,
    CompressorConfig,
    check_decoded,
    check_widths,
    decode_rows,
    encode_rows,
    read_config_file,
)

COLUMNS = ("input_ids", "compressed_logprobs", "bytepacked_indices")
_LEGACY_COLUMNS = {"packed_indices", "exact_values", "coeffs"}


def _rows_to_store_arrays(
    cfg: CompressorConfig, tokens: np.ndarray, ids: np.ndarray, values: np.ndarray, top_k: int, vocab_size: int,
    where: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One sequence's decoded rows as store arrays: -inf slots (vLLM's missing entries) become padding."""
    if np.isnan(values).any():
        pos = int(np.argwhere(np.isnan(values))[0, 0])
        raise TeacherStoreError(f"{where}, position {pos}: log-probs decode to NaN (the writer fitted a row holding "
                                f"-inf, or the settings are wrong)")  # fmt: skip
    kept = np.isfinite(values)
    bad = kept & ((ids >= cfg.d) | (ids >= vocab_size))
    if bad.any():
        pos, slot = (int(x) for x in np.argwhere(bad)[0])
        raise TeacherStoreError(
            f"{where}, position {pos}: token id {int(ids[pos, slot])} >= d {cfg.d} / vocab_size {vocab_size}: the "
            f"compressor's d is not the data's, or --vocab-size is too small for this teacher"
        )
    n = len(tokens)
    out_ids = np.full((n, top_k), -1, dtype=np.int32)
    out_lp = np.full((n, top_k), -np.inf, dtype=np.float64)
    keep = min(top_k, cfg.k)  # rows are sorted by log-prob, so the first slots are the most likely
    out_ids[: len(ids), :keep] = np.where(kept[:, :keep], ids[:, :keep], -1)
    out_lp[: len(ids), :keep] = np.where(kept[:, :keep], values[:, :keep], -np.inf)
    return torch.from_numpy(tokens), torch.from_numpy(out_ids), torch.from_numpy(out_lp).float()


# ------------------------------------------------------------------------------------------------- reading
def _check_columns(names: Iterable[str], where: str) -> None:
    names = set(names)
    if _LEGACY_COLUMNS <= names:
        raise TeacherStoreError(f"{where} is DistillKit's legacy layout ({sorted(_LEGACY_COLUMNS)}); only the newer "
                                f"compressed_logprobs + bytepacked_indices layout is supported")  # fmt: skip
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise TeacherStoreError(f"{where} lacks columns {missing} (has {sorted(names)}); DistillKit's packed parquet "
                                f"has {list(COLUMNS)}")  # fmt: skip


def _parquet_records(files: list[Path]) -> Iterator[dict]:
    """Rows of DistillKit parquet files with their byte rows as (P, bytes) uint8 arrays, vectorised per batch."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"this needs the `pyarrow` package: {INSTALL_FORMATS}") from e
    for path in files:
        pf = pq.ParquetFile(path)
        _check_columns(pf.schema_arrow.names, str(path))
        columns = list(COLUMNS) + (["attention_mask"] if "attention_mask" in pf.schema_arrow.names else [])
        for batch in pf.iter_batches(columns=columns, batch_size=256):
            cols = {name: batch.column(name) for name in columns}
            matrices = {name: _byte_matrix(cols[name], f"{path}: {name}") for name in COLUMNS[1:]}
            for i in range(batch.num_rows):
                record = {name: cols[name][i].values.to_numpy(zero_copy_only=False) for name in cols}
                for name, (starts, matrix) in matrices.items():
                    record[name] = matrix[starts[i] : starts[i + 1]]
                yield record


def _byte_matrix(column, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A list<list<uint8>> column -> (row start offsets, (positions, bytes) matrix); ragged rows are an error."""
    if column.null_count:
        raise TeacherStoreError(f"{where} has null rows")
    counts = column.value_lengths().to_numpy(zero_copy_only=False)
    inner = column.flatten()
    widths = inner.value_lengths().to_numpy(zero_copy_only=False)
    width = int(widths[0]) if len(widths) else 0
    if len(widths) and (widths != width).any():
        raise TeacherStoreError(f"{where}: byte rows of different lengths ({sorted(set(widths.tolist()))[:4]})")
    flat = inner.flatten().to_numpy(zero_copy_only=False).astype(np.uint8, copy=False)
    return np.concatenate([[0], np.cumsum(counts)]), flat.reshape(len(widths), width)


def _dict_records(rows: Iterable[dict]) -> Iterator[dict]:
    for n, row in enumerate(rows):
        where = f"row {n}"
        if not isinstance(row, dict):
            raise TeacherStoreError(f"{where} is a {type(row).__name__}, not a record with {list(COLUMNS)}")
        _check_columns(row.keys(), where)
        record = {"input_ids": row["input_ids"]}
        for name in COLUMNS[1:]:
            record[name] = _byte_rows(row[name], f"{where}: {name}")
        if row.get("attention_mask") is not None:
            record["attention_mask"] = row["attention_mask"]
        yield record


def _byte_rows(value: Any, where: str) -> np.ndarray:
    """A list of equal-length byte rows as (P, bytes) uint8; anything else is a TeacherStoreError."""
    try:
        raw = np.asarray(value)
    except ValueError:  # ragged: sized by the check in decode_rows
        return np.zeros(0, dtype=np.uint8)
    if raw.size == 0:
        return np.zeros((0, 0) if raw.ndim < 2 else raw.shape, dtype=np.uint8)
    if raw.dtype.kind not in "iu" or raw.ndim != 2 or raw.min() < 0 or raw.max() > 255:
        raise TeacherStoreError(f"{where} must be rows of bytes (integers 0-255, one row per position); got "
                                f"{raw.dtype} of shape {raw.shape}")  # fmt: skip
    return raw.astype(np.uint8)


def _segments(record: dict, where: str, vocab_size: int) -> Iterator[tuple[np.ndarray, slice]]:
    """(tokens, row slice) per sequence: a packed row is split where its attention_mask segment id changes."""
    try:  # uint64 ids are range-checked before any cast: 2**40 + 3 is an error, not 3
        tokens = token_ids(record["input_ids"], f"{where}: input_ids", vocab_size=vocab_size).reshape(-1)
    except ValueError as e:
        raise TeacherStoreError(str(e)) from None
    rows = len(record["compressed_logprobs"])
    if rows != len(record["bytepacked_indices"]) or rows not in (len(tokens), len(tokens) - 1):
        raise TeacherStoreError(
            f"{where}: {len(tokens)} input_ids, {rows} compressed_logprobs rows and "
            f"{len(record['bytepacked_indices'])} bytepacked_indices rows; expected one row per token (packed) or "
            f"per token but the last (a capture)"
        )
    mask = record.get("attention_mask")
    if mask is None or len(tokens) == 0:
        yield tokens, slice(0, rows)
        return
    mask = np.asarray(mask)
    if mask.dtype.kind not in "iu" or mask.ndim != 1:
        raise TeacherStoreError(f"{where}: attention_mask must be a list of integer segment ids")
    if len(mask) != len(tokens):
        raise TeacherStoreError(f"{where}: attention_mask has {len(mask)} entries for {len(tokens)} input_ids")
    cuts = np.concatenate([[0], np.flatnonzero(np.diff(mask)) + 1, [len(tokens)]])
    for start, end in zip(cuts[:-1], cuts[1:]):
        if mask[start] != 0:  # 0: padding, no example
            yield tokens[start:end], slice(start, min(end, rows))


def distillkit_to_store(
    source: str | Path | Iterable[dict], out_dir: str | Path, *, compressor: dict | str | Path | None = None,
    vocab_size: int | None = None, top_k: int | None = None, logprob_dtype: str = "float32",
    encoding: str = "plain", shard_size: int = 1024, **meta: Any,
) -> Path:  # fmt: skip
    """Convert DistillKit compressed teacher data into a store.

    source: a .parquet file, a folder of them (DistillKit's capture output, whose compression_config.yaml is used
    when `compressor` is None), or rows (dicts, e.g. a `datasets.Dataset`). compressor: the settings the data was
    written with (dict, .yaml / .json, or a folder). vocab_size: the teacher's (default: the settings' d); top_k:
    slots kept (default k; fewer keeps the most likely)."""
    if compressor is None:
        if isinstance(source, (str, Path)) and Path(source).is_dir():
            compressor = Path(source)
        else:
            raise ValueError("compressor=None: pass the settings the data was written with (its compression_config"
                             ".yaml, --compressor); only a capture folder carries them")  # fmt: skip
    cfg = CompressorConfig.from_any(compressor)
    vocab_size = cfg.d if vocab_size is None else vocab_size
    top_k = cfg.k if top_k is None else top_k
    if isinstance(source, (str, Path)):
        path = Path(source)
        files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
        if not files:
            raise ValueError(f"{path}: no .parquet files")
        records = _parquet_records(files)
    else:
        records = _dict_records(source)
    writer = open_conversion(
        out_dir, "distillkit", meta, vocab_size=vocab_size, top_k=top_k, logprob_dtype=logprob_dtype, temperature=1.0,
        shard_size=shard_size, encoding=encoding, distillkit_compressor=cfg.to_dict(),
    )  # fmt: skip
    with converting(writer):
        pending = []
        for n, record in enumerate(records):
            where = f"row {n}"
            lp_rows, idx_rows = record["compressed_logprobs"], record["bytepacked_indices"]
            check_widths(cfg, lp_rows, idx_rows, where)  # the settings' fault first: it explains the rest
            for tokens, rows in _segments(record, where, vocab_size):
                ids, values = decode_rows(cfg, lp_rows[rows], idx_rows[rows], where)
                check_decoded(cfg, values, where)
                pending.append(_rows_to_store_arrays(cfg, tokens, ids, values, top_k, vocab_size, where))
                if len(pending) == shard_size:
                    flush_rows(writer, pending)
        flush_rows(writer, pending)
    return writer.out_dir


def store_to_distillkit(
    store_dir: str | Path, out_dir: str | Path, *, compressor: dict | str | Path, rows_per_file: int = 4096
) -> Path:
    """Write a store as DistillKit compressed parquet (data_<n>.parquet + compression_config.yaml) in `out_dir`.

    Every position but a sequence's final padding row needs at least k finite slots (the format has no
    padding); a store with more than k slots keeps its k most likely. Lossless only with exact_k = k and an
    exact_dtype holding the store's values (float32 for a float32 store)."""
    refuse_samples(store_dir, "DistillKit's compressed format")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
        import yaml
    except ImportError as e:
        raise ImportError(f"this needs `pyarrow` and `pyyaml`: {INSTALL_FORMATS}") from e
    raw = compressor if isinstance(compressor, dict) else read_config_file(Path(compressor))
    meta = read_manifest(store_dir)
    cfg = CompressorConfig.from_dict({"d": meta["vocab_size"], **raw})
    if cfg.error_diffusion:
        raise ValueError("error_diffusion=True: this writer rounds to nearest only; set it to false (the reader is "
                         "the same either way)")  # fmt: skip
    if meta.get("temperature", 1.0) != 1.0:
        raise TeacherStoreError(f"{store_dir} holds log-probs at temperature {meta['temperature']}; DistillKit data "
                                f"is temperature 1")  # fmt: skip
    if meta["top_k"] < cfg.k:
        raise TeacherStoreError(f"{store_dir} has top_k {meta['top_k']} < the compressor's k {cfg.k}: lower k")
    out_dir = Path(out_dir)
    # never over a file it did not write: a folder already holding DistillKit's names is someone else's data
    names = sorted(p.name for p in out_dir.glob("*"))
    taken = [n for n in names if n == CONFIG_FILE or re.fullmatch(r"data_\d+\.parquet", n)]
    if taken:
        raise FileExistsError(f"--out {out_dir} already holds {', '.join(taken[:3])}: writing DistillKit data there "
                              f"would overwrite them; pass an empty or new folder")  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).write_text(yaml.safe_dump(cfg.to_dict()))
    byte_rows = pa.list_(pa.list_(pa.uint8()))
    schema = pa.schema([("input_ids", pa.list_(pa.uint64())), ("compressed_logprobs", byte_rows),
                        ("bytepacked_indices", byte_rows)])  # fmt: skip
    buffer: dict[str, list] = {name: [] for name in COLUMNS}
    files = 0

    def flush() -> None:
        nonlocal files
        if buffer["input_ids"]:
            pq.write_table(pa.table(buffer, schema=schema), out_dir / f"data_{files}.parquet")
            files += 1
            for column in buffer.values():
                column.clear()

    for n, (tokens, ids, lp) in enumerate(iter_store(store_dir)):
        ids, lp = ids[:, : cfg.k].numpy(), lp[:, : cfg.k].double().numpy()
        rows = len(tokens) - 1 if len(tokens) and not np.isfinite(lp[-1]).any() else len(tokens)
        short = ~np.isfinite(lp[:rows]).all(-1)
        if short.any():
            raise TeacherStoreError(f"store sequence {n}, position {int(np.argmax(short))}: fewer than k = {cfg.k} "
                                    f"slots; DistillKit's format has no padding slots: lower k")  # fmt: skip
        if ids.max(initial=-1) >= cfg.d:
            raise TeacherStoreError(f"store sequence {n}: token id {int(ids.max())} >= the compressor's d {cfg.d}")
        lp_rows, idx_rows = encode_rows(cfg, ids[:rows], lp[:rows])
        buffer["input_ids"].append(tokens.numpy().astype(np.uint64))
        buffer["compressed_logprobs"].append(list(lp_rows))
        buffer["bytepacked_indices"].append(list(idx_rows))
        if len(buffer["input_ids"]) == rows_per_file:
            flush()
    flush()
    return out_dir


def row_bytes(compressor: dict | str | Path) -> int:
    """Bytes per position of DistillKit's format with these settings (log-probs + ids)."""
    cfg = CompressorConfig.from_any(compressor)
    return cfg.logprob_bytes + cfg.index_bytes


__all__ = ["CompressorConfig", "decode_rows", "distillkit_to_store", "encode_rows", "row_bytes", "store_to_distillkit"]
