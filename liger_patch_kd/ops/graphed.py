"""The fused loss's whole chunk loop in a CUDA graph, replayed while the shapes repeat (KDLossConfig.cuda_graph).

Why: the loop issues ~10 kernels per chunk (two products, the loss kernel, two gradient products, selects and
copies); at N = 8192 the host time around them and the gaps between them cost ~4 ms of 62 (MEASUREMENTS.md).
A replay issues them all at once.

How: the fused loss computes its gradients in the forward (reductions "sum" / "batchmean"), so one graph holds
the forward and the backward: the front door's call on static copies of the per-step inputs (hidden states,
labels, the item count), then `torch.autograd.grad` of its loss with respect to the student's hidden states,
weight and bias, all captured once per input signature. Each later call copies its inputs into the static
buffers and replays; its backward hands out the static gradients times grad_output (new tensors: the next
replay overwrites the static ones).

What a signature holds, and why: every shape, dtype and stride; the weights' and biases' data pointers (a graph
reads them where they were at capture: in-place updates such as an optimizer step are seen, a weight moved to
new memory is a new signature); the teacher weight's version counter (its FP8 copy is made once per version);
the loss options; the autocast state. A new signature is captured (up to `MAX_GRAPHS`), beyond that the call runs
eagerly. Reduction "none" (its grad_output is a vector the graph cannot know), calls without gradients, calls
inside another capture or under torch.compile run eagerly too.

Cost: a graph keeps its chunk buffers (~1 GiB at the default chunk size) and the static gradients (one V x H
weight gradient) allocated between calls in its private pool, and each backward allocates the gradients it
returns: ~1 weight gradient more at peak than the eager loss. A second call of the same signature before the
first call's backward overwrites the first's gradients: that backward raises rather than return them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

MAX_GRAPHS = 4  # signatures captured per process; each holds its own buffers
_WARMUP_CALLS = 2  # on a side stream before capture: Triton compiles, cuBLAS picks its kernels and workspace


def tensor_signature(t: torch.Tensor | None, *, address: bool = False) -> tuple | None:
    if t is None:
        return None
    sig = (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)
    return sig + (t.data_ptr(),) if address else sig


def graphs_usable(x: torch.Tensor, reduction: str) -> bool:
    """Whether a call may be graphed at all (else it runs eagerly)."""
    return (
        x.is_cuda
        and reduction != "none"
        and torch.is_grad_enabled()
        and not torch.cuda.is_current_stream_capturing()
        and not torch.compiler.is_compiling()
    )


@dataclass
class CapturedLoss:
    graph: torch.cuda.CUDAGraph
    static_inputs: tuple[torch.Tensor | None, ...]  # the copied inputs' buffers
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # loss, soft, hard
    grads: tuple[torch.Tensor | None, ...]  # d loss / d (copied input 0, *in-place differentiable tensors)
    replays: int = 0  # bumped by each replay: a backward checks its call's gradients are still there
    extra: dict = field(default_factory=dict)

    def replay(self, inputs: Sequence[torch.Tensor | None]) -> None:
        for static, given in zip(self.static_inputs, inputs):
            if static is not None:
                static.copy_(given)
        self.graph.replay()
        self.replays += 1


def _capture(
    copied: Sequence[torch.Tensor | None],
    in_place: Sequence[torch.Tensor | None],
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> CapturedLoss:
    """Capture fn(*static copies of `copied`) and the gradients of its loss wrt copied[0] and `in_place`."""
    static = tuple(None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in copied)
    wrt = [t for t in (static[0], *in_place) if t is not None and t.requires_grad]

    def run():
        loss, soft, hard = fn(*static)
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        return (loss.detach(), soft, hard), grads

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(_WARMUP_CALLS):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs, grads = run()
    # one gradient slot per differentiable argument of the replay (copied[0], then in_place), None where unused
    it = iter(grads)
    slots = tuple(next(it) if t is not None and t.requires_grad else None for t in (static[0], *in_place))
    return CapturedLoss(graph, static, outputs, slots)


class _ReplayFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student_input, student_weight, student_bias, captured: CapturedLoss, inputs):
        captured.replay(inputs)
        ctx.captured, ctx.replay_id = captured, captured.replays
        loss, soft, hard = (t.clone() for t in captured.outputs)
        ctx.mark_non_differentiable(soft, hard)
        return loss, soft, hard

    @staticmethod
    def backward(ctx, grad_loss, _grad_soft, _grad_hard):
        captured = ctx.captured
        if captured.replays != ctx.replay_id:
            raise RuntimeError(
                "a CUDA-graphed fused loss (cuda_graph=True) was called again with the same shapes before the "
                "backward of an earlier call, whose gradients that call overwrote; run each backward before the "
                "next call, or set cuda_graph=False"
            )
        grads = tuple(None if g is None else g * grad_loss.to(g.dtype) for g in captured.grads)
        return (*grads, None, None)


class GraphedLosses:
    """The captured signatures of one process (one per device and shape set, up to MAX_GRAPHS)."""

    def __init__(self, max_graphs: int = MAX_GRAPHS):
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, CapturedLoss] = {}
        self._warned = False

    def clear(self) -> None:
        self.graphs.clear()

    def __call__(
        self,
        key: tuple,
        copied: Sequence[torch.Tensor | None],
        in_place: Sequence[torch.Tensor | None],
        fn: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(loss, soft, hard) from a replay, differentiable wrt copied[0] and in_place (the student's input,
        weight, bias); None when this signature is new and the cache is full (the caller runs eagerly)."""
        captured = self.graphs.get(key)
        if captured is None:
            if len(self.graphs) >= self.max_graphs:
                if not self._warned:
                    warnings.warn(
                        f"cuda_graph=True: {self.max_graphs} input signatures are captured already; new shapes run "
                        f"eagerly (pad batches to a few fixed lengths to keep every step graphed)",
                        stacklevel=3,
                    )
                    self._warned = True
                return None
            captured = self.graphs[key] = _capture(copied, in_place, fn)
        weight, bias = in_place[0], in_place[1] if len(in_place) > 1 else None
        return _ReplayFunction.apply(copied[0], weight, bias, captured, tuple(copied))


GRAPHS = GraphedLosses()
