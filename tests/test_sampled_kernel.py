"""The sampled-token chunk's Triton kernel (ops.fused_linear_sampled_kd) against the same chunk in float64,
chunk by chunk: shapes past one tile, fp32 within the bound fp32 arithmetic guarantees (a GPU's approximate exp),
slot ids that only check_inputs=False lets through, and the float64 scalars. Compiled on a GPU, interpreted on a
CPU; every tensor lives on helpers.DEVICE."""

import math

import pytest
import torch

from liger_patch_kd import KDLossConfig, fused_linear_sampled_kd
from liger_patch_kd.ops import fused_linear_sampled_kd as op
from liger_patch_kd.ops.backend import triton_available
from liger_patch_kd.teacher.sampling import sample_teacher_tokens

from .helpers import DEVICE, U32, fp32_grad_l1_bound, fp32_loss_bound, grads

pytestmark = pytest.mark.skipif(not triton_available(), reason="the Triton kernel needs triton")
TOL = dict(rtol=1e-10, atol=1e-12)


def _chunk(rows, vocab, m, top_k=0, seed=0, scale=3.0, teacher_scale=2.0):
    """(float64 logits, float64 slots, labels, row weights) of one chunk; row 0 ignored (weights 0, no slots)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, dtype=torch.float64, generator=g) * scale
    teacher = torch.log_softmax(torch.randn(rows, vocab, dtype=torch.float64, generator=g) * teacher_scale, -1)
    d = sample_teacher_tokens(teacher, m, top_k=top_k, generator=g)
    slots = op.sampled_slots(d.ids, d.counts, d.logprobs, d.topk_ids, d.topk_logprobs, torch.float64)
    slots = tuple(torch.where(torch.arange(rows)[:, None] == 0, empty, t) for t, empty in zip(slots, (-1, 0.0, 0.0)))
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[0] = -100
    w_soft = torch.rand(rows, dtype=torch.float64, generator=g) + 0.5
    w_soft[0] = 0
    w_hard = torch.where(labels == -100, 0.0, 0.3).double()
    return (t.to(DEVICE) for t in (logits, *slots, labels, w_soft, w_hard))


def _run(kernel, logits, ids, mass, lp, labels, w_soft, w_hard, cfg, grad_dtype=None):
    dtype = logits.dtype
    soft, hard, grad = kernel(
        logits, (ids, mass.to(dtype), lp.to(dtype)), labels, w_soft.to(dtype), w_hard.to(dtype),
        grad_dtype or dtype, cfg,
    )  # fmt: skip
    return soft, hard, grad


@pytest.mark.parametrize(
    "vocab,m,top_k,cfg",
    [
        (4500, 40, 0, KDLossConfig(temperature=0.7)),  # two vocabulary tiles (BLOCK_V = 4096): the running lse
        (4500, 16, 8, KDLossConfig(temperature=1.3, hard_weight=0.4, softcap=5.0)),  # + CE at T = 1, soft-cap
        (1400, 3000, 0, KDLossConfig(temperature=2.0, hard_weight=0.2)),  # a flat teacher: > 1024 distinct slots
    ],
)
def test_float64_beyond_one_tile_matches_the_pytorch_chunk(vocab, m, top_k, cfg):
    logits, ids, mass, lp, labels, w_soft, w_hard = _chunk(3, vocab, m, top_k, teacher_scale=0.1 if m > 1024 else 2.0)
    assert int((ids >= 0).sum(-1).max()) > (1024 if m > 1024 else 0)  # more than one slot tile where asked
    got = _run(op.sampled_chunk_triton, logits, ids, mass, lp, labels, w_soft, w_hard, cfg)
    want = _run(op.sampled_chunk_torch, logits, ids, mass, lp, labels, w_soft, w_hard, cfg)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, **TOL)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_within_the_derived_bound(temperature):
    """fp32 logits against the float64 chunk of the same logits: each row's loss and the l1 norm of its
    dLoss/dlogits within what fp32 arithmetic with an approximate exp guarantees (helpers.fp32_*_bound). The
    PyTorch chunk is held to the same bound."""
    vocab = 4500
    logits, ids, mass, lp, labels, w_soft, w_hard = _chunk(4, vocab, 24, top_k=4)
    cfg = KDLossConfig(temperature=temperature)
    # the fp32 inputs are rounded copies; the float64 reference sees the same rounded values
    l32, m32, lp32, w32 = logits.float(), mass.float(), lp.float(), w_soft.float()
    want_soft, _, want_grad = _run(
        op.sampled_chunk_torch, l32.double(), ids, m32.double(), lp32.double(), labels, w32.double(), w_hard, cfg
    )
    tiles = math.ceil(vocab / 4096)
    max_abs = float(l32.abs().max() / temperature + torch.logsumexp(l32.double() / temperature, -1).abs().max())
    max_abs += float(lp32.abs().max())
    for kernel in (op.sampled_chunk_triton, op.sampled_chunk_torch):
        soft, _, grad = _run(kernel, l32, ids, m32, lp32, labels, w32, w_hard.float(), cfg)
        loss_err = (soft.double() - want_soft).abs()
        assert float(loss_err.max()) <= fp32_loss_bound(vocab, max_abs, tiles), kernel.__name__
        l1 = (grad.double() - want_grad).abs().sum(-1)
        # dL/dlogits = w_soft / T * dL/du, rounded once more by each multiplication
        bound = w32.double() / temperature * (fp32_grad_l1_bound(vocab, max_abs, tiles) + 4 * U32 * 2)
        assert bool((l1 <= bound).all()), (kernel.__name__, (l1 / bound).max())


def test_slot_ids_past_the_vocabulary_are_never_read():
    """With check_inputs=False an id >= V reaches the kernel: it is dropped like a padding slot, not read from
    the next row's logits (or past the buffer). The row's other slots count as before."""
    vocab = 97
    logits, ids, mass, lp, labels, w_soft, w_hard = _chunk(4, vocab, 12, seed=1)
    bad = ids.clone()
    bad[1, 0], bad[3, 0] = vocab, vocab + 5  # row 3 is the chunk's last: vocab + 5 is past the buffer
    dropped = [t.clone() for t in (ids, mass, lp)]
    for t, empty in zip(dropped, (-1, 0.0, 0.0)):
        t[1, 0] = t[3, 0] = empty
    cfg = KDLossConfig(temperature=0.8, hard_weight=0.5)
    got = _run(op.sampled_chunk_triton, logits, bad, mass, lp, labels, w_soft, w_hard, cfg)
    want = _run(op.sampled_chunk_torch, logits, *dropped, labels, w_soft, w_hard, cfg)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, **TOL)


def test_the_scalars_reach_the_kernel_exact():
    """1/T goes in as two float32 halves: compiled, a Python float argument is float32, so 1/T alone would be
    rounded by up to 2^-24 (the interpreter keeps it float64, so only this split makes both agree to round-off)."""
    from liger_patch_kd.ops.triton_utils import fp32_pair

    for value in (1 / 0.7, 1 / 1.3, 1.0, 0.5, 1 / 3):
        hi, lo = fp32_pair(value)
        assert float(torch.tensor(hi, dtype=torch.float32)) == hi and float(torch.tensor(lo, dtype=torch.float32)) == lo
        assert abs(hi + lo - value) <= 2.0**-46 * value


def test_fused_loss_through_the_kernel_on_a_padded_head():
    """The whole fused loss (chunk loop, padded columns past vocab_size, bias, temperature) through the kernel
    equals the PyTorch chunk's in float64."""
    g = torch.Generator().manual_seed(3)
    n, h_dim, rows, vocab = 19, 11, 320, 300
    h = torch.randn(n, h_dim, dtype=torch.float64, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(rows, h_dim, dtype=torch.float64, generator=g).to(DEVICE).requires_grad_()
    b = (torch.randn(rows, dtype=torch.float64, generator=g) * 0.3).to(DEVICE).requires_grad_()
    d = sample_teacher_tokens(torch.log_softmax(torch.randn(n, vocab, dtype=torch.float64, generator=g), -1), 9,
                              top_k=3, generator=g)  # fmt: skip
    labels = torch.randint(0, vocab, (n,), generator=g).to(DEVICE)
    labels[::5] = -100
    out = {}
    for backend in ("triton", "torch"):
        loss = fused_linear_sampled_kd(
            h, w, d.ids.to(DEVICE), d.counts.to(DEVICE), d.logprobs.to(DEVICE), labels,
            teacher_token_ids=d.topk_ids.to(DEVICE), teacher_logprobs=d.topk_logprobs.to(DEVICE), student_bias=b,
            config=KDLossConfig(beta=0.0, temperature=1.7, hard_weight=0.2, vocab_size=vocab, chunk_size=6),
            backend=backend,
        )  # fmt: skip
        out[backend] = (loss, *grads(loss, [h, w, b]))
    for got, want in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(got, want, **TOL)
