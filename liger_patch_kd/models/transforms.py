"""What a model's forward does to its logits after lm_head, reproduced in the fused loss without logits.

A scale s of the logits is applied to the hidden states and the bias instead: (h·s)Wᵀ + b·s = s·(hWᵀ + b), exact in
exact arithmetic and one elementwise pass over (N, H) instead of (N, V). Soft-capping is the loss's own `softcap`.

Every `*ForCausalLM.forward` (and the VLMs' `*ForConditionalGeneration.forward`) of transformers 5.24 was read
for what it does between lm_head and the loss; `forward_audit.survey()` lists them, and the audit checks each
patched class against its entry:

| after lm_head                          | families (transformers 5.24)                   | here                     |
|----------------------------------------|------------------------------------------------|--------------------------|
| nothing                                | llama, mistral, qwen2/3, olmo2, glm4, smollm3, | the registered ones      |
|                                        | phi3, gemma, qwen2.5-vl, qwen3-vl, gemma3 VLM  |                          |
| tanh soft-cap, final_logit_softcapping | gemma2, gemma3, gemma3n, vaultgemma, nanochat  | gemma2, gemma3 (text)    |
| / config.logits_scaling                | granite, granite_swa, granitemoe*              | granite                  |
| * config.logit_scale                   | cohere, cohere2, cohere2_moe, cohere_compass   | cohere, cohere2          |
| + router_aux_loss_coef * load balancing| mixtral, qwen3_moe, gpt_oss, qwen2_moe, olmoe..| mixtral, qwen3_moe,      |
|                                        |                                                | gpt_oss                  |
| * lm_head_multiplier / logits_scaling  | falcon_h1, hyperclovax                         | refused                  |
| hidden states scaled before lm_head    | minicpm3, inkling                              | refused                  |
| z-loss, vocab slicing, other soft-caps | bamba, inkling, inkling2, recurrent_gemma, xlstm| refused                 |

"Refused" is what any class without a registry entry gets, and what a registered class gets when its forward
(a subclass, another transformers release) does something its entry does not declare.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .registry import REGISTRY
from .spec import spec_for_model


@dataclass(frozen=True)
class LogitScale:
    """logits * value (or / value when `divide`), with value read from the model."""

    read: Callable[[nn.Module], float]
    divide: bool = False

    def apply(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        value = float(self.read(model))
        if not value > 0:  # a non-positive scale would flip or erase the distribution: a broken config
            raise ValueError(f"{type(model).__name__} has a logit scale of {value}; it must be > 0 (check its config)")
        return x / value if self.divide else x * value  # the model's own operation, so float64 results agree


# transform name -> how the fused loss reproduces it
LOGIT_TRANSFORMS: dict[str, LogitScale | None] = {
    "softcap": None,  # not a scale: the loss applies tanh(x / c) * c (KDLossConfig.softcap, from the config)
    "logits_scaling": LogitScale(lambda model: model.config.logits_scaling, divide=True),  # Granite
    "logit_scale": LogitScale(lambda model: model.logit_scale),  # Cohere: self.logit_scale = config.logit_scale
}
for _entry in REGISTRY.values():
    assert _entry.logits <= LOGIT_TRANSFORMS.keys(), _entry  # a typo in the registry would silently skip a transform


def scaled_head_inputs(
    model: nn.Module, hidden: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The last hidden states and lm_head bias for the fused loss, with the model's logit scales folded in."""
    for name in sorted(spec_for_model(model).logits):
        scale = LOGIT_TRANSFORMS[name]
        if scale is not None:
            hidden = scale.apply(model, hidden)
            bias = None if bias is None else scale.apply(model, bias)
    return hidden, bias
