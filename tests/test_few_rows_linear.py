"""ops/few_rows_linear.py: a decode step's products, x @ W.T (+ b) for a few rows, against F.linear.

The kernel sums each output in fp32 and rounds once to the input dtype: against a float64 product (the maths) it is
off by that rounding (to nearest on a GPU: half an ulp, 2^-8 relative in bf16, 2^-11 in fp16; the Triton
interpreter's cast rounds toward zero: one ulp) plus the fp32 sum's own order error (K 2^-24 of the sum of |x w|).
F.linear (cuBLAS, or the CPU's BLAS) also sums in fp32, maybe in another order: the two agree to two roundings."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from liger_patch_kd.ops.backend import triton_interpreted
from liger_patch_kd.ops.few_rows_linear import MAX_ROWS, few_rows_applies, few_rows_config, few_rows_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF_ULP = {torch.bfloat16: 2**-8, torch.float16: 2**-11}  # unit roundoff: the relative error of rounding to nearest


def _rounding(dtype) -> float:
    return HALF_ULP[dtype] * (2 if triton_interpreted() else 1)


@pytest.fixture
def kernel_backend(monkeypatch):
    monkeypatch.setenv("LIGER_KD_BACKEND", "triton")  # the interpreter on a CPU (conftest), compiled on a GPU


def _inputs(rows, n, k, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


def _exact(x, w, b):
    out = x.double() @ w.double().t()
    return out if b is None else out + b.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n,k,bias", [(1, 48, 64, True), (8, 100, 96, False), (13, 257, 40, True),
                                           (64, 33, 128, True)])  # fmt: skip
def test_kernel_is_the_product_to_one_rounding(kernel_backend, rows, n, k, bias, dtype):
    x, w, b = _inputs(rows, n, k, dtype, bias)
    assert few_rows_applies(x, w, b)
    got = few_rows_linear(x, w, b)
    exact = _exact(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    # one rounding of the fp32 sum to the output dtype plus the sum's order error (the module docstring)
    scale = (x.double().abs() @ w.double().abs().t()) + (0 if b is None else b.double().abs())
    bound = _rounding(dtype) * exact.abs() + k * 2**-24 * scale + 1e-30
    assert ((got.double() - exact).abs() <= bound).all()
    # and F.linear's own result (rounded to nearest) to two such roundings
    want = F.linear(x, w, b).double()
    assert ((got.double() - want).abs() <= 2 * bound + HALF_ULP[dtype] * want.abs()).all()


def test_leading_dimensions_strides_and_repeatability(kernel_backend):
    x, w, b = _inputs(6, 40, 64, torch.bfloat16)
    x3 = x.reshape(2, 3, 64)
    got = few_rows_linear(x3, w, b)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got.reshape(6, 40), few_rows_linear(x, w, b), rtol=0, atol=0)
    wide = torch.zeros(6, 128, dtype=x.dtype, device=x.device)
    wide[:, :64] = x  # rows with a stride of 128: the kernel reads them in place
    torch.testing.assert_close(few_rows_linear(wide[:, :64], w, b), few_rows_linear(x, w, b), rtol=0, atol=0)
    w_strided = torch.zeros(40, 96, dtype=w.dtype, device=w.device)
    w_strided[:, :64] = w
    torch.testing.assert_close(few_rows_linear(x, w_strided[:, :64], b), few_rows_linear(x, w, b), rtol=0, atol=0)


def test_inputs_it_does_not_take_go_to_f_linear(kernel_backend):
    x, w, b = _inputs(4, 24, 32, torch.bfloat16)
    too_many = torch.zeros(MAX_ROWS + 1, 32, dtype=x.dtype, device=x.device)
    for args in [(x.float(), w.float(), None), (too_many, w, b), (x, w.t().contiguous().t(), b), (x[:0], w, b)]:
        assert not few_rows_applies(*args)
        torch.testing.assert_close(few_rows_linear(*args), F.linear(*args), rtol=0, atol=0)
    assert not few_rows_applies(x, w.float(), None)  # mixed dtypes: F.linear's own error, as without the kernel
    trainable = w.clone().requires_grad_(True)
    assert not few_rows_applies(x, trainable, b)  # a product whose gradient is wanted: autograd's own
    with torch.no_grad():
        assert few_rows_applies(x, trainable, b)


def test_without_a_kernel_backend_it_is_f_linear():
    x, w, b = _inputs(4, 24, 32, torch.bfloat16)
    if DEVICE == "cpu":
        assert not few_rows_applies(x, w, b)
        torch.testing.assert_close(few_rows_linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)


def test_config_fills_the_gpu_and_pads_rows():
    assert few_rows_config(8, 2048, 2048)[:2] == (16, 16)
    assert few_rows_config(64, 16384, 2048)[:3] == (64, 64, 128)
    assert few_rows_config(17, 3072, 8192)[0] == 32
    assert few_rows_config(1, 100, 40)[2] == 64  # a short K gets one tile


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel at a 1B model's shapes")
@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)])
def test_kernel_at_decode_shapes(rows, n, k):
    x, w, b = _inputs(rows, n, k, torch.bfloat16, bias=False)
    got = few_rows_linear(x, w)
    exact = _exact(x, w, None)
    scale = x.double().abs() @ w.double().abs().t()
    assert ((got.double() - exact).abs() <= 2**-8 * exact.abs() + k * 2**-24 * scale).all()
    torch.testing.assert_close(few_rows_linear(x, w), got, rtol=0, atol=0)  # the same bits again
