"""liger_patch_kd: knowledge distillation for Hugging Face causal LMs without materialised logits."""

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

__version__ = "0.1.0"

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
]
