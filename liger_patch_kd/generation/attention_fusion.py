"""A decode step's RoPE, key/value write and attention in one kernel: the attention forward a decode session's twin
(kernel_twin.py) binds on attention modules laid out as Llama's.

    fuse_decode_attention(twin, spec)   # after bind_kernels: the attention classes spec.attention names

A Llama-laid-out attention module projects q, k and v, rotates q and k (RoPE), hands k and v to the cache, attends
and projects the output. In a decode step of a few rows each of the middle three is a short kernel bound by its
launch: the RoPE kernel, the slot write, the split-KV attention. Here the step's forward projects as the module
does (through the session's fused q/k/v copy where there is one) and calls decode_kernel.rope_write_attend, which
rotates, writes the new column into the cache and attends in one launch (two where the splits are merged).

Only where the three steps it replaces are exactly what the module's forward would run: no gradient, inside the
engine's decode_kernel() block, a one-position step over the session's SlotCache while it decodes, transformers'
"sdpa" attention being packed_gqa_sdpa and taking the call to the Triton kernel (packable, kernel_takes), RoPE
being bind_kernels' (transformers' function through ops/rope.py), no sliding window, no dropout, cos / sin of the
full head size. Anything else (a prefill, a forward with gradients, a caller outside the engine) runs the forward
bind_kernels gave the module, unchanged. The layout is the registry's claim about the installed transformers
(ArchSpec.attention, ArchSpec.attention_norms for Qwen3's per-head q/k norms); tests/test_attention_fusion.py
reads each class's source to hold it to that.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ..models.registry import ArchSpec
from .decode_attention import kernel_takes, kernel_wanted, packable, packed_gqa_sdpa
from .decode_kernel import rope_write_attend
from .kv_cache import SlotCache

# on a forward bind_kernels made (the attention forward whose apply_rotary_pos_emb is the RoPE kernel's)
ROTATES_IN_KERNEL = "__liger_kd_rotates_in_kernel__"


def fuse_decode_attention(twin: nn.Module, spec: ArchSpec) -> int:
    """Bind the fused step forward on every attention module of `twin` that `spec.attention` names, whose class's
    forward is transformers' own and whose instance forward is bind_kernels' RoPE one; returns how many."""
    classes = tuple(spec.classes(spec.attention))
    if not classes:
        return 0
    fused = 0
    for module in twin.modules():
        rotating = module.__dict__.get("forward")
        if not (isinstance(module, classes) and spec.is_stock(module, spec.attention)):
            continue
        if not getattr(getattr(rotating, "__func__", None), ROTATES_IN_KERNEL, False):
            continue
        module.forward = types.MethodType(_step_forward(rotating, spec.attention_norms), module)
        fused += 1
    return fused


def _step_forward(rotating, norms: bool):
    """The module's forward: the fused step where it applies (module docstring), `rotating` (bind_kernels'
    forward, bound to the module) elsewhere."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if args or not _step_applies(self, hidden_states, position_embeddings, attention_mask, cache):
            return rotating(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        batch = hidden_states.shape[0]
        heads_shape = (batch, 1, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(heads_shape)
        key = self.k_proj(hidden_states).view(heads_shape)
        value = self.v_proj(hidden_states).view(heads_shape)
        if norms:
            query, key = self.q_norm(query), self.k_norm(key)
        query4, key4 = query.transpose(1, 2), key.transpose(1, 2)  # the (batch, heads, 1, d) the forward attends
        keys, values = cache.layer_tensors(self.layer_idx, key4, value.transpose(1, 2))
        if not (packable(self, query4, keys, attention_mask, kwargs) and kernel_takes(query4, keys, values,
                                                                                      attention_mask)):  # fmt: skip
            return rotating(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        length = keys.shape[2]
        mask = (attention_mask[:, 0, 0, :length] if attention_mask is not None
                else keys.new_ones((1, length), dtype=torch.bool)).expand(batch, length)  # fmt: skip
        cos, sin = position_embeddings
        scale = self.scaling if self.scaling is not None else self.head_dim**-0.5
        out = rope_write_attend(query4[:, :, 0], key4[:, :, 0], value[:, 0], keys, values, cache.slot, cos[:, 0],
                                sin[:, 0], mask, scale)  # fmt: skip
        return self.o_proj(out.reshape(batch, 1, -1)), None

    return forward


def _step_applies(module, hidden_states, position_embeddings, attention_mask, cache) -> bool:
    """What can be told before the projections: a decode step of the engine's, through packed_gqa_sdpa, with
    cos / sin the kernel rotates by."""
    if torch.is_grad_enabled() or not kernel_wanted():
        return False
    if not (isinstance(cache, SlotCache) and cache.decoding and cache.keys[module.layer_idx] is not None):
        return False
    if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
        return False
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = module.config
    if config._attn_implementation != "sdpa" or ALL_ATTENTION_FUNCTIONS["sdpa"] is not packed_gqa_sdpa:
        return False
    if module.training and module.attention_dropout or getattr(module, "sliding_window", None) is not None:
        return False
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return False
    if not (isinstance(position_embeddings, tuple) and len(position_embeddings) == 2):
        return False
    cos, sin = position_embeddings
    rows = hidden_states.shape[0]
    return all(
        t.dim() == 3 and t.shape[0] in (1, rows) and t.shape[1] == 1 and t.shape[2] == module.head_dim
        and t.stride(-1) == 1 and t.is_floating_point()
        for t in (cos, sin)
    ) and module.head_dim % 2 == 0  # fmt: skip
