"""Batches of rows routed to several teachers: each row's `teacher` (a name or an index) or `teacher_weights` (a
mixture) becomes the batch's `teacher_mixture`, (B, J) weights, or (rows, T, J) when the rows are packed. What a
row's routing means (the teachers' names, the default mixture, the checks of a row's weights) is the teacher set's:
the collator asks it (`row_weights`), and leaves the rows themselves to the collator it wraps."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .columns import INPUT_IDS, ROUTING_COLUMNS, TEACHER_MIXTURE


class Routing(Protocol):
    """What a routing collator asks of the teacher set (trainer/teachers/routes.py: TeacherRoutes)."""

    tokenizers: Any  # teachers of tokenizers of their own, which collate the rows' text themselves; or None

    def row_weights(self, row: dict[str, Any]) -> list[float]: ...


class RoutingCollator:
    """`inner` on the rows without their routing columns, plus `teacher_mixture` from them (a class, not a closure:
    DataLoader workers started by spawn pickle it)."""

    def __init__(self, setup: Routing, inner) -> None:
        self.setup, self.inner = setup, inner

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        mixture = torch.tensor([self.setup.row_weights(f) for f in features], dtype=torch.float32)
        rows = [{k: v for k, v in f.items() if k not in ROUTING_COLUMNS} for f in features]
        if self.setup.tokenizers is not None:  # rows of text, tokenized for the student and each other tokenizer
            return {**self.setup.tokenizers.collate(rows, mixture), TEACHER_MIXTURE: mixture}
        batch = dict(self.inner(rows))
        batch[TEACHER_MIXTURE] = per_token_if_packed(mixture, features, batch[INPUT_IDS])
        return batch


def per_token_if_packed(mixture: torch.Tensor, features: list[dict[str, Any]], input_ids: torch.Tensor):
    """(B, J) when the collator keeps one example per row; packed (DataCollatorWithFlattening: the examples laid
    end to end in fewer rows), every token takes its own example's weights, (rows, T, J)."""
    if input_ids.shape[0] == len(features):
        return mixture
    lengths = torch.tensor([len(f[INPUT_IDS]) for f in features])
    if int(lengths.sum()) != input_ids.numel():
        raise ValueError(
            f"the collator put {len(features)} examples of {int(lengths.sum())} tokens into a batch of shape "
            f"{tuple(input_ids.shape)}; routing to several teachers needs one example per row, or the examples "
            f"packed end to end (DataCollatorWithFlattening)"
        )
    return mixture.repeat_interleave(lengths, dim=0).reshape(*input_ids.shape, mixture.shape[-1])


class NamesIfGivenCollator(RoutingCollator):
    """RoutingCollator when any row of the batch names its teacher (then every row must), else `inner` alone: offline
    rows that name their teachers for the per-teacher figures only (an evaluation store naming none is collated as
    it would be without them)."""

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        if any(f.get(c) is not None for f in features for c in ROUTING_COLUMNS):
            return super().__call__(features)
        return self.inner(features)
