"""The lm_head as the fused loss needs it: one (vocab, hidden) weight and a bias, whole.

The fused loss never calls lm_head; it reads its weight. A head wrapped by PEFT is unwrapped rather than
refused (as Liger-Kernel does): a LoRA adapter contributes its low-rank update to an effective weight
W + scaling * B @ A that autograd differentiates back to A and B, and a `modules_to_save` copy is read in
place of the original.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import check_full_weight, gathered_weights


@dataclass
class HeadWeights:
    weight: torch.Tensor  # (vocab, hidden), whole
    bias: torch.Tensor | None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits, as the head itself would give them (adapter included)."""
        return F.linear(hidden.to(self.weight.dtype), self.weight, self.bias)


@dataclass(frozen=True)
class HeadInputs:
    """A model's side of a fused loss: its last hidden states and lm_head bias with the model's logit scale folded
    in (transforms.py), and its lm_head (adapters applied)."""

    hidden: torch.Tensor
    head: HeadWeights
    bias: torch.Tensor | None


class WholeHead(contextlib.nullcontext):
    """The context of a head that needs no gathering: it holds the head inputs. A subclass rather than
    contextlib.nullcontext itself: torch.compile special-cases nullcontext and cannot resume after a graph break
    inside the block when it holds a value (the fused loss is one: a clean graph break), while a subclass is traced
    as any context manager."""


def gathered_head(
    model: nn.Module,
    hidden: torch.Tensor,
    role: str,
    logit_scales: Sequence = (),
    *,
    detached: bool = False,
    gathered: bool = False,
) -> contextlib.AbstractContextManager[HeadInputs]:
    """A context holding the model's HeadInputs on `hidden`, its lm_head whole for the duration of the block: a
    ZeRO-3 partitioned head is gathered (distributed.gathered_weights, with the model as its owner; `gathered`:
    it is already); any other is whole already (a sharded one is refused, check_full_weight). `logit_scales`: the
    model's (models.facts); `detached`: a teacher's, cut from the graph."""
    module = model.get_output_embeddings()
    if not gathered and any(hasattr(p, "ds_id") for p in module.parameters()):  # an adapter's too
        return _gathered_zero3_head(model, module, hidden, role, logit_scales, detached)
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.Linear) and type(weight).__name__ != "DTensor" and weight.shape == (
        module.out_features, module.in_features
    ):  # fmt: skip
        head = HeadWeights(weight, module.bias)  # a plain whole head: what output_head returns for it
    else:
        head = output_head(model, role)  # adapters, and the layouts it refuses
    bias = head.bias
    if detached:
        hidden, bias = hidden.detach(), None if bias is None else bias.detach()
        head = HeadWeights(head.weight.detach(), bias)
    for scale in logit_scales:
        hidden = scale.apply(model, hidden)
        bias = None if bias is None else scale.apply(model, bias)
    return WholeHead(HeadInputs(hidden, head, bias))


@contextlib.contextmanager
def _gathered_zero3_head(model, module, hidden, role, logit_scales, detached) -> Iterator[HeadInputs]:
    with gathered_weights(module, owner=model):
        with gathered_head(model, hidden, role, logit_scales, detached=detached, gathered=True) as inputs:
            yield inputs


def output_head(model: nn.Module, role: str) -> HeadWeights:
    """The model's lm_head weight and bias as the loss must see them (adapters applied)."""
    head = model.get_output_embeddings()
    head = _active_copy(head)
    if _is_lora(head):
        return _lora_weights(head, role)
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"the {role}'s output embedding is a {type(head).__name__}; the fused loss reads an nn.Linear lm_head's "
            f"weight (optionally with a LoRA adapter). Patch with fused_linear_jsd=False to score materialised logits"
        )
    if not hasattr(head.weight, "ds_id"):  # ZeRO-3 partitions are gathered by the caller (gathered_weights)
        check_full_weight(head.weight, (head.out_features, head.in_features), role)
    return HeadWeights(head.weight, head.bias)


def _active_copy(head: nn.Module) -> nn.Module:
    """PEFT's ModulesToSaveWrapper (lm_head in `modules_to_save`): the trained copy, or the original with
    adapters disabled."""
    if not (hasattr(head, "modules_to_save") and hasattr(head, "original_module")):
        return head
    active = getattr(head, "active_adapter", None)
    active = active[0] if isinstance(active, (list, tuple)) else active
    if getattr(head, "disable_adapters", False) or active not in head.modules_to_save:
        return head.original_module
    return head.modules_to_save[active]


def _is_lora(head: nn.Module) -> bool:
    return hasattr(head, "base_layer") and hasattr(head, "lora_A")


def _lora_weights(head: nn.Module, role: str) -> HeadWeights:
    base = head.base_layer
    if not isinstance(base, nn.Linear):
        raise ValueError(f"the {role}'s lm_head adapter wraps a {type(base).__name__}, not an nn.Linear")
    weight, bias = base.weight, base.bias
    if getattr(head, "merged", False) or getattr(head, "disable_adapters", False):
        return HeadWeights(weight, bias)  # merged: the update is in base.weight already; disabled: not applied
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        if getattr(head, "use_dora", {}).get(name, False):
            raise ValueError(
                f"the {role}'s lm_head carries a DoRA adapter ({name!r}); the fused loss applies plain LoRA updates "
                f"only. Exclude lm_head from the adapter's target_modules, merge it, or patch with "
                f"fused_linear_jsd=False"
            )
        dropout = head.lora_dropout[name]
        if head.training and isinstance(dropout, nn.Dropout) and dropout.p > 0:
            raise ValueError(
                f"the {role}'s lm_head LoRA adapter {name!r} has lora_dropout={dropout.p}; dropout on the adapter's "
                f"input cannot be folded into one effective weight. Use lora_dropout=0 for lm_head (e.g. a second "
                f"LoraConfig for it), exclude lm_head from target_modules, or patch with fused_linear_jsd=False"
            )
        a, b, scale = head.lora_A[name], head.lora_B[name], head.scaling[name]
        # (vocab, r) @ (r, hidden): one extra (vocab, hidden) tensor, and exact gradients for A and B
        weight = weight + (b.weight @ a.weight).to(weight.dtype) * scale
        if b.bias is not None:  # PEFT's lora_bias
            bias = (b.bias * scale).to(weight.dtype) if bias is None else bias + (b.bias * scale).to(bias.dtype)
    return HeadWeights(weight, bias)
