"""One entry per architecture: where its classes live and the quirks the kernels must reproduce.

Adding an architecture is adding an `ArchSpec` here; the KD forward itself is generic (`kd_forward.py`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class ArchSpec:
    model_type: str  # config.model_type
    module: str  # where transformers keeps the modeling code
    causal_lm: str  # the *ForCausalLM class whose forward becomes the KD forward
    rms_norm: str  # RMSNorm class (every instance, q/k norms included)
    mlp: str  # gated MLP class
    rms_norm_offset: float = 0.0  # Gemma scales by (1 + weight)
    rms_norm_casting: str = "llama"  # see ops/rms_norm.py
    fused_gate_up: bool = False  # Phi-3 keeps gate and up in one gate_up_proj (gate first)
    # Gemma-2/3's final_logit_softcapping lives in config; the KD forward reads it through `softcap_of`

    def load(self) -> ModuleType:
        try:
            return importlib.import_module(self.module)
        except ImportError as e:  # pragma: no cover - depends on the installed transformers
            raise ValueError(
                f"transformers has no module {self.module} for model_type {self.model_type!r} "
                f"(transformers too old? this library supports >= 4.57): {e}"
            ) from e


def _llama_like(model_type: str, prefix: str, module: str | None = None) -> ArchSpec:
    return ArchSpec(
        model_type=model_type,
        module=module or f"transformers.models.{model_type}.modeling_{model_type}",
        causal_lm=f"{prefix}ForCausalLM",
        rms_norm=f"{prefix}RMSNorm",
        mlp=f"{prefix}MLP",
    )


def _gemma_like(model_type: str, prefix: str, module: str) -> ArchSpec:
    return ArchSpec(
        model_type=model_type,
        module=f"transformers.models.{module}.modeling_{module}",
        causal_lm=f"{prefix}ForCausalLM",
        rms_norm=f"{prefix}RMSNorm",
        mlp=f"{prefix}MLP",
        rms_norm_offset=1.0,
        rms_norm_casting="gemma",
    )


REGISTRY: dict[str, ArchSpec] = {
    spec.model_type: spec
    for spec in (
        _llama_like("llama", "Llama"),
        _llama_like("mistral", "Mistral"),
        _llama_like("qwen2", "Qwen2"),
        _llama_like("qwen3", "Qwen3"),
        _gemma_like("gemma", "Gemma", "gemma"),
        _gemma_like("gemma2", "Gemma2", "gemma2"),
        _gemma_like("gemma3_text", "Gemma3", "gemma3"),
        ArchSpec(
            model_type="phi3",
            module="transformers.models.phi3.modeling_phi3",
            causal_lm="Phi3ForCausalLM",
            rms_norm="Phi3RMSNorm",
            mlp="Phi3MLP",
            fused_gate_up=True,
        ),
    )
}
ALIASES = {"gemma3": "gemma3_text"}  # the apply function is named for the family; the text model's type differs


def spec_for(model_type: str) -> ArchSpec:
    key = ALIASES.get(model_type, model_type)
    if key not in REGISTRY:
        raise ValueError(
            f"model_type {model_type!r} is not supported by liger_patch_kd; supported: {sorted(REGISTRY)}. "
            f"A new architecture is one ArchSpec in liger_patch_kd/models/registry.py"
        )
    return REGISTRY[key]


def softcap_of(config) -> float | None:
    """The final-logit soft-capping the model applies to its logits (Gemma-2/3), or None."""
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None
