"""The fused Gumbel-max kernel (generation/sampling_kernel.py), on CPU through the Triton interpreter (compiled, on
a GPU machine: every tensor here is made on the suite's device).

The kernel's random numbers are its own (Philox), so the draws are checked as distributions: chi-square goodness of
fit against softmax(logits / T), independence across steps and rows, and the rates of low-mass tokens. Shapes are
kept to a few dozen programs a call: the interpreter's cost is per program (~25 ms), not per element.
"""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from liger_patch_kd.generation import sampling_kernel  # noqa: E402
from liger_patch_kd.generation.sampling_kernel import gumbel_argmax  # noqa: E402

from .helpers import DEVICE  # noqa: E402

Z_1E4 = 3.719  # the standard normal's upper 1e-4 quantile


@pytest.fixture(autouse=True)
def _on_the_suites_device():
    with torch.device(DEVICE):
        yield


def chi2_critical(dof: int) -> float:
    """The chi-square upper 1e-4 critical value, by Wilson-Hilferty (chi2/dof)^(1/3) ~ normal; within ~1% of the
    exact value for dof >= 5. A correct kernel fails one such check with probability ~1e-4 (and the seeds are fixed,
    so a pass is a pass every run)."""
    return dof * (1 - 2 / (9 * dof) + Z_1E4 * math.sqrt(2 / (9 * dof))) ** 3


def chi2_statistic(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of observed counts against probabilities; bins expected below 5 (where
    the chi-square approximation fails) are pooled into one."""
    n = counts.sum().item()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    if exp[-1] < 5:  # too little pooled mass to test on its own: fold it into the largest bin
        big = exp[:-1].argmax()
        obs[big] += obs[-1]
        exp[big] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    return ((obs - exp) ** 2 / exp).sum().item(), len(exp) - 1


def counter(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_softmax_chi_square(temperature):
    """4096 rows of the same 24 logits (one call, a draw per row) fit softmax(logits / T). The logits come from a
    seeded CPU generator: the device's own stream would give other values, some too unlikely for 10 tested bins."""
    logits = (torch.randn(24, generator=torch.Generator().manual_seed(2), device="cpu") * 2).to(DEVICE)
    draws = gumbel_argmax(logits.expand(4096, 24), counter(11), counter(3), temperature=temperature)
    assert draws.dtype == torch.int64 and draws.shape == (4096,)
    stat, dof = chi2_statistic(torch.bincount(draws, minlength=24), (logits.double() / temperature).softmax(-1))
    assert dof >= 10 and stat < chi2_critical(dof), (stat, dof)


def test_matches_softmax_across_blocks():
    """V=300 spans two column blocks: the mass sits on ids either side of the block boundary (256) and at both
    ends, so a wrong cross-block reduction or id offset shows as a misfit."""
    logits = torch.full((300,), -4.0)
    logits[[0, 3, 100, 255, 256, 257, 299]] = torch.tensor([1.0, 0.5, 1.5, 1.0, 2.0, 0.0, 1.2])
    draws = gumbel_argmax(logits.repeat(512, 1), counter(5), counter(0))
    stat, dof = chi2_statistic(torch.bincount(draws, minlength=300), logits.double().softmax(-1))
    assert dof >= 6 and stat < chi2_critical(dof), (stat, dof)


def test_low_mass_token_rate():
    """A token trailing by 8 nats (p = 1 / (1 + e**8) = 3.35e-4) over 131072 rows: the count is binomial, mean 44,
    sd 6.6; 5 sd either side fails a correct kernel with probability ~6e-7, and noise capped below 8 draws none."""
    rows = 131072
    logits = torch.tensor([[0.0, -8.0]]).expand(rows, 2)
    hits = gumbel_argmax(logits, counter(7), counter(1)).sum().item()
    p = 1 / (1 + math.exp(8))
    assert abs(hits - rows * p) < 5 * math.sqrt(rows * p * (1 - p)), hits


@triton.jit
def _noise_kernel(hi_ptr, lo_ptr, noise_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    hi = tl.load(hi_ptr + i).to(tl.uint32, bitcast=True)
    lo = tl.load(lo_ptr + i).to(tl.uint32, bitcast=True)
    tl.store(noise_ptr + i, sampling_kernel._gumbel_noise(hi, lo))


def test_noise_is_float64_gumbel_noise_of_52_bit_uniforms():
    """The noise is -log(-log u) of u = (m + 0.5) * 2**-52, m the 52 top bits of (hi, lo), as float64 computes it:
    never infinite, up to 36.7 at u = 1 - 2**-53 (float32 uniforms stop at ~16.6: a token trailing the top score by
    more than ~21 nats could never be drawn; here up to ~36, as sampling.draw's float64), down to -3.6 at u = 2**-53,
    and near either end of (0, 1) and at 1/2, where the kernel changes formula. The bound, absolute: t, s and
    the series each carry a few 2**-24 of relative error into E, which -log turns into as much absolute error, and
    the result is rounded to float32 (2**-24 |noise|, up to 2**-19 at 36.7) after a log within an ulp: 2**-21
    + 2**-22 |noise| allowed."""
    m = torch.randint(0, 2**52, (64,), dtype=torch.int64, device="cpu")
    m[:12] = torch.tensor([0, 2**52 - 1, 1, 2**52 - 2, 2**51 - 1, 2**51, 2**51 + 1, 2**40, 2**52 - 2**40,
                           2**28, 2**52 - 2**28 - 1, 2**52 - 2**30], device="cpu")  # fmt: skip
    hi, lo = m >> 20, (m & (2**20 - 1)) << 12  # lo's low 12 bits are not read: left 0, then set below
    lo[12:] |= torch.randint(0, 2**12, (52,), dtype=torch.int64, device="cpu")
    as_int32 = [torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).to(DEVICE) for w in (hi, lo)]
    noise = torch.empty(64, dtype=torch.float32, device=DEVICE)
    _noise_kernel[(1,)](*as_int32, noise, N=64)
    u = (m.double() + 0.5) / 2**52
    # -log(-log u) in float64, with -log u = -log1p(-(1 - u)) where 1 - u is the exact (2**52 - 1 - m + 0.5) / 2**52
    exact = -torch.where(m < 2**51, -torch.log(u), -torch.log1p(-((2**52 - 1 - m).double() + 0.5) / 2**52)).log()
    assert noise.isfinite().all()
    error = (noise.cpu().double() - exact).abs()
    assert (error <= 2**-21 + 2**-22 * exact.abs()).all(), error.max()
    assert exact[1] > 36.7 and exact[0] < -3.6


def test_steps_and_rows_are_independent():
    """Uniform logits over 8 ids: the pairs (step 0, step 1) of each row, (row 2i, row 2i+1) of a step, and
    (step 5, step 5 + 2**32: the counter's high word) fill the 64 cells evenly (chi-square, 63 degrees of freedom)."""
    logits = torch.zeros(4096, 8)
    seed = counter(-1234567)  # negative seeds are 64-bit words like any other
    step0, step1, step_hi = (gumbel_argmax(logits, seed, counter(s)) for s in (0, 1, 5 + 2**32))
    step5 = gumbel_argmax(logits, seed, counter(5))
    uniform = torch.full((64,), 1 / 64)
    for a, b in ((step0, step1), (step0[0::2], step0[1::2]), (step5, step_hi)):
        stat, dof = chi2_statistic(torch.bincount(a * 8 + b, minlength=64), uniform)
        assert stat < chi2_critical(dof), (stat, dof)


def test_seed_and_step_are_read_from_the_tensors():
    """Same seed and step: the same tokens. The kernel loads both from memory (a CUDA graph replays with new
    values), so changing the tensors in place changes the draw; changing them back restores it. Two draws of 512
    rows over 64 ids agree on a row with probability 1/64: ~8 rows; 64 would be 20 sd out."""
    logits = torch.zeros(512, 64)
    seed, step = counter(42), counter(9)
    first = gumbel_argmax(logits, seed, step)
    assert torch.equal(gumbel_argmax(logits, seed, step), first)
    assert len(set(first.tolist())) > 32  # rows differ: 512 draws over 64 ids cover nearly all
    step.add_(1)
    assert (gumbel_argmax(logits, seed, step) == first).sum() < 64
    step.sub_(1)
    seed.fill_(43)
    assert (gumbel_argmax(logits, seed, step) == first).sum() < 64
    seed.fill_(42)
    assert torch.equal(gumbel_argmax(logits, seed, step), first)


@pytest.mark.parametrize("limit", [200, 260])
def test_vocab_limit_inf_and_nan(limit):
    """Ids at or past vocab_limit are never drawn though their logits are the largest (within the limit's block and
    past it); -inf and NaN logits are never drawn; +inf is drawn first (the lowest such id); a row with nothing
    drawable (all -inf, all NaN) gives 0."""
    logits = torch.randn(64, 300)
    logits[:, limit:] = 50.0
    logits[:, 0:150:3] = -math.inf
    logits[:, 1:150:3] = math.nan
    logits[1, :] = -math.inf
    logits[2, [40, 7, 90]] = math.inf
    logits[3, :limit] = math.nan
    draws = gumbel_argmax(logits, counter(3), counter(4), vocab_limit=limit)
    assert draws[1] == 0 and draws[2] == 7 and draws[3] == 0
    rest = torch.cat([draws[:1], draws[4:]])
    assert (rest < limit).all() and (rest % 3 == 2).logical_or(rest >= 150).all(), rest
    assert len(set(rest.tolist())) > 10  # still random among the allowed ids


def test_vocab_limit_edges():
    logits = torch.randn(16, 40)
    seed, step = counter(1), counter(2)
    assert torch.equal(gumbel_argmax(logits, seed, step, vocab_limit=1000), gumbel_argmax(logits, seed, step))
    assert (gumbel_argmax(logits, seed, step, vocab_limit=1) == 0).all()
    assert gumbel_argmax(logits[:0], seed, step).shape == (0,)


def test_layouts_and_dtypes_give_the_same_tokens():
    """Logits exact in bf16 (quarters below 16) give the same tokens from every dtype and layout: the kernel widens
    them to float64 before anything else, and addresses rows and columns by their strides."""
    values = (torch.randn(16, 300) * 3).clamp(-15, 15).mul(4).round().div(4)
    seed, step = counter(77), counter(8)
    expected = gumbel_argmax(values.double(), seed, step, temperature=0.8)
    wide = torch.zeros(16, 512)
    wide[:, :300] = values
    cols = torch.zeros(16, 600)
    cols[:, ::2] = values
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for layout in (values, wide[:, :300], cols[:, ::2], values.t().contiguous().t()):
            got = gumbel_argmax(layout.to(dtype), seed, step, temperature=0.8)
            assert torch.equal(got, expected), (dtype, layout.stride())
    broadcast = gumbel_argmax(values[:1].expand(16, 300), seed, step)  # row stride 0: one row's logits, 16 draws
    assert len(set(broadcast.tolist())) > 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"logits": torch.zeros(8)}, "logits must be a 2-D"),
        ({"logits": torch.zeros(2, 8, dtype=torch.int64)}, "logits must be a 2-D .* floating-point"),
        ({"logits": torch.zeros(2, 0)}, "logits must have at least one column"),
        ({"seed": torch.tensor([1, 2])}, "seed must be a one-element int64 tensor"),
        ({"seed": torch.tensor([1], dtype=torch.int32)}, "seed must be a one-element int64 tensor"),
        ({"seed": 5}, "seed must be a one-element int64 tensor; got int"),
        ({"step": torch.tensor([1.0])}, "step must be a one-element int64 tensor"),
        ({"step": torch.tensor([1], device="meta")}, "step must be on the logits' device"),
        ({"temperature": 0.0}, "temperature must be a finite number > 0"),
        ({"temperature": -1.0}, "temperature must be a finite number > 0"),
        ({"temperature": math.inf}, "temperature must be a finite number > 0"),
        ({"temperature": 1e-40}, "temperature must be a finite number > 0 \\(at least 1e-30\\)"),
        ({"temperature": True}, "temperature must be a finite number > 0"),
        ({"vocab_limit": 0}, "vocab_limit must be None or an int >= 1"),
        ({"vocab_limit": True}, "vocab_limit must be None or an int >= 1"),
    ],
)
def test_bad_input_names_the_argument(kwargs, message):
    args = {"logits": torch.zeros(2, 8), "seed": counter(0), "step": counter(0)} | kwargs
    with pytest.raises(ValueError, match=message):
        gumbel_argmax(args.pop("logits"), args.pop("seed"), args.pop("step"), **args)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(sampling_kernel, "triton_interpreted", lambda: False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        gumbel_argmax(torch.zeros(2, 8, device="cpu"), counter(0).cpu(), counter(0).cpu())
