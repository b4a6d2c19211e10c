"""The attention mask for a left-padded prefill, so that no query row is fully masked where that gives NaN.

Why: with left padding and a causal mask, a padding position's query row sees no key at all. transformers' eager
attention adds a mask holding torch.finfo(dtype).min and takes the softmax in float32; in float64 that minimum is
-inf in float32, so a fully masked row is softmax(all -inf) = NaN. The NaN is at the padding positions after the
first layer, but the next layer reads their keys and values in every row (a NaN score plus the mask is NaN, and a
zero weight times a NaN value is NaN): the real positions' logits are NaN too. In float32 / bfloat16 the minimum
stays finite (a uniform softmax over the padding, discarded) and SDPA handles a fully masked row itself.

The fix here: for the prefill of such a model, a 4D mask in which each padding position attends to itself only.
The real positions see exactly what the 2D mask gives them (their own prompt, causally); the padding positions
get finite junk that no real position reads. Decode steps need nothing: a new token always sees itself.
"""

from __future__ import annotations

import torch
from torch import nn

from .model_config import text_config


def masked_rows_give_nan(model: nn.Module) -> bool:
    """Whether `model` turns a fully masked query row into NaN: eager attention with float64 activations."""
    if getattr(text_config(model), "_attn_implementation", None) != "eager":
        return False
    return _dtype(model) == torch.float64


def _dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype transformers builds the mask in (its embeddings'); None for a model with no weights."""
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else next((p.dtype for p in model.parameters()), None)


def prefill_mask(model: nn.Module, mask: torch.Tensor) -> torch.Tensor:
    """The attention mask for the first forward of left-padded rows: `mask` (B, W) itself, or, where the model
    would give NaN for the padding rows (masked_rows_give_nan), a (B, 1, W, W) additive mask in the model's dtype
    in which each padding position attends to itself (see the module docstring). A model with a sliding window
    (whose own mask a 4D one would replace) is refused there, naming the fix."""
    if bool(mask.all()) or not masked_rows_give_nan(model):
        return mask
    text = text_config(model)
    if any("sliding" in str(t) for t in (getattr(text, "layer_types", None) or ())) or (
        getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    ):
        raise ValueError("attn_implementation='eager' in float64 gives NaN logits for left-padded prompts of "
                         "different lengths with a sliding window: load the model with attn_implementation='sdpa'")
    visible = self_visible_causal(mask.bool())
    dtype = _dtype(model)
    zeros = torch.zeros(visible.shape, dtype=dtype, device=mask.device)
    return zeros.masked_fill(~visible, torch.finfo(dtype).min)


def self_visible_causal(attended: torch.Tensor) -> torch.Tensor:
    """The (B, 1, W, W) boolean prefill mask of left-padded rows (`attended` (B, W) True on prompt tokens): each
    position sees the attended positions up to itself, and a padding position sees itself too, so no query row is
    fully masked (finite values in its never-read outputs and cache column; real rows see what the 2D mask gives)."""
    width, device = attended.shape[1], attended.device
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    eye = torch.eye(width, dtype=torch.bool, device=device)
    return ((causal & attended[:, None, :]) | eye)[:, None]
