"""The product with the log-sum-exp in its epilogue (ops/logits_lse.py) against float64, and the fused JSD loss
with it (opt-in: LIGER_KD_LSE_IN_PRODUCT=1) against the same loss without it and the reference.

On CPU the kernel runs in the interpreter with one small tile; on a GPU it autotunes, so the first call of each
shape also checks that the configs tried while tuning leave nothing behind in the result.
"""

import pytest
import torch

from liger_patch_kd import KDLossConfig, fused_linear_jsd
from liger_patch_kd import reference as R
from liger_patch_kd.ops import backend as backend_mod

from .helpers import DEVICE, rel_err

pytestmark = pytest.mark.skipif(not backend_mod.triton_available(), reason="needs triton")


def _reference(x, w, bias, temperature, softcap):
    z = x.double() @ w.double().T
    if bias is not None:
        z = z + bias.double()
    capped = z if softcap is None else softcap * torch.tanh(z / softcap)
    return z, torch.logsumexp(capped / temperature, -1), torch.logsumexp(capped, -1)


# (rows, columns, hidden): ragged in every dimension against any tile; a GPU also runs a head-sized product
SHAPES = [(37, 300, 96), (5, 1000, 40), (64, 256, 64)] + ([(300, 128256, 512)] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias,temperature,softcap", [(False, 1.0, None), (True, 0.7, None), (True, 2.0, 5.0)])
def test_logits_and_lse_match_float64(shape, dtype, bias, temperature, softcap):
    from liger_patch_kd.ops.logits_lse import logits_with_lse

    m, n, k = shape
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) * 3 / k**0.5).to(dtype)
    b = torch.randn(n, device=DEVICE) if bias else None
    got = logits_with_lse(x, w, b, temperature=temperature, softcap=softcap, with_unit_temperature=True)
    z, lse, lse_unit = _reference(x, w, b, temperature, softcap)
    assert got.values.dtype == torch.float32 and got.values.shape == (m, n)
    # fp32 accumulation of exact 16-bit products: round-off only
    torch.testing.assert_close(got.values.double(), z, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.lse.double(), lse, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.lse_unit.double(), lse_unit, rtol=1e-5, atol=1e-4)


def test_strided_hidden_states_are_refused_with_the_fix():
    from liger_patch_kd.ops.logits_lse import logits_with_lse

    x = torch.randn(8, 32, device=DEVICE).bfloat16().t()
    with pytest.raises(ValueError, match="unit stride"):
        logits_with_lse(x, torch.randn(10, 8, device=DEVICE).bfloat16(), None)


def _bf16_problem(n=70, h=48, vocab=333, ignore_every=5, seed=1):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).bfloat16().to(DEVICE)

    labels = torch.randint(0, vocab, (n,), generator=g).to(DEVICE)
    if ignore_every:
        labels[::ignore_every] = -100
    return rand(n, h), rand(vocab, h, scale=3 / h**0.5), rand(n, h), rand(vocab, h, scale=3 / h**0.5), labels


def _run(problem, cfg, **kwargs):
    h_s, w_s, h_t, w_t, labels = problem
    h_s, w_s = h_s.clone().requires_grad_(), w_s.clone().requires_grad_()
    loss = fused_linear_jsd(h_s, w_s, h_t, w_t, labels, config=cfg, backend="triton", **kwargs)
    loss.backward()
    return loss.detach(), h_s.grad, w_s.grad


CONFIGS = [
    KDLossConfig(beta=0.5, chunk_size=32),
    KDLossConfig(beta=0.0, temperature=2.0, hard_weight=0.3, chunk_size=32),
    KDLossConfig(beta=1.0, temperature=0.7, softcap=5.0, teacher_softcap=7.0, hard_weight=1.0),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["jsd", "forward-kl-T2-hard", "reverse-kl-capped-T0.7"])
def test_fused_loss_with_lse_in_product_matches_without_and_reference(cfg, monkeypatch):
    from liger_patch_kd.ops import logits_lse

    calls = []
    real = logits_lse.logits_with_lse
    monkeypatch.setattr(logits_lse, "logits_with_lse", lambda *a, **k: calls.append(1) or real(*a, **k))
    problem = _bf16_problem()
    monkeypatch.setenv("LIGER_KD_LSE_IN_PRODUCT", "1")
    with_lse = _run(problem, cfg)
    assert calls, "LIGER_KD_LSE_IN_PRODUCT=1 on the Triton path with bf16 inputs takes the products' log-sum-exp"
    monkeypatch.setenv("LIGER_KD_LSE_IN_PRODUCT", "0")
    calls.clear()
    without = _run(problem, cfg)
    assert not calls
    for a, b in zip(with_lse, without):  # the same math up to where fp32 rounds the log-sum-exp
        assert rel_err(a.float(), b.float()) < 2e-3
    h_s, w_s, h_t, w_t, labels = (t.double() if t.is_floating_point() else t for t in problem)
    h_s, w_s = h_s.requires_grad_(), w_s.requires_grad_()
    expected = R.kd_loss(h_s @ w_s.T, h_t @ w_t.T, labels, cfg)
    expected.backward()
    torch.testing.assert_close(with_lse[0].double(), expected, rtol=1e-4, atol=1e-5)
    assert rel_err(with_lse[1].double(), h_s.grad) < 1e-2 and rel_err(with_lse[2].double(), w_s.grad) < 1e-2


def test_all_rows_ignored_and_nan_in_ignored_rows(monkeypatch):
    monkeypatch.setenv("LIGER_KD_LSE_IN_PRODUCT", "1")
    h_s, w_s, h_t, w_t, labels = _bf16_problem(ignore_every=3)
    h_s[::3] = float("nan")
    h_t[::3] = float("nan")
    loss, g_h, g_w = _run((h_s, w_s, h_t, w_t, labels), KDLossConfig(beta=0.5))
    assert torch.isfinite(loss) and torch.isfinite(g_h).all() and torch.isfinite(g_w).all()
    assert (g_h[::3] == 0).all()
    labels = torch.full_like(labels, -100)
    loss, g_h, g_w = _run((h_s, w_s, h_t, w_t, labels), KDLossConfig(beta=0.5), num_items_in_batch=0)
    assert loss.item() == 0 and (g_h == 0).all() and (g_w == 0).all()
