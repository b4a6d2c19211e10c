"""What the KD forward needs to know about the model it runs on, looked up once per instance and kept with it.

A forward reads its patch state (original forward, loss options), its registry entry (checked against its source by
spec.spec_for_model), the options with the model's soft-cap filled in, the logit scales the registry declares, and
what its backbone call needs (a VLM's backbone taking labels, whether the model may run without a mask that only pads
the end of rows). Finding these walks the registry, imports modeling modules and parses source code, so they are
found on a model's first KD forward and kept in its `__dict__`.

They are found again when what they were found from changes: a new patch state (apply_kd_patch again, or revert and
patch: every patch makes a new PatchState), another config object, another soft-cap value. What a model may change
between steps is read on each call instead: its attention implementation (transformers can switch it), its
logit-scale values (transforms.LogitScale reads them), its lm_head (models.heads).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..config import KDLossConfig, override_options
from .registry import ArchSpec, softcap_of
from .spec import spec_for_model
from .state import INSTANCE_ATTR, PatchState, class_state
from .transforms import LOGIT_TRANSFORMS, LogitScale

__all__ = ["FACTS_ATTR", "ModelFacts", "forward_facts"]

FACTS_ATTR = "_liger_kd_facts"


@dataclass(frozen=True)
class ModelFacts:
    """One model's facts for the KD forward (see the module docstring)."""

    state: PatchState
    spec: ArchSpec
    config: KDLossConfig  # state.config with the model's soft-cap: the options of a call that overrides none
    softcap: float | None  # the model's final-logit soft-cap (Gemma-2/3), or None
    logit_scales: tuple[LogitScale, ...]  # folded into the head inputs, in the registry's (sorted) order
    text_config: Any  # the config the attention implementation is read from, on every call
    causal_text: bool  # a registered causal text model: it may drop a mask that only pads the end of rows
    backbone_takes_labels: bool  # a VLM backbone taking labels (transformers 4.57's Gemma-3 with token_type_ids)
    # what the facts were found from
    model_config: Any
    raw_softcap: Any
    base_config: KDLossConfig

    def loss_config(self, kd_config: KDLossConfig | dict | None) -> KDLossConfig:
        """The options of one call: the patch's, or `kd_config` (a KDLossConfig, or a dict of fields replacing the
        patch's), with the model's soft-cap."""
        if kd_config is None:
            return self.config
        if not isinstance(kd_config, KDLossConfig):
            kd_config = override_options(self.state.config, kd_config)  # this call's options replace the patch's
        return kd_config.replace(softcap=self.softcap)


def forward_facts(model: nn.Module) -> ModelFacts:
    """The facts of a model running the KD forward: kept ones while they still hold, else found now."""
    state = model.__dict__.get(INSTANCE_ATTR) or class_state(type(model))
    if state is None:
        raise RuntimeError(f"{type(model).__name__} runs the KD forward but was never patched; call apply_kd_patch")
    facts = model.__dict__.get(FACTS_ATTR)
    config = getattr(model, "config", None)
    if (
        facts is None
        or facts.state is not state
        or facts.base_config is not state.config
        or facts.model_config is not config
        or facts.raw_softcap != getattr(config, "final_logit_softcapping", None)
    ):
        facts = model.__dict__[FACTS_ATTR] = _found(model, state)
    return facts


def _found(model: nn.Module, state: PatchState) -> ModelFacts:
    spec = spec_for_model(model)  # a model whose forward does what its entry does not declare: refused here
    config = model.config
    softcap = softcap_of(config)
    scales = tuple(LOGIT_TRANSFORMS[name] for name in sorted(spec.logits))
    backbone = getattr(model, "model", None)
    takes_labels = spec.is_vlm and backbone is not None and "labels" in inspect.signature(backbone.forward).parameters
    return ModelFacts(
        state=state,
        spec=spec,
        config=state.config.replace(softcap=softcap),
        softcap=softcap,
        logit_scales=tuple(scale for scale in scales if scale is not None),
        text_config=config.get_text_config(),
        causal_text=not spec.is_vlm,
        backbone_takes_labels=takes_labels,
        model_config=config,
        raw_softcap=getattr(config, "final_logit_softcapping", None),
        base_config=state.config,
    )
