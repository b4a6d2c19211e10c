"""Which implementation of a per-chunk kernel runs, the fp32-output products the chunks need, and autocast switched
off around them."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

BACKENDS = ("triton", "torch")

F = TypeVar("F", bound=Callable)


def eager(fn: F) -> F:
    """`torch.compiler.disable(fn)`, applied on the first call rather than at import.

    A clean graph break under torch.compile: the decorated function (a chunk loop, Triton launches, a source
    audit) always runs eagerly. Applying the decorator at import would import torch._dynamo (1.8 s) with the
    package; on the first call under torch.compile dynamo is loaded anyway, and it handles the disable there.
    """
    disabled: list[Callable] = []

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs products in on `device`, or None where it is off (or unknown to autocast)."""
    if torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def compute_dtype(device: torch.device, hidden: torch.Tensor) -> torch.dtype:
    """Under autocast the products run in the autocast dtype, as nn.Linear's would; otherwise in the dtype of
    the hidden states (a weight of another dtype, e.g. fp32 master weights, is cast to it)."""
    return autocast_dtype(device) or hidden.dtype


def no_autocast(device: torch.device):
    """Autocast off on `device`: under it even an fp32 product returns the autocast dtype, which would round the
    logits before a log-sum-exp (the fused losses cast their inputs to the autocast dtype themselves)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def select_backend(device: torch.device, requested: str | None = None) -> str:
    """ "triton" for CUDA tensors (or any tensor under TRITON_INTERPRET=1 when asked for), else "torch".

    `requested` forces one; so does the LIGER_KD_BACKEND environment variable (the tests use both to run the
    Triton kernels, and whole patched models, on CPU through the interpreter).
    """
    requested = requested or os.environ.get("LIGER_KD_BACKEND") or None
    if requested is not None:
        if requested not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None (automatic); got backend={requested!r}")
        if requested == "triton" and not triton_available():
            raise ValueError("backend='triton' was requested but triton is not installed; pip install triton")
        if requested == "triton" and device.type != "cuda" and not triton_interpreted():
            raise ValueError(
                f"backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before import "
                f"for {device.type} tensors"
            )
        return requested
    return "triton" if device.type == "cuda" and triton_available() else "torch"


_warned_upcast = False


def logits_fp32(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """hidden @ weight.T (+ bias) with a float32 (or float64) output.

    Low-precision products are accumulated in fp32 by cuBLAS anyway; asking for an fp32 *output* keeps the
    logits from being rounded to bf16 before the softmax (the source of Liger's 4-23% gradient error).
    """
    if hidden.dtype in (torch.bfloat16, torch.float16):
        if hidden.is_cuda and hasattr(torch.ops.aten.mm, "dtype"):
            out = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        else:
            global _warned_upcast
            if hidden.is_cuda and not _warned_upcast:
                warnings.warn("this torch has no mm(out_dtype=); upcasting products to fp32 (slow)", stacklevel=2)
                _warned_upcast = True
            out = hidden.float() @ weight.float().t()
    else:
        out = hidden @ weight.t()
    if bias is not None:
        out += bias.to(out.dtype)
    return out
