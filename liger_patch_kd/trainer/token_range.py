"""Token ids checked against the student's vocabulary as each batch is collated, on the CPU before it moves: an id
past the embedding's rows (rows tokenized by another tokenizer, a pad id the model does not have) or a negative one
is a one-line ValueError naming the column, the id and the vocabulary, not the embedding's IndexError mid-step (or,
on a GPU, a device-side assert). Two reductions over a CPU tensor the collator just built: no device sync."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


class CheckedTokenIds:
    """A DataLoader's collate_fn whose batches' input_ids (and labels) are checked against the student's
    vocabulary: `input_rows` embedding rows, `output_rows` lm_head rows; `where` names the dataset."""

    def __init__(self, collate: Callable, input_rows: int, output_rows: int | None, ignore_index: int,
                 where: str) -> None:  # fmt: skip
        self.collate, self.input_rows, self.output_rows = collate, input_rows, output_rows
        self.ignore_index, self.where = ignore_index, where

    def __call__(self, features: Any) -> Any:
        batch = self.collate(features)
        if isinstance(batch, Mapping):
            check_token_ids(batch, self.input_rows, self.output_rows, self.ignore_index, self.where)
        return batch


def check_token_ids(batch: Mapping[str, Any], input_rows: int, output_rows: int | None, ignore_index: int,
                    where: str) -> None:  # fmt: skip
    ids = batch.get("input_ids")
    if _on_cpu(ids):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= input_rows:
            bad = high if high >= input_rows else low
            raise ValueError(
                f"{where}: a batch's input_ids holds id {bad} (ids in [{low}, {high}]) and the student's embedding "
                f"has {input_rows} rows (ids 0..{input_rows - 1}): tokenize the rows with the student's tokenizer "
                f"(processing_class), pad with a token id the model has (attention_mask / labels=-100 hide it), or "
                f"resize the student's embeddings (model.resize_token_embeddings(len(tokenizer)))"
            )
    labels = batch.get("labels")
    if output_rows is None or not _on_cpu(labels):
        return
    scored = labels[labels != ignore_index]
    if scored.numel() and (int(scored.min()) < 0 or int(scored.max()) >= output_rows):
        bad = int(scored.max()) if int(scored.max()) >= output_rows else int(scored.min())
        raise ValueError(
            f"{where}: a batch's labels holds id {bad}, neither ignored ({ignore_index}) nor one of the student's "
            f"{output_rows} lm_head rows: mark unscored positions with {ignore_index}, and tokenize with the "
            f"student's tokenizer"
        )


def _on_cpu(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and tensor.numel() > 0


def check_collated_ids(dataloader: Any, input_rows: int | None, output_rows: int | None, ignore_index: int,
                       where: str) -> Any:  # fmt: skip
    """`dataloader` (a torch DataLoader, or accelerate's) with its collate_fn checking each batch's ids; kept as it
    is when the vocabulary is unknown or it has no collate_fn to wrap."""
    # accelerate's DataLoaderShard reads collate_fn off the DataLoader it wraps (its base_dataloader)
    loader = getattr(dataloader, "base_dataloader", dataloader)
    collate = getattr(loader, "collate_fn", None)
    if input_rows is None or collate is None or isinstance(collate, CheckedTokenIds):
        return dataloader
    loader.collate_fn = CheckedTokenIds(collate, input_rows, output_rows, ignore_index, where)
    return dataloader
