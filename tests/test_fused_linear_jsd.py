"""fused_linear_jsd against reference.kd_loss on materialised logits, for both backends.

The torch backend is checked in float64 to round-off; the Triton kernel (compiled on a GPU, interpreted on
CPU) receives its scalars (beta, 1/T) as float32, so in float64 it agrees to ~1e-7 relative, not 1e-15.
"""

import pytest
import torch

from liger_patch_kd import FusedLinearJSDLoss, KDLossConfig, fused_linear_jsd
from liger_patch_kd import reference as R

from .helpers import DEVICE, backends, grads, make_pair, rel_err

TOL = {"torch": dict(rtol=1e-10, atol=1e-12), "triton": dict(rtol=1e-6, atol=1e-8)}


def _check(pair, cfg, backend, num_items_in_batch=None):
    loss = fused_linear_jsd(
        pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight, pair.labels,
        student_bias=pair.student_bias, teacher_bias=pair.teacher_bias, config=cfg, backend=backend,
        num_items_in_batch=num_items_in_batch,
    )  # fmt: skip
    expected = R.kd_loss(pair.student_logits(), pair.teacher_logits(), pair.labels, cfg, num_items_in_batch)
    torch.testing.assert_close(loss, expected, **TOL[backend])
    upstream = torch.randn_like(loss) if cfg.reduction == "none" else torch.tensor(1.7, dtype=loss.dtype)
    got = grads((loss * upstream).sum(), pair.params())
    want = grads((expected * upstream).sum(), pair.params())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL[backend])
    return loss


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_matches_reference_float64(backend, beta, temperature):
    pair = make_pair(scale=3.0, device=DEVICE)
    _check(pair, KDLossConfig(beta=beta, temperature=temperature, chunk_size=16), backend)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_bias_softcap_and_hard_term(backend, beta):
    pair = make_pair(bias=True, scale=8.0, device=DEVICE)
    cfg = KDLossConfig(
        beta=beta, temperature=1.5, soft_weight=0.8, hard_weight=0.4, softcap=5.0, teacher_softcap=7.0, chunk_size=10
    )
    _check(pair, cfg, backend)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("reduction", ["sum", "none", "batchmean"])
def test_reductions_and_num_items_in_batch(backend, reduction):
    pair = make_pair(leading=(3, 7), device=DEVICE)
    cfg = KDLossConfig(reduction=reduction, hard_weight=0.5, chunk_size=8)
    loss = _check(pair, cfg, backend, num_items_in_batch=25 if reduction == "batchmean" else None)
    assert loss.shape == ((3, 7) if reduction == "none" else ())


@pytest.mark.parametrize("backend", backends())
def test_num_items_in_batch_as_tensor(backend):
    pair = make_pair(device=DEVICE)
    _check(pair, KDLossConfig(chunk_size=13), backend, num_items_in_batch=torch.tensor(99, device=DEVICE))


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "none"])
def test_all_rows_ignored_give_zero_loss_and_grads(backend, reduction):
    pair = make_pair(n=9, ignore_every=0, device=DEVICE)
    pair.labels.fill_(-100)
    loss = fused_linear_jsd(
        pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight, pair.labels,
        config=KDLossConfig(hard_weight=1.0, reduction=reduction), backend=backend,
    )  # fmt: skip
    assert torch.all(loss == 0)
    for g in grads(loss.sum(), pair.params()):
        assert torch.all(g == 0) and not g.isnan().any()


@pytest.mark.parametrize("backend", backends())
def test_no_labels_means_every_row_counts(backend):
    pair = make_pair(device=DEVICE)
    loss = fused_linear_jsd(
        pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight, backend=backend
    )
    expected = R.generalized_jsd(pair.student_logits(), pair.teacher_logits())
    torch.testing.assert_close(loss, expected, **TOL[backend])


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_inputs(backend, dtype):
    """bf16 / fp32 inputs against the float64 reference on the same (rounded) inputs."""
    pair = make_pair(n=64, h_s=64, h_t=48, vocab=1000, dtype=dtype, scale=4.0, device=DEVICE)
    cfg = KDLossConfig(beta=0.5, temperature=2.0, hard_weight=0.3, chunk_size=24)
    loss = fused_linear_jsd(
        pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight, pair.labels,
        config=cfg, backend=backend,
    )  # fmt: skip
    assert loss.dtype == (torch.float32 if dtype != torch.float64 else dtype)
    got = grads(loss, pair.params())
    s64 = [t.detach().double().requires_grad_() for t in pair.params()]
    ref = R.kd_loss(s64[0] @ s64[1].T, pair.teacher_logits().double(), pair.labels, cfg)
    want = grads(ref, s64)
    # fp32 logits and softmax math: only the bf16 rounding of dLoss/dlogits and of the products remains
    loss_tol, grad_tol = (1e-6, 1e-5) if dtype == torch.float32 else (1e-5, 1.5e-2)
    assert abs(loss.item() - ref.item()) <= loss_tol * abs(ref.item())
    for g, w in zip(got, want):
        assert g.dtype == dtype
        assert rel_err(g, w) < grad_tol


@pytest.mark.parametrize("backend", backends())
def test_three_dim_inputs_and_module(backend):
    pair = make_pair(leading=(2, 5), device=DEVICE)
    module = FusedLinearJSDLoss(beta=0.9, temperature=0.5, chunk_size=4)
    out = module(
        pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight, pair.labels,
        return_components=True,
    )  # fmt: skip
    expected = R.kd_loss(pair.student_logits(), pair.teacher_logits(), pair.labels, module.config)
    tol = TOL["triton" if DEVICE.type == "cuda" else "torch"]  # the module picks its backend by device
    torch.testing.assert_close(out.loss, expected, **tol)
    torch.testing.assert_close(out.soft, expected, **tol)
    assert out.hard.item() == 0.0 and not out.soft.requires_grad


def test_inputs_without_grad_and_no_grad_mode():
    pair = make_pair()
    args = (pair.student_input.detach(), pair.student_weight.detach(), pair.teacher_input, pair.teacher_weight)
    loss = fused_linear_jsd(*args, pair.labels)
    assert not loss.requires_grad
    with torch.no_grad():
        loss2 = fused_linear_jsd(
            pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight, pair.labels
        )
    torch.testing.assert_close(loss, loss2)
    # only the weight needs grad (frozen embeddings below, e.g. LoRA elsewhere)
    w = pair.student_weight.detach().requires_grad_()
    out = fused_linear_jsd(args[0], w, *args[2:], pair.labels)
    (gw,) = torch.autograd.grad(out, [w])
    ref = R.kd_loss(args[0] @ w.T, pair.teacher_logits(), pair.labels)
    torch.testing.assert_close(gw, torch.autograd.grad(ref, [w])[0])


def test_gradcheck_tiny_float64():
    pair = make_pair(n=5, h_s=4, h_t=3, vocab=7, bias=True, ignore_every=2)
    cfg = KDLossConfig(beta=0.3, temperature=1.3, hard_weight=0.5, softcap=3.0, chunk_size=2)

    def f(h, w, b):
        return fused_linear_jsd(h, w, pair.teacher_input, pair.teacher_weight, pair.labels, student_bias=b, config=cfg)

    assert torch.autograd.gradcheck(f, tuple(pair.params()))


def test_autocast_casts_like_linear():
    pair = make_pair(n=16, h_s=32, h_t=16, vocab=300, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_jsd(
            pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight, pair.labels
        )
    g = grads(loss, pair.params())
    assert all(t.dtype == torch.float32 for t in g)  # grads come back in the parameters' dtype
    ref = R.kd_loss(pair.student_logits(), pair.teacher_logits(), pair.labels)
    assert abs(loss.item() - ref.item()) < 2e-2 * ref.item()


@pytest.mark.parametrize("backward_under_autocast", [False, True])
def test_bf16_autocast_reduction_none_gradients_see_fp32_logits_whatever_autocast_holds_at_backward(
    backward_under_autocast,
):
    """reduction="none" recomputes the chunks in the backward. A backward called inside the autocast block (fp32
    weights, bf16=True) must not take the recomputed logits in bf16: rounding them before the softmax loses 8 bits
    (errors of ~1e-2 in every probability's gradient). The gradient products run in bf16 as nn.Linear's would, so
    against the float64 gradients of the bf16-rounded inputs the error is bf16's rounding of those products (1 % of
    the largest entry bounds it); the stricter check is that the backward gives the same gradients whether or not
    autocast is on when it runs."""
    pair = make_pair(n=24, h_s=32, h_t=32, vocab=1000, dtype=torch.float32, scale=3.0, ignore_every=5)
    cfg = KDLossConfig(beta=0.5, reduction="none", chunk_size=8)
    upstream = torch.randn(24)

    def run(under_autocast: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fused_linear_jsd(
                pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight, pair.labels,
                config=cfg,
            )  # fmt: skip
            if under_autocast:
                return loss, grads((loss * upstream).sum(), pair.params())
        return loss, grads((loss * upstream).sum(), pair.params())

    loss_outside, outside = run(False)
    loss, got = run(backward_under_autocast)
    rounded = [t.detach().bfloat16().double().requires_grad_() for t in pair.params()]
    h_t, w_t = (t.detach().bfloat16().double() for t in (pair.teacher_input, pair.teacher_weight))
    want_loss = R.kd_loss(rounded[0] @ rounded[1].T, h_t @ w_t.T, pair.labels, cfg)
    torch.testing.assert_close(loss.double(), want_loss, rtol=0, atol=1e-5)
    want = grads((want_loss * upstream.double()).sum(), rounded)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=1e-2 * float(w.abs().max()))
    for g, o in zip(got, outside):
        assert torch.equal(g, o)


def test_peak_memory_is_one_chunk_not_n_by_v():
    """The largest tensor any op creates holds one chunk of logits, whatever N is."""
    from torch.utils._python_dispatch import TorchDispatchMode

    vocab, hidden, chunk = 512, 32, 16

    class LargestLogitTensor(TorchDispatchMode):
        """The largest tensor with a vocab-sized dimension, except the (V, H) weight, its grad and transposes."""

        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and vocab in t.shape and sorted(t.shape) != sorted((vocab, hidden)):
                    self.largest = max(self.largest, t.numel())
            return out

    seen = {}
    for n in (64, 1024):
        pair = make_pair(n=n, h_s=hidden, h_t=hidden, vocab=vocab, dtype=torch.float32)
        with LargestLogitTensor() as mode:
            loss = fused_linear_jsd(
                pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight, pair.labels,
                config=KDLossConfig(chunk_size=chunk),
            )  # fmt: skip
            loss.backward()
        seen[n] = mode.largest
    assert seen[64] == seen[1024] == chunk * vocab


BAD_INPUTS = [
    (dict(beta=1.5), "beta"),
    (dict(temperature=0.0), "temperature"),
    (dict(reduction="mean"), "reduction"),
    (dict(soft_weight=0.0, hard_weight=0.0), "both 0"),
    (dict(chunk_size=0), "chunk_size"),
]


@pytest.mark.parametrize("options,needle", BAD_INPUTS)
def test_bad_options_raise(options, needle):
    pair = make_pair(n=4, vocab=11)
    with pytest.raises(ValueError, match=needle):
        fused_linear_jsd(pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight,
                         config=KDLossConfig(**options))  # fmt: skip


def test_bad_shapes_raise():
    pair = make_pair(n=4, h_s=8, h_t=6, vocab=11)
    a = (pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight)
    with pytest.raises(ValueError, match="vocab"):
        fused_linear_jsd(a[0], a[1], a[2], torch.randn(12, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="hidden size 8"):
        fused_linear_jsd(a[0], torch.randn(11, 9, dtype=torch.float64), a[2], a[3])
    with pytest.raises(ValueError, match="labels"):
        fused_linear_jsd(*a, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="teacher_input rows"):
        fused_linear_jsd(a[0], a[1], a[2][:3], a[3])
    with pytest.raises(ValueError, match="student_bias"):
        fused_linear_jsd(*a, student_bias=torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="hard_weight"):
        fused_linear_jsd(*a, config=KDLossConfig(hard_weight=1.0))


@pytest.mark.parametrize("backend", backends())
def test_fp32_weight_grad_accumulation(backend):
    pair = make_pair(n=96, h_s=32, h_t=32, vocab=500, dtype=torch.bfloat16, scale=3.0, device=DEVICE)
    args = (pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight, pair.labels)
    plain = grads(fused_linear_jsd(*args, config=KDLossConfig(chunk_size=8), backend=backend), pair.params())
    fp32 = grads(
        fused_linear_jsd(*args, config=KDLossConfig(chunk_size=8, fp32_weight_grad=True), backend=backend),
        pair.params(),
    )
    w64 = pair.student_weight.detach().double().requires_grad_()
    ref = R.kd_loss(pair.student_input.detach().double() @ w64.T, pair.teacher_logits().double(), pair.labels)
    (want,) = torch.autograd.grad(ref, [w64])
    assert fp32[1].dtype == torch.bfloat16
    # 12 chunks: one bf16 rounding of the accumulator per chunk costs accuracy that fp32 accumulation keeps
    assert rel_err(fp32[1], want) <= rel_err(plain[1], want) + 1e-3
    assert rel_err(fp32[1], want) < 1e-2


def _chunk_loop_node(loss):
    """The autograd node of the fused loss under `loss` (its ctx: the node holds `plan`)."""
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "plan"):
            return node
        stack.extend(fn for fn, _ in node.next_functions)
    raise AssertionError("no fused-loss node under the loss")


def test_the_teacher_side_is_freed_after_the_last_backward_while_the_loss_is_held():
    """A loss tensor kept after its backward (a log of losses, say) does not keep the chunk loop's teacher side
    (teacher hidden states, quantised heads) alive; a retained graph keeps it for the second backward."""
    pair = make_pair(n=6, vocab=50)
    args = (pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight, pair.labels)
    loss = fused_linear_jsd(*args)
    node = _chunk_loop_node(loss)
    loss.backward(retain_graph=True)
    assert node.plan is not None  # a second backward will need it
    loss.backward()
    assert node.plan is None and loss.grad_fn is not None  # released with the saved inputs, the loss still held
    loss = fused_linear_jsd(*args)
    node = _chunk_loop_node(loss)
    torch.autograd.grad(loss, pair.params())
    assert node.plan is None


def test_second_backward_through_a_retained_graph_recomputes():
    pair = make_pair(n=6, vocab=50)
    loss = fused_linear_jsd(
        pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight, pair.labels
    )
    first = torch.autograd.grad(3.0 * loss, pair.params(), retain_graph=True)
    second = torch.autograd.grad(3.0 * loss, pair.params())
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("reduction", ["batchmean", "none"])
@pytest.mark.parametrize("chunk,group", [(4, 12), (5, 20), (8, 64)])
def test_gradient_groups_match_reference_float64(backend, beta, reduction, chunk, group):
    """Several chunks' gradients gathered in one group buffer, then one pair of gradient products per group: 41
    rows make groups of 12 (the last of 5), of 20 (the last of 1) or one group larger than the rows. Bias, soft-caps,
    T != 1, a CE term and ignored rows; "none" recomputes in its backward, grouped too."""
    pair = make_pair(bias=True, scale=6.0, device=DEVICE)
    cfg = KDLossConfig(beta=beta, temperature=1.3, hard_weight=0.4, softcap=9.0, teacher_softcap=11.0,
                       reduction=reduction, chunk_size=chunk, grad_chunk_size=group)  # fmt: skip
    _check(pair, cfg, backend)


@pytest.mark.parametrize("backend", backends())
def test_gradient_groups_with_no_items_in_batch_and_nan_in_ignored_rows(backend):
    """Every row ignored (num_items_in_batch=0) with NaN in the hidden rows: loss 0 and zero gradients, grouped as
    ungrouped (the group's hidden rows are masked before its products read them)."""
    pair = make_pair(device=DEVICE)
    with torch.no_grad():
        pair.student_input[::2] = float("nan")
    labels = torch.full_like(pair.labels, -100)
    cfg = KDLossConfig(chunk_size=4, grad_chunk_size=16)
    loss = fused_linear_jsd(pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight, labels,
                            num_items_in_batch=0, config=cfg, backend=backend)  # fmt: skip
    assert loss.item() == 0.0
    for g in grads(loss, [pair.student_input, pair.student_weight]):
        assert torch.equal(g, torch.zeros_like(g))


def test_grad_chunk_size_must_be_whole_chunks():
    with pytest.raises(ValueError, match=r"grad_chunk_size=6 must be a multiple of chunk_size=4.*grad_chunk_size=8"):
        KDLossConfig(chunk_size=4, grad_chunk_size=6)
    with pytest.raises(ValueError, match="grad_chunk_size must be None"):
        KDLossConfig(grad_chunk_size=0)
    with pytest.raises(ValueError, match="grad_chunk_size must be None"):
        KDLossConfig(grad_chunk_size=True)
    # a sampled-token estimator has no full-vocabulary gradient to gather: refused, not ignored
    with pytest.raises(ValueError, match="grad_chunk_size=8 gathers full-vocabulary gradients.*estimator='k1'"):
        KDLossConfig(estimator="k1", grad_chunk_size=8)
