"""A static KV cache whose rows share one write slot: what a captured decode step writes into.

Prompts are left-padded to one width W, so every row's next token goes to the same column of the cache: slot W,
then W + 1, ... The slot is a one-element device tensor the decode step reads and advances, so the same kernels
(one CUDA graph) serve every step. Attention masks are given whole (4D, boolean) by the engine, which knows which
columns hold a row's prompt; transformers returns a 4D mask as it is, so nothing here sizes a mask.

The tensors are allocated at the first write of each layer, in the dtype the keys arrive in: a float32 model under
bfloat16 autocast writes bfloat16 keys, and its cache is bfloat16 (allocating by the weights' dtype gave
`index_copy_(): ... Float and BFloat16`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class SlotCache(Cache):
    """(rows, kv heads, length, head dim) keys and values per layer, written at `slot` during decode steps.

    Prefill (`decoding` False) writes a prompt's W positions at columns [0, W) and attends to those only; a decode
    step (`decoding` True, one new position) writes at column `slot` and attends to all `length` columns, the
    engine's mask hiding the padding and the columns not written yet.
    """

    def __init__(self, num_layers: int, rows: int, length: int, slot: torch.Tensor) -> None:
        super().__init__(layers=[])
        self.rows, self.length, self.slot = rows, length, slot
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.decoding = False
        self.prefilled = 0

    def _tensors(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.keys[layer]
        if keys is None:  # first write: the dtype and heads the model's keys have here (autocast included)
            shape = (self.rows, key.shape[1], self.length)
            self.keys[layer] = key.new_zeros((*shape, key.shape[-1]))
            self.values[layer] = value.new_zeros((*shape, value.shape[-1]))
        elif keys.dtype != key.dtype:
            raise ValueError(
                f"layer {layer}'s keys arrive as {key.dtype} but its cache holds {keys.dtype}: the KV "
                f"cache was made under another autocast state; make a new one (DecodeEngine keys on it)"
            )
        return self.keys[layer], self.values[layer]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self._tensors(layer_idx, key_states, value_states)
        if self.decoding:
            keys.index_copy_(2, self.slot, key_states)
            values.index_copy_(2, self.slot, value_states)
            return keys, values
        width = key_states.shape[-2]
        keys[:, :, :width].copy_(key_states)
        values[:, :, :width].copy_(value_states)
        self.prefilled = width
        return keys[:, :, :width], values[:, :, :width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.prefilled  # only read when position ids are not given; the engine always gives them

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return (self.length if self.decoding else self.prefilled + query_length), 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.length

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return self.keys[0] is not None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)
