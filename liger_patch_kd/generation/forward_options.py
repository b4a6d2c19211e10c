"""What a decode forward passes besides its inputs, whatever the model's config asks of its training forwards.

A mixture-of-experts model whose config sets output_router_logits=True computes its load-balancing loss in every
forward from the attention mask; in a decode step the router sees one token a row while the mask covers the
cache's columns, and the loss fails on the shapes (transformers' own generate() too). Sampling needs no router
output, so every decode forward (the captured engine, the rollouts' lean loop, the server's sampler, generate())
turns it off.
"""

from __future__ import annotations

from torch import nn

from .model_config import text_config


def decode_forward_options(model: nn.Module) -> dict:
    """Keyword arguments for a decode forward of `model`: output_router_logits=False where its config has it."""
    return {"output_router_logits": False} if getattr(text_config(model), "output_router_logits", False) else {}
