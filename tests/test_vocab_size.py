"""Heads padded to different sizes (Qwen2.5: 151936 / 152064 rows for 151665 tokens), shrunk to V_s = 67,
V_t = 71, vocab_size = 61: both distributions and the CE term over ids [0, vocab_size) only, against the
reference on sliced logits in float64. The padding rows carry large logits, so truncating to the smaller head
(or to nothing) would give another value."""

import pytest
import torch
import torch.nn.functional as F

from liger_patch_kd import (
    FusedLinearJSDLoss,
    FusedLinearTopKKDLoss,
    KDLossConfig,
    fused_linear_jsd,
    fused_linear_topk_kd,
)
from liger_patch_kd import reference as R

from .helpers import DEVICE, backends, grads

TOL = {"torch": dict(rtol=1e-10, atol=1e-12), "triton": dict(rtol=1e-6, atol=1e-8)}
V_S, V_T, VOCAB, N, H_S, H_T = 67, 71, 61, 23, 11, 9


def _padded_pair():
    """Student and teacher heads with padding rows whose logits dwarf the real ones."""
    g = torch.Generator().manual_seed(3)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(DEVICE)

    w_s, w_t = rand(V_S, H_S, scale=0.5), rand(V_T, H_T, scale=0.5)
    w_s[VOCAB:] *= 20  # some checkpoints hold copies of real rows (or noise) there: probability a real token lacks
    w_t[VOCAB:] *= 20
    h_s, h_t = rand(N, H_S), rand(N, H_T)
    b_s, b_t = rand(V_S, scale=0.3), rand(V_T, scale=0.3)
    b_s[VOCAB:] += 30.0
    labels = torch.randint(0, VOCAB, (N,), generator=g).to(DEVICE)
    labels[::5] = -100
    leaves = [t.requires_grad_() for t in (h_s, w_s, b_s)]
    return leaves, (h_t, w_t, b_t), labels


def _sliced_reference_jsd(student, teacher, labels, cfg):
    h_s, w_s, b_s = student
    h_t, w_t, b_t = teacher
    s_logits, t_logits = h_s @ w_s.T + b_s, h_t @ w_t.T + b_t
    return R.kd_loss(s_logits[:, :VOCAB], t_logits[:, :VOCAB], labels, cfg.replace(vocab_size=None))


def _fused_and_sliced_reference_jsd(student, teacher, labels, cfg, backend):
    """The fused loss with vocab_size=VOCAB and the reference on the sliced logits, checked to agree."""
    loss = fused_linear_jsd(
        student[0], student[1], teacher[0], teacher[1], labels, student_bias=student[2], teacher_bias=teacher[2],
        config=cfg.replace(vocab_size=VOCAB), backend=backend,
    )  # fmt: skip
    expected = _sliced_reference_jsd(student, teacher, labels, cfg)
    torch.testing.assert_close(loss, expected, **TOL[backend])
    return loss, expected


def _check_grads(loss, expected, student, backend):
    got, want = grads(loss, student), grads(expected, student)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, **TOL[backend])
    assert torch.all(got[1][VOCAB:] == 0) and torch.all(got[2][VOCAB:] == 0)  # padding rows: exactly 0


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_over_the_real_vocabulary(backend, beta):
    student, teacher, labels = _padded_pair()
    cfg = KDLossConfig(beta=beta, temperature=1.3, hard_weight=0.4, softcap=20.0, teacher_softcap=25.0, chunk_size=9)
    loss, expected = _fused_and_sliced_reference_jsd(student, teacher, labels, cfg, backend)
    # the oracle with vocab_size on the full logits is the same thing
    full = R.kd_loss(
        student[0] @ student[1].T + student[2], teacher[0] @ teacher[1].T + teacher[2], labels,
        cfg.replace(vocab_size=VOCAB),
    )  # fmt: skip
    torch.testing.assert_close(full, expected, rtol=1e-12, atol=0)
    truncated = R.kd_loss(
        (student[0] @ student[1].T + student[2])[:, :V_S], (teacher[0] @ teacher[1].T + teacher[2])[:, :V_S], labels,
        cfg,
    )  # fmt: skip
    assert abs(truncated.item() - expected.item()) > 0.1 * abs(expected.item())  # the padding rows matter
    _check_grads(loss, expected, student, backend)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("tail", ["bucket", "renormalize", "none"])
def test_topk_over_the_real_vocabulary(backend, tail):
    student, teacher, labels = _padded_pair()
    t_logits = (teacher[0] @ teacher[1].T + teacher[2])[:, :VOCAB]
    logprobs, ids = F.log_softmax(t_logits, -1).topk(7, -1)
    cfg = KDLossConfig(beta=0.3, temperature=0.8, tail=tail, hard_weight=0.5, chunk_size=6)
    module = FusedLinearTopKKDLoss(config=cfg, vocab_size=VOCAB)
    loss = fused_linear_topk_kd(
        student[0], student[1], ids, logprobs, labels, student_bias=student[2], config=module.config, backend=backend
    )
    s_logits = student[0] @ student[1].T + student[2]
    expected = R.topk_kd_loss(s_logits[:, :VOCAB], ids, logprobs, labels, cfg)
    torch.testing.assert_close(loss, expected, **TOL[backend])
    torch.testing.assert_close(R.topk_kd_loss(s_logits, ids, logprobs, labels, module.config), expected)
    _check_grads(loss, expected, student, backend)


def test_module_forms_take_vocab_size():
    student, teacher, labels = _padded_pair()
    module = FusedLinearJSDLoss(beta=0.2, vocab_size=VOCAB)
    assert module.config.vocab_size == VOCAB and "vocab_size=61" in repr(module)
    loss = module(student[0], student[1], teacher[0], teacher[1], labels, student_bias=student[2],
                  teacher_bias=teacher[2])  # fmt: skip
    torch.testing.assert_close(loss, _sliced_reference_jsd(student, teacher, labels, module.config))


def test_weights_are_viewed_not_copied():
    """Slicing the heads is free: no op copies a weight, and autograd hands back one full-size gradient."""
    from torch.utils._python_dispatch import TorchDispatchMode

    student, teacher, labels = _padded_pair()
    weight_shapes = {(VOCAB, H_S), (VOCAB, H_T), (V_S, H_S), (V_T, H_T)}

    class WeightCopies(TorchDispatchMode):
        copies: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            is_copy = name in ("clone", "_to_copy", "copy_", "contiguous") or name.startswith("slice_backward")
            if is_copy and isinstance(out, torch.Tensor) and tuple(out.shape) in weight_shapes:
                self.copies.append(name)
            return out

    with WeightCopies() as mode:
        loss = fused_linear_jsd(
            student[0], student[1], teacher[0], teacher[1], labels, config=KDLossConfig(vocab_size=VOCAB)
        )
        loss.backward()
    assert mode.copies == []
    assert student[1].grad.shape == (V_S, H_S) and torch.all(student[1].grad[VOCAB:] == 0)


def test_errors_name_the_fix():
    student, teacher, labels = _padded_pair()
    h_s, w_s, _ = student
    h_t, w_t, _ = teacher
    with pytest.raises(ValueError, match=r"vocab_size=len\(tokenizer\)"):
        fused_linear_jsd(h_s, w_s, h_t, w_t, labels)
    with pytest.raises(ValueError, match=r"vocab_size=68 is larger than the student lm_head \(67 rows\)"):
        fused_linear_jsd(h_s, w_s, h_t, w_t, labels, config=KDLossConfig(vocab_size=68))
    with pytest.raises(ValueError, match="vocab_size=70 is larger than the student"):
        fused_linear_topk_kd(
            h_s, w_s, torch.zeros(N, 2, dtype=torch.long), torch.zeros(N, 2), config=KDLossConfig(vocab_size=70)
        )
    with pytest.raises(ValueError, match="config.vocab_size=61"):
        fused_linear_jsd(
            h_s, w_s, h_t, w_t, labels, config=KDLossConfig.build(KDLossConfig(vocab_size=VOCAB), vocab_size=60)
        )
    with pytest.raises(ValueError, match="vocab_size"):
        R.kd_loss(h_s @ w_s.T, h_t @ w_t.T, labels)
    bad_labels = labels.clone()
    bad_labels[3] = VOCAB  # a padding id: the data or vocab_size is wrong
    with pytest.raises(ValueError, match=r"labels hold 1 value\(s\) .* in \[0, 61\)"):
        fused_linear_jsd(h_s, w_s, h_t, w_t, bad_labels, config=KDLossConfig(vocab_size=VOCAB))
    with pytest.raises(ValueError, match=r"ids outside \[0, 61\)"):
        R.kd_loss(h_s @ w_s.T, h_t @ w_t.T, bad_labels, KDLossConfig(vocab_size=VOCAB))
    ids = torch.rand(N, VOCAB).argsort(-1)[:, :3]  # unique within a row
    logprobs = torch.full((N, 3), -3.0)
    with pytest.raises(ValueError, match="labels hold 1 value"):
        fused_linear_topk_kd(h_s, w_s, ids, logprobs, bad_labels, config=KDLossConfig(vocab_size=VOCAB))
    ids[4, 1] = VOCAB + 2
    with pytest.raises(ValueError, match="teacher_token_ids holds ids >= the vocab size 61"):
        fused_linear_topk_kd(h_s, w_s, ids, logprobs, labels, config=KDLossConfig(vocab_size=VOCAB))
    with pytest.raises(ValueError, match=r"teacher_token_ids holds ids outside \[0, 61\)"):
        R.topk_kd_loss(h_s @ w_s.T, ids, logprobs, labels, KDLossConfig(vocab_size=VOCAB))


@pytest.mark.parametrize("backend", backends())
def test_unchecked_out_of_range_labels_are_never_read_out_of_row(backend):
    """check_inputs=False skips the host sync; a label past the vocabulary then counts as ignored for the CE
    term (both backends alike) instead of reading another row's logits."""
    student, teacher, labels = _padded_pair()
    bad = labels.clone()
    bad[1] = V_S + 5
    cfg = KDLossConfig(hard_weight=1.0, soft_weight=1e-9, reduction="none", chunk_size=4)
    rows = fused_linear_jsd(student[0], student[1], teacher[0], teacher[1], bad, config=cfg.replace(vocab_size=VOCAB),
                            check_inputs=False, backend=backend)  # fmt: skip
    assert torch.isfinite(rows).all() and rows[1].abs().item() < 1e-6


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("temperature", [1.0, 2.5, 0.05])
def test_aligned_columns_for_an_odd_vocab_size(backend, temperature):
    """vocab_size 61 is odd (as Qwen2.5's 151665): the chunks compute 64 columns for aligned products and push the
    3 extra ones out with conventions.PAD_LOGIT. The result is still the reference on the sliced logits, and the
    padding rows' gradients are exactly 0 (their probability underflows to 0, not merely to something small)."""
    from liger_patch_kd.conventions import computed_columns

    assert computed_columns(VOCAB, [V_S, V_T], [None, None], temperature) == 64
    student, teacher, labels = _padded_pair()
    cfg = KDLossConfig(beta=0.4, temperature=temperature, hard_weight=0.3, chunk_size=5)
    loss, expected = _fused_and_sliced_reference_jsd(student, teacher, labels, cfg, backend)
    _check_grads(loss, expected, student, backend)
    if temperature == 1.0:  # the top-k loss pads its columns at T = 1 only (tempering counts the real V)
        t_logits = (teacher[0] @ teacher[1].T + teacher[2])[:, :VOCAB]
        logprobs, ids = F.log_softmax(t_logits, -1).topk(7, -1)
        topk_cfg = cfg.replace(tail="bucket", vocab_size=VOCAB)
        loss = fused_linear_topk_kd(
            student[0], student[1], ids, logprobs, labels, student_bias=student[2], config=topk_cfg, backend=backend
        )
        s_logits = (student[0] @ student[1].T + student[2])[:, :VOCAB]
        expected = R.topk_kd_loss(s_logits, ids, logprobs, labels, topk_cfg.replace(vocab_size=None))
        torch.testing.assert_close(loss, expected, **TOL[backend])
        _check_grads(loss, expected, student, backend)
