"""RMSNorm, RoPE and gated-MLP kernels (Triton: compiled on GPU, interpreted on CPU) against their PyTorch
twins, forward and backward, in the dtypes models run in."""

import pytest
import torch

from liger_patch_kd import KDLossConfig
from liger_patch_kd.ops.backend import triton_available
from liger_patch_kd.ops.rms_norm import rms_norm, rms_norm_torch
from liger_patch_kd.ops.rope import rope, rope_torch
from liger_patch_kd.ops.swiglu import gated_act, gated_act_torch

from .helpers import DEVICE, count_launches

TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),  # RoPE and the gated MLP compute fp64 inputs in fp64, as HF does
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=3e-2),
}
GRAD_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _compare(fn_kernel, fn_torch, inputs, dtype):
    a = [t.detach().clone().requires_grad_() for t in inputs]
    b = [t.detach().clone().requires_grad_() for t in inputs]
    out_a, out_b = fn_kernel(*a), fn_torch(*b)
    out_a = out_a if isinstance(out_a, tuple) else (out_a,)
    out_b = out_b if isinstance(out_b, tuple) else (out_b,)
    upstream = [torch.randn_like(o) for o in out_b]
    for x, y in zip(out_a, out_b):
        assert x.dtype == y.dtype and x.shape == y.shape
        torch.testing.assert_close(x, y, **TOL[dtype])
    ga = torch.autograd.grad(sum((o * u).sum() for o, u in zip(out_a, upstream)), a)
    gb = torch.autograd.grad(sum((o * u).sum() for o, u in zip(out_b, upstream)), b)
    for x, y in zip(ga, gb):
        # weight grads sum over rows: compare norm-wise
        assert float((x.double() - y.double()).norm() / y.double().norm()) < GRAD_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # HF normalises in fp32 even for fp64 models
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0), ("olmo", 0.0)])
@pytest.mark.parametrize("hidden", [48, 64])
def test_rms_norm(dtype, casting, offset, hidden):
    x = torch.randn(3, 7, hidden, device=DEVICE, dtype=dtype)
    w = (torch.rand(hidden, device=DEVICE) - 0.5).to(dtype)
    _compare(
        lambda x, w: rms_norm(x, w, 1e-6, offset, casting, backend="triton"),
        lambda x, w: rms_norm_torch(x, w, 1e-6, offset, casting),
        [x, w],
        dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch_cos", [1, 2])
@pytest.mark.parametrize("dim", [16, 24, 80])  # halves 8, 12 and 40: a power of two, and masked tiles
def test_rope_q_and_k_in_one_kernel(dtype, batch_cos, dim):
    bsz, heads, kv_heads, seq = 2, 4, 2, 9
    # HF layout: (B, T, heads, D) projections transposed to (B, heads, T, D) views
    q = torch.randn(bsz, seq, heads, dim, device=DEVICE, dtype=dtype).transpose(1, 2)
    k = torch.randn(bsz, seq, kv_heads, dim, device=DEVICE, dtype=dtype).transpose(1, 2)
    angles = torch.randn(batch_cos, seq, dim // 2, device=DEVICE)
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    _compare(
        lambda q, k: rope(q, k, cos, sin, backend="triton"), lambda q, k: rope_torch(q, k, cos, sin), [q, k], dtype
    )


@pytest.mark.parametrize("heads,kv_heads,seq", [(6, 3, 1), (5, 1, 4)])
def test_rope_launches_once_for_q_and_k_forward_and_backward(monkeypatch, heads, kv_heads, seq):
    """q and k in one launch each way (a decode step is bound by launches), head counts that are not powers of two,
    the decode shape (one position), against the torch rotation in float64."""
    import liger_patch_kd.ops.rope as rope_module

    launches = count_launches(monkeypatch, rope_module, "_rope_kernel")
    q = torch.randn(3, seq, heads, 8, device=DEVICE, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(3, seq, kv_heads, 8, device=DEVICE, dtype=torch.float64).transpose(1, 2)
    angles = torch.randn(3, seq, 4, device=DEVICE, dtype=torch.float64)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    _compare(
        lambda q, k: rope(q, k, cos, sin, backend="triton"), lambda q, k: rope_torch(q, k, cos, sin), [q, k],
        torch.float64,
    )  # fmt: skip
    assert len(launches) == 2  # one forward, one backward


def test_rope_takes_the_torch_path_for_a_k_it_cannot_pair_with():
    """A k of another dtype than q's (each rotated in its own dtype by the torch path) is not put in q's launch."""
    q = torch.randn(1, 2, 3, 8, device=DEVICE, dtype=torch.float64)
    k = torch.randn(1, 1, 3, 8, device=DEVICE, dtype=torch.float32)
    cos, sin = torch.randn(1, 3, 8, device=DEVICE, dtype=torch.float64), torch.randn(1, 3, 8, device=DEVICE,
                                                                                     dtype=torch.float64)  # fmt: skip
    got, want = rope(q, k, cos, sin, backend="triton"), rope_torch(q, k, cos, sin)
    assert got[1].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


@pytest.mark.parametrize("cos_batch,cos_seq", [(2, 5), (4, 3)])
def test_rope_tables_that_do_not_cover_q_are_refused_not_read_past(cos_batch, cos_seq):
    """cos / sin of another batch (not 1) or fewer positions than q: the torch path's broadcasting error, not the
    kernel reading past the tables."""
    q, k = torch.randn(4, 2, 5, 8, device=DEVICE), torch.randn(4, 1, 5, 8, device=DEVICE)
    cos = sin = torch.randn(cos_batch, cos_seq, 8, device=DEVICE)
    with pytest.raises(RuntimeError, match="size of tensor"):
        rope(q, k, cos, sin, backend="triton")


def test_rope_backward_with_unequal_halves():
    """The backward is the transposed rotation: right even when cos/sin halves differ (not HF's layout)."""
    q = torch.randn(1, 3, 2, 8, device=DEVICE).transpose(1, 2)  # (B, heads=2, T=3, D)
    k = torch.randn(1, 3, 1, 8, device=DEVICE).transpose(1, 2)
    cos, sin = torch.randn(1, 3, 8, device=DEVICE), torch.randn(1, 3, 8, device=DEVICE)
    _compare(
        lambda q, k: rope(q, k, cos, sin, backend="triton"),
        lambda q, k: rope_torch(q, k, cos, sin),
        [q, k],
        torch.float32,
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_gated_activation(dtype, activation):
    gate = torch.randn(5, 333, device=DEVICE, dtype=dtype) * 3
    up = torch.randn(5, 333, device=DEVICE, dtype=dtype)
    _compare(
        lambda g, u: gated_act(g, u, activation, backend="triton"),
        lambda g, u: gated_act_torch(g, u, activation),
        [gate, up],
        dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_gated_activation_without_gradients_reads_column_slices_of_one_product(dtype, activation):
    """A decode step's gate and up are column slices of one fused product (row-strided views): read where they are,
    the same values as the reference on contiguous copies."""
    fused = torch.randn(2, 3, 2 * 333 + 7, device=DEVICE, dtype=dtype) * 3
    gate, up = fused[..., :333], fused[..., 333 : 2 * 333]
    assert not gate.is_contiguous()
    with torch.no_grad():
        out = gated_act(gate, up, activation, backend="triton")
    want = gated_act_torch(gate.contiguous(), up.contiguous(), activation)
    assert out.shape == want.shape and out.is_contiguous()
    # the same elementwise arithmetic as the kernel on contiguous inputs (fp32 for bf16, fp64 for fp64)
    torch.testing.assert_close(out, want, rtol=1e-12 if dtype == torch.float64 else 1e-2, atol=1e-12 if
                               dtype == torch.float64 else 1e-2)  # fmt: skip


@pytest.mark.parametrize("shape", [(3, 0), ()])
def test_gated_activation_without_gradients_of_empty_and_scalar_inputs(shape):
    """Shapes the no-gradient path once refused (a reshape of 0 elements, a 0-d index): the reference's values."""
    gate, up = torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE)
    with torch.no_grad():
        out = gated_act(gate, up, "silu", backend="triton")
    torch.testing.assert_close(out, gated_act_torch(gate, up, "silu"))


def test_rope_with_fp32_tables_returns_q_dtype_as_olmo2_does():
    """OLMo-2's rotary tables stay fp32 for bf16 q and k, and its apply_rotary_pos_emb casts the result back: so
    do both paths here (the PyTorch one promoted, and the attention then met fp32 q against bf16 v)."""
    olmo2 = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")
    q = torch.randn(2, 4, 6, 16, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 6, 16, device=DEVICE, dtype=torch.bfloat16)
    angle = torch.randn(1, 6, 16, device=DEVICE)
    cos, sin = angle.cos(), angle.sin()
    want = olmo2.apply_rotary_pos_emb(q, k, cos, sin)
    got = rope(q, k, cos, sin, backend="torch")
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.bfloat16
        assert torch.equal(a, b)


def test_kernel_argument_errors():
    with pytest.raises(ValueError, match="activation"):
        gated_act(torch.zeros(2), torch.zeros(2), "relu")
    with pytest.raises(ValueError, match="same shape|one shape"):
        gated_act(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="casting"):
        rms_norm(torch.zeros(2, 4), torch.ones(4), 1e-6, casting="t5")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_olmo_casting_is_the_models_own_norm(dtype):
    """OLMo-2's and GPT-OSS's RMSNorm, op for op, against the "olmo" mode on the PyTorch path (fp64 included)."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    norm = Olmo2RMSNorm(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(-1.0, 1.0)
    x = torch.randn(4, 32, dtype=dtype)
    assert torch.equal(rms_norm_torch(x, norm.weight, 1e-6, 0.0, "olmo"), norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("factor", [1.0, 0.37, 0.0])
def test_scale_by_a_device_factor(dtype, factor):
    """The backward's in-place scaling by grad_output (ops/scale.py): exact fp32 products rounded once, the
    tensor left bit-for-bit untouched when the factor is 1, and a size that is not a multiple of the block."""
    from liger_patch_kd.ops.scale import scale_

    x = torch.randn(3, 8195, device=DEVICE).to(dtype)
    expected = (x.float() * factor).to(dtype)
    before = x.clone()
    out = scale_(x, torch.tensor(factor, device=DEVICE))
    assert out is x
    if factor == 1.0:
        assert torch.equal(x, before)
    # the interpreter casts fp32 to bf16 by truncation (one ulp off half the time); the GPU rounds, exactly
    interpreted_bf16 = DEVICE.type == "cpu" and dtype == torch.bfloat16
    torch.testing.assert_close(x, expected, rtol=2**-7 if interpreted_bf16 else 0, atol=0)


@pytest.mark.skipif(not triton_available(), reason="the Triton JSD kernel's walk order")
@pytest.mark.parametrize("reverse_middle", [False, True])
@pytest.mark.parametrize("l2_hints", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_kernel_walk_orders_agree_with_float64_math(reverse_middle, l2_hints, beta):
    """Every JSDLaunch (pass 2 right to left, L2 eviction hints) gives the float64 result over a row of several
    vocabulary tiles with a partial last one (4096-wide tiles: V = 2 * 4096 + 300), the gradient written in place
    over the teacher logits as in training. Float64 rows: the kernel's scalars are exact pairs, so the only
    difference is the order of the partial sums (rounding, 1e-12)."""
    from liger_patch_kd.ops.fused_linear_jsd import JSDLaunch, jsd_chunk_torch, jsd_chunk_triton

    g = torch.Generator().manual_seed(11)
    rows, vocab = 3, 2 * 4096 + 300
    zs = (torch.randn(rows, vocab, generator=g) * 3).double()
    zt = (torch.randn(rows, vocab, generator=g) * 4).double()
    labels = torch.randint(0, vocab, (rows,), generator=g)
    w = torch.tensor([0.5, 0.0, 1.25], dtype=torch.float64)
    cfg = KDLossConfig(beta=beta, temperature=1.7, hard_weight=0.3)
    want = jsd_chunk_torch(zs, zt, labels, w, w, torch.float64, cfg)
    launch = JSDLaunch(reverse_middle=reverse_middle, l2_hints=l2_hints)
    args = (t.to(DEVICE) for t in (zs, zt.clone(), labels, w, w))
    got = [t.cpu() for t in jsd_chunk_triton(*args, torch.float64, cfg, launch=launch)]
    for name, a, b in zip(("soft", "hard", "grad"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.skipif(not triton_available(), reason="the Triton JSD kernel's segment walk")
@pytest.mark.parametrize("segment,phased", [(2048, False), (256, False), (256, True)])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature,hard_weight,softcap", [(1.7, 0.3, None), (1.0, 0.3, 30.0), (1.0, 0.0, None)])
def test_jsd_segment_walk_agrees_with_float64_math(segment, phased, beta, temperature, hard_weight, softcap):
    """Rows split over programs that each hold a segment in registers (`JSDLaunch.segment`): V = 1271 is one
    segment of 2048 or five of 255 (the last 251), each row's partial log-sum-exps and sums combined across them.
    On a GPU the unphased walk is one launch whose row programs meet at barriers and write the gradient over the
    teacher logits; the interpreter (programs run one after another) runs a lone segment the same way and several
    as three phased launches, the same arithmetic. Float64 rows: the only difference from the reference is the
    order of the partial sums (rounding, 1e-12); a weight of 0 and a loss without a gradient included."""
    from liger_patch_kd.ops.fused_linear_jsd import JSDLaunch, jsd_chunk_torch, jsd_chunk_triton

    g = torch.Generator().manual_seed(5)
    rows, vocab = 4, 1271
    zs = (torch.randn(rows, vocab, generator=g) * 3).double()
    zt = (torch.randn(rows, vocab, generator=g) * 4).double()
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[1] = -100
    w = torch.tensor([0.5, 0.0, 1.25, 2.0], dtype=torch.float64)
    cfg = KDLossConfig(beta=beta, temperature=temperature, hard_weight=hard_weight, softcap=softcap,
                       teacher_softcap=softcap)  # fmt: skip
    launch = JSDLaunch(segment=segment, phased=phased)
    for grad_dtype in (torch.float64, None):
        want = jsd_chunk_torch(zs, zt, labels, w, w, grad_dtype, cfg)
        args = (t.to(DEVICE) for t in (zs, zt.clone(), labels, w, w))
        got = jsd_chunk_triton(*args, grad_dtype, cfg, launch=launch)
        assert (got[2] is None) == (grad_dtype is None)
        for name, a, b in zip(("soft", "hard", "grad"), got, want):
            if b is not None:
                torch.testing.assert_close(a.cpu(), b, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.skipif(not triton_available(), reason="the Triton JSD kernel's segment walk")
def test_jsd_segment_walk_writes_the_bf16_gradient_the_streaming_walk_writes():
    """fp32 logits and a bf16 gradient, as in training: the segment walk (several segments; on a GPU written over
    the teacher logits after the row's first barrier) gives the streaming walk's loss to fp32 summation order and
    its gradient to one bf16 rounding step."""
    from liger_patch_kd.ops.fused_linear_jsd import JSDLaunch, jsd_chunk_triton

    g = torch.Generator().manual_seed(8)
    rows, vocab = 6, 1000
    zs = (torch.randn(rows, vocab, generator=g) * 3).to(DEVICE)
    zt = (torch.randn(rows, vocab, generator=g) * 4).to(DEVICE)
    labels = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)
    w = torch.full((rows,), 1 / rows, device=DEVICE)
    cfg = KDLossConfig(beta=0.5, hard_weight=0.5)
    soft_a, hard_a, grad_a = jsd_chunk_triton(zs, zt.clone(), labels, w, w, torch.bfloat16, cfg)
    soft_b, hard_b, grad_b = jsd_chunk_triton(zs, zt.clone(), labels, w, w, torch.bfloat16, cfg,
                                              launch=JSDLaunch(segment=256))  # fmt: skip
    torch.testing.assert_close(soft_b, soft_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hard_b, hard_a, rtol=1e-5, atol=1e-6)
    assert grad_b.dtype == torch.bfloat16 and grad_b.shape == grad_a.shape
    torch.testing.assert_close(grad_b.float(), grad_a.float(), rtol=2**-7, atol=1e-7)


@pytest.mark.skipif(not triton_available(), reason="the Triton JSD kernel")
@pytest.mark.parametrize("segment", [None, 256, 2048])
def test_jsd_kernel_writes_its_gradient_into_a_given_group_buffer(segment):
    """`grad_out=` (a gradient group, ops/chunked.py): the kernel writes the gradient it would return into the given
    rows of a larger buffer, touches none of the buffer's other rows, and leaves the teacher logits as they were
    (without it the gradient may take their bytes). Streaming walk, several segments, one segment."""
    from liger_patch_kd.ops.fused_linear_jsd import JSDLaunch, jsd_chunk_triton

    g = torch.Generator().manual_seed(9)
    rows, vocab = 5, 1271
    zs = (torch.randn(rows, vocab, generator=g) * 3).to(DEVICE)
    zt = (torch.randn(rows, vocab, generator=g) * 4).to(DEVICE)
    labels = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)
    w = torch.full((rows,), 0.2, device=DEVICE)
    cfg = KDLossConfig(beta=0.5, temperature=1.5, hard_weight=0.3)
    launch = JSDLaunch(segment=segment)
    soft_a, hard_a, grad_a = jsd_chunk_triton(zs, zt.clone(), labels, w, w, torch.bfloat16, cfg, launch=launch)
    group = torch.full((rows + 4, vocab), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    teacher = zt.clone()
    soft_b, hard_b, grad_b = jsd_chunk_triton(zs, teacher, labels, w, w, torch.bfloat16, cfg, launch=launch,
                                              grad_out=group[2 : 2 + rows])  # fmt: skip
    assert grad_b.data_ptr() == group[2].data_ptr()
    torch.testing.assert_close(soft_b, soft_a, rtol=0, atol=0)
    torch.testing.assert_close(hard_b, hard_a, rtol=0, atol=0)
    torch.testing.assert_close(grad_b, grad_a, rtol=0, atol=0)
    assert group[:2].isnan().all() and group[2 + rows :].isnan().all()
    assert torch.equal(teacher, zt)


@pytest.mark.parametrize(
    "options,needle",
    [
        (dict(block=100), "power of two"),
        (dict(block=8), "power of two"),
        (dict(num_warps=3), "one of"),
        (dict(segment=1000), "JSDLaunch.segment must be a power of two"),
        (dict(programs_per_sm=0), "programs_per_sm"),
    ],
)
def test_jsd_launch_refuses_a_tile_or_warp_count_triton_cannot_launch(options, needle):
    from liger_patch_kd.ops.fused_linear_jsd import JSDLaunch

    with pytest.raises(ValueError, match=needle):
        JSDLaunch(**options)


@pytest.mark.parametrize("dim", [24, 64])
def test_rope_with_fp32_tables_for_bf16_q_rotates_in_fp32_in_one_launch(monkeypatch, dim):
    """fp32 weights under bf16 autocast: q and k come out of the products in bf16, cos / sin stay fp32. The kernel
    reads the tables in fp32 and rotates in fp32, as transformers' apply_rotary_pos_emb does by type promotion,
    and rounds once to bf16 (what attention then casts it to): at most one bf16 step from that reference; in one
    launch, head sizes whose half is no power of
    two included (the arithmetic benchmark's student has 24)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    import liger_patch_kd.ops.rope as rope_module

    launches = count_launches(monkeypatch, rope_module, "_rope_kernel")
    q = torch.randn(3, 5, 4, dim, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(3, 5, 2, dim, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
    angles = torch.randn(1, 5, dim // 2, device=DEVICE) * 4
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos(), emb.sin()
    with torch.no_grad():
        got = rope(q, k, cos, sin, backend="triton")
        want = [w.to(torch.bfloat16) for w in apply_rotary_pos_emb(q, k, cos, sin)]
    assert len(launches) == 1
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        # one bf16 step at most (2^-7 relative): the same fp32 value rounded once (the interpreter's conversion
        # to bf16 may round another way than a GPU's round-to-nearest-even)
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=2**-7)
