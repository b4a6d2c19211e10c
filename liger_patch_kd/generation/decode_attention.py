"""SDPA for one-token decode steps with grouped-query heads packed, compiled or not.

With grouped-query attention (H query heads sharing H_kv key/value heads) and a mask, transformers' SDPA path
copies the key/value cache H / H_kv times (`repeat_kv`) before every attention call, except in eager decode steps
where it packs the query heads instead; inside a compiled decode step (the static cache's) it always copies. A
profile of a 1B student (32 query heads, 8 key/value heads) generating 64 rows with the static cache found a large
share of the call's GPU time in that copy, and attention reading the 4x larger cache again: per layer and step,
H / H_kv times the cache written and read (`benchmarks/onpolicy/bench_rollouts.py --profile`).

A decode step has one query per row, so the query heads of one key/value head can be that head's query *rows*:
(batch, H, 1, d) -> (batch, H_kv, H / H_kv, d). Attention of those rows over the un-copied cache is the same
attention (softmax per row; the mask, shared by every head and query of a row, broadcasts), with no copy.
`packed_decode_attention` applies it inside its block; anything it does not cover (a prompt's prefill, a mask per
head, position biases, soft-capping, attention sinks) goes to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..ops.backend import select_backend
from .decode_kernel import decode_attention, layout_refusal

# keyword arguments of an attention call that the packed path would have to honour and does not: defer on them
_DEFERRED_KWARGS = ("position_bias", "softcap", "s_aux", "sinks", "output_attentions")


def packable(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask, kwargs: dict) -> bool:
    """Whether packed_gqa_sdpa attends to this call itself (one query position, grouped heads, a mask shared by
    every head, nothing in `kwargs` it would have to honour) rather than handing it to transformers' SDPA."""
    groups = getattr(module, "num_key_value_groups", 1)
    return (
        groups > 1
        and query.shape[2] == 1
        and key.shape[1] * groups == query.shape[1]
        and (attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1))
        and not any(kwargs.get(name) is not None and kwargs.get(name) is not False for name in _DEFERRED_KWARGS)
    )


def packed_gqa_sdpa(
    module: torch.nn.Module,
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
        module: the attention layer (its `num_key_value_groups` is H / H_kv).
        query: (batch, H, q_len, d).
        key, value: (batch, H_kv, kv_len, d), the cache as it is.
        attention_mask: None, or (batch or 1, 1, q_len, kv_len), boolean (True attends) or additive.

    Returns:
        ((batch, q_len, H, d) attention output, None).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, dim = query.shape
    if not packable(module, query, key, attention_mask, kwargs):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if kernel_wanted() and kernel_takes(query, key, value, attention_mask, dropout):
        mask, scale = kernel_mask_and_scale(attention_mask, key, batch, scaling)
        return decode_attention(query, key, value, mask, scale), None
    rows = query.reshape(batch, heads // groups, groups, dim)  # query heads j*G .. j*G+G-1 read key/value head j
    if attention_mask is not None:
        attention_mask = attention_mask[..., : key.shape[-2]]
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
    return out.reshape(out.shape[0], heads, 1, dim).transpose(1, 2).contiguous(), None


def kernel_takes(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, dropout: float = 0.0
) -> bool:
    """Whether decode_kernel.decode_attention computes this call: Triton's backend for the device (CUDA, or the
    interpreter where LIGER_KD_BACKEND=triton asks for it), float inputs of one dtype and one head size, a boolean
    mask (the engine's) or none, no dropout (the kernel has none), and a layout it reads (decode_kernel.layout_refusal:
    contiguous head dims, no float64 on CUDA)."""
    if select_backend(query.device) != "triton" or mask is not None and mask.dtype != torch.bool or dropout:
        return False
    if not (query.dtype == key.dtype == value.dtype and query.dtype.is_floating_point):
        return False
    if not query.shape[-1] == key.shape[-1] == value.shape[-1] <= 256:
        return False
    return layout_refusal(query, key, value) is None


def kernel_mask_and_scale(attention_mask: torch.Tensor | None, key: torch.Tensor, batch: int, scaling: float | None):
    """What the Triton kernel reads for a packable call: the (batch, length) boolean mask from the attention
    function's (batch or 1, 1, 1, >= length) one (None: every column of `key`, the cache), and the scores' factor
    (1 / sqrt(d) where the call gives none)."""
    length = key.shape[-2]
    mask = (attention_mask[:, 0, 0, :length] if attention_mask is not None
            else key.new_ones((1, length), dtype=torch.bool)).expand(batch, length)  # fmt: skip
    return mask, scaling if scaling is not None else key.shape[-1] ** -0.5


def kernel_wanted() -> bool:
    """Whether this thread is inside a decode_kernel() block: the decode engine's steps."""
    return _Kernel.wanted()


class _Kernel:
    """Whether packed decode steps use the Triton kernel (decode_kernel.py) on this thread: the decode engine's
    captured or eager steps ask for it; a step torch.compile traces (transformers' static cache's) keeps SDPA, which
    the compiler knows."""

    local = threading.local()

    @classmethod
    def wanted(cls) -> bool:
        return getattr(cls.local, "depth", 0) > 0


@contextlib.contextmanager
def decode_kernel(enabled: bool = True) -> Iterator[None]:
    """Within the block (on this thread), packed decode steps attend through the Triton split-KV kernel where
    kernel_takes says it can (use with packed_decode_attention)."""
    if not enabled:
        yield
        return
    _Kernel.local.depth = getattr(_Kernel.local, "depth", 0) + 1
    try:
        yield
    finally:
        _Kernel.local.depth -= 1


class _Swap:
    """How many blocks are open (nested, or on several threads): the first installs, the last restores."""

    lock = threading.Lock()
    depth = 0
    previous = None


@contextlib.contextmanager
def packed_decode_attention() -> Iterator[None]:
    """Within the block, transformers' "sdpa" attention is `packed_gqa_sdpa` (its masks stay "sdpa"'s: the same
    name). The swap is process-wide, and blocks may nest or overlap across threads (the first to open installs it,
    the last to close restores what was there); the function gives SDPA's attention for every input, so another
    thread attending meanwhile (the server scoring a teacher request) gets the same values."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # the mapping the models look "sdpa" up in

    with _Swap.lock:
        if _Swap.depth == 0:
            _Swap.previous = ALL_ATTENTION_FUNCTIONS["sdpa"]
            ALL_ATTENTION_FUNCTIONS["sdpa"] = packed_gqa_sdpa  # an override on this mapping, not the registry
        _Swap.depth += 1
    try:
        yield
    finally:
        with _Swap.lock:
            _Swap.depth -= 1
            if _Swap.depth == 0:
                del ALL_ATTENTION_FUNCTIONS["sdpa"]
                if ALL_ATTENTION_FUNCTIONS["sdpa"] is not _Swap.previous:  # someone had overridden it here before
                    ALL_ATTENTION_FUNCTIONS["sdpa"] = _Swap.previous
                _Swap.previous = None
