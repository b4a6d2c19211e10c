"""Gated MLP activation: act(gate) * up in one pass, forward and backward; act is SiLU (SwiGLU: Llama, Mistral,
Qwen, Phi-3) or tanh-approximated GELU (GeGLU: Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import select_backend, triton_available

ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}


def gated_act_torch(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    act = F.silu(gate) if ACTIVATIONS[activation] == 0 else F.gelu(gate, approximate="tanh")
    return act * up


if triton_available():
    import triton
    import triton.language as tl

    from .triton_utils import acc_type, tanh

    @triton.jit
    def act_and_grad(g, GELU: tl.constexpr):
        """(act(g), act'(g)) in the arithmetic type of g."""
        if GELU:
            k: tl.constexpr = 0.7978845608028654  # sqrt(2 / pi)
            inner = k * (g + 0.044715 * g * g * g)
            t = tanh(inner)
            act = 0.5 * g * (1.0 + t)
            d = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * g * g)
        else:
            sig = 1.0 / (1.0 + tl.exp(-g))
            act = g * sig
            d = sig * (1.0 + g * (1.0 - sig))
        return act, d

    @triton.jit
    def _gated_fwd_kernel(gate_ptr, up_ptr, out_ptr, n, GELU: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(ACC)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(ACC)
        act, _ = act_and_grad(g, GELU)
        tl.store(out_ptr + offs, (act * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gated_bwd_kernel(
        dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, GELU: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        do = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(ACC)
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(ACC)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(ACC)
        act, d = act_and_grad(g, GELU)
        tl.store(dgate_ptr + offs, (do * u * d).to(dgate_ptr.dtype.element_ty), mask=mask)
        tl.store(dup_ptr + offs, (do * act).to(dup_ptr.dtype.element_ty), mask=mask)

    _BLOCK = 1024  # elementwise: 1024 elements at 4 warps is 8 per thread, enough to saturate bandwidth


class GatedActFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation):
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        n = gate.numel()
        gelu = ACTIVATIONS[activation] == 1
        _gated_fwd_kernel[(triton.cdiv(n, _BLOCK),)](
            gate, up, out, n, GELU=gelu, ACC=acc_type(gate.dtype), BLOCK=_BLOCK
        )
        ctx.save_for_backward(gate, up)
        ctx.gelu = gelu
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dout = dout.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _gated_bwd_kernel[(triton.cdiv(n, _BLOCK),)](
            dout, gate, up, dgate, dup, n, GELU=ctx.gelu, ACC=acc_type(gate.dtype), BLOCK=_BLOCK
        )
        return dgate, dup, None


def gated_act(
    gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", backend: str | None = None
) -> torch.Tensor:
    """act(gate) * up; activation is one of ACTIVATIONS' names."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}; got activation={activation!r}")
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape; got {tuple(gate.shape)} and {tuple(up.shape)}")
    if select_backend(gate.device, backend) == "torch":
        return gated_act_torch(gate, up, activation)
    return GatedActFunction.apply(gate, up, activation)
