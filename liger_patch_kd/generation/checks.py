"""decode()'s arguments checked before any work: one-line ValueErrors naming the argument, the value and the fix.

A wrong call would otherwise either fail deep in the model (an IndexError from the embedding on a CPU, a device-side
assert on a GPU) or, worse, sample silently from the wrong place: a right-padded row is prefilled up to its padding
and continues from there, a mask of 2s doubles the prompt's position ids, a prompt plus its completion past the
context runs the model on positions it never saw. The tensor checks cost one host sync per call (not per step).
"""

from __future__ import annotations

import torch
from torch import nn

from .model_config import text_config


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_decode_arguments(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
    max_new_tokens: int, pad_id: int, eos_ids: tuple[int, ...], check_every: int,
) -> None:  # fmt: skip
    """ValueError unless decode() can sample what its docstring promises from these arguments."""
    if not (_is_int(max_new_tokens) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be an int >= 1; got {max_new_tokens!r}")
    if not (_is_int(check_every) and check_every >= 1):
        raise ValueError(f"check_every must be an int >= 1 (decode steps between end-of-rows checks); "
                         f"got {check_every!r}")  # fmt: skip
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids and attention_mask must both be (rows, W); got {tuple(input_ids.shape)} and "
                         f"{tuple(attention_mask.shape)}")  # fmt: skip
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids must hold at least one row of at least one token; got {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.long, torch.int32):
        raise ValueError(f"input_ids must be integer token ids (torch.long); got {input_ids.dtype}: pass "
                         f"input_ids.long() if they hold ids")  # fmt: skip
    if model.training:
        raise ValueError("model is in training mode (dropout would be sampled through): call model.eval() first")
    vocab = model.get_input_embeddings().num_embeddings
    if not (_is_int(pad_id) and 0 <= pad_id < vocab):
        raise ValueError(f"pad_id must be an id in [0, {vocab}) (the model's embedding rows); got {pad_id!r}")
    bad_eos = [e for e in eos_ids if not (_is_int(e) and e >= 0)]
    if bad_eos:
        raise ValueError(f"eos_ids must be ids >= 0; got {bad_eos}")
    low, high, mask_low, mask_high, last_unattended, longest = torch.stack([
        input_ids.min().long(), input_ids.max().long(), attention_mask.min().long(), attention_mask.max().long(),
        (attention_mask[:, -1] == 0).sum().long(), (attention_mask != 0).sum(-1).max().long(),
    ]).tolist()  # fmt: skip
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids must be in [0, {vocab}) (the model's embedding rows); got ids in "
                         f"[{low}, {high}]: a tokenizer larger than the model, or padding marked -100?")  # fmt: skip
    if mask_low < 0 or mask_high > 1:
        raise ValueError(f"attention_mask must hold 0 (padding) and 1 (a token) only; got values in "
                         f"[{mask_low}, {mask_high}]")  # fmt: skip
    if last_unattended:
        raise ValueError(f"the prompts must be left-padded (every row's last column attended); {last_unattended} "
                         f"row(s) of attention_mask end in padding (or are all padding): pad on the left "
                         f"(tokenizer.padding_side = 'left') and drop empty prompts")  # fmt: skip
    text = text_config(model)
    context = getattr(text, "max_position_embeddings", None)
    if _is_int(context) and longest + max_new_tokens > context:
        raise ValueError(f"the longest prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) passes the "
                         f"model's context (max_position_embeddings={context}): shorten the prompts to "
                         f"<= {context - max_new_tokens} tokens or ask for fewer new tokens"
                         if context > max_new_tokens else
                         f"max_new_tokens ({max_new_tokens}) must be below the model's context "
                         f"(max_position_embeddings={context})")  # fmt: skip
