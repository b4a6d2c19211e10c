"""What generation reads of a transformers model's config: the language model's own (a VLM's text config)."""

from __future__ import annotations

from typing import Any

from torch import nn


def text_config(model: nn.Module) -> Any:
    """`model.config`'s text config (the config itself for a text-only model; None for a model without a config):
    where the attention implementation, the context length, the sliding window and router options live."""
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config
