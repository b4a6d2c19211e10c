"""An FP8 teacher: the frozen teacher's decoder products run as e4m3 `torch._scaled_mm` (ops/fp8.py).

`quantize_teacher_fp8(teacher)` replaces, in place and once, every `nn.Linear` of the teacher's decoder by an
`Fp8Linear` holding the weight in e4m3 with one scale per output channel, and frees the bf16 weight: the
decoder's weights take half the memory. Activations are quantised per token as they arrive (dynamic scales):
  - an input shared by several products (q, k and v read the same normed hidden states) is quantised once;
  - a gated MLP's gate and up products become one product over the concatenated weight, and its activation
    kernel writes the quantised input of the down product directly (the wide intermediate never exists in bf16).
What stays in bf16, and why:
  - lm_head: the fused KD loss reads the teacher's head weight in its own chunked product (the teacher's logits
    are never materialised), so a quantised head would need an FP8 product inside the loss; it is also the one
    product whose rounding lands directly on the distribution the student learns;
  - embeddings, norms, attention (softmax(QKᵀ)V inside sdpa / flash), MoE experts held as 3-D tensors and
    routers (a routing decision is discrete: a flipped expert is not a small error);
  - everything outside the language decoder (`get_decoder()`), e.g. a VLM's vision tower;
  - products whose sizes are not multiples of 16 (`_scaled_mm`'s requirement).
`fast_accum=True` runs the decoder products without cuBLASLt's periodic fp32 promotion of the running sums
(ops/fp8.py): faster, less exact; the lm_head's product is not affected (it is the loss's).
The result is for inference only: the teacher must be frozen, and it cannot be sharded afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..distributed import is_dtensor
from ..ops.fp8 import (
    QUANTIZED_INPUTS,
    LastOnThisThread,
    fp8_available,
    fp8_linear,
    gated_act_quantized,
    note_if_emulated,
    quantize_rows,
    quantize_weight,
)
from .patch import activation_name
from .state import FP8_OUTPUT_ATTR, unwrap_model

_FP8_ATTR = "__liger_kd_fp8__"
_ROUTER_NAMES = ("router", "gate")  # MoE routers: a module named exactly so is kept in bf16


_PRODUCT = LastOnThisThread()  # an activation's product with a shared projection weight (owner: the Fp8Linear)


class Fp8Linear(nn.Module):
    """y = x Wᵀ + b with W in e4m3 (one scale per output channel) and x quantised per token on the fly (or found
    quantised in QUANTIZED_INPUTS: by a sibling product, or by the norm that wrote x)."""

    _FIXED_DTYPE = ("weight_fp8", "weight_scale")  # e4m3 and fp32 whatever the model is cast to

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fast_accum: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.fast_accum = fast_accum
        weight_fp8, weight_scale = quantize_weight(weight)
        self.register_buffer("weight_fp8", weight_fp8)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def _apply(self, fn, recurse=True):
        """A model-wide cast (`teacher.half()`, `.to(torch.bfloat16)`) moves the quantised weight and its scales to
        the new device but keeps their dtypes: cast, they would no longer be an FP8 product's operands."""
        fixed = {name: self._buffers.pop(name) for name in self._FIXED_DTYPE}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, buffer in fixed.items():
                self._buffers[name] = buffer.to(fn(buffer[:0]).device)  # fn on an empty view: where it goes
        return self

    @classmethod
    def from_linears(cls, *linears: nn.Linear, fast_accum: bool = False) -> Fp8Linear:
        """One product over several linears reading the same input (their outputs concatenated, in order)."""
        biases = [lin.bias for lin in linears]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else lin.weight.new_zeros(lin.out_features) for b, lin in zip(biases, linears)]
        )  # fmt: skip
        return cls(torch.cat([lin.weight.detach() for lin in linears]), bias, fast_accum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quantized = QUANTIZED_INPUTS.lookup(x)
        if quantized is None:
            quantized = quantize_rows(x.reshape(-1, self.in_features).contiguous())
            QUANTIZED_INPUTS.remember(x, quantized)
        return self.forward_quantized(*quantized, x.shape[:-1], x.dtype)

    def forward_quantized(
        self, x8: torch.Tensor, x_scale: torch.Tensor, leading: torch.Size, dtype: torch.dtype
    ) -> torch.Tensor:
        y = fp8_linear(x8, x_scale, self.weight_fp8, self.weight_scale, self.bias, fast_accum=self.fast_accum)
        return y.to(dtype).reshape(*leading, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"fast_accum={self.fast_accum}"
        )


class Fp8Projection(nn.Module):
    """One of several projections of the same input (an attention's q, k and v) served by one FP8 product over
    their concatenated weights: the first of them called with an input runs the product, the others take their
    columns of it (a view: the attention reshapes each into heads, which its row stride allows). Three products
    of N = 4096, 1024, 1024 become one of 6144, where cuBLASLt runs closer to its peak (probe_fp8_accum). A
    projection called on an input of its own (not its siblings') still gets the right columns, computed for it."""

    def __init__(self, shared: Fp8Linear, start: int, end: int):
        super().__init__()
        self._shared = (shared,)  # a tuple: registered once, on the parent, not under every projection
        self.start, self.end = start, end
        self.in_features, self.out_features = shared.in_features, end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self._shared[0]
        y = _PRODUCT.lookup(x, shared)
        if y is None:
            y = shared(x)
            _PRODUCT.remember(x, y, shared)
        return y[..., self.start : self.end]

    def extra_repr(self) -> str:
        return f"columns {self.start}:{self.end} of the shared product, in_features={self.in_features}"


_SHARED_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
_SHARED_NAME = "qkv_proj_fp8"  # where the parent holds their shared product


def _share_projections(module: nn.Module, fast_accum: bool) -> bool:
    """Replace `module`'s q, k and v linears (same input width, sizes FP8 can take) by one shared FP8 product;
    False (and nothing changed) where it has no such three."""
    linears = [getattr(module, n, None) for n in _SHARED_PROJECTIONS]
    if not all(isinstance(lin, nn.Linear) and _fits(lin) for lin in linears):
        return False
    if len({lin.in_features for lin in linears}) != 1:
        return False
    shared = Fp8Linear.from_linears(*linears, fast_accum=fast_accum)
    module.add_module(_SHARED_NAME, shared)
    start = 0
    for name, lin in zip(_SHARED_PROJECTIONS, linears):
        setattr(module, name, Fp8Projection(shared, start, start + lin.out_features))
        start += lin.out_features
    return True


def _norms_feeding_fp8(layer: nn.Module) -> list[nn.Module]:
    """A pre-norm decoder layer's norms whose output only FP8 products read: the attention's input norm when its
    q, k and v share one product, and the MLP's input norm (Gemma 2/3's pre_feedforward_layernorm, else
    post_attention_layernorm) when the MLP is an Fp8GatedMLP. A post-norm layer (OLMo-2: no input_layernorm) has
    none: its norms feed the residual stream."""
    norm_in = getattr(layer, "input_layernorm", None)
    if not isinstance(norm_in, nn.Module):
        return []
    norms = []
    if isinstance(getattr(getattr(layer, "self_attn", None), "q_proj", None), Fp8Projection):
        norms.append(norm_in)
    norm_mlp = getattr(layer, "pre_feedforward_layernorm", None) or getattr(layer, "post_attention_layernorm", None)
    if isinstance(getattr(layer, "mlp", None), Fp8GatedMLP) and isinstance(norm_mlp, nn.Module):
        norms.append(norm_mlp)
    return norms


class Fp8GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up as one FP8 product and the activation quantised in-kernel.
    It replaces the model's MLP module (rather than its forward), so nothing that restores patched forwards
    (revert_kd_patch) can bring back a forward whose weights are gone."""

    def __init__(self, gate_up: Fp8Linear, down: Fp8Linear, activation: str):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.activation = gate_up, down, activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        h8, h_scale = gated_act_quantized(gate_up.reshape(-1, gate_up.shape[-1]), self.activation)
        return self.down_proj.forward_quantized(h8, h_scale, x.shape[:-1], x.dtype)

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


@dataclass
class Fp8Summary:
    """What `quantize_teacher_fp8` did: products quantised, kept in bf16 (with the reason), bytes before/after,
    and whether the products accumulate fast."""

    fast_accum: bool = False
    quantized: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0


def _fits(linear: nn.Linear) -> bool:
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def _check_teacher(model: nn.Module) -> torch.device:
    params = list(model.parameters())
    if not params:
        raise ValueError(f"quantize_teacher_fp8: {type(model).__name__} has no parameters")
    if any(p.requires_grad for p in params):
        raise ValueError(
            "quantize_teacher_fp8: the teacher has parameters with requires_grad=True; an FP8 teacher is for "
            "inference only: call teacher.requires_grad_(False) (KDTrainer does) before quantising it"
        )
    if any(is_dtensor(p) or hasattr(p, "ds_id") or type(p).__name__ == "FlatParameter" for p in params):
        raise ValueError(
            "quantize_teacher_fp8: the teacher is sharded (FSDP / ZeRO-3); an FP8 teacher runs whole on each "
            "device. Quantise it unsharded, or keep kd_teacher_precision='bf16' when sharding the teacher"
        )
    device = params[0].device
    ok, why = fp8_available(device)
    if not ok:
        raise ValueError(f"quantize_teacher_fp8: {why}. Keep the teacher in bf16 (kd_teacher_precision='bf16')")
    note_if_emulated(device, "the FP8 teacher")
    return device


@torch.no_grad()
def quantize_teacher_fp8(model: nn.Module, *, fast_accum: bool = False) -> Fp8Summary:
    """Quantise the frozen teacher's decoder products to FP8, in place (see the module's docstring). Returns
    what was done; a second call returns the first call's summary and changes nothing (asking it for another
    `fast_accum` is an error: the products are already built)."""
    inner = unwrap_model(model)
    if hasattr(inner, _FP8_ATTR):
        done = getattr(inner, _FP8_ATTR)
        if done.fast_accum != fast_accum:
            raise ValueError(
                f"quantize_teacher_fp8(fast_accum={fast_accum}): this teacher was already quantised with "
                f"fast_accum={done.fast_accum}; quantise a fresh copy of the teacher to change it"
            )
        return done
    _check_teacher(inner)
    summary = Fp8Summary(fast_accum=fast_accum, bytes_before=_nbytes(inner))
    names = {id(m): n for n, m in inner.named_modules()}
    head = inner.get_output_embeddings()
    summary.kept[names[id(head)]] = "lm_head: read by the fused loss in bf16"
    # the language decoder only: a VLM's vision tower (and anything else outside it) stays as loaded
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else inner
    decoder_modules = [(names[id(m)], m) for m in decoder.modules()]
    # gated MLPs first: gate and up become one product, the activation feeds the down product quantised
    for name, module in decoder_modules:
        separate = all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
        fused = all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_up_proj", "down_proj"))
        activation = activation_name(module) if separate or fused else None
        if activation is None or not name:
            continue
        parts = (module.gate_proj, module.up_proj) if separate else (module.gate_up_proj,)
        if not all(_fits(lin) for lin in (*parts, module.down_proj)):
            continue  # left to the loop below, which keeps them in bf16 and says why
        down = Fp8Linear(module.down_proj.weight, module.down_proj.bias, fast_accum)
        mlp = Fp8GatedMLP(Fp8Linear.from_linears(*parts, fast_accum=fast_accum), down, activation)
        parent_name, _, child_name = name.rpartition(".")
        setattr(inner.get_submodule(parent_name), child_name, mlp)
        summary.quantized += [f"{name}.gate_up_proj", f"{name}.down_proj"]
    # attentions next: q, k and v become one product (the o-projection is left to the loop below)
    for name, module in decoder_modules:
        if name and _share_projections(module, fast_accum):
            summary.quantized += [f"{name}.{n}" for n in _SHARED_PROJECTIONS]
    for _, module in decoder_modules:
        for norm in _norms_feeding_fp8(module):
            setattr(norm, FP8_OUTPUT_ATTR, True)
    for module in list(decoder.modules()):
        name = names.get(id(module), "")
        for child_name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear) or child is head:
                continue
            full = f"{name}.{child_name}" if name else child_name
            if child_name in _ROUTER_NAMES:
                summary.kept[full] = "MoE router: routing is discrete"
            elif not _fits(child):
                summary.kept[full] = f"{child.in_features} x {child.out_features}: not multiples of 16"
            else:
                setattr(module, child_name, Fp8Linear(child.weight, child.bias, fast_accum))
                summary.quantized.append(full)
    summary.bytes_after = _nbytes(inner)
    setattr(inner, _FP8_ATTR, summary)
    if next(inner.parameters()).device.type == "cuda":
        torch.cuda.empty_cache()
    return summary


TEACHER_PRECISIONS = ("bf16", "fp8", "fp8_fast_accum")  # kd_teacher_precision / `liger-kd serve --precision`


def check_teacher_precision(precision: str, option: str = "teacher precision") -> None:
    """A one-line ValueError naming `option` unless `precision` is one of TEACHER_PRECISIONS."""
    if precision not in TEACHER_PRECISIONS:
        raise ValueError(f"{option} must be one of {TEACHER_PRECISIONS}; got {precision!r}")


def apply_teacher_precision(model: nn.Module, precision: str) -> Fp8Summary | None:
    """The frozen teacher at `precision`, one of TEACHER_PRECISIONS: bf16 leaves it as loaded (None); fp8 and
    fp8_fast_accum quantise its decoder products (`quantize_teacher_fp8`, without and with fast accumulation)."""
    check_teacher_precision(precision)
    if precision == "bf16":
        return None
    return quantize_teacher_fp8(model, fast_accum=precision == "fp8_fast_accum")
