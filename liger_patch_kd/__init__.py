"""liger_patch_kd: knowledge distillation for Hugging Face causal LMs without materialised logits."""

from .config import KDLossConfig
from .losses import FusedLinearJSDLoss, KDLossOutput, fused_linear_jsd

__version__ = "0.1.0"

__all__ = ["KDLossConfig", "KDLossOutput", "FusedLinearJSDLoss", "fused_linear_jsd", "__version__"]
