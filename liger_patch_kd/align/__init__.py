"""Distillation across tokenizers: alignment of two tokenizations by character offsets, a vocabulary map, and
the fused ULD / exact-token / hybrid loss (see align.config.CrossTokenizerConfig)."""

from .collator import CrossTokenizerCollator
from .config import CrossTokenizerConfig
from .loss import CrossTokenizerLossOutput, fused_linear_cross_tokenizer_kd, fused_linear_cross_tokenizer_topk_kd
from .offsets import Group, align_tokens, canonical_ends, encode_with_offsets
from .vocab import VocabMap, byte_level_to_text

__all__ = [
    "CrossTokenizerCollator",
    "CrossTokenizerConfig",
    "CrossTokenizerLossOutput",
    "Group",
    "VocabMap",
    "align_tokens",
    "byte_level_to_text",
    "canonical_ends",
    "encode_with_offsets",
    "fused_linear_cross_tokenizer_kd",
    "fused_linear_cross_tokenizer_topk_kd",
]
