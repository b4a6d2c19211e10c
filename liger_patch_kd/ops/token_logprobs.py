"""Log-probabilities of given tokens straight from hidden states and an lm_head, one chunk of logits at a time.

The sampled-token losses of on-policy distillation (policy-gradient reverse KL, the k1 / k3 estimators) need
log q(y_t) = z_t[y_t] - logsumexp(z_t) for one token per row, differentiable, where z = cap(h Wᵀ + b) / T. Autograd
through a chunk loop would keep every chunk's logits for the backward; this Function keeps only the (N,)
log-sum-exps and recomputes each chunk's logits in the backward, so memory is one chunk whatever N is.

The two products per chunk (forward, and backward's recomputation plus two gradient products) run in cuBLAS;
the softmax is a handful of elementwise passes over one chunk, cheap beside them (CE-shaped work: the kernels of
the divergence losses would buy little here).
"""

from __future__ import annotations

import torch

from ..conventions import apply_softcap
from .backend import autocast_dtype, logits_fp32, no_autocast
from .chunked import choose_chunk_size


def _chunk_logits(h, weight, bias, temperature, softcap):
    """fp32 logits of one chunk as the loss sees them, and the capped pre-temperature values (for the backward)."""
    raw = logits_fp32(h, weight.to(h.dtype), None if bias is None else bias.to(h.dtype))
    capped = apply_softcap(raw, softcap)
    return capped / temperature, capped


class LinearTokenLogprobsFunction(torch.autograd.Function):
    """Only the scored rows (ids >= 0) are read: the others (a prompt, padding) cost nothing and their hidden
    states, NaN or not, touch neither the output nor a gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temperature, softcap, chunk):
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        rows = (ids >= 0).nonzero().squeeze(1)
        picked_ids = ids[rows]
        out = hidden.new_zeros(hidden.shape[0], dtype=dtype)
        lse = hidden.new_zeros(len(rows), dtype=dtype)
        for start in range(0, len(rows), chunk):
            end = min(len(rows), start + chunk)
            z, _ = _chunk_logits(hidden[rows[start:end]], weight, bias, temperature, softcap)
            lse[start:end] = torch.logsumexp(z, dim=-1)
            out[rows[start:end]] = z.gather(1, picked_ids[start:end, None]).squeeze(1) - lse[start:end]
        ctx.save_for_backward(hidden, weight, bias, rows, picked_ids, lse)
        ctx.options = (temperature, softcap, chunk)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden = ctx.saved_tensors[0]
        with no_autocast(hidden.device):  # a backward called under autocast: the recomputed logits stay fp32
            return LinearTokenLogprobsFunction.gradients(ctx, grad_out)

    @staticmethod
    def gradients(ctx, grad_out):
        hidden, weight, bias, rows, ids, lse = ctx.saved_tensors
        temperature, softcap, chunk = ctx.options
        needs_h, needs_w, needs_b = ctx.needs_input_grad[:3]
        acc = lse.dtype  # fp32 (fp64 for fp64 inputs): the weight gradient sums over every chunk
        grad_h = torch.zeros_like(hidden) if needs_h else None
        grad_w = torch.zeros_like(weight, dtype=acc) if needs_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if needs_b else None
        g = grad_out[rows].to(acc)
        for start in range(0, len(rows), chunk):
            end = min(len(rows), start + chunk)
            h = hidden[rows[start:end]]
            z, capped = _chunk_logits(h, weight, bias, temperature, softcap)
            # d(z[y] - lse)/dz = onehot(y) - softmax(z), times the upstream gradient of the row
            dz = torch.exp(z - lse[start:end, None]).mul_(-g[start:end, None])
            dz.scatter_add_(1, ids[start:end, None], g[start:end, None])
            dz = dz / temperature
            if softcap is not None:  # d(tanh(x / c) c)/dx = 1 - tanh(x / c)^2 = 1 - (capped / c)^2
                dz = dz * (1 - (capped / softcap) ** 2)
            if needs_h:
                grad_h[rows[start:end]] = torch.mm(dz.to(h.dtype), weight.to(h.dtype)).to(hidden.dtype)
            if needs_w:
                grad_w.addmm_(dz.t(), h.to(acc))
            if needs_b:
                grad_b += dz.sum(0)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """log softmax(cap(hidden Wᵀ + b) / T)[ids], one chunk of logits at a time.

    Under autocast the products run in the autocast dtype, as nn.Linear's would (the inputs are cast to it), and
    their logits come out in fp32 for the softmax, as every fused loss's do.

    Args:
        hidden: (N, H) last hidden states (any float dtype; products run in it, softmax in fp32).
        weight: (V, H) lm_head weight; pass a row view `weight[:vocab_size]` to drop padding rows.
        ids: (N,) token ids in [0, V), or negative for rows that are not scored (their output and gradient are 0).
        bias: (V,) or None.
        temperature: softmax temperature (> 0).
        softcap: final-logit soft-capping c (tanh(x / c) c), or None.
        chunk_size: rows per chunk; None: ops.chunked.choose_chunk_size's (a chunk's fp32 logits and their
            gradient).

    Returns:
        (N,) float32 log-probabilities (float64 for float64 inputs), differentiable in hidden, weight and bias.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden (N, H) and weight (V, H) must share H; got hidden {tuple(hidden.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if ids.shape != hidden.shape[:1]:
        raise ValueError(f"ids must have shape ({hidden.shape[0]},) like hidden's rows; got {tuple(ids.shape)}")
    rows = max(1, int(hidden.shape[0]))
    # a chunk holds its fp32 logits and, in the backward, their gradient: 8 bytes per logit
    chunk = chunk_size or choose_chunk_size(rows, weight.shape[0], hidden.device, bytes_per_logit=8)
    chunk = max(1, min(rows, chunk))
    dtype = autocast_dtype(hidden.device)
    if dtype is not None:
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    with no_autocast(hidden.device):
        return LinearTokenLogprobsFunction.apply(hidden, weight, bias, ids.long(), float(temperature), softcap, chunk)
