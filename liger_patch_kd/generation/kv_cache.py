"""A static KV cache whose rows share one write slot: what a captured decode step writes into.

Prompts are left-padded to one width W, so every row's next token goes to the same column of the cache: slot W,
then W + 1, ... The slot is a one-element device tensor the decode step reads and advances, so the same kernels
(one CUDA graph) serve every step. Attention masks are given whole (4D, boolean) by the engine, which knows which
columns hold a row's prompt; transformers returns a 4D mask as it is, so nothing here sizes a mask.

The tensors are allocated at the first write of each layer, in the dtype the keys arrive in: a float32 model under
bfloat16 autocast writes bfloat16 keys, and its cache is bfloat16 (allocating by the weights' dtype gave
`index_copy_(): ... Float and BFloat16`).

A decode step writes a layer's new key and value columns in one Triton launch where the backend is Triton (two
`index_copy_` kernels otherwise): a step of a few rows is bound by how many kernels it launches.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..ops.backend import select_backend, triton_available

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _slot_write_kernel(
        key_ptr, value_ptr, keys_ptr, values_ptr, slot_ptr, kv_heads, length,
        s_kb, s_kh, s_vb, s_vh, s_ksb, s_ksh, s_ksn, s_vsb, s_vsh, s_vsn,
        DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """One program per (row, key/value head): its key and value, (dim,) each, into column `slot` of the cache."""
        pair = tl.program_id(0)
        b, h = (pair // kv_heads).to(tl.int64), (pair % kv_heads).to(tl.int64)
        slot = tl.load(slot_ptr).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        # the engine never steps past its cache; were it asked to (or given a negative slot), nothing is written
        # outside it
        ok = d < tl.where((slot >= 0) & (slot < length), DIM, 0)
        key = tl.load(key_ptr + b * s_kb + h * s_kh + d, mask=ok)
        value = tl.load(value_ptr + b * s_vb + h * s_vh + d, mask=ok)
        tl.store(keys_ptr + b * s_ksb + h * s_ksh + slot * s_ksn + d, key, mask=ok)
        tl.store(values_ptr + b * s_vsb + h * s_vsh + slot * s_vsn + d, value, mask=ok)


def write_slot(keys: torch.Tensor, values: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot: torch.Tensor):
    """keys[:, :, slot] = key[:, :, 0] and values[:, :, slot] = value[:, :, 0]; `slot` a one-element device tensor
    (read by the kernel: one graph serves every step), key / value (rows, kv heads, 1, dim)."""
    # one dtype too: index_copy_ refuses another, where the kernel's store would cast it silently
    single = key.shape[2] == 1 and key.shape == value.shape and key.shape[:2] + key.shape[3:] == keys.shape[:2] + \
        keys.shape[3:] and keys.shape == values.shape and \
        key.dtype == value.dtype == keys.dtype == values.dtype  # fmt: skip
    if not single or select_backend(key.device) != "triton" or key.stride(-1) != 1 or value.stride(-1) != 1 \
            or keys.stride(-1) != 1 or values.stride(-1) != 1:  # fmt: skip
        keys.index_copy_(2, slot, key)
        values.index_copy_(2, slot, value)
        return
    rows, kv_heads, _, dim = key.shape
    _slot_write_kernel[(rows * kv_heads,)](
        key, value, keys, values, slot, kv_heads, keys.shape[2],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *keys.stride()[:3], *values.stride()[:3], DIM=dim, BLOCK_D=triton.next_power_of_2(dim),
    )  # fmt: skip


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

    def layer_tensors(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values (made at its first write, in the dtype and heads `key` has), refused
        where `key` comes in another dtype than the cache holds."""
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
        keys, values = self.layer_tensors(layer_idx, key_states, value_states)
        if self.decoding:
            write_slot(keys, values, key_states, value_states, self.slot)
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
