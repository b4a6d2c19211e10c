"""Patching Hugging Face causal LMs: one generic KD forward, a registry of architectures."""

from .kd_forward import kd_causal_lm_forward, unwrap_model
from .kd_io import KDCausalLMOutput
from .patch import (
    apply_kd_patch,
    apply_kd_patch_to_gemma,
    apply_kd_patch_to_gemma2,
    apply_kd_patch_to_gemma3,
    apply_kd_patch_to_llama,
    apply_kd_patch_to_mistral,
    apply_kd_patch_to_phi3,
    apply_kd_patch_to_qwen2,
    apply_kd_patch_to_qwen3,
    revert_kd_patch,
)
from .registry import REGISTRY, ArchSpec

__all__ = [
    "KDCausalLMOutput",
    "REGISTRY",
    "ArchSpec",
    "apply_kd_patch",
    "apply_kd_patch_to_gemma",
    "apply_kd_patch_to_gemma2",
    "apply_kd_patch_to_gemma3",
    "apply_kd_patch_to_llama",
    "apply_kd_patch_to_mistral",
    "apply_kd_patch_to_phi3",
    "apply_kd_patch_to_qwen2",
    "apply_kd_patch_to_qwen3",
    "kd_causal_lm_forward",
    "revert_kd_patch",
    "unwrap_model",
]
