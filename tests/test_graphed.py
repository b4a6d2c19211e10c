"""The CUDA-graphed chunk loop (KDLossConfig.cuda_graph, ops/graphed.py): graphed against eager on the GPU (loss and
gradients over repeated steps with new data, an in-place weight update, gradient accumulation, a shape change,
the FP8 options), and on the CPU the unchanged eager path."""

import pytest
import torch

from liger_patch_kd import KDLossConfig, fused_linear_jsd
from liger_patch_kd.ops.graphed import GRAPHS


def _inputs(n, hidden, vocab, device, dtype, seed):
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dtype)

    labels = torch.randint(0, vocab, (n,), device=device, generator=g)
    labels[::7] = -100
    return rand(n, hidden), rand(n, hidden, scale=1.5), labels


def test_cpu_path_unchanged():
    """Off CUDA the option changes nothing: the same eager call, bit for bit."""
    h_s, h_t, labels = _inputs(37, 32, 211, "cpu", torch.float32, 0)
    w_s = torch.randn(211, 32, requires_grad=True)
    w_t = torch.randn(211, 32)
    results = []
    for graphed in (False, True):
        h = h_s.clone().requires_grad_()
        loss = fused_linear_jsd(h, w_s, h_t, w_t, labels, cuda_graph=graphed)
        results.append((loss, *torch.autograd.grad(loss, [h, w_s])))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert not GRAPHS.graphs
    with pytest.raises(ValueError, match="cuda_graph must be True or False"):
        KDLossConfig(cuda_graph="yes")


def _step(h_s, w_s, b_s, h_t, w_t, labels, cfg, count=None):
    h = h_s.clone().requires_grad_()
    loss = fused_linear_jsd(h, w_s, h_t, w_t, labels, student_bias=b_s, num_items_in_batch=count, config=cfg)
    loss.backward()
    return loss.detach(), h.grad, w_s.grad.clone(), None if b_s is None else b_s.grad.clone()


def _close(got, want):
    """Graphed and eager run the same kernels, but cuBLAS may pick another algorithm under capture: the products'
    summation order may differ, i.e. bf16 rounding of the gradients (2^-8) and fp32 rounding of the loss."""
    if want is None:
        assert got is None
        return
    err = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
    assert err <= (1e-5 if want.dtype == torch.float32 else 1e-2), err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize(
    "opts",
    [dict(), dict(beta=0.0, temperature=2.0, hard_weight=0.5), dict(teacher_logits_fp8=True, student_logits_fp8=True)],
)
def test_graphed_matches_eager(opts):
    if opts.get("teacher_logits_fp8"):
        from liger_patch_kd.ops.fp8 import fp8_available

        ok, why = fp8_available(torch.device("cuda"))
        if not ok:
            pytest.skip(why)
    GRAPHS.clear()
    n, hidden, vocab = 700, 256, 5003  # an odd vocabulary and a last chunk of another size
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(1)
    w_s = (torch.randn(vocab, hidden, device=dev, generator=g) / hidden**0.5).to(dt).requires_grad_()
    b_s = torch.randn(vocab, device=dev, generator=g).to(dt).requires_grad_()
    w_t = (torch.randn(vocab, hidden, device=dev, generator=g) * 1.5 / hidden**0.5).to(dt)
    eager = KDLossConfig(chunk_size=256, **opts)
    graphed = eager.replace(cuda_graph=True)
    for step in range(4):  # new data each step, same shapes: the first captures, the rest replay
        h_s, h_t, labels = _inputs(n, hidden, vocab, dev, dt, seed=10 + step)
        count = torch.tensor(float(n), device=dev) if step % 2 else None
        outs = []
        for cfg in (eager, graphed):
            w_s.grad = b_s.grad = None
            outs.append(_step(h_s, w_s, b_s, h_t, w_t, labels, cfg, count))
        for a, b in zip(*outs):
            _close(b, a)
        with torch.no_grad():
            w_s.mul_(0.9)  # an optimizer step in place: the graph reads the weight where it is
    assert len(GRAPHS.graphs) == 2  # with and without num_items_in_batch: two signatures
    # gradient accumulation: two graphed micro-batches sum into .grad as eager ones do
    w_s.grad = b_s.grad = None
    batches = [_inputs(n, hidden, vocab, dev, dt, seed=s) for s in (20, 21)]
    for h_s, h_t, labels in batches:
        fused_linear_jsd(h_s.requires_grad_(), w_s, h_t, w_t, labels, student_bias=b_s, config=graphed).backward()
    accumulated = w_s.grad.clone()
    w_s.grad = b_s.grad = None
    for h_s, h_t, labels in batches:
        fused_linear_jsd(h_s.detach(), w_s, h_t, w_t, labels, student_bias=b_s, config=eager).backward()
    _close(accumulated, w_s.grad)
    # another shape: a second signature, captured as well
    h_s, h_t, labels = _inputs(n // 2, hidden, vocab, dev, dt, seed=30)
    a = _step(h_s, w_s, b_s, h_t, w_t, labels, eager)
    w_s.grad = b_s.grad = None
    b = _step(h_s, w_s, b_s, h_t, w_t, labels, graphed)
    for got, want in zip(b, a):
        _close(got, want)
    assert len(GRAPHS.graphs) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_second_call_before_backward_is_refused():
    GRAPHS.clear()
    n, hidden, vocab = 256, 128, 1024
    w_s = torch.randn(vocab, hidden, device="cuda", requires_grad=True)
    w_t = torch.randn(vocab, hidden, device="cuda")
    cfg = KDLossConfig(cuda_graph=True)
    h_s, h_t, labels = _inputs(n, hidden, vocab, "cuda", torch.float32, 0)
    first = fused_linear_jsd(h_s, w_s, h_t, w_t, labels, config=cfg)
    second = fused_linear_jsd(h_s, w_s, h_t, w_t, labels, config=cfg)
    second.backward()
    with pytest.raises(RuntimeError, match="called again with the same shapes before the backward"):
        first.backward()
    # reduction "none" and no-grad calls run eagerly, not from a graph
    with torch.no_grad():
        fused_linear_jsd(h_s, w_s, h_t, w_t, labels, config=cfg)
    fused_linear_jsd(h_s, w_s, h_t, w_t, labels, config=cfg.replace(reduction="none")).sum().backward()
    assert len(GRAPHS.graphs) == 1


def test_replay_plumbing_on_cpu(monkeypatch):
    """The cache, the gradient slots and the stale-gradient check, with torch.cuda's graph calls replaced by no-ops
    (a replay then returns what the capture computed, so the call repeats the captured inputs)."""
    import contextlib
    import types

    import liger_patch_kd.ops.graphed as G

    fake_stream = types.SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: fake_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: fake_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: types.SimpleNamespace(replay=lambda: None))
    cache = G.GraphedLosses(max_graphs=1)
    h_s, h_t, labels = _inputs(29, 32, 97, "cpu", torch.float32, 0)
    w_s = torch.randn(97, 32, requires_grad=True)
    b_s = torch.randn(97, requires_grad=True)
    w_t = torch.randn(97, 32)

    def loss_fn(h, t, lab):
        out = fused_linear_jsd(h, w_s, t, w_t, lab, student_bias=b_s, return_components=True)
        return out.loss, out.soft, out.hard

    h = h_s.clone().requires_grad_()
    eager = loss_fn(h, h_t, labels)
    want = torch.autograd.grad(eager[0], [h, w_s, b_s])
    results = []
    for _ in range(2):
        h = h_s.clone().requires_grad_()
        loss, soft, hard = cache(("k",), (h, h_t, labels), (w_s, b_s), loss_fn)
        results.append((loss, h))
    torch.testing.assert_close(results[1][0], eager[0])
    torch.testing.assert_close(soft, eager[1])
    (2 * results[1][0]).backward()  # grad_output 2 scales the static gradients
    for got, expected in zip((results[1][1].grad, w_s.grad, b_s.grad), want):
        torch.testing.assert_close(got, 2 * expected)
    with pytest.raises(RuntimeError, match="called again with the same shapes before the backward"):
        results[0][0].backward()
    with pytest.warns(UserWarning, match="input signatures are captured already"):
        assert cache(("another",), (h, h_t, labels), (w_s, b_s), loss_fn) is None  # full: the caller runs eagerly
