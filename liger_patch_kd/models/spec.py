"""A model instance's registry entry, checked: the one place that both picks an entry (registry.py) and audits
the model's forward against it (forward_audit.py), so neither of those needs the other's caller."""

from __future__ import annotations

from torch import nn

from ..ops.backend import eager
from .forward_audit import check_model
from .registry import FAMILIES, ArchSpec, spec_for, specs_for

__all__ = ["spec_for_model"]

_SPEC_ATTR = "_liger_kd_spec"


def spec_for_model(model: nn.Module) -> ArchSpec:
    """The entry of a model instance, checked: its class is the entry's, and its forward and config do nothing to
    the logits or the loss that the entry does not declare (ValueError otherwise). Resolved once per instance:
    the KD forward asks several times per step, and the check parses source code."""
    spec = model.__dict__.get(_SPEC_ATTR)
    if spec is None:
        spec = model.__dict__[_SPEC_ATTR] = _checked_spec(model)
    return spec


@eager  # once per instance; dynamo need not trace the source audit
def _checked_spec(model: nn.Module) -> ArchSpec:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    spec = spec_for(model_type or type(model).__name__)
    for candidate in specs_for(model_type) if model_type in FAMILIES else [spec]:
        if isinstance(model, candidate.model_class()):
            check_model(model, candidate)
            return candidate
    raise ValueError(
        f"model is a {type(model).__name__} (model_type {model_type!r}); liger_patch_kd patches "
        f"{spec.causal_lm} for that model_type. Pass that model"
    )
