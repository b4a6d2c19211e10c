"""Rows of text ({"text": ...}, Hugging Face's most common format and what `liger-kd precompute --data` reads)
tokenized for the user when KDTrainer is built, as TRL's trainers do: input_ids from processing_class (special
tokens added, as precompute adds them; the first kd_max_length tokens when set), labels then copied from them by the
collator. A datasets.IterableDataset is tokenized lazily (IterableDataset.map), row by row as training reads it.
Without a tokenizer such rows, and rows with no column KDTrainer trains on, are refused in one line naming the
columns found, before any work; so is a row whose text tokenizes to no tokens (blank text, a tokenizer that adds no
BOS), by its index: before training for a list or a datasets.Dataset, when it is read for an iterable one. And the
note a run without the patch gets at its first step: what its materialised logits cost."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TEXT = "text"
TRAINED_COLUMNS = ("input_ids", TEXT, "prompt", "messages")  # a row needs one (prompt / messages: TRL's formats)


def tokenize_text_datasets(kwargs: dict[str, Any], max_length: int | None, across_tokenizers: bool) -> None:
    """KDTrainer's train_dataset and eval_dataset (one, or a dict of them) in `kwargs`, their text rows replaced by
    token rows; across tokenizers by {"prompt": "", "completion": text} rows, which the cross-tokenizer collator
    tokenizes with both tokenizers."""
    tokenizer = kwargs.get("processing_class")
    for key in ("train_dataset", "eval_dataset"):
        value = kwargs.get(key)
        if isinstance(value, Mapping) and key == "eval_dataset":
            kwargs[key] = {name: _rows(d, f"{key}[{name!r}]", tokenizer, max_length, across_tokenizers,
                                       kwargs.get("data_collator")) for name, d in value.items()}  # fmt: skip
        elif value is not None:
            kwargs[key] = _rows(value, key, tokenizer, max_length, across_tokenizers, kwargs.get("data_collator"))


def _first_row(dataset: Any) -> Any:
    if not _is_hf_iterable(dataset):  # (whose dataset[0] is a column named 0, not a row)
        try:
            return dataset[0]
        except Exception:  # another iterable (or none): its rows are the collator's business
            return None
    if dataset.column_names is not None:  # known without reading a row (a stream may be remote)
        return dict.fromkeys(dataset.column_names)
    try:
        return next(iter(dataset))
    except Exception:  # an empty or unreadable stream: training says so where it reads it
        return None


def _is_hf_iterable(dataset: Any) -> bool:
    """Whether `dataset` is a datasets.IterableDataset (datasets is an optional extra: never imported here)."""
    return any(c.__name__ == "IterableDataset" and c.__module__.startswith("datasets") for c in type(dataset).__mro__)


def _rows(dataset: Any, name: str, tokenizer: Any, max_length: int | None, across: bool, collator: Any) -> Any:
    row = _first_row(dataset)
    if not isinstance(row, Mapping) or "input_ids" in row:
        return dataset
    columns = sorted(row)
    if TEXT not in row:
        if collator is None and not any(c in row for c in TRAINED_COLUMNS):
            raise ValueError(
                f"{name}'s rows have the columns {columns}, none of which KDTrainer trains on: give 'input_ids' "
                f"(token ids), 'text' (with processing_class=tokenizer), 'prompt' + 'completion' or 'messages' (TRL's "
                f"formats), or a data_collator that builds input_ids from these columns"
            )
        return dataset
    if any(c in row for c in ("prompt", "messages")):
        return dataset  # TRL's formats: the prompt collators read them
    if across:
        return _map(dataset, lambda text, index: {"prompt": "", "completion": text}, name)
    if tokenizer is None:
        raise ValueError(
            f"{name}'s rows have the columns {columns} and no 'input_ids': KDTrainer tokenizes 'text' with the "
            f"student's tokenizer. Pass processing_class=tokenizer, or tokenize the rows into 'input_ids' yourself"
        )
    if not callable(tokenizer):
        raise ValueError(
            f"{name}'s rows have the columns {columns} and no 'input_ids', and processing_class "
            f"({type(tokenizer).__name__}) cannot tokenize text: it is not callable as a Hugging Face tokenizer "
            f"(tokenizer(text)['input_ids']). Pass a transformers tokenizer, or tokenize the rows into 'input_ids'"
        )

    def tokenize(text: str, index: int) -> dict[str, Any]:
        if not isinstance(text, str):
            raise ValueError(f"{name}[{index}]'s 'text' is {type(text).__name__}, not a str: {str(text)[:60]!r}")
        ids = tokenizer(text, add_special_tokens=True, truncation=max_length is not None, max_length=max_length)
        if len(ids["input_ids"]) == 0:  # a row of no tokens: attention cannot run on it
            raise ValueError(
                f"{name}[{index}]'s 'text' {text[:40]!r} tokenizes to no tokens with processing_class "
                f"({type(tokenizer).__name__}, which adds no BOS token); remove blank rows (e.g. "
                f"dataset.filter(lambda row: row['text'].strip())) or give the row text"
            )
        return {"input_ids": ids["input_ids"]}

    return _map(dataset, tokenize, name)


def _text(row: Any, index: int, name: str) -> Any:
    """A row's 'text'; a row without one (the first row had it) is refused by index with the columns it has."""
    if not isinstance(row, Mapping) or row.get(TEXT) is None:
        has = sorted(k for k, v in row.items() if v is not None) if isinstance(row, Mapping) else type(row).__name__
        raise ValueError(f"{name}[{index}] has no 'text' value (its columns with a value: {has}), and the rows before "
                         f"it are text rows: give every row a 'text', or remove the rows without one")  # fmt: skip
    return row[TEXT]


def _map(dataset: Any, make: Any, name: str) -> Any:
    """Each row with its 'text' replaced by make(text, row index)'s columns: a list of dicts stays a list, a
    datasets.Dataset becomes one (Dataset.map; its other columns kept), a datasets.IterableDataset stays one, mapped
    lazily as it is read (IterableDataset.map)."""
    if _is_hf_iterable(dataset):
        return dataset.map(lambda row, index: make(_text(row, index, name), index), with_indices=True,
                           remove_columns=[TEXT])  # fmt: skip
    if hasattr(dataset, "map") and hasattr(dataset, "column_names"):
        return dataset.map(lambda row, index: make(_text(row, index, name), index), with_indices=True,
                           remove_columns=[TEXT], desc="tokenizing text rows")  # fmt: skip
    return [{**{k: v for k, v in row.items() if k != TEXT}, **make(_text(row, i, name), i)}
            for i, row in enumerate(dataset)]  # fmt: skip


def materialised_logits_note(tokens: int, vocab: int, offline: bool) -> str:
    """use_kd_patch=False's note: the logits a step materialises, their size for this batch, the flag."""
    return (
        f"use_kd_patch=False: each step materialises the (tokens x vocabulary) logits of the student"
        f"{'' if offline else ' and of the teacher'}, N x V x 4 bytes in float32 = {tokens} x {vocab} x 4 = "
        f"{tokens * vocab * 4 / 2**20:.1f} MiB each (this first batch), which the fused loss never holds; set "
        f"use_kd_patch=True (KDTrainingArguments; --use_kd_patch on liger-kd train's command line) to train without "
        f"them"
    )
