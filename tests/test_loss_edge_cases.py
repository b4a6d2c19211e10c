"""Inputs a hostile user (or a padded batch) brings: no items, strided views, NaN padding, repeated top-k ids,
mixed model dtypes, bad on-policy log-probs. Each ends in the reference's value or a clear ValueError."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from liger_patch_kd import KDLossConfig, fused_linear_jsd, fused_linear_topk_kd, kl_estimator, topk_kd_from_logprobs
from liger_patch_kd import reference as R

from .helpers import DEVICE, backends, grads, make_pair

TOL = {"torch": dict(rtol=1e-10, atol=1e-12), "triton": dict(rtol=1e-6, atol=1e-8)}
K = 6


def _topk(teacher_logits: torch.Tensor, k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs, ids = F.log_softmax(teacher_logits.detach().double(), -1).topk(k, -1)
    return ids, logprobs


def _fused(kind, h, w, teacher, labels, cfg, backend, **kw):
    """The fused loss of `kind` ("jsd": teacher = (h_t, w_t); "topk": teacher = (ids, logprobs))."""
    fn = fused_linear_jsd if kind == "jsd" else fused_linear_topk_kd
    return fn(h, w, *teacher, labels, config=cfg, backend=backend, **kw)


def _reference(kind, h, w, teacher, labels, cfg, num_items_in_batch=None):
    if kind == "jsd":
        h_t, w_t = teacher
        return R.kd_loss(h @ w.T, h_t @ w_t.T, labels, cfg, num_items_in_batch)
    return R.topk_kd_loss(h @ w.T, *teacher, labels, cfg, num_items_in_batch)


def _teacher(kind, pair):
    return (pair.teacher_input, pair.teacher_weight) if kind == "jsd" else _topk(pair.teacher_logits())


# ------------------------------------------------------------------------------------ item 1: no items at all
@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("kind", ["jsd", "topk"])
@pytest.mark.parametrize("num_items", [0, "tensor0"])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "none"])
def test_every_label_ignored_with_zero_items_gives_zero_loss_and_grads(backend, kind, num_items, reduction):
    """The Trainer passes num_items_in_batch=0 for a micro-batch whose labels are all ignored: 0, not 0 / 0."""
    pair = make_pair(n=7, vocab=53, ignore_every=0, device=DEVICE)
    pair.labels.fill_(-100)
    n_items = torch.tensor(0, device=DEVICE) if num_items == "tensor0" else 0
    cfg = KDLossConfig(reduction=reduction, hard_weight=0.5, chunk_size=3)
    teacher = _teacher(kind, pair)
    loss = _fused(kind, pair.student_input, pair.student_weight, teacher, pair.labels, cfg, backend,
                  num_items_in_batch=n_items)  # fmt: skip
    assert torch.all(loss == 0)
    for g in grads(loss.sum(), pair.params()):
        assert torch.all(g == 0)
    expected = _reference(kind, pair.student_input, pair.student_weight, teacher, pair.labels, cfg, n_items)
    assert torch.all(expected == 0)
    for g in grads(expected.sum(), pair.params()):
        assert torch.all(g == 0)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("kind", ["jsd", "topk"])
def test_zero_items_with_counted_rows_is_zero_and_negative_count_is_refused(backend, kind):
    """num_items_in_batch = 0 means nothing to average over, whatever the labels say: the loss is 0."""
    pair = make_pair(n=5, vocab=31, device=DEVICE)
    teacher = _teacher(kind, pair)
    cfg = KDLossConfig(chunk_size=2)
    loss = _fused(kind, pair.student_input, pair.student_weight, teacher, pair.labels, cfg, backend,
                  num_items_in_batch=0)  # fmt: skip
    assert loss.item() == 0.0 and all(torch.all(g == 0) for g in grads(loss, pair.params()))
    assert _reference(kind, pair.student_input, pair.student_weight, teacher, pair.labels, cfg, 0).item() == 0.0
    with pytest.raises(ValueError, match="num_items_in_batch"):
        _fused(kind, pair.student_input, pair.student_weight, teacher, pair.labels, cfg, backend,
               num_items_in_batch=-1)  # fmt: skip


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("kind", ["jsd", "topk"])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "none"])
def test_no_rows_at_all(backend, kind, reduction):
    pair = make_pair(n=0, vocab=29, device=DEVICE)
    teacher = (
        (pair.teacher_input, pair.teacher_weight) if kind == "jsd" else _topk(torch.zeros(0, 29, device=DEVICE), 4)
    )
    cfg = KDLossConfig(reduction=reduction, hard_weight=0.5)
    loss = _fused(kind, pair.student_input, pair.student_weight, teacher, pair.labels, cfg, backend)
    assert loss.shape == ((0,) if reduction == "none" else ())
    assert torch.all(loss == 0)
    for g, p in zip(grads(loss.sum(), pair.params()), pair.params()):
        assert g.shape == p.shape and torch.all(g == 0)
    expected = _reference(kind, pair.student_input, pair.student_weight, teacher, pair.labels, cfg)
    assert expected.shape == loss.shape and torch.all(expected == 0)


# ------------------------------------------------------------------------------ item 2: strided tensor views
def _strided(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as `t` in a non-contiguous layout."""
    if how == "transposed":  # column-major, as a topk result seen through .t().contiguous().t()
        return t.t().contiguous().t() if t.dim() == 2 else torch.stack([t, t, t], -1)[:, 0]
    if how == "every_other":  # a stride-2 slice of a wider tensor
        wide = torch.stack([t, torch.zeros_like(t)], dim=-1).flatten(-2)
        return wide[..., ::2]
    raise ValueError(how)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("kind", ["jsd", "topk"])
@pytest.mark.parametrize("how", ["transposed", "every_other"])
@pytest.mark.parametrize("group", [None, 14])  # 14: gradient groups of two 7-row chunks, the last group short
def test_non_contiguous_inputs_give_the_reference(backend, kind, how, group):
    pair = make_pair(n=19, h_s=9, h_t=7, vocab=83, bias=True, device=DEVICE)
    pair.teacher_bias = None
    teacher = tuple(_strided(t, how) for t in _teacher(kind, pair))
    h, w, b, labels = (_strided(t, how) for t in (*pair.params(), pair.labels))
    assert not any(t.is_contiguous() for t in (h, w, b, labels, *teacher))
    cfg = KDLossConfig(beta=0.3, temperature=1.4, hard_weight=0.5, chunk_size=7, grad_chunk_size=group)
    loss = _fused(kind, h, w, teacher, labels, cfg, backend, student_bias=b)
    logits = h @ w.T + b
    if kind == "jsd":
        expected = R.kd_loss(logits, teacher[0] @ teacher[1].T, labels.contiguous(), cfg)
    else:
        expected = R.topk_kd_loss(logits, *(t.contiguous() for t in teacher), labels.contiguous(), cfg)
    torch.testing.assert_close(loss, expected, **TOL[backend])
    for g, e in zip(grads(loss, [h, w, b]), grads(expected, [h, w, b])):
        torch.testing.assert_close(g, e, **TOL[backend])


@pytest.mark.parametrize("backend", backends())
def test_expanded_topk_data_and_labels(backend):
    """One teacher row broadcast to every row (stride 0), as a test or a constant prior would pass it."""
    pair = make_pair(n=9, vocab=47, device=DEVICE)
    ids, logprobs = _topk(pair.teacher_logits()[:1])
    ids, logprobs = ids.expand(9, K), logprobs.expand(9, K)
    labels = pair.labels[2:3].expand(9)
    cfg = KDLossConfig(hard_weight=0.3, chunk_size=4)
    loss = fused_linear_topk_kd(pair.student_input, pair.student_weight, ids, logprobs, labels, config=cfg,
                                backend=backend)  # fmt: skip
    expected = R.topk_kd_loss(pair.student_logits(), ids.contiguous(), logprobs.contiguous(), labels.contiguous(), cfg)
    torch.testing.assert_close(loss, expected, **TOL[backend])


# ------------------------------------------------------------------------------ item 3: NaN in ignored rows
@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("kind", ["jsd", "topk"])
@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_garbage_in_ignored_rows_touches_nothing(backend, kind, poison):
    pair = make_pair(n=13, vocab=61, bias=True, ignore_every=3, device=DEVICE)
    pair.teacher_bias = None
    teacher = _teacher(kind, pair)
    cfg = KDLossConfig(beta=0.5, hard_weight=0.4, chunk_size=5)
    ignored = pair.labels == -100
    h = pair.student_input.detach().clone()
    h[ignored] = poison
    h.requires_grad_()
    if kind == "jsd":
        h_t = teacher[0].clone()
        h_t[ignored] = poison
        poisoned_teacher = (h_t, teacher[1])
    else:
        ids, lp = teacher[0].clone(), teacher[1].clone()
        lp[ignored] = math.nan  # rows that do not count are neither checked nor read
        ids[ignored] = 10**6
        poisoned_teacher = (ids, lp)
    params = [h, pair.student_weight, pair.student_bias]
    loss = _fused(kind, h, pair.student_weight, poisoned_teacher, pair.labels, cfg, backend,
                  student_bias=pair.student_bias)  # fmt: skip
    # the expected value does not depend on the ignored rows at all: the reference on the clean inputs
    clean = [pair.student_input, pair.student_weight, pair.student_bias]
    logits = clean[0] @ clean[1].T + clean[2]
    if kind == "jsd":
        expected = R.kd_loss(logits, pair.teacher_logits(), pair.labels, cfg)
    else:
        expected = R.topk_kd_loss(logits, *teacher, pair.labels, cfg)
    torch.testing.assert_close(loss, expected, **TOL[backend])
    got, want = grads(loss, params), grads(expected, clean)
    assert torch.all(got[0][ignored] == 0)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, **TOL[backend])


# ---------------------------------------------------------------------------- item 8: repeated top-k ids
@pytest.mark.parametrize("backend", backends())
def test_repeated_ids_in_a_counted_row_are_refused(backend):
    pair = make_pair(n=6, vocab=40, ignore_every=0, device=DEVICE)
    ids, logprobs = _topk(pair.teacher_logits())
    dup = ids.clone()
    dup[3, 4] = dup[3, 1]
    with pytest.raises(ValueError, match="repeats an id"):
        fused_linear_topk_kd(pair.student_input, pair.student_weight, dup, logprobs, pair.labels, backend=backend)


@pytest.mark.parametrize("backend", backends())
def test_repeats_among_padding_slots_or_in_ignored_rows_are_fine(backend):
    pair = make_pair(n=6, vocab=40, ignore_every=0, device=DEVICE)
    ids, logprobs = _topk(pair.teacher_logits())
    ids, logprobs = ids.clone(), logprobs.clone()
    ids[0, 3:] = -1  # negative ids: padding
    logprobs[1, 2:] = -9999.0  # vLLM padding: the ids there (any values, repeated) are not data
    ids[1, 2:] = ids[1, 0]
    ids[2, 5] = ids[2, 0]  # a repeat in a row that does not count
    labels = pair.labels.clone()
    labels[2] = -100
    loss = fused_linear_topk_kd(pair.student_input, pair.student_weight, ids, logprobs, labels, backend=backend)
    torch.testing.assert_close(loss, R.topk_kd_loss(pair.student_logits(), ids, logprobs, labels), **TOL[backend])


# ------------------------------------------------------------------------------ item 9: each model's dtype
@pytest.mark.parametrize("backend", backends())
def test_fp16_student_with_bf16_teacher_beyond_fp16_range(backend):
    """The teacher's hidden states exceed fp16's 65504: its product must not be cast to the student's fp16."""
    pair = make_pair(n=12, h_s=16, h_t=8, vocab=70, device=DEVICE)
    h_s = pair.student_input.detach().half().requires_grad_()
    w_s = pair.student_weight.detach().half().requires_grad_()
    h_t = (pair.teacher_input * 1e5).bfloat16()
    w_t = (pair.teacher_weight * 1e-5).bfloat16()
    assert h_t.abs().max() > 65504
    cfg = KDLossConfig(beta=0.5, chunk_size=5)
    loss = fused_linear_jsd(h_s, w_s, h_t, w_t, pair.labels, config=cfg, backend=backend)
    assert torch.isfinite(loss)
    teacher_logits = h_t.double() @ w_t.double().T
    h64, w64 = h_s.detach().double().requires_grad_(), w_s.detach().double().requires_grad_()
    expected = R.kd_loss(h64 @ w64.T, teacher_logits, pair.labels, cfg)
    assert abs(loss.item() - expected.item()) < 1e-3 * expected.item()
    for g, e in zip(grads(loss, [h_s, w_s]), grads(expected, [h64, w64])):
        assert g.dtype == torch.float16 and torch.isfinite(g).all()
        assert (g.double() - e).norm() < 1e-2 * e.norm()


# ------------------------------------------------------------------------ item 10: on-policy log-prob checks
BAD_LOGPROBS = [(math.nan, "NaN"), (math.inf, "values > 0"), (0.5, "values > 0")]


@pytest.mark.parametrize("value,needle", BAD_LOGPROBS)
@pytest.mark.parametrize("side", ["student", "teacher"])
def test_kl_estimator_refuses_what_is_not_a_log_prob(value, needle, side):
    q, p = torch.full((4,), -1.0), torch.full((4,), -2.0)
    (q if side == "student" else p)[2] = value
    with pytest.raises(ValueError, match=f"{side}_logprobs contains {needle}"):
        kl_estimator(q, p)
    mask = torch.tensor([1, 1, 0, 1])  # the same value on a token that does not count is never read
    assert torch.isfinite(kl_estimator(q, p, mask=mask))


def test_kl_estimator_student_minus_inf_is_refused():
    with pytest.raises(ValueError, match="cannot have sampled"):
        kl_estimator(torch.tensor([-1.0, -math.inf]), torch.tensor([-1.0, -2.0]))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimator_teacher_minus_inf(kind):
    """A token the teacher rules out: +inf without clamp; with clamp its log-ratio is -clamp, no gradient."""
    q = torch.tensor([-1.0, -0.5], dtype=torch.float64, requires_grad=True)
    p = torch.tensor([-1.5, -math.inf], dtype=torch.float64)
    terms = kl_estimator(q, p, kind, clamp=3.0, reduction="none")
    expected_second = {"k1": 3.0, "k2": 4.5, "k3": math.exp(-3.0) + 3.0 - 1}[kind]
    assert terms[1].item() == pytest.approx(expected_second)
    (g,) = torch.autograd.grad(terms.sum(), [q])
    assert torch.isfinite(g).all() and g[1].item() == 0.0
    assert math.isinf(kl_estimator(q, p, kind, reduction="none")[1].item())


@pytest.mark.parametrize("value,needle", BAD_LOGPROBS)
@pytest.mark.parametrize("side", ["student", "teacher"])
def test_topk_from_logprobs_refuses_what_is_not_a_log_prob(value, needle, side):
    q = F.log_softmax(torch.randn(3, 10), -1)[:, :4].clone()
    p = F.log_softmax(torch.randn(3, 10), -1)[:, :4].clone()
    (q if side == "student" else p)[1, 2] = value
    with pytest.raises(ValueError, match=f"{side}_logprobs contains {needle}"):
        topk_kd_from_logprobs(q, p)
    q.requires_grad_()
    loss = topk_kd_from_logprobs(q, p, mask=torch.tensor([1, 0, 1]))
    (g,) = torch.autograd.grad(loss, [q])
    assert torch.isfinite(loss) and torch.isfinite(g).all() and torch.all(g[1] == 0)


# ------------------------------------------------------------------------------- interpreter quietness
@pytest.mark.skipif("triton" not in backends(), reason="needs triton")
@pytest.mark.parametrize("tail", ["bucket", "renormalize", "none"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_topk_kernel_computes_no_inf_minus_inf(tail, beta):
    """Padding slots, rows without teacher data and K = V (no tail) must not evaluate -inf - -inf or log(0):
    harmless after the select on a GPU, but each is a RuntimeWarning from the interpreter."""
    pair = make_pair(n=4, vocab=12, ignore_every=0, device=DEVICE)
    ids, logprobs = _topk(pair.teacher_logits(), 12)
    ids, logprobs = ids.clone(), logprobs.clone()
    logprobs[0, 5:] = -math.inf
    logprobs[1, :] = -math.inf
    ids[2, 3:] = -1
    cfg = KDLossConfig(beta=beta, tail=tail, hard_weight=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        loss = fused_linear_topk_kd(pair.student_input, pair.student_weight, ids, logprobs, pair.labels,
                                    config=cfg, backend="triton")  # fmt: skip
        grads(loss, pair.params())


@pytest.mark.parametrize(
    "n_rows,vocab,bytes_per_logit,expected",
    [
        (8192, 128256, 8, 1024),  # eight aligned chunks of a Llama-3 vocabulary under the 1 GiB budget
        (2048, 128256, 8, 1024),
        (16384, 128256, 8, 1024),
        (8192, 151936, 8, 820),  # Qwen2.5: 10 equal chunks (896 rows would not fit)
        (300, 128256, 8, 300),  # fewer rows than a chunk: one chunk of exactly N
    ],
)
def test_gpu_chunk_rows_stay_under_one_gib(monkeypatch, n_rows, vocab, bytes_per_logit, expected):
    """choose_chunk_size's GPU rule, with the free memory faked: equal chunks, multiples of 128 rows where they
    fit, and a chunk's (rows x V) buffers at most the budget that keeps a call's own memory under 1 GiB."""
    from liger_patch_kd.ops import chunked

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 141 << 30))
    rows = chunked.choose_chunk_size(n_rows, vocab, torch.device("cuda"), bytes_per_logit)
    assert rows == expected
    assert rows * vocab * bytes_per_logit <= chunked._GPU_CHUNK_BYTES < 1 << 30
    assert -(-n_rows // rows) * rows - n_rows < rows  # no chunk is empty


@pytest.mark.parametrize(
    "n_rows,vocab,expected",
    [
        (8192, 128256, (512, 2048)),  # four groups of four 512-row chunks in the budget a plain chunk of 1024 had
        (2048, 128256, (512, 2048)),
        (3000, 128256, (512, 1536)),  # two equal groups of whole chunks
        (1000, 128256, (1000, 1000)),  # one plain chunk holds every row: nothing to gather
        (8192, 262144, (482, 482)),  # no room for two chunks' gradients beside a 512-row chunk: plain chunks
        (65536, 32000, (4096, 4096)),  # plain chunks of 4096 rows: their products gain nothing from groups
        (8192, 151936, (512, 1024)),
        (2049, 128256, (384, 1152)),  # two groups of three equal chunks, none of a single row
    ],
)
def test_gpu_gradient_groups_fit_the_same_budget(monkeypatch, n_rows, vocab, expected):
    """plan_chunk_rows's GPU rule with an fp32 weight gradient, free memory faked: a 512-row chunk's fp32 student and
    teacher logits (8 bytes a logit) beside a group of bf16 gradients (2 bytes), together within the budget one plain
    chunk has."""
    from liger_patch_kd.ops import chunked

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 141 << 30))
    rows, group = chunked.plan_chunk_rows(n_rows, vocab, torch.device("cuda"), 8, 8, 2, fp32_weight_grad=True)
    assert (rows, group) == expected
    # with the weight's own (bf16) gradient, groups do not pay: the plain chunk
    plain = chunked.choose_chunk_size(n_rows, vocab, torch.device("cuda"), 8)
    assert chunked.plan_chunk_rows(n_rows, vocab, torch.device("cuda"), 8, 8, 2) == (plain, plain)
    # nor without a gradient to gather (evaluation, no_grad): smaller chunks would buy nothing
    no_grad = chunked.plan_chunk_rows(n_rows, vocab, torch.device("cuda"), 8, 8, 2, fp32_weight_grad=True,
                                      needs_grad=False)  # fmt: skip
    assert no_grad == (plain, plain)
    assert group % rows == 0
    held = rows * vocab * 8 + (group * vocab * 2 if group > rows else 0)
    assert held <= chunked._GPU_CHUNK_BYTES < 1 << 30


@pytest.mark.parametrize(
    "n_rows,group,expected",
    [
        (8192, 2048, (512, 2048)),  # four equal chunks fit beside a 2048-row group
        (8192, 1009, (505, 1010)),  # two chunks: a group no chunk divides is rounded up by a row, never 1-row chunks
        (300, 4096, (300, 300)),  # never more than the rows there are
    ],
)
def test_a_given_gradient_group_is_split_into_equal_chunks_that_fit_beside_it(monkeypatch, n_rows, group, expected):
    from liger_patch_kd.ops import chunked

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 141 << 30))
    rows, got = chunked.plan_chunk_rows(n_rows, 128256, torch.device("cuda"), 8, 8, 2, grad_chunk_size=group)
    assert (rows, got) == expected
    assert got % rows == 0 and rows * 128256 * 8 + got * 128256 * 2 <= chunked._GPU_CHUNK_BYTES


def test_gradient_groups_are_refused_by_a_loss_whose_kernel_cannot_write_into_one():
    """The multi-teacher loss folds its teachers in a kernel of its own: grad_chunk_size is refused by name, not
    ignored; on the CPU an automatic plan never groups."""
    from liger_patch_kd import fused_linear_multi_teacher_jsd
    from liger_patch_kd.ops import chunked

    h = torch.randn(6, 4, dtype=torch.float64)
    w = torch.randn(10, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="grad_chunk_size=4 gathers the gradients.*leave grad_chunk_size=None"):
        mixture = torch.tensor([0.5, 0.5], dtype=torch.float64)
        fused_linear_multi_teacher_jsd(h, w, [h, h], [w, w], mixture, torch.zeros(6, dtype=torch.long),
                                       config=KDLossConfig(grad_chunk_size=4))  # fmt: skip
    assert chunked.plan_chunk_rows(100000, 128256, torch.device("cpu"), 8, 8, 2, fp32_weight_grad=True) == (32, 32)
