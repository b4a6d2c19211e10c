"""The decode step's own copies of its projection weights: one product where a layer runs several on the same
input (q/k/v, and a gated MLP's gate/up), and weights already in the autocast dtype.

A decode step multiplies a few rows by each weight: every projection is a short kernel bound by its launch and
ramp-up, not by the bytes it reads (the k and v projections of a 1B model read 2 MB each). Multiplying by the
concatenated weights once reads the same bytes in fewer, fuller kernels. And float32 weights under bfloat16
autocast (the usual mixed-precision training) are cast by autocast at every product of every step: a read of the
float32 weights, a write of their bfloat16 copy and one more kernel each, per token. Held already cast, a step reads
half the bytes and launches no cast; the product is the same bits (autocast's cast of the weight is this copy's).

The copies are the session's (at fixed addresses, which a captured graph reads), refreshed by `sync()` at the start
of every decode call: an optimizer's in-place update of q_proj.weight is in the copy by the next call, and the
model's parameters, their storage and the module tree stay as they were (optimizers, checkpoints and DDP see
nothing). A copy costs its weights' bytes once more in memory, in its dtype (1.3 GB for a 1B Llama's fused
projections in bfloat16), and one read + write of them per call, small beside a call's hundreds of steps.

While installed, the first projection of a group computes them all and keeps the others' outputs with the input
they belong to; the others hand theirs back only for that very input, with gradients off, else they compute their
own (so an architecture that feeds k_proj something else, or a concurrent forward with gradients, stays exact).

Every product here goes through `few_row_linear.linear`: at a decode step's few rows and for the products wide
enough (few_row_linear.MIN_OUT_FEATURES), the few-row kernel; elsewhere F.linear. With `few_rows`, the plain linears
that get no copy (o_proj, down_proj, the head) go through it too, with their own weights.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..utils.hooks import no_hooks
from .few_row_linear import linear
from .same_input import input_mark

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedGroup:
    """Linears of one module sharing an input, their weights (and biases) concatenated into one buffer."""

    def __init__(self, linears: list[nn.Linear], dtype: torch.dtype | None = None) -> None:
        self.linears = linears
        first = linears[0].weight
        self.sizes = [lin.out_features for lin in linears]
        self.weight = first.new_empty(sum(self.sizes), first.shape[1], dtype=dtype)
        self.bias = first.new_empty(sum(self.sizes), dtype=dtype) if linears[0].bias is not None else None
        # (input, its version, the outputs of the tails that have not taken theirs yet)
        self.last: tuple[torch.Tensor, int | None, dict[int, torch.Tensor]] | None = None

    def sync(self) -> None:
        for copy, name in ((self.weight, "weight"), (self.bias, "bias")):
            if copy is None:
                continue
            parts = [getattr(lin, name) for lin in self.linears]
            if len(parts) > 1 and copy.dtype == parts[0].dtype:
                torch.cat(parts, out=copy)
            else:  # copy_ rounds as autocast's cast does
                for part, rows in zip(parts, copy.split(self.sizes)):
                    rows.copy_(part)

    def head_forward(self, x: torch.Tensor) -> torch.Tensor:
        # the copy is no parameter: a forward with gradients takes the model's own weights; so does a product the
        # model runs outside the autocast a cast copy stands for (a router in float32 under autocast(enabled=False))
        if torch.is_grad_enabled() or not self.stands_in(x):
            return F.linear(x, self.linears[0].weight, self.linears[0].bias)
        if len(self.linears) == 1:  # a cast copy alone: nothing to keep for another projection
            return linear(x, self.weight, self.bias)
        if not no_hooks(after=self.linears, before=self.linears[1:]):  # a hook may change x before a tail reads it
            rows = self.sizes[0]
            return linear(x, self.weight[:rows], None if self.bias is None else self.bias[:rows])
        outputs = linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
        self.last = (x, input_mark(x), dict(enumerate(outputs[1:], start=1)))  # each tail takes its own once
        return outputs[0]

    def stands_in(self, x: torch.Tensor) -> bool:
        """Whether the copy computes here what the weights would: always in their own dtype; a cast copy only where
        autocast would cast the weights to its dtype."""
        own = self.linears[0].weight.dtype
        if self.weight.dtype == own:
            return True
        kind = x.device.type
        return torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == self.weight.dtype

    def tail_forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        last = self.last  # one read: another thread may replace it meanwhile
        # the very input, not changed in place since the head read it
        if last is not None and last[0] is x and last[1] == input_mark(x) and not torch.is_grad_enabled():
            taken = last[2].pop(index, None)
            # Once every tail has taken its output nothing is kept: a prefill's outputs are large (at 64 rows of 512
            # tokens a 1B Llama's gate/up output is 1 GiB a layer), and holding them until the group's next call kept
            # every layer's at once, far above the training step's peak.
            if not last[2] and self.last is last:
                self.last = None
            if taken is not None:
                return taken
        lin = self.linears[index]
        return linear(x, lin.weight, lin.bias)


def step_weight(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The weight `lin` computes x with while FusedProjections are installed: its rows of its group's copy (fused,
    or cast to the autocast dtype) where that copy stands in for x, else its own."""
    _, owner, index = _installed(lin.__dict__.get("forward"))
    if owner is None or not owner.stands_in(x) or owner.linears[index] is not lin:
        return lin.weight
    start = sum(owner.sizes[:index])
    return owner.weight[start : start + owner.sizes[index]]


def _installed(forward) -> tuple[object, FusedGroup | None, object]:
    """(the function, its FusedGroup or None, the linear's index in that group) of an instance-level forward, as
    `installed` binds them: a head's is the group's bound method (index 0), a tail's a partial of the group's
    tail_forward over its index, a plain linear's a partial of own_weights_forward."""
    if isinstance(forward, functools.partial):
        function, index = forward.func, forward.args[0] if forward.args else None
    else:
        function, index = forward, 0
    owner = getattr(function, "__self__", None)
    return function, owner if isinstance(owner, FusedGroup) else None, index


def own_weights_forward(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A plain linear's forward through `linear` (the few-row kernel at a decode step), with its own weights."""
    return linear(x, lin.weight, lin.bias)


# nn.Linear's forward as torch defines it (read when this module is imported): a library that patches the class
# (every linear computing something else) keeps every linear out of the copies and the few-row kernel
TORCH_LINEAR_FORWARD = nn.Linear.forward


def _plain(lin) -> bool:
    """A plain nn.Linear (a LoRA / quantized wrapper computes more than x @ W.T) with torch's forward: no one else's
    on the instance or on the class."""
    return type(lin) is nn.Linear and "forward" not in lin.__dict__ and nn.Linear.forward is TORCH_LINEAR_FORWARD


def computes_plainly(lin: nn.Module) -> bool:
    """Whether `lin` computes x @ W.T (+ b) and nothing else: a plain nn.Linear, or one whose forward
    FusedProjections installed (its copies stand in for its weights; step_weight says which)."""
    forward = lin.__dict__.get("forward")
    if forward is None:
        return _plain(lin)
    function, owner, _ = _installed(forward)
    ours = owner is not None or function is own_weights_forward
    return ours and type(lin) is nn.Linear and nn.Linear.forward is TORCH_LINEAR_FORWARD


def _fusable(linears: list) -> bool:
    if not all(_plain(lin) for lin in linears):
        return False
    first = linears[0]
    return all(
        lin.in_features == first.in_features
        and lin.weight.dtype == first.weight.dtype
        and lin.weight.device == first.weight.device
        and (lin.bias is None) == (first.bias is None)
        for lin in linears
    )


def _cast_dtype(linear: nn.Linear, autocast: torch.dtype | None) -> torch.dtype | None:
    """The dtype autocast computes `linear` in where that is not its weights' own (None: no cast). Autocast never
    casts float64 tensors (a float64 product stays float64), so float64 weights get no copy."""
    weight = linear.weight
    eligible = weight.is_floating_point() and weight.dtype != torch.float64
    return autocast if autocast is not None and eligible and weight.dtype != autocast else None


class FusedProjections:
    """`model`'s projection copies: with `fuse`, every module with all of a GROUPS entry as plain nn.Linear
    children gets one concatenated copy; with `autocast` (the dtype autocast computes in during the calls), every
    plain nn.Linear whose weights autocast would cast is held in that dtype (fused or alone); with `few_rows`, every
    other plain nn.Linear computes through the few-row kernel at decode steps, with its own weights (no copy)."""

    def __init__(
        self, model: nn.Module, fuse: bool = True, autocast: torch.dtype | None = None, few_rows: bool = False
    ) -> None:
        self.groups: list[FusedGroup] = []
        self.alone: list[nn.Linear] = []
        grouped: set[int] = set()
        for module in model.modules():
            for names in GROUPS if fuse else ():
                linears = [getattr(module, name, None) for name in names]
                if _fusable(linears):
                    self.groups.append(FusedGroup(linears, _cast_dtype(linears[0], autocast)))
                    grouped.update(id(lin) for lin in linears)
        for module in model.modules():
            dtype = _cast_dtype(module, autocast) if _plain(module) else None
            if dtype is not None and id(module) not in grouped:
                grouped.add(id(module))  # a module reached twice (shared) gets one copy
                self.groups.append(FusedGroup([module], dtype))
        for module in model.modules() if few_rows else ():
            if _plain(module) and id(module) not in grouped:
                grouped.add(id(module))
                self.alone.append(module)

    def __bool__(self) -> bool:
        """Whether there is anything to install."""
        return bool(self.groups or self.alone)

    def tensors(self) -> list[torch.Tensor]:
        """The concatenated weights and biases (what a captured step reads)."""
        return [t for g in self.groups for t in (g.weight, g.bias) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @torch.no_grad()
    def sync(self) -> None:
        """Copy the current weights in (an update made in place since the last call included)."""
        for group in self.groups:
            group.sync()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Within the block the grouped linears compute through the concatenated weights (instance-level
        forwards, removed at the end; parameters and modules untouched)."""
        try:
            for group in self.groups:
                head, *tails = group.linears
                head.forward = group.head_forward
                for index, tail in enumerate(tails, start=1):
                    tail.forward = functools.partial(group.tail_forward, index)
            for lin in self.alone:
                lin.forward = functools.partial(own_weights_forward, lin)
            yield
        finally:
            for group in self.groups:
                for lin in group.linears:
                    lin.__dict__.pop("forward", None)
                group.last = None  # no reference kept to the step's tensors
            for lin in self.alone:
                lin.__dict__.pop("forward", None)
