"""Gated MLP activation: act(gate) * up in one pass, forward and backward; act is SiLU (SwiGLU: Llama, Mistral,
Qwen, Phi-3) or tanh-approximated GELU (GeGLU: Gemma).

`recomputed_gated_outputs()` trades one elementwise pass for memory: inside it, wherever autograd saves a gated
activation's output for later (the down projection keeps its input for its weight gradient), it saves how to
recompute it instead (the gate and up tensors, which the activation's own backward keeps anyway), and the
backward recomputes it, bit for bit, with the same kernel. Per layer that is a (tokens x intermediate) tensor:
256 MiB at 16,384 tokens of a 1B Llama, for a pass that reads 512 MiB and writes 256.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

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
    def _gated_fwd_kernel(
        # pointers
        gate_ptr, up_ptr, out_ptr,
        # shapes: n elements; cols a row's (read with ROWS)
        n, cols,
        # strides: of the gate's and the up's rows (read with ROWS)
        stride_gate, stride_up,
        # meta-parameters; ROWS: inputs whose rows are strided (views of one product), output contiguous
        GELU: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr = False,
    ):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if ROWS:
            row, col = offs // cols, offs % cols
            g = tl.load(gate_ptr + row * stride_gate + col, mask=mask, other=0.0).to(ACC)
            u = tl.load(up_ptr + row * stride_up + col, mask=mask, other=0.0).to(ACC)
        else:
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
            gate, up, out, n, n, 0, 0, GELU=gelu, ACC=acc_type(gate.dtype), BLOCK=_BLOCK
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
        out = gated_act_torch(gate, up, activation)
    elif not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
        return _gated_rows(gate, up, activation)  # nothing to save: the views as they are, no copies
    else:  # contiguous here, so that a recipe below holds the very tensors the function saves
        gate, up = gate.contiguous(), up.contiguous()
        out = GatedActFunction.apply(gate, up, activation)
    recipes = _RECORDING.recipes
    if recipes is not None and out.requires_grad and out.numel():
        # by storage: what an op saves may be a view of the output (a linear reshapes its 3-D input to 2-D); the
        # entry goes when the output goes (a later tensor may reuse the storage)
        key = out.untyped_storage().data_ptr()
        ref = weakref.ref(out, lambda _, k=key: recipes.pop(k, None))
        recipes[key] = (ref, out._version, gate, up, activation, backend)
    return out


def _gated_rows(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up without gradients, reading row-strided inputs where they are: a decode step's gate and up are
    column slices of one fused product (generation/fused_projections.py), and making each contiguous first was two
    copy kernels a layer (for a 1B model, one in twelve of a decode step's kernels)."""
    if gate.numel() == 0 or gate.dim() == 0:  # nothing to launch for, or a scalar: the reference's arithmetic
        return gated_act_torch(gate, up, activation)
    cols = gate.shape[-1]
    gate2, up2 = gate.reshape(-1, cols), up.reshape(-1, cols)  # views where the leading dims allow
    if gate2.stride(-1) != 1 or up2.stride(-1) != 1:
        gate2, up2 = gate2.contiguous(), up2.contiguous()
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = out.numel()
    _gated_fwd_kernel[(triton.cdiv(n, _BLOCK),)](
        gate2, up2, out, n, cols, gate2.stride(0), up2.stride(0), GELU=ACTIVATIONS[activation] == 1,
        ACC=acc_type(gate.dtype), BLOCK=_BLOCK, ROWS=not (gate2.is_contiguous() and up2.is_contiguous()),
    )  # fmt: skip  # contiguous (a teacher's forward): the flat loop, no index arithmetic
    return out


class _Recording(threading.local):
    recipes: dict | None = None  # output's storage -> (weakref, version, gate, up, activation, backend)


_RECORDING = _Recording()


def _check_version(tensor: torch.Tensor, saved: int, what: str) -> None:
    """Autograd's in-place check, which it skips for tensors saved through hooks: done here instead."""
    if tensor._version != saved:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"{what} {tuple(tensor.shape)} is at version {tensor._version}, saved at version {saved} (inside "
            f"recomputed_gated_outputs(), which saves it through saved-tensor hooks)"
        )


class _GatedRecipe:
    """A saved gated output (or a view of it), as its inputs: called in the backward, it computes the output again
    and takes the same view of it, after the checks autograd would have made on the saved tensor."""

    __slots__ = ("output", "version", "gate", "up", "versions", "activation", "backend", "view")

    def __init__(self, output, version, gate, up, activation, backend, view):
        self.output, self.version, self.gate, self.up = output, version, gate, up
        self.versions = (gate._version, up._version)
        self.activation, self.backend, self.view = activation, backend, view

    def __call__(self) -> torch.Tensor:
        output = self.output()  # gone: nobody could change it in place after it was saved
        if output is not None:
            _check_version(output, self.version, "the gated activation's output")
        _check_version(self.gate, self.versions[0], "its gate input")
        _check_version(self.up, self.versions[1], "its up input")
        # values only: autograd gives an unpacked tensor the saved one's place in the graph (grad_fn, output_nr),
        # so a second derivative (create_graph=True) still runs back through gate and up (tested)
        with torch.no_grad():
            out = gated_act(self.gate.detach(), self.up.detach(), self.activation, self.backend)
        return out.as_strided(*self.view)


@contextmanager
def recomputed_gated_outputs() -> Iterator[None]:
    """Inside: gated outputs (of `gated_act`) that autograd saves are recomputed in the backward instead of kept
    (see the module's docstring). Other saved tensors are kept as they are, with autograd's in-place check done
    here (autograd skips it for tensors saved through hooks). The hooks are the innermost while the block runs:
    an outer saved-tensor hook (an offloader, a checkpoint entered outside) does not see what is saved inside,
    so enter it only where nothing outside packs saved tensors (models/recompute.py: kept layers, not
    checkpointed ones). Nested, the outer block records."""
    if _RECORDING.recipes is not None:
        yield
        return
    recipes: dict = {}

    def pack(tensor: torch.Tensor):
        entry = recipes.get(tensor.untyped_storage().data_ptr())
        output = None if entry is None else entry[0]()
        if (
            output is None
            or tensor.dtype != output.dtype
            or tensor.device != output.device
            or tensor._version != entry[1]
        ):  # changed in place since: saved as it is now
            return tensor, tensor._version
        return _GatedRecipe(*entry, view=(tensor.size(), tensor.stride(), tensor.storage_offset()))

    def unpack(saved):
        if isinstance(saved, _GatedRecipe):
            return saved()
        tensor, version = saved
        _check_version(tensor, version, "a tensor saved for the backward")
        return tensor

    _RECORDING.recipes = recipes
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        _RECORDING.recipes = None
