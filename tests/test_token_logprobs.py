"""linear_token_logprobs against log_softmax of materialised logits, float64."""

import pytest
import torch

from liger_patch_kd.ops.token_logprobs import linear_token_logprobs


def materialised(h, w, ids, b, temperature, softcap):
    z = h @ w.T + (0 if b is None else b)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    lp = torch.log_softmax(z / temperature, dim=-1).gather(1, ids.clamp_min(0)[:, None]).squeeze(1)
    return torch.where(ids >= 0, lp, 0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [None, 5])
def test_values_and_gradients_equal_log_softmax(temperature, softcap, bias, chunk):
    torch.manual_seed(0)
    n, hdim, v = 23, 11, 97
    h = torch.randn(n, hdim, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(v, hdim, dtype=torch.float64) / hdim**0.5).requires_grad_()
    b = torch.randn(v, dtype=torch.float64, requires_grad=True) if bias else None
    ids = torch.randint(0, v, (n,))
    ids[::4] = -100
    upstream = torch.randn(n, dtype=torch.float64)
    got = linear_token_logprobs(h, w, ids, b, temperature=temperature, softcap=softcap, chunk_size=chunk)
    want = materialised(h, w, ids, b, temperature, softcap)
    # float64 throughout; chunked and whole-matrix products sum in other orders: ~1e-15 relative, 1e-10 allowed
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    params = [h, w] + ([b] if bias else [])
    g_got = torch.autograd.grad((got * upstream).sum(), params)
    g_want = torch.autograd.grad((want * upstream).sum(), params)
    for a, e in zip(g_got, g_want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_ignored_rows_with_nan_get_no_gradient_and_non_contiguous_inputs_work():
    torch.manual_seed(1)
    base = torch.randn(12, 16, dtype=torch.float64)
    h = base[:, ::2].clone().requires_grad_()  # (12, 8)
    w_full = torch.randn(8, 50, dtype=torch.float64)
    w = w_full.T.requires_grad_()  # (50, 8), non-contiguous
    ids = torch.randint(0, 50, (12,))
    ids[3] = -100
    with torch.no_grad():
        h[3] = float("nan")
    out = linear_token_logprobs(h, w, ids)
    assert out[3] == 0 and torch.isfinite(out).all()
    (gh,) = torch.autograd.grad(out.sum(), [h])
    assert (gh[3] == 0).all()


def test_bf16_autocast_takes_the_products_in_bf16_and_the_softmax_in_fp32():
    """fp32 hidden states and head under bf16 autocast (bf16=True with fp32 weights): the products run on the
    bf16-rounded inputs, as nn.Linear's would, but the log-sum-exp must see fp32 logits. Rounding the logits to bf16
    first loses 8 bits where a log-prob near -7 has a spacing of 2^-5: errors of ~1e-2 nats in every log q, an
    importance ratio off by ~1 % and a staleness that is never 0. Against the float64 log-softmax of the rounded
    inputs the error is fp32 rounding of logits of size ~3 (1e-6 of them; 1e-5 allowed)."""
    torch.manual_seed(2)
    n, hdim, v = 37, 32, 1000
    h = torch.randn(n, hdim, requires_grad=True)
    w = (torch.randn(v, hdim) * 2 / hdim**0.5).requires_grad_()
    ids = torch.randint(0, v, (n,))
    ids[::5] = -100
    upstream = torch.randn(n)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_token_logprobs(h, w, ids, chunk_size=8)
        again = linear_token_logprobs(h, w, ids, chunk_size=8)
        g_inside = torch.autograd.grad((again * upstream).sum(), [h, w])  # a backward called under autocast
    g_got = torch.autograd.grad((got * upstream).sum(), [h, w])
    assert got.dtype == torch.float32 and all(g.dtype == torch.float32 for g in g_got)
    h64, w64 = (t.detach().bfloat16().double().requires_grad_() for t in (h, w))
    want = materialised(h64, w64, ids, None, 1.0, None)
    assert want.min() < -7  # log-probs where bf16's spacing is 2^-5
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    # the gradient products run in bf16 as nn.Linear's backward would (bf16's rounding of each product: 1 % of the
    # largest entry bounds it), and the recomputed logits are the forward's whatever autocast holds at backward
    for a, e in zip(g_got, torch.autograd.grad((want * upstream.double()).sum(), [h64, w64])):
        torch.testing.assert_close(a.double(), e, rtol=0, atol=1e-2 * float(e.abs().max()))
    for a, b in zip(g_got, g_inside):
        assert torch.equal(a, b)
