"""Selective recompute of the gated MLP's activation output (ops/swiglu.recomputed_gated_outputs, set up by
models/recompute.limit_recompute): the output is not kept for the backward, and the gradients are those of
keeping it, bit for bit (the backward recomputes it with the same kernel from the same gate and up)."""

import contextlib
import weakref

import pytest
import torch

from liger_patch_kd.models import apply_kd_patch
from liger_patch_kd.models.recompute import RECOMPUTE_ACT_ATTR, limit_recompute
from liger_patch_kd.ops.swiglu import gated_act, recomputed_gated_outputs

from .helpers import DEVICE
from .tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")


def _mlp_grads(backend: str, dtype: torch.dtype, recompute: bool, activation: str = "silu"):
    """(whether the gated output outlived the forward, the gradients of x and the three weights)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(6, 16), (12, 16), (12, 16), (16, 12)]  # x, gate weight, up weight, down weight
    params = [torch.randn(*shape, generator=g, dtype=dtype).to(DEVICE).requires_grad_() for shape in shapes]
    x, wg, wu, wd = params
    with recomputed_gated_outputs() if recompute else contextlib.nullcontext():
        h = gated_act(x @ wg.T, x @ wu.T, activation, backend=backend)
        kept = weakref.ref(h)
        y = h @ wd.T
    del h
    outlived = kept() is not None  # autograd keeps it for wd's gradient, unless it saved the recipe instead
    return outlived, torch.autograd.grad((y * y).sum(), params)


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("backend,dtype", [("torch", torch.float64), ("triton", torch.float64),
                                           ("triton", torch.float32)])  # fmt: skip
def test_the_output_is_dropped_and_the_gradients_are_the_same(backend, dtype, activation):
    kept, reference = _mlp_grads(backend, dtype, recompute=False, activation=activation)
    dropped, grads = _mlp_grads(backend, dtype, recompute=True, activation=activation)
    assert kept and not dropped
    for a, b in zip(grads, reference):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_second_derivatives_run_through_the_recomputed_output(backend):
    """With create_graph=True the recomputed output carries its history again: a gradient of the weight gradient
    equals the one computed with the output kept."""
    results = []
    for recompute in (False, True):
        g = torch.Generator().manual_seed(1)
        x, wg, wu = (torch.randn(*s, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
                     for s in ((5, 8), (6, 8), (6, 8)))  # fmt: skip
        wd = torch.randn(8, 6, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
        with recomputed_gated_outputs() if recompute else contextlib.nullcontext():
            y = gated_act(x @ wg.T, x @ wu.T, "silu", backend=backend) @ wd.T
        (grad_wd,) = torch.autograd.grad((y * y).sum(), [wd], create_graph=True)
        results.append(torch.autograd.grad(grad_wd.pow(2).sum(), [x, wg, wu]))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_in_place_changes_are_seen_as_autograd_sees_them():
    """Inside the block autograd's own in-place check is off (it skips tensors saved through hooks): the block
    makes it. An output changed in place before it is saved is saved as changed (not recomputed from before)."""

    def run(recompute: bool, change: str):
        g = torch.Generator().manual_seed(2)
        x, wg, wu = (torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()
                     for s in ((5, 8), (6, 8), (6, 8)))  # fmt: skip
        wd = torch.randn(8, 6, generator=g, dtype=torch.float64).requires_grad_()
        with recomputed_gated_outputs() if recompute else contextlib.nullcontext():
            gate, up = x @ wg.T, x @ wu.T
            h = gated_act(gate, up, "silu")
            if change == "output before it is saved":
                h.mul_(2)
            y = h @ wd.T
        with torch.no_grad():
            {"down weight": wd, "gate": gate, "output after it is saved": h}.get(change, torch.zeros(1)).mul_(2)
        return torch.autograd.grad((y * y).sum(), [x, wg, wu, wd])

    for change in ("down weight", "gate", "output after it is saved"):
        for recompute in (False, True):
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                run(recompute, change)
    for a, b in zip(run(True, "output before it is saved"), run(False, "output before it is saved")):
        assert torch.equal(a, b)


def test_only_gated_outputs_are_replaced_and_nesting_records_once():
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    with recomputed_gated_outputs(), recomputed_gated_outputs():
        other = (x * 2).exp()  # exp saves its output: an ordinary saved tensor, kept as it is
        kept = weakref.ref(other)
        y = other.sum()
    del other
    assert kept() is not None
    (grad,) = torch.autograd.grad(y, [x])
    torch.testing.assert_close(grad, 2 * (x * 2).exp(), rtol=0, atol=0)


def test_limit_recompute_flags_the_kept_layers_mlps_and_training_is_unchanged(monkeypatch):
    """The kept layer's MLP recomputes its activation output in the backward (the activation runs once more); the
    checkpointed layer's is recomputed with its layer anyway. A step's gradients equal those without the flag,
    bit for bit."""
    import liger_patch_kd.ops.swiglu as S

    calls = [0]  # the activation's computations, on either backend (the PyTorch one on a CPU, Triton on a GPU)
    # (on a GPU the recipe's no-gradient recompute takes the row-strided kernel entry, _gated_rows)
    for owner, name in ((S, "gated_act_torch"), (S.GatedActFunction, "apply"), (S, "_gated_rows")):
        original = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, f=original: calls.__setitem__(0, calls[0] + 1) or f(*a))
    grads, counts = {}, {}
    for flag in (False, True):
        calls[0] = 0
        model = tiny_model("llama", dtype=torch.float64, seed=1).to(DEVICE)
        apply_kd_patch(model=model)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        limit_recompute(model, 1)
        mlps = [layer.mlp for layer in model.model.layers]
        assert [getattr(m, RECOMPUTE_ACT_ATTR) for m in mlps] == [False, True]
        if not flag:
            setattr(mlps[1], RECOMPUTE_ACT_ATTR, False)
        ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)
        model(input_ids=ids, labels=ids).loss.backward()
        grads[flag], counts[flag] = {n: p.grad for n, p in model.named_parameters()}, calls[0]
    # two layers forward, layer 0 again in its checkpoint's recompute, and layer 1's output from its recipe
    assert counts == {False: 3, True: 4}
    for name, grad in grads[True].items():
        assert torch.equal(grad, grads[False][name]), name
    limit_recompute(model, 2)  # every layer recomputed now: no MLP keeps the flag
    assert not any(getattr(layer.mlp, RECOMPUTE_ACT_ATTR) for layer in model.model.layers)
