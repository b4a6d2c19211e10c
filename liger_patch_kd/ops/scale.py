"""grad *= factor for a factor that lives on the device (the loss's upstream gradient), without a host sync.

The fused losses compute their gradients during the forward and scale them by grad_output in the backward.
`t.mul_(factor)` with a 0-dim CUDA factor takes PyTorch's broadcasting elementwise path, at well under the
memory's bandwidth, for a whole (V x H) weight gradient every step, even for a factor of 1. This kernel reads the
factor first and leaves the tensor untouched when it is 1, the usual case (a loss that is the last op); any other
factor streams at close to the memory's bandwidth (benchmarks/loss/bench_loss_breakdown.py times both).
"""

from __future__ import annotations

import torch

from .backend import triton_available, triton_interpreted

_BLOCK = 8192


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _scale_kernel(x_ptr, factor_ptr, n, BLOCK: tl.constexpr):
        factor = tl.load(factor_ptr).to(tl.float32)
        if factor != 1.0:
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask)
            tl.store(x_ptr + offs, (x.to(tl.float32) * factor).to(x.dtype), mask=mask)


def scale_(grad: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """grad *= factor in place and return grad. `factor` is a one-element tensor on grad's device."""
    use_kernel = (
        triton_available()
        and (grad.is_cuda or triton_interpreted())
        and grad.is_contiguous()
        and grad.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )
    if not use_kernel:
        return grad.mul_(factor.to(grad.dtype))
    factor = factor.reshape(1).to(device=grad.device, dtype=torch.float32)
    n = grad.numel()
    _scale_kernel[(triton.cdiv(n, _BLOCK),)](grad, factor, n, BLOCK=_BLOCK)
    return grad
