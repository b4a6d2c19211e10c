"""FP8 logit products inside the fused loss (KDLossConfig.teacher_logits_fp8 / student_logits_fp8, ops/fp8_logits.py).

Three kinds of check: the FP8 loss is exactly the loss of the dequantised operands (float64 reference, so the
implementation is tested to fp32 accuracy, not to FP8 accuracy); its error against the unquantised loss stays
within what e4m3 rounding allows (bounds derived in the tests' docstrings); and the refusals. On the CPU this
needs torch >= 2.13 (rowwise `torch._scaled_mm`)."""

import math

import pytest
import torch

import liger_patch_kd.ops.fp8_logits as FL
from liger_patch_kd import KDLossConfig, fused_linear_jsd, fused_linear_topk_kd
from liger_patch_kd import reference as R
from liger_patch_kd.ops.fp8 import fp8_available, quantize_rows_torch

from .helpers import DEVICE
from .test_fp8_teacher import cpu_torch_2_11  # noqa: F401  (the fixture)
from .test_trainer import _args, _dataset
from .tiny_models import tiny_model

CPU_FP8, CPU_WHY = fp8_available(torch.device("cpu"))
needs_fp8 = pytest.mark.skipif(not CPU_FP8, reason=CPU_WHY)
U = 2.0**-4  # e4m3 keeps 3 mantissa bits: round to nearest is off by at most 2^-4 of the value


def _inputs(n=41, hidden=64, vocab=301, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = dict(
        h_s=torch.randn(n, hidden, generator=g, dtype=torch.float64),
        w_s=torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 2 / hidden**0.5,
        h_t=torch.randn(n, hidden, generator=g, dtype=torch.float64),
        w_t=torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 2.5 / hidden**0.5,
        labels=torch.randint(0, vocab, (n,), generator=g),
    )
    x["labels"][::5] = -100
    x["b_s"] = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    x["b_t"] = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    return x


def _dequantised(m: torch.Tensor) -> torch.Tensor:
    return FL.dequantized(*quantize_rows_torch(m))


def _fused(x, dtype, cfg, *, grad=True):
    h_s = x["h_s"].to(dtype).requires_grad_(grad)
    w_s = x["w_s"].to(dtype).requires_grad_(grad)
    b_s = None if x["b_s"] is None else x["b_s"].to(dtype)
    b_t = None if x["b_t"] is None else x["b_t"].to(dtype)
    loss = fused_linear_jsd(h_s, w_s, x["h_t"].to(dtype), x["w_t"].to(dtype), x["labels"], student_bias=b_s,
                            teacher_bias=b_t, config=cfg)  # fmt: skip
    if not grad:
        return loss, None
    return loss, torch.autograd.grad(loss.sum(), [h_s, w_s])


def _reference(x, cfg, *, teacher_fp8=False, student_fp8=False):
    """Loss and (d/dh_s, d/dw_s) in float64 from the operands the FP8 path multiplies. The student's gradient is
    dL/dz at those logits chained through the unquantised head (the straight-through rule of the backward)."""
    h_t, w_t = (_dequantised(x["h_t"]), _dequantised(x["w_t"])) if teacher_fp8 else (x["h_t"], x["w_t"])
    h_s, w_s = (_dequantised(x["h_s"]), _dequantised(x["w_s"])) if student_fp8 else (x["h_s"], x["w_s"])
    z_s = (h_s @ w_s.T + (0 if x["b_s"] is None else x["b_s"])).requires_grad_()
    z_t = h_t @ w_t.T + (0 if x["b_t"] is None else x["b_t"])
    loss = R.kd_loss(z_s, z_t, x["labels"], cfg)
    (g,) = torch.autograd.grad(loss.sum(), [z_s])
    return loss.detach(), (g @ x["w_s"], g.T @ x["h_s"]), z_t


@needs_fp8
@pytest.mark.parametrize(
    "beta,temperature,bias", [(0.0, 1.0, False), (0.5, 1.0, True), (1.0, 2.0, False), (0.9, 0.7, True)]
)
@pytest.mark.parametrize("student_fp8", [False, True])
def test_fp8_loss_is_the_loss_of_the_dequantised_operands(beta, temperature, bias, student_fp8):
    """With the products in FP8 (fp32 accumulation) the loss and gradients equal float64 math on the dequantised
    operands, to fp32 accuracy: what the FP8 path computes is exactly that loss, nothing else changes."""
    x = _inputs(bias=bias)
    cfg = KDLossConfig(beta=beta, temperature=temperature, hard_weight=0.3, teacher_logits_fp8=True,
                       student_logits_fp8=student_fp8)  # fmt: skip
    loss, grads = _fused(x, torch.float32, cfg)
    ref_loss, ref_grads, _ = _reference(x, cfg, teacher_fp8=True, student_fp8=student_fp8)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=2e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=2e-6 * want.abs().max().item())


def test_the_fp8_loss_on_a_cpu_torch_that_refuses_rowwise_scales(cpu_torch_2_11):  # noqa: F811
    """torch 2.11's CPU product refuses rowwise scales: the logit products are then the dequantised operands' fp32
    product, and the loss is still float64 math on those operands, as above."""
    test_fp8_loss_is_the_loss_of_the_dequantised_operands(0.5, 2.0, True, True)


def _row_bound(eps: torch.Tensor, log_p: torch.Tensor, log_s: torch.Tensor, beta: float) -> torch.Tensor:
    """How far a row's generalized JSD can move when the teacher's tempered logits move by at most `eps` each.

    Every log P_j then moves by at most 2 eps (the logit and the log-sum-exp each by eps), so P'_j / P_j and
    M'_j / M_j lie in [e^-2eps, e^2eps]. Writing KL(P'||X') - KL(P||X) = sum (P' - P) log(P / X) + sum P' log(P'/P)
    - sum P' log(X'/X):
      beta = 0, KL(P||S):  |d| <= (e^2eps - 1) E_P|log P/S| + 2 eps
      beta = 1, KL(S||P):  |d| <= 2 eps
      otherwise:           |d| <= beta ((e^2eps - 1) E_P|log P/M| + 4 eps) + (1 - beta) 2 eps
    """
    grow = torch.expm1(2 * eps)
    p = log_p.exp()
    if beta == 0:
        return grow * (p * (log_p - log_s).abs()).sum(-1) + 2 * eps
    if beta == 1:
        return 2 * eps
    log_m = torch.logaddexp(math.log(beta) + log_p, math.log1p(-beta) + log_s)
    return beta * (grow * (p * (log_p - log_m).abs()).sum(-1) + 4 * eps) + (1 - beta) * 2 * eps


@needs_fp8
@pytest.mark.parametrize("beta,temperature", [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (0.5, 2.0)])
def test_teacher_fp8_error_within_what_e4m3_allows(beta, temperature):
    """Against the unquantised loss: (1) every teacher logit is within the worst case of e4m3 rounding,
    |dz| <= (2u + u^2) sum_k |h_k W_k| + (subnormal terms), u = 2^-4; (2) averaged over the hidden size the error is
    far smaller: independent roundings of mean 0 and variance <= u^2/3 of the value give rms(dz / sqrt(sum_k h_k^2
    W_k^2)) <= u sqrt(2/3); (3) each row's loss moves by at most `_row_bound` of its largest logit error."""
    x = _inputs(n=64, hidden=128, vocab=509, seed=1)
    cfg = KDLossConfig(beta=beta, temperature=temperature, reduction="none", teacher_logits_fp8=True)
    loss, _ = _fused(x, torch.float32, cfg, grad=False)
    exact = R.kd_loss(x["h_s"] @ x["w_s"].T, x["h_t"] @ x["w_t"].T, x["labels"], cfg)
    _, _, z_fp8 = _reference(x, cfg, teacher_fp8=True)
    z = x["h_t"] @ x["w_t"].T
    dz = (z_fp8 - z).abs()
    terms = x["h_t"].abs() @ x["w_t"].abs().T
    # |dh| <= u |h| + a and |dw| <= u |w| + b per element, with a, b half a subnormal step (2^-10 of the row's
    # scale amax / 448) and u = 2^-4 widened by the fp32 rounding of h / scale; so |d(h w)| <= (2u + u^2) |h w|
    # + (1 + u)(a |w| + b |h|) + a b, summed over k
    u = U + 2.0**-20
    a = 2.0**-10 * x["h_t"].abs().amax(-1, keepdim=True) / 448
    b = 2.0**-10 * x["w_t"].abs().amax(-1, keepdim=True) / 448
    hidden = x["h_t"].shape[1]
    subnormal = (1 + u) * (a * x["w_t"].abs().sum(-1) + x["h_t"].abs().sum(-1, keepdim=True) * b.T) + hidden * a * b.T
    assert (dz <= (2 * u + u * u) * terms + subnormal).all()
    rms_ratio = (dz.square() / (x["h_t"].square() @ x["w_t"].square().T)).mean().sqrt()
    assert rms_ratio <= U * math.sqrt(2 / 3)
    assert dz.amax() > 0  # the FP8 path did round
    eps = dz.amax(-1) / temperature
    log_p = torch.log_softmax(z / temperature, -1)
    log_s = torch.log_softmax(x["h_s"] @ x["w_s"].T / temperature, -1)
    counted = x["labels"] != cfg.ignore_index
    bound = _row_bound(eps, log_p, log_s, beta)[counted]
    assert ((loss.double() - exact)[counted].abs() <= bound + 1e-5).all()


@needs_fp8
def test_fp8_gradient_error_is_reported_and_small():
    """The gradient error of each option against the float64 unquantised gradient (printed with -s). The bound is
    loose on purpose (first order in the logit error, ~u sqrt(2/3) of a logit's typical size): a wiring mistake
    (a quantised operand in a backward product, a wrong scale) gives errors of order 1."""
    x = _inputs(n=64, hidden=128, vocab=509, seed=2)
    cfg = KDLossConfig(beta=0.5)
    _, exact = _reference(x, cfg)[:2]
    for opts in (dict(teacher_logits_fp8=True), dict(teacher_logits_fp8=True, student_logits_fp8=True)):
        _, grads = _fused(x, torch.float32, cfg.replace(**opts))
        errs = [float((g.double() - e).norm() / e.norm()) for g, e in zip(grads, exact)]
        print(f"{opts}: relative gradient error d/dh {errs[0]:.3g}, d/dW {errs[1]:.3g}")
        assert max(errs) < 0.2


@needs_fp8
def test_ignored_rows_and_no_items():
    """NaN in ignored rows reaches nothing (they are zeroed before quantisation), and num_items_in_batch=0 gives
    loss 0 and zero gradients with the FP8 products as without."""
    x = _inputs(seed=3)
    x["h_t"][x["labels"] == -100] = float("nan")
    x["h_s"][x["labels"] == -100] = float("nan")
    cfg = KDLossConfig(teacher_logits_fp8=True, student_logits_fp8=True)
    loss, grads = _fused(x, torch.float32, cfg)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    h_s = x["h_s"].float().requires_grad_()
    zero = fused_linear_jsd(h_s, x["w_s"].float(), x["h_t"].float(), x["w_t"].float(), x["labels"],
                            num_items_in_batch=0, config=cfg)  # fmt: skip
    zero.backward()
    assert zero.item() == 0 and (h_s.grad == 0).all()


@needs_fp8
def test_frozen_teacher_head_quantised_once_and_invalidated_on_change():
    w_t = torch.randn(301, 64)
    first = FL.quantize_head(w_t, 301, keep=True)
    assert FL.quantize_head(w_t, 301, keep=True) is first
    with torch.no_grad():
        w_t.mul_(2)  # an in-place update moves the version counter: the cached copy is stale
    second = FL.quantize_head(w_t, 301, keep=True)
    assert second is not first
    torch.testing.assert_close(second.scale, 2 * first.scale)
    trainable = torch.randn(301, 64, requires_grad=True)
    x = _inputs()
    fused_linear_jsd(x["h_s"].float(), x["w_s"].float(), x["h_t"].float(), trainable, x["labels"],
                     config=KDLossConfig(teacher_logits_fp8=True))  # fmt: skip
    assert not hasattr(trainable, "__liger_kd_fp8_head__")  # only a frozen head keeps its copy
    assert FL.quantize_head(torch.randn(301, 64), 301, keep=False).weight.shape == (304, 64)  # 16-row aligned


def test_refusals(monkeypatch):
    x = _inputs(hidden=64)
    args = (x["h_s"].float(), x["w_s"].float(), x["h_t"].float(), x["w_t"].float(), x["labels"])
    with pytest.raises(ValueError, match="teacher_logits_fp8 must be True or False"):
        KDLossConfig(teacher_logits_fp8=1)
    with pytest.raises(ValueError, match="student_logits_fp8=True .* estimator='k1'"):
        KDLossConfig(student_logits_fp8=True, estimator="k1", beta=1.0)
    monkeypatch.setattr(FL, "fp8_available", lambda device: (False, "no FP8 tensor cores on this test device"))
    with pytest.raises(ValueError, match="teacher_logits_fp8=True needs FP8 products.*no FP8 tensor cores"):
        fused_linear_jsd(*args, config=KDLossConfig(teacher_logits_fp8=True))
    monkeypatch.undo()
    if CPU_FP8:
        with pytest.raises(ValueError, match="hidden size that is a multiple of 16.*got hidden size 40"):
            fused_linear_jsd(
                *(t[..., :40] if t.dim() == 2 else t for t in args), config=KDLossConfig(student_logits_fp8=True)
            )
    ids, logprobs = torch.arange(4).repeat(41, 1), torch.full((41, 4), -2.0)
    with pytest.raises(ValueError, match="teacher_logits_fp8=True .* top-k teacher log-probs have no product"):
        fused_linear_topk_kd(args[0], args[1], ids, logprobs, x["labels"], config=KDLossConfig(teacher_logits_fp8=True))


@needs_fp8
def test_fp8_logits_on_the_cpu_say_once_that_they_are_emulated(monkeypatch, caplog):
    """teacher_logits_fp8 on the CPU runs the FP8 maths without FP8 tensor cores: said once, naming the option."""
    import liger_patch_kd.ops.fp8 as F8

    monkeypatch.setattr(F8, "_EMULATION_SAID", set())
    x = _inputs()
    with caplog.at_level("WARNING", logger="liger_patch_kd.ops.fp8"):
        for _ in range(2):
            _fused(x, torch.float32, KDLossConfig(teacher_logits_fp8=True), grad=False)
    said = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("fp8 emulated on cpu: no speed-up (teacher_logits_fp8's logit"), said


def test_training_arguments_carry_the_options(tmp_path):
    cfg = _args(tmp_path, use_kd_patch=True, kd_teacher_logits_fp8=True, kd_student_logits_fp8=True).kd_loss_config()
    assert cfg.teacher_logits_fp8 and cfg.student_logits_fp8
    assert not _args(tmp_path).kd_loss_config().teacher_logits_fp8


@needs_fp8
@pytest.mark.usefixtures("clean_patches")
def test_trainer_with_fp8_logits(tmp_path):
    """KDTrainer.train() with bf16=True and gradient accumulation: the FP8 teacher logits train as the bf16 ones."""
    from liger_patch_kd.trainer import KDTrainer

    losses = {}
    for fp8 in (False, True):
        trainer = KDTrainer(
            model=tiny_model("llama", dtype=torch.float32, seed=1),
            teacher_model=tiny_model("llama", dtype=torch.bfloat16, seed=2, hidden=96),
            args=_args(
                tmp_path,
                use_kd_patch=True,
                max_steps=3,
                bf16=True,
                gradient_accumulation_steps=2,
                kd_teacher_logits_fp8=fp8,
            ),  # fmt: skip
            train_dataset=_dataset(),
        )
        trainer.train()
        losses[fp8] = torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert torch.isfinite(losses[True]).all() and not torch.equal(losses[True], losses[False])
    torch.testing.assert_close(losses[True], losses[False], rtol=5e-2, atol=1e-3)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_jsd_kernels_read_bf16_teacher_logits(beta, grad_dtype):
    """On CUDA the rowwise FP8 product may only write bf16, and the Triton loss kernel then reads those bf16 teacher
    logits as they are (a bf16 gradient overwrites them in place): both kernels equal float64 math on the same
    values. (CPU: the Triton interpreter, which truncates fp32 to bf16 where the GPU rounds: one bf16 step.)"""
    from liger_patch_kd.ops.backend import triton_available
    from liger_patch_kd.ops.fused_linear_jsd import jsd_chunk_torch, jsd_chunk_triton

    g = torch.Generator().manual_seed(4)
    zs = torch.randn(7, 301, generator=g) * 2
    zt = (torch.randn(7, 301, generator=g) * 2.5).bfloat16()
    labels = torch.randint(0, 301, (7,), generator=g)
    w = torch.full((7,), 0.25)
    cfg = KDLossConfig(beta=beta, temperature=1.5, hard_weight=0.3)
    want = jsd_chunk_torch(zs.double(), zt.double(), labels, w, w, torch.float64, cfg)
    kernels = [jsd_chunk_torch] + ([jsd_chunk_triton] if triton_available() else [])
    for kernel in kernels:  # on the device the Triton kernel runs on (interpreted on a CPU)
        args = (t.to(DEVICE) for t in (zs, zt.clone(), labels, w, w))
        soft, hard, grad = (t.cpu() for t in kernel(*args, grad_dtype, cfg))
        torch.testing.assert_close(soft.double(), want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(hard.double(), want[1], rtol=1e-5, atol=1e-6)
        step = 2.0**-7 if grad_dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(grad.double(), want[2], rtol=step, atol=step * want[2].abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA FP8 product is checked on a GPU")
@pytest.mark.parametrize("beta,temperature", [(0.0, 1.0), (0.5, 2.0), (1.0, 1.0)])
def test_cuda_fp8_loss_against_the_dequantised_operands(beta, temperature):
    """On the GPU (Triton quantisation, cuBLAS / CUTLASS FP8 products, bf16 inputs): the loss against float64 math on
    the dequantised operands, within what the product's accumulation and output rounding allow (through
    `_row_bound`), and the gradients within bf16 accuracy of that reference."""
    ok, why = fp8_available(torch.device("cuda"))
    if not ok:
        pytest.skip(why)
    x = {k: (None if v is None else v.cuda()) for k, v in _inputs(n=300, hidden=256, vocab=4099, seed=5).items()}
    x.update({k: x[k].bfloat16().double() for k in ("h_s", "w_s", "h_t", "w_t")})  # the values the GPU sees
    cfg = KDLossConfig(beta=beta, temperature=temperature, reduction="none", teacher_logits_fp8=True)
    h_s, w_s = x["h_s"].bfloat16().requires_grad_(), x["w_s"].bfloat16().requires_grad_()
    loss = fused_linear_jsd(h_s, w_s, x["h_t"].bfloat16(), x["w_t"].bfloat16(), x["labels"], config=cfg)
    grads = torch.autograd.grad(loss.sum(), [h_s, w_s])
    want, want_grads, z_t = _reference(x, cfg, teacher_fp8=True)
    counted = x["labels"] != cfg.ignore_index
    # Hopper's FP8 tensor cores accumulate with fewer bits than fp32: a step (2^-8) of the terms' magnitudes, and
    # one of the logit for a bf16 output (as test_fp8_teacher bounds the decoder's products)
    terms = _dequantised(x["h_t"]).abs() @ _dequantised(x["w_t"]).abs().T
    eps = (2.0**-8 * (terms + z_t.abs())).amax(-1) / temperature
    log_p = torch.log_softmax(z_t / temperature, -1)
    log_s = torch.log_softmax(x["h_s"] @ x["w_s"].T / temperature, -1)
    bound = _row_bound(eps, log_p, log_s, beta)
    assert ((loss.double() - want).abs()[counted] <= bound[counted] + 1e-4).all()
    for got, ref in zip(grads, want_grads):
        assert float((got.double() - ref).norm() / ref.norm()) < 2e-2
