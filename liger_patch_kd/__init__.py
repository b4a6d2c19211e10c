"""liger_patch_kd: knowledge distillation for Hugging Face causal LMs without materialised logits.

Everything a user needs is importable from here. The losses load at once (torch and triton only); the model
patches, the Trainer and the teacher-data classes load on first use, so `import liger_patch_kd` does not pull
in transformers' Trainer machinery.
"""

from importlib import import_module
from typing import Any

from .config import KDLossConfig
from .losses import (
    FusedLinearJSDLoss,
    FusedLinearTopKKDLoss,
    KDLossOutput,
    fused_linear_jsd,
    fused_linear_topk_kd,
    kl_estimator,
    topk_kd_from_logprobs,
)

__version__ = "0.2.0.dev0"

# public name -> the submodule that defines it, imported when the name is first used
_LAZY = {
    **{
        name: ".models"
        for name in (
            "apply_kd_patch",
            "revert_kd_patch",
            "apply_kd_patch_to_gemma",
            "apply_kd_patch_to_gemma2",
            "apply_kd_patch_to_gemma3",
            "apply_kd_patch_to_llama",
            "apply_kd_patch_to_mistral",
            "apply_kd_patch_to_phi3",
            "apply_kd_patch_to_qwen2",
            "apply_kd_patch_to_qwen3",
            "KDCausalLMOutput",
            "quantize_teacher_fp8",
        )
    },
    "KDTrainer": ".trainer",
    "KDTrainingArguments": ".trainer",
    **{
        name: ".teacher"
        for name in (
            "TeacherLogprobsDataset",
            "TeacherDataCollator",
            "TeacherStoreError",
            "StoreWriter",
            "precompute",
            "import_vllm_logprobs",
        )
    },
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "KDLossConfig",
    "KDLossOutput",
    "FusedLinearJSDLoss",
    "FusedLinearTopKKDLoss",
    "fused_linear_jsd",
    "fused_linear_topk_kd",
    "kl_estimator",
    "topk_kd_from_logprobs",
    "__version__",
    *_LAZY,
]
