"""Sampled teacher tokens (importance-weighted forward KL): the fused loss against reference.sampled_kd_loss in
float64, its odd cases and its refusals, on both backends (the Triton kernel compiled on a GPU, interpreted on a
CPU). The data live on helpers.DEVICE: CPU tensors with backend="triton" on a GPU machine are refused (the
interpreter is off there), which is how this file's first GPU run failed without ever reaching the kernel."""

import math

import pytest
import torch
import torch.nn.functional as F

from liger_patch_kd import KDLossConfig, fused_linear_sampled_kd
from liger_patch_kd import reference as R
from liger_patch_kd.teacher.sampling import sample_teacher_tokens

from .helpers import DEVICE, U32, backends, fp32_loss_bound, grads

N, H, V = 23, 17, 301
# float64 on both sides, the same sums in another order: both backends compute in float64 (the kernel's exp / log
# on float64 are numpy's interpreted and libdevice's compiled, <= 2 ulp; 1/T reaches it exact, triton_utils.fp32_pair)
TOL = dict(rtol=1e-10, atol=1e-12)
KERNEL_TOL = {"torch": TOL, "triton": TOL}


def _data(m=8, top_k=0, temperature=1.0, bias=False, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, dtype=torch.float64, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, H, dtype=torch.float64, generator=g) * 0.8).to(dtype).requires_grad_()
    b = (torch.randn(V, dtype=torch.float64, generator=g) * 0.3).to(dtype).requires_grad_() if bias else None
    teacher = torch.randn(N, V, dtype=torch.float64, generator=g) * 2
    data = sample_teacher_tokens(F.log_softmax(teacher / temperature, -1), m, top_k=top_k, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::4] = -100
    on_device = [None if t is None else t.detach().to(DEVICE).requires_grad_() for t in (h, w, b)]
    return *on_device, _to_device(data), labels.to(DEVICE)


def _to_device(data):
    return data._replace(**{k: None if v is None else v.to(DEVICE) for k, v in data._asdict().items()})


def _fused(h, w, b, data, labels, **options):
    fields = {k: options.pop(k) for k in list(options) if k in KDLossConfig.__dataclass_fields__}
    if fields:  # the loss's options go in its config (forward KL, beta 0, unless the test says otherwise)
        options["config"] = KDLossConfig(**{"beta": 0.0, **fields})
    return fused_linear_sampled_kd(
        h, w, data.ids, data.counts, data.logprobs, labels, teacher_token_ids=data.topk_ids,
        teacher_logprobs=data.topk_logprobs, student_bias=b, **options,
    )  # fmt: skip


def _expected(logits, data, labels, **options):
    return R.sampled_kd_loss(
        logits, data.ids, data.counts, data.logprobs, labels, topk_ids=data.topk_ids,
        topk_logprobs=data.topk_logprobs, **options,
    )  # fmt: skip


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "none"])
def test_matches_reference_float64(top_k, temperature, reduction, backend):
    h, w, b, data, labels = _data(top_k=top_k, temperature=temperature, bias=True)
    opts = dict(temperature=temperature, reduction=reduction, chunk_size=7, backend=backend)
    loss = _fused(h, w, b, data, labels, **opts)
    opts.pop("backend")
    expected = _expected(h @ w.T + b, data, labels, **opts)
    torch.testing.assert_close(loss, expected, **KERNEL_TOL[backend])
    weight = torch.rand_like(loss) if reduction == "none" else torch.ones(())
    for g, e in zip(grads((loss * weight).sum(), [h, w, b]), grads((expected * weight).sum(), [h, w, b])):
        torch.testing.assert_close(g, e, **KERNEL_TOL[backend])


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_hard_term_softcap_vocab_size_and_num_items(backend, temperature):
    h, w, _, data, labels = _data(m=16, top_k=3)
    opts = dict(softcap=4.0, hard_weight=0.3, soft_weight=0.7, temperature=temperature, vocab_size=V)
    loss = _fused(h, w, None, data, labels, num_items_in_batch=40, backend=backend, **opts)
    expected = _expected(h @ w.T, data, labels, num_items_in_batch=40, **opts)
    torch.testing.assert_close(loss, expected, **KERNEL_TOL[backend])
    for g, e in zip(grads(loss, [h, w]), grads(expected, [h, w])):
        torch.testing.assert_close(g, e, **KERNEL_TOL[backend])


@pytest.mark.parametrize("backend", backends())
def test_all_ignored_num_items_zero_and_nan_in_ignored_rows(backend):
    h, w, _, data, labels = _data()
    labels[:] = -100
    with torch.no_grad():
        h[1] = math.nan
    ids, lp = data.ids.clone(), data.logprobs.clone()
    ids[2] = 10**6  # garbage in an ignored row is never read
    lp[3] = math.nan
    data = data._replace(ids=ids, logprobs=lp)
    loss = _fused(h, w, None, data, labels, num_items_in_batch=0, backend=backend)
    assert loss.item() == 0
    gh, gw = grads(loss, [h, w])
    assert gh.abs().max() == 0 and gw.abs().max() == 0


def test_the_reference_reads_no_teacher_data_of_ignored_rows():
    """Garbage ids in an ignored row (out of the vocabulary, as a padded batch may hold): the oracle, like the fused
    loss, never indexes them, and both agree on the rows that count."""
    h, w, _, data, labels = _data(top_k=3)
    labels[::3] = -100
    ids, top = data.ids.clone(), data.topk_ids.clone()
    ids[0], top[3] = 10**6, 10**6
    data = data._replace(ids=ids, topk_ids=top)
    expected = _expected(h @ w.T, data, labels)
    torch.testing.assert_close(_fused(h, w, None, data, labels), expected, **TOL)


@pytest.mark.parametrize("backend", backends())
def test_bf16_close_to_float64(backend):
    h, w, _, data, labels = _data(m=16)
    loss = _fused(h, w, None, data, labels)
    hb, wb = (t.detach().bfloat16().requires_grad_() for t in (h, w))
    low = _fused(hb, wb, None, data, labels, backend=backend)
    # bf16 hidden states and weights carry a relative rounding of 2^-8 each into the logits
    torch.testing.assert_close(low.double(), loss, rtol=3e-2, atol=3e-2)
    (gb, gwb), ge = grads(low, [hb, wb]), grads(loss, [h])[0]
    assert gb.dtype == gwb.dtype == torch.bfloat16
    assert float((gb.double() - ge).norm() / ge.norm()) < 5e-2


def test_non_contiguous_inputs_and_3d_rows():
    h, w, _, data, labels = _data(m=4, top_k=2)
    h3 = h.detach().reshape(1, N, H).transpose(0, 1).requires_grad_()  # (N, 1, H), strided
    d3 = data._replace(**{k: getattr(data, k).reshape(N, 1, -1) for k in data._fields})
    loss = _fused(h3, w, None, d3, labels.reshape(N, 1))
    torch.testing.assert_close(loss, _expected(h3 @ w.T, d3, labels.reshape(N, 1)), **TOL)


def test_refusals_name_the_argument():
    h, w, _, data, labels = _data(top_k=3)
    with pytest.raises(ValueError, match="beta=0.5"):
        _fused(h, w, None, data, labels, beta=0.5)
    with pytest.raises(ValueError, match="beta=1"):
        _fused(h, w, None, data, labels, config=KDLossConfig(beta=1.0))
    with pytest.raises(ValueError, match="beta=0.5"):
        _expected(h @ w.T, data, labels, beta=0.5)
    with pytest.raises(ValueError, match="repeats a teacher id"):  # a draw that is also a top-k id counts twice
        ids = data.ids.clone()
        ids[1, 0] = data.topk_ids[1, 0]
        _fused(h, w, None, data._replace(ids=ids), labels)
    with pytest.raises(ValueError, match="vocab size"):
        ids = data.ids.clone()
        ids[1, 0] = V
        _fused(h, w, None, data._replace(ids=ids), labels)
    with pytest.raises(ValueError, match="one shape"):
        _fused(h, w, None, data._replace(counts=data.counts[:, :2]), labels)
    pure = _data()[3]
    with pytest.raises(ValueError, match="no teacher draws"):
        _fused(h, w, None, pure._replace(counts=torch.zeros_like(pure.counts)), labels)


def test_hybrid_with_nothing_left_to_draw_is_the_exact_top_k():
    # a teacher whose mass is all in its top-k: the hybrid has no draws and is the exact forward KL
    h, w, _, _, labels = _data()
    teacher = torch.full((N, V), -1e4, dtype=torch.float64)
    teacher[:, :4] = torch.randn(N, 4, dtype=torch.float64)
    lp = F.log_softmax(teacher, -1)
    data = _to_device(sample_teacher_tokens(lp, 8, top_k=4, generator=torch.Generator().manual_seed(1)))
    teacher = teacher.to(DEVICE)
    assert int(data.counts.sum()) == 0
    loss = _fused(h, w, None, data, labels)
    full = R.kd_loss(h @ w.T, teacher, labels, beta=0.0)
    torch.testing.assert_close(loss, full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend", backends())
def test_mixed_dtypes_bf16_logprobs_and_uint8_counts(backend):
    # counts as the store reads them (int32 from uint8), log-probs in bf16 (the store's default), an fp32 student
    h, w, _, data, labels = _data(m=8, top_k=4, dtype=torch.float32)
    data = data._replace(counts=data.counts.to(torch.uint8).int(), logprobs=data.logprobs.bfloat16(),
                         topk_logprobs=data.topk_logprobs.bfloat16())  # fmt: skip
    loss = _fused(h, w, None, data, labels, backend=backend)
    logits = (h @ w.T).detach().double()
    expected = _expected(logits, data, labels)  # the same rounded data and fp32 logits, float64 math
    # fp32 softmax math against float64 on the same logits, a per-row bound (so also the mean's); the fp32 masses
    # (1 - the top-k's fp32 exp, over the draws) are off by <= (k + 2) u each, on terms |lp - log S| <= max_abs
    max_abs = float(logits.abs().max() + torch.logsumexp(logits, -1).abs().max() + data.logprobs.float().abs().max())
    bound = fp32_loss_bound(V, max_abs) + (4 + 2) * U32 * max_abs + N * U32 * float(expected.abs())
    torch.testing.assert_close(loss.double(), expected, rtol=0, atol=bound)
