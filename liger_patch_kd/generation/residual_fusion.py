"""A decode step's residual adds folded into the RMSNorms that read them: one kernel where a Llama-laid-out decoder
layer runs two (the add, then the norm of its sum), in the twin a decode session runs (kernel_twin.py).

    fold_residual_adds(twin, spec)   # after bind_kernels: the layers spec.residual_layers names, and their norms

A decoder layer laid out as Llama's adds the attention's output to its input, normalises the sum for the MLP, adds
the MLP's output to that sum and hands it on, where the next layer (or the final norm) normalises it again. At a
few rows a step every one of those is a short kernel bound by its launch: two adds and two norms a layer. Here the
layer computes each sum and the norm that reads it in one kernel (ops.rms_norm.add_rms_norm) and hands the norm's
output to that norm module, which returns it when it is called on that very sum (same tensor, not changed in place
since) and otherwise computes its own: the model's module calls, hooks and outputs stay as they were, and a sum that
something else changes before its norm reads it (Qwen3-VL's deepstack adds image features between layers) costs
only the unused norm.

Where the layer's readers of a norm are products under autocast (the attention's q/k/v projections, a dense gated
MLP's gate/up, the head after the final norm), the fused kernel writes the norm in autocast's dtype: the same values
rounded once, without the cast autocast would launch before each product. The twin's last hidden state is then in
that dtype too: the twin is the decode sessions', which read its logits and nothing else.

Only for inference: a forward with gradients (the twin is never trained, but a caller might) adds and normalises as
the model does. The layout is the registry's claim about the installed transformers (ArchSpec.residual_layers);
tests/test_residual_fusion.py reads each class's source to hold it to that.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ..models.patch import norm_eps
from ..models.registry import ArchSpec
from ..models.state import FP8_OUTPUT_ATTR
from ..ops.rms_norm import add_rms_norm, norm_output_dtype
from ..utils.hooks import no_hooks
from .dependent_launch import dependent_launch
from .same_input import input_mark

PRENORMED = "_kd_prenormed"  # on a norm module: (the sum it will be called on, its input_mark, the norm of it)


def fold_residual_adds(twin: nn.Module, spec: ArchSpec) -> int:
    """Bind the fused layer forward on every layer of `twin` that `spec.residual_layers` names and whose norms run
    the kernel (bind_kernels' forward); returns how many layers got it."""
    if not spec.classes(spec.residual_layers):
        return 0
    dense_mlps = tuple(spec.classes(spec.mlp))
    folded = 0
    for parent in twin.modules():
        for stack in parent.children():
            layered = isinstance(stack, nn.ModuleList) and len(stack) > 0
            # transformers' own layer forward only: a subclass's, or one set on the class, computes something else
            if not (layered and all(spec.is_stock(m, spec.residual_layers) for m in stack)):
                continue
            layers = list(stack)
            final_norm = getattr(parent, "norm", None)
            for index, layer in enumerate(layers):
                next_layer = layers[index + 1] if index + 1 < len(layers) else None
                following = final_norm if next_layer is None else next_layer.input_layernorm
                if not (_kernel_norm(layer.input_layernorm) and _kernel_norm(layer.post_attention_layernorm)):
                    continue
                if layer.__dict__.get("forward") is not None:  # someone else's forward on this instance: theirs
                    continue
                for norm in (layer.input_layernorm, layer.post_attention_layernorm, following):
                    _take_prenormed(norm)
                next_norm = following if isinstance(following, nn.Module) and _kernel_norm(following) else None
                # the MLP's products read the post-attention norm when it is a dense gated MLP (a router may not)
                mlp_reads_in_autocast = bool(dense_mlps) and isinstance(layer.mlp, dense_mlps)
                layer.forward = types.MethodType(
                    _layer_forward(spec, next_norm, next_layer, mlp_reads_in_autocast), layer
                )
                folded += 1
    return folded


def _kernel_norm(norm: object) -> bool:
    """Whether `norm` is a module whose forward is bind_kernels' kernel (possibly already taking a prenormed sum),
    and not an FP8 teacher's (whose norm also quantises its output)."""
    own = getattr(norm, "__dict__", {})
    function = getattr(own.get("forward"), "__func__", None)
    return bool(getattr(function, "__liger_kd__", False)) and hasattr(norm, "weight") and not own.get(FP8_OUTPUT_ATTR)


def _take_prenormed(norm: object) -> None:
    """Wrap a kernel norm's forward so that it returns the output a fused add left for its very input."""
    if not _kernel_norm(norm):
        return
    function = norm.forward.__func__
    if getattr(function, "takes_prenormed", False):
        return

    def forward(self, hidden_states):
        left = self.__dict__.pop(PRENORMED, None)
        if left is not None and left[0] is hidden_states and left[1] == input_mark(hidden_states):
            return left[2]
        return function(self, hidden_states)

    forward.__liger_kd__ = True
    forward.takes_prenormed = True
    norm.forward = types.MethodType(forward, norm)


def add_for_norm(spec: ArchSpec, residual: torch.Tensor, x: torch.Tensor, norm: nn.Module | None,
                 read_in_autocast: bool, between: tuple[tuple, tuple] = ((), ())) -> torch.Tensor:  # fmt: skip
    """residual + x; where `norm` (spec's RMSNorm) will read that sum, its output made in the same kernel and left
    on it. `between`: (the modules whose forward hooks, the modules whose pre-hooks) run between this add and the
    norm's forward (the norm's own pre-hooks always): with any of them, or a global one, the norm computes its own
    (a hook may change the sum in place unseen)."""
    if norm is None or torch.is_grad_enabled() or x.shape != residual.shape:
        return residual + x
    after, before = between
    if not no_hooks(after=after, before=(*before, norm)):
        return residual + x
    eps = norm_eps(norm)
    kind = x.device.type
    out_dtype = None
    if read_in_autocast and torch.is_autocast_enabled(kind):
        # only a float32 norm: autocast's cast of it is one rounding of the float32 value, which the kernel makes;
        # a 16-bit norm is rounded to its own dtype first, a float64 one autocast never casts
        own = norm_output_dtype(torch.promote_types(residual.dtype, x.dtype), norm.weight.dtype, spec.rms_norm_casting)
        out_dtype = torch.get_autocast_dtype(kind) if own == torch.float32 else None
    summed, normed = add_rms_norm(x, residual, norm.weight, eps, spec.rms_norm_offset, spec.rms_norm_casting,
                                  out_dtype=out_dtype, dependent=dependent_launch(x.device))  # fmt: skip
    norm.__dict__[PRENORMED] = (summed, input_mark(summed), normed)
    return summed


def _layer_forward(spec: ArchSpec, next_norm: nn.Module | None, next_layer: nn.Module | None,
                   mlp_reads_in_autocast: bool):  # fmt: skip
    """The Llama layout's forward, each add fused with the norm after it. Every keyword goes on to the attention, as
    the layer passes each of its own (whatever transformers calls the cache; the registry's test holds the layer to
    that); the models call their layers with keywords, and a positional one would be a TypeError here."""

    def forward(self, hidden_states, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        hidden_states = add_for_norm(
            spec, residual, hidden_states, self.post_attention_layernorm, mlp_reads_in_autocast
        )
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        # between this return and the next norm: this layer's forward hooks, the next layer's pre-hooks; that norm's
        # readers are products (the next layer's q/k/v, or the head after the final norm)
        between = ((self,), () if next_layer is None else (next_layer,))
        return add_for_norm(spec, residual, hidden_states, next_norm, True, between)

    forward.__liger_kd__ = True
    return forward
