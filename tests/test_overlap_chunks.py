"""overlap_chunks: the chunk kernels on a side stream beside the next chunk's products (CUDA only).

The same kernels and products run on the same inputs, in another order of independent work, so with one chunk
size the results are bitwise those of the sequential loop; with the automatic size (half the rows) they follow
the float64 reference like the sequential loss. On a CPU the option changes nothing.
"""

import pytest
import torch

from liger_patch_kd import KDLossConfig, fused_linear_jsd, fused_linear_topk_kd
from liger_patch_kd import reference as R


def _inputs(device, n=1000, hidden=64, vocab=3000, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(n, hidden, generator=g).to(device, dtype).requires_grad_()
    w_s = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(device, dtype).requires_grad_()
    h_t = torch.randn(n, hidden, generator=g).to(device, dtype)
    w_t = (torch.randn(vocab, hidden, generator=g) * 1.3 / hidden**0.5).to(device, dtype)
    labels = torch.randint(0, vocab, (n,), generator=g).to(device)
    labels[::7] = -100
    return h_s, w_s, h_t, w_t, labels


def _loss_and_grads(inputs, **options):
    h_s, w_s, h_t, w_t, labels = inputs
    h_s.grad = w_s.grad = None
    loss = fused_linear_jsd(h_s, w_s, h_t, w_t, labels, config=KDLossConfig(**options))
    loss.backward()
    return loss.detach(), h_s.grad.clone(), w_s.grad.clone()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_overlap_changes_no_value_on_the_cpu(beta):
    inputs = _inputs("cpu", n=40, vocab=300, dtype=torch.float32)
    plain = _loss_and_grads(inputs, beta=beta, chunk_size=16)
    overlapped = _loss_and_grads(inputs, beta=beta, chunk_size=16, overlap_chunks=True)
    for a, b in zip(plain, overlapped):
        assert torch.equal(a, b)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="overlap_chunks runs on CUDA streams")


@cuda
@pytest.mark.parametrize("options", [dict(beta=0.5), dict(beta=0.0, hard_weight=0.4, temperature=2.0), dict(beta=1.0)])
def test_overlap_is_bitwise_the_sequential_loop_at_one_chunk_size(options):
    inputs = _inputs("cuda")
    plain = _loss_and_grads(inputs, chunk_size=128, **options)
    overlapped = _loss_and_grads(inputs, chunk_size=128, overlap_chunks=True, **options)
    for a, b in zip(plain, overlapped):
        assert torch.equal(a, b)


@cuda
def test_overlap_with_its_own_chunk_size_follows_the_float64_reference():
    inputs = _inputs("cuda")
    loss, g_h, g_w = _loss_and_grads(inputs, beta=0.5, overlap_chunks=True)
    h_s, w_s, h_t, w_t, labels = (t.detach().double().requires_grad_(t.requires_grad) for t in inputs)
    ref = R.kd_loss(h_s @ w_s.T, h_t @ w_t.T, labels, KDLossConfig(beta=0.5))
    ref.backward()
    # bf16 operands, fp32 products and math: the loss to fp32 accumulation, the gradients to bf16 rounding
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-3, atol=1e-5)
    for got, want in ((g_h, h_s.grad), (g_w, w_s.grad)):
        assert (got.double() - want).norm() / want.norm() < 1e-2


@cuda
def test_overlap_reaches_the_top_k_loss_too():
    h_s, w_s, h_t, w_t, labels = _inputs("cuda")
    top = torch.log_softmax((h_t @ w_t.T).float(), -1).topk(8)
    out = []
    for overlap in (False, True):
        h_s.grad = w_s.grad = None
        cfg = KDLossConfig(chunk_size=128, overlap_chunks=overlap)
        loss = fused_linear_topk_kd(h_s, w_s, top.indices, top.values, labels, config=cfg)
        loss.backward()
        out.append((loss.detach(), h_s.grad.clone(), w_s.grad.clone()))
    for a, b in zip(*out):
        assert torch.equal(a, b)
