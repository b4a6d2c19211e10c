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
