"""Several teachers: the fused mixture loss against reference.multi_teacher_kd_loss in float64."""

import math

import pytest
import torch

from liger_patch_kd import KDLossConfig, reference
from liger_patch_kd.losses import fused_linear_jsd, fused_linear_multi_teacher_jsd

from .helpers import DEVICE, backends, grads, rel_err

N, H_S, VOCAB = 29, 19, 203
HIDDEN = (13, 23, 17)  # the teachers' hidden sizes differ from each other and from the student's


def _setup(n_teachers=3, bias=False, ignore_every=3, heads=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    heads = heads or [VOCAB] * (n_teachers + 1)

    def rand(*size, s=1.0):  # drawn on the CPU (one stream whatever the device), then moved: leaves on DEVICE
        return (torch.randn(*size, generator=g, dtype=torch.float64) * s).to(DEVICE)

    student = [rand(N, H_S).requires_grad_(), rand(heads[0], H_S, s=1.5 / H_S**0.5).requires_grad_()]
    student.append(rand(heads[0], s=0.5).requires_grad_() if bias else None)
    teachers = [
        (rand(N, h), rand(v, h, s=2.0 / h**0.5), rand(v, s=0.5) if bias else None)
        for h, v in zip(HIDDEN[:n_teachers], heads[1:])
    ]
    labels = torch.randint(0, VOCAB, (N,), generator=g)
    if ignore_every:
        labels[::ignore_every] = -100
    weights = torch.rand(N, n_teachers, generator=g, dtype=torch.float64) + 0.05
    return student, teachers, labels.to(DEVICE), (weights / weights.sum(-1, keepdim=True)).to(DEVICE)


def _logits(h, w, b):
    return h @ w.T + (0 if b is None else b)


def _both(student, teachers, labels, weights, *, backend="torch", caps=None, num_items=None, **options):
    h_s, w_s, b_s = student
    fields = {k: v for k, v in options.items() if k in KDLossConfig.__dataclass_fields__}
    others = {k: v for k, v in options.items() if k not in fields}
    fused = fused_linear_multi_teacher_jsd(
        h_s, w_s, [t[0] for t in teachers], [t[1] for t in teachers], weights, labels, student_bias=b_s,
        teacher_biases=[t[2] for t in teachers], teacher_softcaps=caps, num_items_in_batch=num_items,
        backend=backend, config=KDLossConfig(**fields), **others,
    )  # fmt: skip
    ref = reference.multi_teacher_kd_loss(
        _logits(*student), [_logits(*t) for t in teachers], weights, labels, None, num_items,
        teacher_softcaps=caps, **options,
    )  # fmt: skip
    return fused, ref


def _assert_same(fused, ref, student):
    params = [p for p in student if p is not None]
    assert torch.allclose(fused, ref, rtol=1e-9, atol=1e-12), (fused, ref)
    for a, b in zip(grads(fused, params), grads(ref, params)):
        assert rel_err(a, b) < 1e-9


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("mixture", ["distribution", "loss"])
def test_mixture_matches_the_reference(backend, beta, mixture):
    student, teachers, labels, weights = _setup(bias=True)
    fused, ref = _both(
        student, teachers, labels, weights, backend=backend, beta=beta, temperature=1.7, hard_weight=0.3,
        mixture=mixture, chunk_size=8,
    )  # fmt: skip
    _assert_same(fused, ref, student)


@pytest.mark.parametrize("backend", backends())
def test_softcaps_padded_heads_and_one_mixture_for_every_row(backend):
    heads = [VOCAB + 5, VOCAB, VOCAB + 64, VOCAB + 1]  # padded to different sizes: vocab_size names the real ids
    student, teachers, labels, _ = _setup(heads=heads)
    weights = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64, device=DEVICE)
    fused, ref = _both(
        student, teachers, labels, weights, backend=backend, caps=[3.0, None, 5.0], softcap=4.0, vocab_size=VOCAB,
        beta=0.1, temperature=0.8, num_items=torch.tensor(23),
    )  # fmt: skip
    _assert_same(fused, ref, student)


def test_the_temperature_applies_to_each_teacher_before_mixing():
    z1, z2 = torch.randn(2, 4, 11, dtype=torch.float64)
    w = torch.tensor([0.4, 0.6], dtype=torch.float64)
    log_p = reference.log_teacher_mixture([z1, z2], w, temperature=2.0)
    by_hand = (0.4 * torch.softmax(z1 / 2, -1) + 0.6 * torch.softmax(z2 / 2, -1)).log()
    assert torch.allclose(log_p, by_hand, rtol=1e-12)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("mixture", ["distribution", "loss"])
def test_a_row_routed_to_one_teacher_is_the_single_teacher_loss(backend, mixture):
    student, teachers, labels, _ = _setup()
    route = torch.arange(N, device=DEVICE) % 3
    weights = torch.nn.functional.one_hot(route, 3).double()
    h_s, w_s, _ = student
    fused = fused_linear_multi_teacher_jsd(
        h_s, w_s, [t[0] for t in teachers], [t[1] for t in teachers], weights, labels,
        config=KDLossConfig(reduction="none", temperature=2.0), backend=backend, mixture=mixture,
    )  # fmt: skip
    for j, (h_t, w_t, _) in enumerate(teachers):
        single = fused_linear_jsd(
            h_s, w_s, h_t, w_t, labels, config=KDLossConfig(reduction="none", temperature=2.0), backend=backend
        )
        rows = route == j
        assert torch.allclose(fused[rows], single[rows], rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("backend", backends())
def test_all_rows_ignored_and_no_items_give_zero_and_nan_in_ignored_rows_is_never_read(backend):
    student, teachers, labels, weights = _setup()
    labels[:] = -100
    teachers[1][0][::2] = math.nan
    weights[::2] = math.nan  # ignored rows' weights are not data either
    for num_items in (None, 0):
        fused, _ = _both(student, teachers, labels, weights, backend=backend, num_items=num_items)
        assert fused.item() == 0
        assert all(g.abs().sum() == 0 for g in grads(fused, student[:2]))


def test_bf16_inputs_follow_the_float64_reference():
    student, teachers, labels, weights = _setup(bias=True)
    low = [t.detach().bfloat16().requires_grad_() if t is not None else None for t in student]
    low_teachers = [tuple(None if t is None else t.bfloat16() for t in teacher) for teacher in teachers]
    fused = fused_linear_multi_teacher_jsd(
        low[0], low[1], [t[0] for t in low_teachers], [t[1] for t in low_teachers], weights.float(), labels,
        student_bias=low[2], teacher_biases=[t[2] for t in low_teachers], config=KDLossConfig(temperature=1.5),
    )  # fmt: skip
    ref = reference.multi_teacher_kd_loss(
        _logits(*[None if t is None else t.detach().bfloat16().double() for t in student]),
        [_logits(*[None if x is None else x.double() for x in t]) for t in low_teachers], weights, labels,
        temperature=1.5,
    )  # fmt: skip
    # bf16 products accumulated in fp32: the loss to fp32 rounding of logits of size ~3 (a few 1e-6 relative)
    assert abs(fused.item() - ref.item()) < 1e-4 * ref.item()
    assert fused.dtype == torch.float32 and grads(fused, low[:1])[0].dtype == torch.bfloat16


def test_bad_weights_and_shapes_are_clear_errors():
    student, teachers, labels, weights = _setup()
    hs, ws = [t[0] for t in teachers], [t[1] for t in teachers]
    with pytest.raises(ValueError, match="sum to 1"):
        fused_linear_multi_teacher_jsd(student[0], student[1], hs, ws, weights * 2, labels)
    with pytest.raises(ValueError, match="finite and >= 0"):
        fused_linear_multi_teacher_jsd(student[0], student[1], hs, ws, -weights, labels)
    with pytest.raises(ValueError, match="mixture_weights must have shape"):
        fused_linear_multi_teacher_jsd(student[0], student[1], hs, ws, weights[:, :2], labels)
    with pytest.raises(ValueError, match="one lm_head weight per teacher"):
        fused_linear_multi_teacher_jsd(student[0], student[1], hs, ws[:2], weights, labels)
    with pytest.raises(ValueError, match=r"teacher\[1\]_input has hidden size"):
        fused_linear_multi_teacher_jsd(student[0], student[1], hs, [ws[0], ws[0], ws[2]], weights, labels)
    with pytest.raises(ValueError, match="mixture must be one of"):
        fused_linear_multi_teacher_jsd(student[0], student[1], hs, ws, weights, labels, mixture="mean")


@pytest.mark.parametrize("backend", backends())
def test_the_fold_kernel_builds_the_reference_log_mixture(backend):
    """ops.mixture folds teachers one at a time (a zero weight, a soft-cap, the last one scaled by T) into the
    reference's log P, in float64, odd V (tiles with a masked tail)."""
    from liger_patch_kd.ops.mixture import FOLD_KERNELS

    g = torch.Generator().manual_seed(3)
    logits = [(torch.randn(7, 1271, generator=g, dtype=torch.float64) * 3).to(DEVICE) for _ in range(3)]
    weights = torch.tensor([[0.2, 0.0, 0.8]] * 4 + [[0.0, 1.0, 0.0]] * 3, dtype=torch.float64, device=DEVICE)
    caps, temperature = [None, 2.5, None], 1.7
    mix = None
    for j, z in enumerate(logits):
        scale = temperature if j == 2 else 1.0
        mix = FOLD_KERNELS[backend](mix, z.clone(), weights[:, j].log(), 1 / temperature, caps[j], scale)
    expected = reference.log_teacher_mixture(logits, weights, temperature=temperature, softcaps=caps)
    torch.testing.assert_close(mix / temperature, expected, rtol=1e-12, atol=1e-12)


def test_non_contiguous_leading_dims_and_teachers_in_another_dtype():
    """(B, T, H) student rows from a transposed buffer, per-position (B, T, J) weights, bf16 teachers beside a
    float64 student: each teacher's product runs in its own dtype (bf16 operands, fp32 accumulation), so the loss
    follows the reference on the same bf16 values to fp32 rounding of those products (~1e-7 relative)."""
    student, teachers, labels, weights = _setup(n_teachers=2, ignore_every=4)
    b, t = 1, N
    h_s = student[0].detach().T.contiguous().T.reshape(b, t, H_S).requires_grad_()  # strides (.., 1, N)
    assert not h_s.is_contiguous()
    low = [(h.bfloat16().reshape(b, t, -1), w.bfloat16()) for h, w, _ in teachers]
    fused = fused_linear_multi_teacher_jsd(
        h_s, student[1], [h for h, _ in low], [w for _, w in low], weights.reshape(b, t, 2), labels.reshape(b, t),
        config=KDLossConfig(temperature=1.3, beta=0.7),
    )  # fmt: skip
    ref = reference.multi_teacher_kd_loss(
        h_s @ student[1].T, [h.double() @ w.double().T for h, w in low], weights.reshape(b, t, 2),
        labels.reshape(b, t), temperature=1.3, beta=0.7,
    )  # fmt: skip
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=0)
    for a, r in zip(grads(fused, [h_s, student[1]]), grads(ref, [h_s, student[1]])):
        assert rel_err(a, r) < 1e-5


@pytest.mark.parametrize("backend", backends())
def test_reduction_none_recomputes_every_teacher_in_its_backward(backend):
    """reduction="none": the backward recomputes the chunks with the per-row upstream gradient, every teacher's
    logits included; it equals the reference's gradient of the same weighted sum."""
    student, teachers, labels, weights = _setup(bias=True)
    fused, ref = _both(student, teachers, labels, weights, backend=backend, reduction="none", temperature=1.5)
    upstream = torch.rand(N, dtype=torch.float64, device=DEVICE)
    torch.testing.assert_close(fused, ref, rtol=1e-9, atol=1e-12)
    params = [p for p in student if p is not None]
    for a, b in zip(grads((fused * upstream).sum(), params), grads((ref * upstream).sum(), params)):
        assert rel_err(a, b) < 1e-9


@pytest.mark.parametrize("setup", ["bf16 weights", "fp32 weights under bf16 autocast"])
def test_per_teacher_figures_take_fp32_logits_of_the_products_the_loss_takes(setup):
    """The logged kd_soft_loss/<name> of several teachers is a divergence of logits from models.teachers.head_logits.
    Rounded to bf16 before the softmax (a bf16 product's output, or any product under bf16 autocast), the figure
    differs from the loss's own term by ~1e-2 nats; the loss takes the product of the bf16 (or autocast-rounded)
    inputs with an fp32 output. Against the float64 product of the rounded inputs the error is fp32 rounding of
    logits of size ~10 (1e-6 of them; 1e-5 allowed)."""
    from liger_patch_kd.models.teachers import head_logits

    torch.manual_seed(3)
    n, hdim, v = 12, 32, 1000
    hidden = torch.randn(2, n, hdim)
    weight = torch.randn(v, hdim) * 3 / hdim**0.5
    bias = (torch.randn(v) * 0.5).bfloat16().float()  # exact in bf16: a bias rounded or not, the same logits
    rows = torch.tensor([0, 3, 5, 13, 20])
    flat = hidden.reshape(-1, hdim)[rows]
    want = flat.bfloat16().double() @ weight.bfloat16().double().T + bias.double()
    if setup == "bf16 weights":
        got = head_logits(hidden.bfloat16(), weight.bfloat16(), bias.bfloat16(), rows)
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = head_logits(hidden, weight, bias, rows)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
