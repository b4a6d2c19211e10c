"""The frozen teacher's causal attention on cuDNN's SDPA kernel (`kd_teacher_attention="cudnn"`).

On an H200 (torch 2.11), cuDNN's causal attention runs the 8B-shaped teacher's layer at 1.7-1.9x flash's speed
(benchmarks/bench_attention.py: 0.31 against 0.57 ms at 4k, 14.9 against 25.6 ms at 32k, batch 1), but
transformers' SDPA path never reaches it for a grouped-query model: without a mask it calls SDPA with
`enable_gqa=True`, which only flash and the math kernel take here, so asking SDPA for cuDNN first changed nothing
in the step (an earlier `kd_attention_backend` option, removed). This attention function repeats the key/value
heads per query head (a transient copy; the frozen teacher saves nothing for a backward) and calls SDPA with cuDNN
first, flash and the rest after it, so a shape cuDNN refuses still runs. It takes only what it can do exactly: a
causal self-attention without a mask (unpadded, unpacked rows: transformers then passes none), no dropout, no
position bias, soft-cap or sinks; anything else goes to the "sdpa" attention function unchanged.

It is selected per model, through transformers' own extension points: the function and the "sdpa" masks are
registered under NAME, and the model's attention implementation set to it (`set_teacher_attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .state import unwrap_model

NAME = "liger_kd_cudnn"
TEACHER_ATTENTIONS = ("sdpa", "cudnn")
_DEFERRED_KWARGS = ("position_bias", "softcap", "s_aux", "sinks", "output_attentions")


def cudnn_causal_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (`ALL_ATTENTION_FUNCTIONS`).

    Args:
        module: the attention layer.
        query: (batch, H, seq, d).
        key, value: (batch, H_kv, seq, d).
        attention_mask: None here (causal rows without padding), else the call is transformers' SDPA's.

    Returns:
        ((batch, seq, H, d) attention output, None).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    heads, kv_heads, seq = query.shape[1], key.shape[1], query.shape[2]
    plain = (
        attention_mask is None
        and causal
        and not dropout
        and seq > 1
        and key.shape[2] == seq
        and heads % kv_heads == 0
        and not any(kwargs.get(name) not in (None, False) for name in _DEFERRED_KWARGS)
    )
    if not plain:  # "sdpa" as it stands (inside models.packed_decode_attention: the packed decode step)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    groups = heads // kv_heads
    if groups > 1:  # query head j*G + i reads key/value head j, as transformers' repeat_kv arranges them
        key, value = (t[:, :, None].expand(-1, -1, groups, -1, -1).flatten(1, 2) for t in (key, value))
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(order, set_priority=True):
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def set_teacher_attention(model: nn.Module, attention: str) -> None:
    """Select the teacher's attention: "cudnn" (`cudnn_causal_sdpa`) or back to "sdpa". A model that does not run
    SDPA ("eager", flash-attention, flex) is refused for "cudnn": there is no SDPA call to move to cuDNN."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if attention not in TEACHER_ATTENTIONS:
        raise ValueError(f"kd_teacher_attention must be one of {TEACHER_ATTENTIONS}; got {attention!r}")
    inner = unwrap_model(model)
    current = getattr(inner.config, "_attn_implementation", None)
    if attention == "sdpa":
        if current == NAME:
            inner.set_attn_implementation("sdpa")
        return
    if current not in ("sdpa", NAME):
        raise ValueError(
            f"kd_teacher_attention='cudnn' moves the teacher's SDPA calls to cuDNN, but {type(inner).__name__} runs "
            f"attn_implementation={current!r}: load the teacher with attn_implementation='sdpa', or leave "
            f"kd_teacher_attention='sdpa'"
        )
    AttentionInterface.register(NAME, cudnn_causal_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks (or none) SDPA gets
    inner.set_attn_implementation(NAME)
