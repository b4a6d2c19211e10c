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
being the kernel's (bind_kernels' forward, or apply_kd_patch's function in the modeling module), no dropout, cos /
sin of the full head size. Anything else that can be told before the projections (a prefill, a forward with
gradients, a caller outside the engine, plain multi-head attention) runs the forward the module had, unchanged;
what the projections decide (dtypes the kernel does not take: Qwen3's float32 q/k norms under bf16 autocast) runs
that forward's remaining steps on them, so that no projection runs twice. The layout is the registry's claim about
the installed transformers (ArchSpec.attention, ArchSpec.attention_norms for Qwen3's per-head q/k norms);
tests/test_attention_fusion.py reads each class's source to hold it to that.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ..models.patch import is_rope_kernel
from ..models.registry import ArchSpec
from ..ops.backend import select_backend
from ..ops.rope import rope
from .decode_attention import kernel_mask_and_scale, kernel_takes, kernel_wanted, packable, packed_gqa_sdpa
from .decode_kernel import rope_write_attend
from .dependent_launch import dependent_launch
from .kv_cache import SlotCache

ROPE_NAME = "apply_rotary_pos_emb"  # the module-level function transformers' attention forwards call
CACHE_KEYWORDS = ("cache", "past_key_values")  # the cache's name in one transformers or another

# on a forward bind_kernels made (the attention forward whose apply_rotary_pos_emb is the RoPE kernel's)
ROTATES_IN_KERNEL = "__liger_kd_rotates_in_kernel__"


def fuse_decode_attention(twin: nn.Module, spec: ArchSpec) -> int:
    """Bind the fused step forward on every attention module of `twin` that `spec.attention` names, whose class's
    forward is transformers' own and rotates through the RoPE kernel: bind_kernels' forward on the instance, or the
    class's own where apply_kd_patch made the modeling module's apply_rotary_pos_emb the kernel. Returns how many."""
    classes = tuple(spec.classes(spec.attention))
    if not classes:
        return 0
    patched_rope = is_rope_kernel(getattr(spec.load(), ROPE_NAME, None))
    fused = 0
    for module in twin.modules():
        if not (isinstance(module, classes) and spec.is_stock(module, spec.attention)):
            continue
        own = module.__dict__.get("forward")
        if own is None and patched_rope:
            rotating = module.forward  # the class's forward, reading the kernel from its module
        elif getattr(getattr(own, "__func__", None), ROTATES_IN_KERNEL, False):
            rotating = own
        else:
            continue
        module.forward = types.MethodType(_step_forward(rotating, spec.attention_norms), module)
        fused += 1
    return fused


def _step_forward(rotating, norms: bool):
    """The module's forward: the fused step where it applies (module docstring), `rotating` (the forward it had,
    bound to the module) elsewhere."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if args or not _step_applies(self, hidden_states, position_embeddings, attention_mask, cache, kwargs):
            return rotating(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        batch = hidden_states.shape[0]
        heads_shape = (batch, 1, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(heads_shape)
        key = self.k_proj(hidden_states).view(heads_shape)
        value = self.v_proj(hidden_states).view(heads_shape)
        if norms:
            query, key = self.q_norm(query), self.k_norm(key)
        # the (batch, heads, 1, d) tensors the module's forward rotates, hands to the cache and attends with
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        keys, values = cache.layer_tensors(self.layer_idx, key, value)
        cos, sin = position_embeddings
        if kernel_takes(query, keys, values, attention_mask) and _new_column_taken(query, key, value):
            mask, scale = kernel_mask_and_scale(attention_mask, keys, batch, self.scaling)
            out = rope_write_attend(query[:, :, 0], key[:, :, 0], value[:, :, 0], keys, values, cache.slot, cos[:, 0],
                                    sin[:, 0], mask, scale, dependent_launch(query.device))  # fmt: skip
        else:  # what the module's forward does from here, the projections not run again (their hooks fire once)
            query, key = rope(query, key, cos, sin)
            keys, values = cache.update(key, value, self.layer_idx)
            attention_kwargs = {k: v for k, v in kwargs.items() if k not in CACHE_KEYWORDS}
            out, _ = packed_gqa_sdpa(self, query, keys, values, attention_mask, dropout=0.0, scaling=self.scaling,
                                     **attention_kwargs)  # fmt: skip
        return self.o_proj(out.reshape(batch, 1, -1).contiguous()), None

    return forward


def _new_column_taken(query, key, value) -> bool:
    """The new key and value as rope_write_attend reads them: the query's dtype, head dims contiguous (a hook on
    k_proj may hand on a strided view; the unfused path copies it into the cache, the kernel would refuse it)."""
    return key.dtype == value.dtype == query.dtype and key.stride(-1) == value.stride(-1) == 1


def _step_applies(module, hidden_states, position_embeddings, attention_mask, cache, kwargs) -> bool:
    """What can be told before the projections: a decode step of the engine's whose attention packed_gqa_sdpa
    takes to its kernel (grouped heads, a boolean mask shared by the heads, nothing it defers on), with cos / sin
    of the full head size. The window is not looked at: decode_applies refuses a model with one before any step,
    as packed_gqa_sdpa's kernel path relies on."""
    if torch.is_grad_enabled() or not kernel_wanted() or select_backend(hidden_states.device) != "triton":
        return False
    if not (isinstance(cache, SlotCache) and cache.decoding and cache.keys[module.layer_idx] is not None):
        return False
    if hidden_states.dim() != 3 or hidden_states.shape[1] != 1 or module.training and module.attention_dropout:
        return False
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if module.config._attn_implementation != "sdpa" or ALL_ATTENTION_FUNCTIONS["sdpa"] is not packed_gqa_sdpa:
        return False
    keys = cache.keys[module.layer_idx]
    heads = keys.shape[1] * getattr(module, "num_key_value_groups", 1)
    shapes = torch.empty((hidden_states.shape[0], heads, 1, 0), device="meta")  # the query's shape, for packable
    if not packable(module, shapes, keys, attention_mask, kwargs) or module.head_dim % 2 or module.head_dim > 256:
        return False
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return False
    if not (isinstance(position_embeddings, tuple) and len(position_embeddings) == 2):
        return False
    rows = hidden_states.shape[0]
    return all(
        t.dim() == 3 and t.shape[0] in (1, rows) and t.shape[1] == 1 and t.shape[2] == module.head_dim
        and t.stride(-1) == 1 and t.is_floating_point()
        for t in position_embeddings
    )  # fmt: skip
