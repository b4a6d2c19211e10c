"""The input checks of the loss front doors (fused.py, logprob.py, and align's fused loss).

Value checks that need the data (an id out of range, a NaN log-prob) return (device flag, message) pairs: the
flags stay on the device until `run_device_checks` reads them all with one host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import reference
from ..config import KDLossConfig
from ..conventions import topk_valid_slots

__all__ = [
    "check_labels",
    "check_linear",
    "check_num_items",
    "check_topk_shapes",
    "flatten_labels",
    "has_duplicate_ids",
    "label_check",
    "logprob_checks",
    "run_device_checks",
    "selected_tokens",
    "topk_checks",
    "zero_rows",
]


def check_linear(role: str, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2:
        raise ValueError(f"{role}_weight must be (vocab, hidden); got shape {tuple(weight.shape)}")
    if hidden.dim() < 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{role}_input has hidden size {hidden.shape[-1] if hidden.dim() else None} (shape {tuple(hidden.shape)}) "
            f"but {role}_weight expects {weight.shape[1]} (shape {tuple(weight.shape)}); pass the last hidden states "
            f"of the model that owns this lm_head"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"{role}_bias must have shape ({weight.shape[0]},) to match {role}_weight; got {tuple(bias.shape)}"
        )


def check_labels(labels: torch.Tensor | None, leading: torch.Size) -> None:
    if labels is not None and labels.shape != leading:
        raise ValueError(
            f"labels must have the leading shape of the hidden states {tuple(leading)}; got {tuple(labels.shape)}. "
            f"Shift labels HF style (labels[..., 1:] padded with ignore_index) rather than slicing the hidden states"
        )


def flatten_labels(labels: torch.Tensor | None, leading: torch.Size, device: torch.device, cfg: KDLossConfig):
    check_labels(labels, leading)
    reference.require_labels_for_hard_term(cfg, labels)
    if labels is None and cfg.estimator is not None:
        raise ValueError(f"estimator={cfg.estimator!r} scores each row's label (the sampled token): pass labels")
    if labels is None:
        return torch.zeros(leading.numel(), dtype=torch.long, device=device)
    # contiguous: the Triton kernels index labels by row (a stride-2 view would be read as every other label)
    return labels.reshape(-1).to(device).contiguous()


def counted_rows(flat_labels: torch.Tensor, labels: torch.Tensor | None, cfg: KDLossConfig) -> torch.Tensor:
    """(N,) True for the rows that count: a label that is not ignore_index, every row when there are no labels."""
    if labels is None:
        return torch.ones_like(flat_labels, dtype=torch.bool)
    return flat_labels != cfg.ignore_index


def label_check(flat_labels: torch.Tensor, vocab: int, cfg: KDLossConfig) -> tuple[torch.Tensor, Callable[[], str]]:
    """(device flag, message) for labels that are neither ignore_index nor a real id in [0, vocab)."""
    bad = (flat_labels != cfg.ignore_index) & ((flat_labels < 0) | (flat_labels >= vocab))

    def message() -> str:
        wrong = flat_labels[bad]
        return (
            f"labels hold {wrong.numel()} value(s) that are neither ignore_index={cfg.ignore_index} nor a token id "
            f"in [0, {vocab}) (e.g. {wrong[:4].tolist()}); set ignored positions to ignore_index, and pass "
            f"vocab_size=len(tokenizer) (or a tokenizer that matches the model)"
        )

    return bad.any(), message


def run_device_checks(checks: list[tuple[torch.Tensor, Callable[[], str]]]) -> None:
    """Every check's flag stays on the device until one host sync reads them all; the first failure raises."""
    if not checks:
        return
    failed = torch.stack([flag for flag, _ in checks]).tolist()
    for bad, (_, message) in zip(failed, checks):
        if bad:
            raise ValueError(message())


def check_num_items(num_items_in_batch, *, read_device: bool = False) -> None:
    """ValueError unless num_items_in_batch is None or a count >= 0 (0: a micro-batch without items, loss 0 and
    zero gradients). A number, or a tensor on the CPU (torch.tensor(n)), is read here; a tensor on an accelerator
    only with `read_device` (a host sync, which the fused losses do not spend per call)."""
    if num_items_in_batch is None:
        return
    if isinstance(num_items_in_batch, torch.Tensor):
        readable = read_device or num_items_in_batch.device.type == "cpu"
        bad = readable and bool((num_items_in_batch < 0).any())
    else:
        bad = not num_items_in_batch >= 0
    if bad:
        raise ValueError(
            f"num_items_in_batch must be a count >= 0 (the whole batch's scored tokens); got {num_items_in_batch!r}"
        )


def zero_rows(values: torch.Tensor, keep: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """`values` with `fill` where `keep` (its leading dims) is False. A select, not a product: 0 * NaN is NaN."""
    return torch.where(keep.reshape(keep.shape + (1,) * (values.dim() - keep.dim())), values, fill)


def check_topk_shapes(ids: torch.Tensor, logprobs: torch.Tensor, leading: torch.Size, vocab: int) -> None:
    if ids.shape != logprobs.shape:
        raise ValueError(
            f"teacher_token_ids {tuple(ids.shape)} and teacher_logprobs {tuple(logprobs.shape)} must have one shape"
        )
    if ids.shape[:-1] != leading:
        raise ValueError(
            f"teacher_token_ids rows {tuple(ids.shape[:-1])} do not match the student's rows {tuple(leading)}; "
            f"they are row-aligned like logits (row t: the teacher's top-k for the token after position t)"
        )
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"teacher_token_ids must be integer ids; got dtype {ids.dtype}")
    if not logprobs.dtype.is_floating_point:
        raise ValueError(f"teacher_logprobs must be floating point log-probabilities; got dtype {logprobs.dtype}")
    if ids.shape[-1] > vocab:
        raise ValueError(f"teacher_token_ids has K={ids.shape[-1]} slots per row but the vocabulary has {vocab} ids")


# Log-probs are <= 0; this much above 0 is more than bf16 rounding of a log-prob near 0 and means logits.
LOGPROB_SLACK = 1e-3
# Rows per sort in the duplicate-id check: bounds its temporary to 16M ids even for full-vocabulary rows.
DUPLICATE_CHECK_ELEMS = 1 << 24


def topk_checks(ids: torch.Tensor, logprobs: torch.Tensor, counted: torch.Tensor, vocab: int):
    """(device flag, message) pairs for the top-k data of the rows that count; padding slots are skipped."""
    counted = counted[:, None]
    present = topk_valid_slots(ids, logprobs) & counted

    def too_big() -> str:
        return (
            f"teacher_token_ids holds ids >= the vocab size {vocab} (max {int(ids[present].max())}); the "
            f"teacher data was made with another tokenizer or vocabulary (or vocab_size is too small)"
        )

    return [
        ((present & (ids >= vocab)).any(), too_big),
        (
            (logprobs.isnan() & counted).any(),
            lambda: "teacher_logprobs contains NaN; regenerate the teacher data (padding slots should be -inf)",
        ),
        (
            ((logprobs > LOGPROB_SLACK) & counted).any(),
            lambda: (
                "teacher_logprobs contains values > 0 (or +inf), so they are not log-probabilities (logits?); "
                "pass log_softmax(teacher_logits) or the log-probs an inference server returns"
            ),
        ),
        (
            has_duplicate_ids(ids, present),
            lambda: (
                "teacher_token_ids repeats an id within a row; top-k ids are unique (a repeated id would count "
                "its probability twice): deduplicate the teacher data, or mark the repeats as padding (id -1)"
            ),
        ),
    ]


def has_duplicate_ids(ids: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """True (on the device) when a row repeats an id among its present slots: sort each row, compare neighbours.
    Padding slots get distinct negative keys so they never match each other or a real id."""
    n, k = ids.shape
    found = torch.zeros((), dtype=torch.bool, device=ids.device)
    if k < 2:
        return found
    padding_keys = -1 - torch.arange(k, device=ids.device)
    rows = max(1, DUPLICATE_CHECK_ELEMS // k)
    for start in range(0, n, rows):
        keys = torch.where(present[start : start + rows], ids[start : start + rows].long(), padding_keys)
        keys = keys.sort(-1).values
        found |= (keys[:, 1:] == keys[:, :-1]).any()
    return found


def selected_tokens(mask: torch.Tensor | None, shape: torch.Size, device: torch.device) -> torch.Tensor:
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if mask.shape != shape:
        raise ValueError(f"mask {tuple(mask.shape)} must have the per-token shape {tuple(shape)}")
    return mask.bool()


def logprob_checks(name: str, values: torch.Tensor, selected: torch.Tensor):
    """(device flag, message) pairs: no NaN and nothing above 0 (+inf included) among the selected values."""
    return [
        ((values.isnan() & selected).any(), lambda: f"{name} contains NaN on a selected token; mask it out or fix it"),
        (
            ((values > LOGPROB_SLACK) & selected).any(),
            lambda: (
                f"{name} contains values > 0 (or +inf), so they are not log-probabilities (logits?); pass "
                f"log_softmax(logits) gathered at the tokens"
            ),
        ),
    ]


def loss_config(
    function: str, config: KDLossConfig | None, options: dict[str, Any], default: KDLossConfig | None = None
) -> KDLossConfig:
    """The options of one call of the functional loss `function`: `config`, else `default` (KDLossConfig()). A
    functional loss takes its options in one KDLossConfig and no keyword for any of them (its nn.Module twin takes
    them as keywords): `options`, the keywords it was given beside its own, are a TypeError naming them."""
    if options:
        names = sorted(options)
        known = [n for n in names if n in KDLossConfig.__dataclass_fields__]
        if known:
            given = ", ".join(f"{n}=..." for n in known)
            raise TypeError(
                f"{function}() takes its loss options in one KDLossConfig: pass config=KDLossConfig({given}) "
                f"instead of {', '.join(known)} as keyword(s)"
            )
        raise TypeError(f"{function}() got an unexpected keyword argument {names[0]!r}")
    if config is None:
        return KDLossConfig() if default is None else default
    if not isinstance(config, KDLossConfig):
        raise ValueError(f"config must be a KDLossConfig; got {type(config).__name__}")
    return config
