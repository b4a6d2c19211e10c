"""A decode step's gated MLP in two launches: the gate and up products with the activation in one kernel
(few_row_linear.few_row_gated), then down. The MLP forward a decode session's twin (kernel_twin.py) binds on the
gated MLPs it gave the project's kernel forward.

    fuse_decode_mlp(twin, spec)   # after bind_kernels: the MLP classes spec.mlp names

The kernel forward (models/patch.py) computes down(act(gate(x)) * up(x)) with the activation in a kernel of its own
(ops/swiglu.py). At a decode step's few rows that kernel is bound by its launch, and the gate/up product writes an
output only it reads. Here the product rounds gate and up to x's dtype in registers, as the unfused product's
output is rounded, and applies the same activation arithmetic: the same bits, one launch fewer a layer.

Only where the step computes what the kernel forward computes: no gradient, inside the engine's decode_kernel()
block, at most FUSED_ROWS rows, what few_row_linear.gated_step takes (the dtype F.linear computes in); an activation
the kernel knows (models.patch.activation_name); gate and up (or Phi-3's gate_up_proj) plain nn.Linear without bias,
without the user's hooks and without a forward of anyone else's (accelerate's hooks, a user's wrapper, a patch of
nn.Linear itself: fused_projections.computes_plainly). The weights are what the step's projections compute with
(fused_projections.step_weight: under autocast, the session's copy in the autocast dtype). down_proj is called as
the module (its hooks run). Else the forward the module had.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ..models.patch import activation_name, gated_mlp_kernel_forward
from ..models.registry import ArchSpec
from ..utils.hooks import no_hooks
from . import few_row_linear
from .fused_projections import computes_plainly, step_weight

# At most this many rows take the fused step: the gated kernel holds two accumulators, and 64 rows of both spill
# registers where 16 do not (tests/test_kernel_resources.py compiles it); untimed there, so 64-row steps keep the
# product and the activation kernel.
FUSED_ROWS = 16


def fuse_decode_mlp(twin: nn.Module, spec: ArchSpec) -> int:
    """Bind the decode-step forward on every MLP module of `twin` that computes through the kernel forward (bound on
    the instance by bind_kernels, or on the class by apply_kd_patch). Returns how many."""
    classes = tuple(spec.classes(spec.mlp))
    if not classes:
        return 0
    kernel = gated_mlp_kernel_forward(spec)
    fused = 0
    for module in twin.modules():
        if not isinstance(module, classes):
            continue
        own = module.__dict__.get("forward")
        current = own.__func__ if isinstance(own, types.MethodType) and own.__self__ is module else None
        if own is None:
            current = type(module).forward
        if current is not kernel:
            continue
        module.forward = types.MethodType(_decode_forward(kernel, spec.fused_gate_up), module)
        fused += 1
    return fused


def _decode_forward(kernel, fused_gate_up: bool):
    def forward(self, x):
        activation = activation_name(self)
        weights = None if activation is None else _gate_and_up(self, x, fused_gate_up)
        gated = None if weights is None else few_row_linear.gated_step(x, *weights, activation)
        return kernel(self, x) if gated is None else self.down_proj(gated)

    return forward


def _gate_and_up(mlp: nn.Module, x: torch.Tensor, fused_gate_up: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The gate and up weights the fused step would compute x with, or None where the module's own path must run
    (module docstring; few_row_linear.gated_step decides the rest)."""
    if torch.is_grad_enabled() or x.numel() > FUSED_ROWS * x.shape[-1]:
        return None
    linears = (mlp.gate_up_proj,) if fused_gate_up else (mlp.gate_proj, mlp.up_proj)
    if not all(computes_plainly(lin) and lin.bias is None for lin in linears):  # no forward of anyone else's
        return None
    if not no_hooks(after=linears, before=linears):
        return None
    if fused_gate_up:
        both = step_weight(linears[0], x)
        return None if both.shape[0] % 2 else both.chunk(2, dim=0)
    return step_weight(linears[0], x), step_weight(linears[1], x)
