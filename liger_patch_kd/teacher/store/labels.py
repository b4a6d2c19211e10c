"""Completion-only labels in a store of given sequences (`liger-kd precompute` of TRL's prompt / completion or
messages rows). A store that holds them has the manifest key `labels: true`, and each shard holds, per position,
label-aligned like a training row's labels:
    labels  (int32)  the token itself on a completion, ignore_index (-100) on the prompt
so training on the store scores the completions only, as training on the rows with a teacher in process does
(batch/prompts.py's PromptCollator). A store without the key scores every token of its sequences. Such stores are
format 5: a reader that knows only formats up to 4 refuses them instead of training on their prompts as if they
were completions. A rollout store (rollouts.py) carries its labels among its own arrays and never this key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .rollouts import IGNORE_INDEX

LABELLED_FORMAT_VERSION = 5


def labels_of(meta: dict) -> bool:
    """Whether a store's shards hold completion-only labels (rollout stores hold theirs among the rollout arrays)."""
    return meta.get("labels") is True


def label_option_problem(meta: dict) -> str | None:
    """What is wrong with a manifest's `labels` key, or None."""
    if "labels" not in meta:
        return None
    if not isinstance(meta["labels"], bool):
        return f"labels must be true or false (whether the shards hold completion-only labels); got {meta['labels']!r}"
    if meta["labels"] and isinstance(meta.get("rollouts"), dict):
        return "a rollout store holds its labels among its rollout arrays, not under the key labels"
    return None


def label_tensor(labels: Sequence[Any] | None, sequences: Sequence[np.ndarray], where: str) -> torch.Tensor:
    """The shard's (positions,) int32 labels: each sequence's labels, of its length, each the token itself or
    ignore_index (-100); ValueError naming the sequence otherwise."""
    if labels is None or len(labels) != len(sequences):
        got = "none" if labels is None else f"{len(labels)}"
        raise ValueError(f"{where}: this store holds labels: pass labels= one list per sequence ({len(sequences)}); "
                         f"got {got}")  # fmt: skip
    rows = []
    for j, (label, seq) in enumerate(zip(labels, sequences)):
        label = np.asarray(label, dtype=np.int64).reshape(-1)
        if label.shape != seq.shape:
            raise ValueError(f"{where}, sequence {j}: {label.shape[0]} labels for {seq.shape[0]} tokens: give one "
                             f"label per token")  # fmt: skip
        wrong = (label != IGNORE_INDEX) & (label != seq)
        if wrong.any():
            t = int(np.argmax(wrong))
            raise ValueError(f"{where}, sequence {j}: label {int(label[t])} at position {t} is neither the token "
                             f"({int(seq[t])}) nor {IGNORE_INDEX}: a store's labels only say which tokens are scored")
        rows.append(label.astype(np.int32))
    return torch.from_numpy(np.concatenate(rows) if rows else np.zeros(0, np.int32))


def label_layout(meta: dict, positions: int) -> dict:
    """{array: (allowed safetensors dtypes, shape)} the labels of a shard must have (empty without)."""
    return {"labels": (("I32",), (positions,))} if labels_of(meta) else {}


def label_item(meta: dict, raw: dict, n: int) -> dict:
    """A store item's labels (int64, (n,)) from a sequence's raw rows (empty without)."""
    if not labels_of(meta):
        return {}
    return {"labels": torch.from_numpy(raw["labels"].view(np.int32).reshape(n).astype(np.int64))}
