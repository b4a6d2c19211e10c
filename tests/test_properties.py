"""Property-based suite: both fused losses, both backends (PyTorch chunks; Triton, through the interpreter on
CPU), held to reference/ in float64 on whatever hypothesis draws: shapes (N = 0, 1, odd; V not a multiple
of a block; K = 1 or V; H_s != H_t), a strided layout per tensor argument, dtypes per model (fp64, fp32, bf16,
fp16, mixed), masks, num_items_in_batch, NaN in ignored rows, beta, temperature, softcaps, tail policies,
reductions, padded heads with vocab_size.

Tolerances are error bounds, not guesses: the fused path sees the same rounded inputs as the reference, so
what differs is its arithmetic (fp32 softmax math: about eps32 times the largest tempered logit per row, more
for a tail bucket whose mass 1 - sum(S_k) cancels) and the rounding of dLoss/dlogits and of the gradient
products to the input dtype. Each gradient element is checked against that bound, propagated through |W|
and |h| from the reference's own dLoss/dlogits.

Profiles (HYPOTHESIS_PROFILE): "ci" (default) is derandomized and bounded for 2 CPU cores; "gpu" draws more
and larger examples (several vocabulary and top-k tiles) for Triton compiled on CUDA.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from liger_patch_kd import KDLossConfig, fused_linear_jsd, fused_linear_topk_kd
from liger_patch_kd import reference as R

from .helpers import DEVICE, backends

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_QUIET = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
settings.register_profile(
    "ci", max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=_QUIET
)
settings.register_profile("gpu", max_examples=100, deadline=None, database=None, suppress_health_check=_QUIET)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
BIG = PROFILE == "gpu"  # vocabularies and top-k beyond one kernel tile (4096 / 1024): too slow interpreted
PROPERTY_SETTINGS = settings.get_profile(PROFILE)

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SMALLEST = {torch.float64: 0.0, torch.float32: 1e-45, torch.bfloat16: 1e-38, torch.float16: 2.0**-24}  # subnormals
LAYOUTS = ["contiguous", "transposed", "every_other"]
SAFETY = 4.0


def _layout(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values in another memory layout (a view, never a copy of the caller's tensor)."""
    if how == "transposed":
        return t.t().contiguous().t() if t.dim() == 2 else torch.stack([t, t], -1)[:, 0]
    if how == "every_other":
        return torch.stack([t, torch.zeros_like(t)], -1).flatten(-2)[..., ::2]
    return t


LAYOUT_NAMES = ("student_input", "student_weight", "student_bias", "labels", "teacher_a", "teacher_b")


@dataclass
class Case:
    kind: str
    n: int
    vocab: int
    pad_s: int
    pad_t: int
    h_s: int
    h_t: int
    k: int
    student_dtype: torch.dtype
    teacher_dtype: torch.dtype
    mask: str
    poison: bool
    num_items: str
    extra_items: int
    bias: bool
    give_vocab_size: bool
    layouts: dict
    cfg: KDLossConfig
    seed: int


def _mostly(common: st.SearchStrategy, *edges) -> st.SearchStrategy:
    """`common` three times in four, else one of the edge values: edges stay covered without crowding out the
    examples where everything interacts."""
    return st.one_of(common, common, common, st.sampled_from(edges))


@st.composite
def cases(draw, kind: str) -> Case:
    n = draw(_mostly(st.integers(2, 48), 0, 1))
    vocab = draw(st.integers(2, 300) | (st.integers(4097, 4500) | st.integers(301, 9000) if BIG else st.just(127)))
    give_vocab_size = draw(st.booleans())
    pad_s = draw(st.integers(0, 9)) if give_vocab_size else 0
    pad_t = draw(st.integers(0, 9)) if give_vocab_size and kind == "jsd" else pad_s
    k = draw(_mostly(st.integers(1, min(vocab, 1500 if BIG else 40)), 1, vocab))
    beta = draw(st.sampled_from([0.0, 1.0]) | st.floats(0.01, 0.99))
    reduction = draw(st.sampled_from(["batchmean", "sum", "none"]))
    hard_weight = draw(st.sampled_from([0.0, 0.5]))
    cfg = KDLossConfig(
        beta=beta,
        temperature=draw(st.sampled_from([1.0]) | st.floats(0.4, 3.0)),
        reduction=reduction,
        soft_weight=draw(st.sampled_from([1.0, 0.7])),
        hard_weight=hard_weight,
        softcap=draw(st.none() | st.floats(3.0, 30.0)),
        teacher_softcap=draw(st.none() | st.floats(3.0, 30.0)) if kind == "jsd" else None,
        tail=draw(st.sampled_from(["bucket", "renormalize", "none"])),
        chunk_size=draw(st.none() | st.integers(1, max(1, n))),
        fp32_weight_grad=draw(st.booleans()),
    )
    return Case(
        kind=kind,
        n=n,
        vocab=vocab,
        pad_s=pad_s,
        pad_t=pad_t,
        h_s=draw(st.integers(1, 24)),
        h_t=draw(st.integers(1, 24)),
        k=k,
        student_dtype=draw(st.sampled_from(DTYPES)),
        teacher_dtype=draw(st.sampled_from(DTYPES)),
        mask=draw(_mostly(st.just("random"), "none", "all", "no_labels")),
        poison=draw(st.booleans()),
        num_items=draw(_mostly(st.sampled_from(["none", "count", "tensor"]), "zero")),
        extra_items=draw(st.integers(0, 5)),
        bias=draw(st.booleans()),
        give_vocab_size=give_vocab_size,
        layouts={name: draw(st.sampled_from(LAYOUTS)) for name in LAYOUT_NAMES},
        cfg=cfg,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).to(torch.float64)


def _check_case(case: Case, backend: str) -> None:
    g = torch.Generator().manual_seed(case.seed)
    cfg = case.cfg
    n, vocab, k = case.n, case.vocab, case.k
    v_s, v_t = vocab + case.pad_s, vocab + case.pad_t

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    # the values both sides see: rounded once to each model's dtype, then the reference works in float64
    sd, td = case.student_dtype, case.teacher_dtype
    h64 = _rounded(rand(n, case.h_s), sd)
    w64 = _rounded(rand(v_s, case.h_s, scale=2.5 / case.h_s**0.5), sd)
    w64[vocab:] = _rounded(rand(case.pad_s, case.h_s, scale=10.0), sd)  # padding rows with large logits
    b64 = _rounded(rand(v_s, scale=0.5), sd) if case.bias else None
    labels = torch.randint(0, vocab, (n,), generator=g)
    if case.mask == "all":
        labels.fill_(-100)
    elif case.mask == "random":
        labels[torch.rand(n, generator=g) < 0.4] = -100
    ignored = labels == -100
    counted = int((~ignored).sum())
    num_items = {
        "none": None,
        "zero": 0,
        "count": counted + case.extra_items,
        "tensor": torch.tensor(counted + case.extra_items, device=DEVICE),
    }[case.num_items]
    give_labels = case.mask != "no_labels"
    if not give_labels:
        labels.fill_(0)
        ignored = torch.zeros(n, dtype=torch.bool)
        assume(not cfg.hard_weight)

    if case.kind == "jsd":
        ht64 = _rounded(rand(n, case.h_t), td)
        wt64 = _rounded(rand(v_t, case.h_t, scale=2.5 / case.h_t**0.5), td)
        wt64[vocab:] = _rounded(rand(case.pad_t, case.h_t, scale=10.0), td)
        teacher_logits = (ht64 @ wt64.T)[:, :vocab]
        teacher64 = (ht64, wt64)
    else:
        full = F.log_softmax(rand(n, vocab, scale=2.0), -1)
        lp, ids = full.topk(k, -1)
        perm = torch.rand(n, k, generator=g).argsort(-1)  # any slot order
        ids, lp = ids.gather(-1, perm), _rounded(lp.gather(-1, perm), td)
        teacher64 = (ids, lp)

    # what the fused call gets: each model's dtype, garbage in ignored rows, strided layouts
    def model_tensor(t64, dtype, name, poison_value=None, grad=False):
        t = t64.clone()
        if poison_value is not None and case.poison and t.shape[0] == n:
            t[ignored] = poison_value
        leaf = t.to(dtype=dtype, device=DEVICE).requires_grad_(grad)
        return leaf, _layout(leaf, case.layouts[name])

    h_leaf, h = model_tensor(h64, sd, "student_input", math.nan, grad=True)
    w_leaf, w = model_tensor(w64, sd, "student_weight", grad=True)
    b_leaf, b = model_tensor(b64, sd, "student_bias", grad=True) if case.bias else (None, None)
    _, lab = model_tensor(labels, labels.dtype, "labels")
    if case.kind == "jsd":
        _, t_a = model_tensor(teacher64[0], td, "teacher_a", math.inf)
        _, t_b = model_tensor(teacher64[1], td, "teacher_b")
    else:
        _, t_a = model_tensor(teacher64[0], torch.long, "teacher_a")
        _, t_b = model_tensor(teacher64[1], td, "teacher_b", math.nan)
    fused = fused_linear_jsd if case.kind == "jsd" else fused_linear_topk_kd
    loss = fused(
        h, w, t_a, t_b, lab if give_labels else None, student_bias=b, num_items_in_batch=num_items,
        config=KDLossConfig.build(cfg, vocab_size=vocab if case.give_vocab_size else None), backend=backend,
    )  # fmt: skip
    upstream = torch.rand(loss.shape, generator=g, dtype=torch.float64) + 0.5
    leaves = [t for t in (h_leaf, w_leaf, b_leaf) if t is not None]
    got = torch.autograd.grad((loss * upstream.to(loss)).sum(), leaves)

    # the reference on the sliced float64 logits; dLoss/dlogits from it carries the gradients to h, W, b
    s_logits = (h64 @ w64.T + (0 if b64 is None else b64))[:, :vocab].requires_grad_()
    ref_labels = labels if give_labels else None
    if case.kind == "jsd":
        expected = R.kd_loss(s_logits, teacher_logits, ref_labels, cfg, num_items)
    else:
        expected = R.topk_kd_loss(s_logits, *teacher64, ref_labels, cfg, num_items)
    (g_ref,) = torch.autograd.grad((expected * upstream).sum(), [s_logits])
    want = [g_ref @ w64[:vocab], F.pad(g_ref.T @ h64, (0, 0, 0, case.pad_s))]
    if case.bias:
        want.append(F.pad(g_ref.sum(0), (0, case.pad_s)))

    # error bounds
    all_fp64 = sd == torch.float64 and td == torch.float64
    eps = (1e-14 if backend == "torch" else 1e-7) if all_fp64 else 2.0**-24
    row_weight = _row_weights(labels, ignored, give_labels, cfg, num_items) * (cfg.soft_weight + cfg.hard_weight)
    row_scale = _logit_scale(s_logits.detach(), teacher_logits if case.kind == "jsd" else teacher64[1], cfg, vocab)
    tail_factor = torch.ones(n, dtype=torch.float64)
    if case.kind == "topk" and cfg.tail == "bucket" and not all_fp64:
        s_tail, p_tail = _tails(s_logits.detach(), *teacher64, cfg)
        # 1 - sum(S_k) cancels in fp32: its relative error is ~eps / S_tail (and the floor's kink must not be near)
        assume(bool(((s_tail > 1e-3) | ~row_weight.bool()).all()))
        # rows that weigh nothing need no bound: their S_tail may be 0 (K = V), and 0 * inf would make it NaN
        tail_factor = torch.where(row_weight.bool(), 1 + (1 + p_tail) / s_tail, 1.0)
    # fp32 accumulation of the logit products over H adds ~sqrt(H) eps of the logit scale
    row_err = SAFETY * eps * row_scale * tail_factor * (2 + math.sqrt(case.h_s + case.h_t))
    loss_err = row_weight.abs() * row_err
    if cfg.reduction != "none":
        loss_err = loss_err.sum()
    loss_diff = (loss.detach().double().cpu() - expected.detach()).abs()
    assert torch.all(loss_diff <= loss_err + 1e-12), (loss, expected, loss_err)

    u = UNIT_ROUNDOFF[sd]
    g_abs = g_ref.abs()
    g_bound = u * g_abs + row_err[:, None] * g_abs.amax(-1, keepdim=True) + SMALLEST[sd]
    chunks = -(-n // (cfg.chunk_size or max(n, 1)))
    acc = (2.0**-24 if sd != torch.float64 else eps) * (vocab + n)  # fp32 accumulation inside the products
    weight_rounds = 2.0**-24 if cfg.fp32_weight_grad and sd != torch.float64 else u
    bounds = [
        g_bound @ w64[:vocab].abs() + (u + acc) * (g_abs @ w64[:vocab].abs()),
        F.pad(g_bound.T @ h64.abs() + (acc + weight_rounds * chunks) * (g_abs.T @ h64.abs()), (0, 0, 0, case.pad_s)),
        F.pad(g_bound.sum(0) + acc * g_abs.sum(0), (0, case.pad_s)),
    ]
    for name, gt, wt, bound in zip(("input", "weight", "bias"), got, want, bounds):
        gt = gt.double().cpu()
        assert torch.isfinite(gt).all(), name
        err = (gt - wt).abs()
        limit = SAFETY * bound + u * wt.abs() + SMALLEST[sd]
        assert torch.all(err <= limit), (name, float((err - limit).max()), float(wt.abs().max()))
    assert torch.all(got[0].double().cpu()[ignored] == 0)  # ignored rows: exactly no gradient
    if case.pad_s:
        assert torch.all(got[1][vocab:] == 0)


def _row_weights(labels, ignored, give_labels, cfg: KDLossConfig, num_items) -> torch.Tensor:
    """Each row's share of the reduction, as the contract defines it (float64, on the CPU)."""
    valid = (~ignored).double() if give_labels else torch.ones(labels.shape[0], dtype=torch.float64)
    if cfg.reduction != "batchmean":
        return valid
    count = float(valid.sum()) if num_items is None else float(num_items)
    return valid / count if count > 0 else torch.zeros_like(valid)


def _logit_scale(student: torch.Tensor, teacher: torch.Tensor, cfg: KDLossConfig, vocab: int) -> torch.Tensor:
    """Per row, the size of the numbers the softmax math adds and exponentiates: fp32 errors scale with it."""
    s = R.apply_softcap(student, cfg.softcap)
    t = R.apply_softcap(teacher, cfg.teacher_softcap) if teacher.shape == student.shape else teacher.clamp(min=-1e3)
    scale = (s.abs().amax(-1) + t.abs().amax(-1)) / cfg.temperature + s.abs().amax(-1)
    return scale + math.log(vocab) + 4.0


def _tails(student: torch.Tensor, ids, logprobs, cfg: KDLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's and the teacher's tail-bucket masses per row, in float64."""
    capped = R.apply_softcap(student, cfg.softcap)
    valid, _, log_p_tail = R.tempered_topk_teacher(ids, logprobs, student.shape[-1], cfg.temperature)
    log_s = F.log_softmax(capped / cfg.temperature, -1).gather(-1, torch.where(valid, ids, 0).long())
    s_tail = 1 - torch.where(valid, log_s.exp(), 0).sum(-1)
    return s_tail, log_p_tail.exp()


@pytest.mark.parametrize("backend", backends())
@given(case=cases("jsd"))
@PROPERTY_SETTINGS
def test_fused_linear_jsd_matches_the_reference(backend, case):
    _check_case(case, backend)


# found by the "gpu" profile on an H200: K = V leaves no tail, and every row weighed 0 (num_items_in_batch=0)
_NO_TAIL_NO_ITEMS = Case(
    kind="topk", n=2, vocab=2, pad_s=0, pad_t=0, h_s=1, h_t=1, k=2, student_dtype=torch.float64,
    teacher_dtype=torch.float32, mask="random", poison=False, num_items="zero", extra_items=0, bias=False,
    give_vocab_size=False, layouts=dict.fromkeys(LAYOUT_NAMES, "contiguous"), cfg=KDLossConfig(beta=0.0), seed=0,
)  # fmt: skip


@pytest.mark.parametrize("backend", backends())
@given(case=cases("topk"))
@example(case=_NO_TAIL_NO_ITEMS)
@PROPERTY_SETTINGS
def test_fused_linear_topk_kd_matches_the_reference(backend, case):
    _check_case(case, backend)
