"""The one table of formats a store converts to and from: `CONVERTERS[name] = Converter(to_store, from_store)`.
`liger-kd convert --from / --to` takes its choices from it, and calls `to_store` for `--from name --to store`,
`from_store` for `--from store --to name` (the "store" row re-encodes a store into a new one). Each function
takes (input, out, options: ConvertOptions), the command line's options."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..store import read_manifest
from .axolotl import axolotl_to_store, store_to_axolotl
from .distillkit import distillkit_to_store, store_to_distillkit
from .hf_datasets import dataset_to_store, load_table, store_items, store_to_dataset


@dataclass(frozen=True)
class ConvertOptions:
    """What a conversion may need; each converter reads its own (see `liger-kd convert --help`)."""

    vocab_size: int | None = None
    top_k: int | None = None
    compressor: str | None = None
    temperature: float = 1.0
    keep_temperature: bool = False
    logprobs_field: str = "logprobs"
    encoding: str = "plain"
    dtype: str | None = None
    shard_size: int = 1024

    def store_options(self) -> dict:
        """The options of the store a conversion writes; refused without the vocabulary and k."""
        return dict(vocab_size=self.vocab_size, top_k=self.top_k, logprob_dtype=self.dtype or "float32",
                    encoding=self.encoding, shard_size=self.shard_size)  # fmt: skip


Convert = Callable[[str, str, ConvertOptions], Path]


@dataclass(frozen=True)
class Converter:
    to_store: Convert  # (the format's input, a new store folder, options)
    from_store: Convert  # (a store folder, the format's output, options)


def _needs_vocab_and_k(name: str, options: ConvertOptions) -> None:
    if options.vocab_size is None or options.top_k is None:
        raise ValueError(f"--from {name} needs --vocab-size (the teacher's) and --top-k (slots to keep)")


def save_table(table, out: str) -> Path:
    """A `datasets.Dataset` as .parquet, .jsonl / .json, or a save_to_disk folder, by the name of `out`."""
    if out.endswith(".parquet"):
        table.to_parquet(out)
    elif out.endswith((".jsonl", ".json")):
        table.to_json(out)
    else:
        table.save_to_disk(out)
    return Path(out)


def store_rows(store: str):
    """A store's sequences as rows of the `datasets` layout (input_ids, teacher_token_ids, teacher_logprobs, and the
    sampled tokens' columns of a store of them)."""
    return store_items(store)


def _restore(source: str, out: str, options: ConvertOptions) -> Path:
    """store -> store: the same sequences in a new store (e.g. another --encoding or --dtype)."""
    meta = read_manifest(source)
    seed = {"sample_seed": meta["sample_seed"]} if "sample_seed" in meta else {}
    return dataset_to_store(
        store_rows(source), out, vocab_size=meta["vocab_size"], top_k=meta["top_k"],
        logprob_dtype=options.dtype or meta.get("logprob_dtype", "float32"), encoding=options.encoding,
        shard_size=options.shard_size, teacher=meta.get("teacher", ""), temperature=meta.get("temperature", 1.0),
        tokenizer_fingerprint=meta.get("tokenizer_fingerprint"), **seed,
    )  # fmt: skip


def _axolotl_to_store(source: str, out: str, options: ConvertOptions) -> Path:
    _needs_vocab_and_k("axolotl", options)
    return axolotl_to_store(load_table(source), out, temperature=options.temperature,
                            keep_temperature=options.keep_temperature, logprobs_field=options.logprobs_field,
                            **options.store_options())  # fmt: skip


def _hf_to_store(source: str, out: str, options: ConvertOptions) -> Path:
    _needs_vocab_and_k("hf", options)
    return dataset_to_store(load_table(source), out, **options.store_options())


def _distillkit_to_store(source: str, out: str, options: ConvertOptions) -> Path:
    # the settings carry the vocabulary and k: --vocab-size / --top-k may be left out
    return distillkit_to_store(source, out, compressor=options.compressor, **options.store_options())


def _store_to_axolotl(store: str, out: str, options: ConvertOptions) -> Path:
    return save_table(store_to_axolotl(store), out)


def _store_to_hf(store: str, out: str, options: ConvertOptions) -> Path:
    return save_table(store_to_dataset(store), out)


def _store_to_distillkit(store: str, out: str, options: ConvertOptions) -> Path:
    if options.compressor is None:
        raise ValueError("--to distillkit needs --compressor (a compression_config.yaml: d, k, exact_k, ...)")
    return store_to_distillkit(store, out, compressor=options.compressor)


CONVERTERS: dict[str, Converter] = {
    "store": Converter(to_store=_restore, from_store=_restore),
    "axolotl": Converter(to_store=_axolotl_to_store, from_store=_store_to_axolotl),
    "hf": Converter(to_store=_hf_to_store, from_store=_store_to_hf),
    "distillkit": Converter(to_store=_distillkit_to_store, from_store=_store_to_distillkit),
}


def convert(from_format: str, to_format: str, source: str, out: str, options: ConvertOptions) -> Path:
    """One conversion through the table; one side must be "store" (convert through a store otherwise)."""
    if from_format == to_format and from_format != "store":
        raise ValueError(f"--from and --to are both {from_format}: nothing to convert")
    if from_format == "store":
        if to_format != "store" and (Path(out).exists() or Path(out).is_symlink()):
            # an export writes a new file or folder (as the store writer refuses a file for a store): never over one
            raise FileExistsError(f"--out {out} already exists: --to {to_format} writes a new file or folder and "
                                  f"does not overwrite; remove it or pass another --out")  # fmt: skip
        return CONVERTERS[to_format].from_store(source, out, options)
    if to_format != "store":
        raise ValueError(f"--from {from_format} converts to --to store only (then export the store)")
    return CONVERTERS[from_format].to_store(source, out, options)
