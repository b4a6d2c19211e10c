"""The special tokens a generator needs: its pad id, its EOS ids and the token an empty prompt starts with, read
from the model's generation config first, then from its tokenizer."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..models import unwrap_model


def special_ids(generator: nn.Module, tokenizer: Any) -> tuple[int, set[int], int]:
    """(pad id, EOS ids, the token an empty prompt starts with) from the generation config, then the tokenizer."""
    gen = unwrap_model(generator).generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    pads = (gen.pad_token_id, getattr(tokenizer, "pad_token_id", None), *sorted(eos_ids))
    pad = next((x for x in pads if x is not None), 0)
    start = next((x for x in (gen.bos_token_id, getattr(tokenizer, "bos_token_id", None)) if x is not None), pad)
    return pad, eos_ids, start
