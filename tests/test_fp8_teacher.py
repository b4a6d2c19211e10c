"""The FP8 teacher (models/fp8_teacher.py, ops/fp8.py): quantisation bounds, the product's scale orientation, the
quantised model against the bf16 one, the shared-input reuse, its errors, and KDTrainer with an FP8 teacher.

The models run on the GPU when there is one (Triton kernels), else on the CPU, where torch >= 2.13's
`torch._scaled_mm` takes rowwise scales (an older torch's CPU takes the dequantised product: `cpu_torch_2_11`).
The Triton kernels are compared with the PyTorch reference on the GPU only: the Triton interpreter's e4m3 cast is
not round-to-nearest (measured: ~1.5 % of values a step or two off), so a CPU comparison of the kernels would test
the interpreter."""

import pytest
import torch

import liger_patch_kd.ops.fp8 as F8
from liger_patch_kd.models import apply_kd_patch, apply_teacher_precision, quantize_teacher_fp8, revert_kd_patch
from liger_patch_kd.models.fp8_teacher import Fp8GatedMLP, Fp8Linear, Fp8Projection

from .test_trainer import _args, _dataset
from .tiny_models import VOCAB, tiny_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CPU_FP8, CPU_WHY = F8.fp8_available(torch.device("cpu"))
pytestmark = [
    pytest.mark.usefixtures("clean_patches"),
    pytest.mark.skipif(not F8.fp8_available(DEVICE)[0], reason=F8.fp8_available(DEVICE)[1]),
]
E4M3_STEP = 2.0**-3  # e4m3 keeps 3 mantissa bits: neighbours differ by at most 2^-3 of the smaller one


def _rows(m=37, k=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]  # rows of very different scales
    x[5] = 0.0  # an all-zero row
    return x.to(DEVICE)


def test_quantize_rows_bound_and_zero_row():
    x = _rows()
    x8, scale = F8.quantize_rows_torch(x)
    assert x8.dtype == torch.float8_e4m3fn and scale.shape == (x.shape[0],)
    back = x8.float() * scale[:, None]
    # round to nearest: half a step of the element's magnitude, or of the smallest normal (2^-6) in scaled units
    bound = 0.5 * E4M3_STEP * back.abs().clamp_min(2.0**-6 * scale[:, None])
    assert ((back - x).abs() <= bound + 1e-30).all()
    assert (x8.float().abs().amax(-1)[scale > F8.SCALE_FLOOR] == F8.FP8_MAX).all()  # the range is used in full
    assert (back[5] == 0).all() and scale[5] == F8.SCALE_FLOOR / F8.FP8_MAX


def test_fp8_linear_is_the_product_of_the_dequantised_operands():
    """A scale applied on the wrong side (per input channel, or transposed) cannot pass: the rows and the
    output channels have scales six orders of magnitude apart."""
    x, w = _rows(m=24, k=64), _rows(m=48, k=64, seed=1)
    bias = torch.randn(48, device=DEVICE).bfloat16()
    x8, sx = F8.quantize_rows_torch(x)
    w8, sw = F8.quantize_weight(w)
    y = F8.fp8_linear(x8, sx, w8, sw, bias)
    xd, wd = x8.double() * sx.double()[:, None], w8.double() * sw.double()[:, None]
    product = xd @ wd.T
    # a dot product's error is relative to the sum of its terms' magnitudes (Hopper's FP8 tensor cores accumulate
    # with fewer than fp32's bits), then bf16 roundings of the product and of the sum (a step, 2^-8, each)
    bound = 2**-8 * (xd.abs() @ wd.abs().T + (product + bias.double()).abs())
    excess = (y.double() - (product + bias.double())).abs() / bound
    worst = excess.argmax()
    assert (excess <= 1).all(), (excess.max().item(), product.flatten()[worst].item(), y.flatten()[worst].item())


def _pair(arch, hidden=64):
    model = tiny_model(arch, dtype=torch.bfloat16, seed=3, hidden=hidden).to(DEVICE).eval().requires_grad_(False)
    quantized = tiny_model(arch, dtype=torch.bfloat16, seed=3, hidden=hidden).to(DEVICE).eval().requires_grad_(False)
    return model, quantized


@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gemma"])  # separate / biased / fused gate-up / GeGLU
def test_quantized_teacher_follows_the_bf16_teacher(arch, fast_accum):
    model, quantized = _pair(arch)
    summary = quantize_teacher_fp8(quantized, fast_accum=fast_accum)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert summary.kept == {"lm_head": "lm_head: read by the fused loss in bf16"} or arch == "gemma"  # gemma ties it
    assert not [m for m in quantized.modules() if type(m) is torch.nn.Linear and m is not quantized.lm_head]
    assert all(isinstance(m, Fp8GatedMLP) for n, m in quantized.named_modules() if n.endswith(".mlp"))
    assert len(summary.quantized) >= len(linears) - 1 - model.config.num_hidden_layers  # gate+up counted once
    assert summary.bytes_after < summary.bytes_before
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    ref = model(input_ids=ids).logits.float().log_softmax(-1)
    out = quantized(input_ids=ids).logits.float().log_softmax(-1)
    kl = (ref.exp() * (ref - out)).sum(-1)
    assert kl.mean() < 2e-3 and kl.max() < 1e-2, kl  # bf16 rounding alone gives ~1e-5 on these random models
    assert (kl > 0).any()  # quantisation did happen
    assert quantize_teacher_fp8(quantized, fast_accum=fast_accum) is summary  # a second call changes nothing


def test_shared_inputs_are_quantised_once(monkeypatch):
    """Per layer: the attention input (shared by q, k, v), the o-projection input and the MLP input; the down
    projection's input comes quantised out of the activation kernel."""
    _, quantized = _pair("llama")
    quantize_teacher_fp8(quantized)
    calls = []
    original = F8.quantize_rows
    counting = lambda x: calls.append(x.shape) or original(x)  # noqa: E731
    monkeypatch.setattr("liger_patch_kd.models.fp8_teacher.quantize_rows", counting)
    quantized(input_ids=torch.ones(1, 8, dtype=torch.long, device=DEVICE))
    assert len(calls) == 3 * quantized.config.num_hidden_layers


def test_fast_accumulation_reaches_every_decoder_product_and_nothing_else(monkeypatch):
    """fast_accum=True asks `torch._scaled_mm` for fast accumulation in each of the decoder's FP8 products (q, k
    and v as one, o, gate/up, down: four per layer) and in no other product; fast_accum=False in none."""
    flags = []
    original = torch._scaled_mm

    def spy(*args, **kwargs):
        flags.append(kwargs.get("use_fast_accum", False))
        return original(*args, **kwargs)

    ids = torch.ones(1, 8, dtype=torch.long, device=DEVICE)
    for fast in (False, True):
        _, quantized = _pair("llama")
        summary = apply_teacher_precision(quantized, "fp8_fast_accum" if fast else "fp8")
        assert summary.fast_accum is fast
        flags.clear()
        monkeypatch.setattr(torch, "_scaled_mm", spy)
        quantized(input_ids=ids)
        monkeypatch.setattr(torch, "_scaled_mm", original)
        assert flags == [fast] * 4 * quantized.config.num_hidden_layers
        assert all(m.fast_accum is fast for m in quantized.modules() if isinstance(m, Fp8Linear))


def test_teacher_precision_choices():
    _, quantized = _pair("llama")
    assert apply_teacher_precision(quantized, "bf16") is None
    assert not [m for m in quantized.modules() if isinstance(m, Fp8Linear)]  # bf16 leaves it as loaded
    with pytest.raises(ValueError, match=r"teacher precision must be one of .*got 'fp16'"):
        apply_teacher_precision(quantized, "fp16")
    summary = quantize_teacher_fp8(quantized)
    assert apply_teacher_precision(quantized, "fp8") is summary  # once
    with pytest.raises(ValueError, match="already quantised with fast_accum=False; quantise a fresh copy"):
        quantize_teacher_fp8(quantized, fast_accum=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q, k and v have biases
def test_shared_qkv_product_gives_each_projection_its_own_product(arch):
    """q, k and v served from one product over their concatenated weights give what each projection's own FP8
    product gives (the rowwise scales of x and of each weight row are the same either way), also when one of them
    is called on an input of its own."""
    model = tiny_model(arch, dtype=torch.bfloat16, seed=3, hidden=64).to(DEVICE).eval().requires_grad_(False)
    attn = model.model.layers[0].self_attn
    own = {n: Fp8Linear(getattr(attn, n).weight, getattr(attn, n).bias) for n in ("q_proj", "k_proj", "v_proj")}
    quantize_teacher_fp8(model)
    assert isinstance(attn.q_proj, Fp8Projection) and isinstance(attn.qkv_proj_fp8, Fp8Linear)
    x = torch.randn(2, 7, attn.q_proj.in_features, device=DEVICE, dtype=torch.bfloat16)
    other = torch.randn_like(x)
    for name, inp in (("q_proj", x), ("k_proj", x), ("v_proj", other)):
        got = getattr(attn, name)(inp)
        assert got.shape == (2, 7, own[name].out_features)
        # one bf16 rounding of the same fp32 sums, which a product of another width may add in another order
        torch.testing.assert_close(got.float(), own[name](inp).float(), rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gemma"])  # gemma: the (1 + w) casting mode
def test_patched_norms_hand_their_output_over_quantised(monkeypatch, arch):
    """With the teacher's kernels patched (as KDTrainer does), the norms before the attention and the MLP quantise
    their own output in the same pass: only the o-projection's input is quantised on its own (one call per layer,
    not three), and the logits are those of quantising each norm's output afterwards, bit for bit."""
    from liger_patch_kd.models.state import FP8_OUTPUT_ATTR

    _, quantized = _pair(arch)
    apply_kd_patch(model=quantized)
    quantize_teacher_fp8(quantized)
    layer = quantized.model.layers[0]
    assert getattr(layer.input_layernorm, FP8_OUTPUT_ATTR) and getattr(layer.post_attention_layernorm, FP8_OUTPUT_ATTR)
    calls = []
    original = F8.quantize_rows
    monkeypatch.setattr("liger_patch_kd.models.fp8_teacher.quantize_rows", lambda x: calls.append(1) or original(x))
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        handed_over = quantized(input_ids=ids).logits
        assert len(calls) == quantized.config.num_hidden_layers
        for module in quantized.modules():
            module.__dict__.pop(FP8_OUTPUT_ATTR, None)
        separate = quantized(input_ids=ids).logits
    assert len(calls) == 4 * quantized.config.num_hidden_layers
    assert torch.equal(handed_over, separate)


def test_a_model_wide_cast_keeps_the_fp8_operands():
    """teacher.to(torch.bfloat16) / .half() move the e4m3 weights and fp32 scales, never cast them (a cast would
    break every product); a cast to the dtype the teacher already has changes nothing."""
    _, quantized = _pair("llama")
    quantize_teacher_fp8(quantized)
    ids = torch.randint(0, VOCAB, (1, 7)).to(DEVICE)
    before = quantized(input_ids=ids).logits
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to(DEVICE, torch.float32)):
        cast(quantized)
        fp8 = [m for m in quantized.modules() if isinstance(m, Fp8Linear)]
        assert {(m.weight_fp8.dtype, m.weight_scale.dtype) for m in fp8} == {(F8.FP8_DTYPE, torch.float32)}
        assert torch.isfinite(quantized(input_ids=ids).logits).all()
    quantized.to(torch.bfloat16)
    torch.testing.assert_close(quantized(input_ids=ids).logits, before, rtol=0, atol=0)


def test_inference_mode_reuses_nothing_and_gives_the_no_grad_logits():
    """Inference tensors have no version counter: under torch.inference_mode the products reuse no quantised
    input or shared product (they could not tell an in-place change), and the logits are the same."""
    _, quantized = _pair("llama")
    apply_kd_patch(model=quantized)
    quantize_teacher_fp8(quantized)
    ids = torch.randint(0, VOCAB, (2, 6)).to(DEVICE)
    with torch.no_grad():
        want = quantized(input_ids=ids).logits
    with torch.inference_mode():
        got = quantized(input_ids=ids).logits
    assert torch.equal(got, want)


def test_gated_mlp_matches_its_definition():
    mlp_source = tiny_model("llama", dtype=torch.bfloat16, seed=0).model.layers[0].mlp.to(DEVICE)
    gate_up = Fp8Linear.from_linears(mlp_source.gate_proj, mlp_source.up_proj)
    mlp = Fp8GatedMLP(gate_up, Fp8Linear(mlp_source.down_proj.weight, None), "silu")
    x = torch.randn(3, 5, mlp_source.gate_proj.in_features, device=DEVICE, dtype=torch.bfloat16)
    gu = gate_up(x).float().reshape(15, -1)
    g, u = gu.chunk(2, -1)
    h8, sh = F8.quantize_rows_torch(torch.nn.functional.silu(g) * u)
    expected = F8.fp8_linear(h8, sh, mlp.down_proj.weight_fp8, mlp.down_proj.weight_scale).reshape(3, 5, -1)
    # the Triton activation kernel may round a value across an e4m3 tie where PyTorch does not (see below)
    torch.testing.assert_close(mlp(x), expected, **({} if DEVICE.type == "cpu" else dict(rtol=0.1, atol=0.02)))


def test_revert_keeps_a_quantised_teacher_working():
    _, quantized = _pair("llama")
    apply_kd_patch(model=quantized)  # KDTrainer patches the teacher's kernels first
    quantize_teacher_fp8(quantized)
    ids = torch.randint(0, VOCAB, (1, 9)).to(DEVICE)
    before = quantized(input_ids=ids).logits
    revert_kd_patch()
    torch.testing.assert_close(quantized(input_ids=ids).logits, before)


def test_refusals(monkeypatch):
    model = tiny_model("llama", dtype=torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match=r"requires_grad_\(False\)"):
        quantize_teacher_fp8(model)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    ok, why = F8.fp8_available(torch.device("cuda"))
    assert not ok and "A100" in why and "8.0" in why


@pytest.fixture
def cpu_torch_2_11(monkeypatch):
    """torch 2.11's CPU `_scaled_mm`, which refuses rowwise scales (setup.cfg promises torch >= 2.11): the real
    product stays reachable as the fixture's value."""
    real = torch._scaled_mm

    def scaled_mm(a, b, scale_a, scale_b, **kw):
        if a.device.type == "cpu" and (scale_a.numel() > 1 or scale_b.numel() > 1):
            raise RuntimeError("Invalid scaling configuration. For tensorwise scaling, both scales should be scalar.")
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(F8, "_CPU_ROWWISE", [])  # probed again, under the refusing product
    return real


def test_a_cpu_torch_that_refuses_rowwise_scales_still_runs_the_fp8_teacher(cpu_torch_2_11):
    """On torch 2.11's CPU the README's FP8 block failed ("CPU FP8 product refuses rowwise scales"): the product is
    then taken from the dequantised operands, which equals their float64 product to bf16 rounding (fp32 sums of
    exact e4m3 products: far below one bf16 step), and the FP8 teacher runs."""
    assert F8.fp8_available(torch.device("cpu")) == (True, "") and not F8.cpu_takes_rowwise_scales()
    x, w = _rows(m=24, k=64).cpu(), _rows(m=48, k=64, seed=1).cpu()
    x8, sx = F8.quantize_rows_torch(x)
    w8, sw = F8.quantize_weight(w)
    bias = torch.randn(48).bfloat16()
    y = F8.fp8_linear(x8, sx, w8, sw, bias)
    # the product of the dequantised operands in float64, written here (torch 2.11's own CPU product refuses these
    # scales, so it cannot be the reference on every torch this test runs on)
    want = (x8.double() * sx.double()[:, None]) @ (w8.double() * sw.double()[:, None]).t() + bias.double()
    step = 2.0**-7 * want.abs()  # one bf16 step (8 significant bits) at each value, and of the bias sum
    assert ((y.double() - want).abs() <= step + 2.0**-7 * bias.double().abs()).all()
    model = tiny_model("llama", dtype=torch.bfloat16, seed=3).eval().requires_grad_(False)
    quantized = tiny_model("llama", dtype=torch.bfloat16, seed=3).eval().requires_grad_(False)
    quantize_teacher_fp8(quantized)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = model(input_ids=ids).logits.float().log_softmax(-1)
    out = quantized(input_ids=ids).logits.float().log_softmax(-1)
    kl = (ref.exp() * (ref - out)).sum(-1)
    assert kl.mean() < 2e-3 and (kl > 0).any(), kl  # the bound of test_quantized_teacher_follows_the_bf16_teacher


@pytest.mark.skipif(not CPU_FP8, reason=CPU_WHY)  # the Trainer test runs on the CPU (use_cpu=True)
def test_trainer_with_an_fp8_teacher(tmp_path):
    """The FP8 teacher trains the student through KDTrainer; its losses stay close to the bf16 teacher's."""
    from liger_patch_kd.trainer import KDTrainer

    losses = {}
    for precision in ("bf16", "fp8", "fp8_fast_accum"):
        trainer = KDTrainer(
            model=tiny_model("llama", dtype=torch.float32, seed=1),
            teacher_model=tiny_model("llama", dtype=torch.bfloat16, seed=2, hidden=96),
            args=_args(tmp_path, use_kd_patch=True, max_steps=4, kd_teacher_precision=precision),
            train_dataset=_dataset(),
        )
        trainer.train()
        losses[precision] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if precision != "bf16":
            assert isinstance(trainer.teacher_model.model.layers[0].mlp, Fp8GatedMLP)
            assert trainer.teacher_model.model.layers[0].mlp.down_proj.fast_accum is (precision == "fp8_fast_accum")
    for precision in ("fp8", "fp8_fast_accum"):
        assert all(torch.isfinite(torch.tensor(losses[precision])))
        torch.testing.assert_close(torch.tensor(losses[precision]), torch.tensor(losses["bf16"]), rtol=5e-2, atol=1e-3)
        assert losses[precision] != losses["bf16"]


@pytest.mark.skipif(not CPU_FP8, reason=CPU_WHY)
def test_an_fp8_teacher_on_the_cpu_says_once_that_it_is_emulated(monkeypatch, caplog):
    """The CPU runs the FP8 teacher's maths (what these tests check) without FP8 tensor cores: it says so once per
    process, naming the device, never silently; a GPU of compute capability < 8.9 is refused (test_refusals)."""
    monkeypatch.setattr(F8, "_EMULATION_SAID", set())
    with caplog.at_level("WARNING", logger="liger_patch_kd.ops.fp8"):
        for seed in (0, 1):  # two teachers quantised: one note
            quantize_teacher_fp8(tiny_model("llama", dtype=torch.bfloat16, seed=seed).requires_grad_(False))
    said = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("fp8 emulated on cpu: no speed-up (the FP8 teacher"), said
    assert "compute capability 8.9+" in said[0]


def test_trainer_refuses_fp8_without_a_teacher(tmp_path):
    from liger_patch_kd.trainer import KDTrainer

    with pytest.raises(ValueError, match="kd_teacher_precision='fp8'.*liger-kd serve --precision fp8"):
        KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1), train_dataset=_dataset(),
                  args=_args(tmp_path, use_kd_patch=True, kd_teacher_precision="fp8"))  # fmt: skip
    with pytest.raises(ValueError, match=r"kd_teacher_precision must be one of \('bf16', 'fp8', 'fp8_fast_accum'\)"):
        _args(tmp_path, kd_teacher_precision="int8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels' e4m3 cast is checked on a GPU")
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
@pytest.mark.parametrize("width", [2048, 4096, 5120])
def test_norm_that_quantises_its_output_is_the_norm_then_the_quantisation(width, casting, offset):
    from liger_patch_kd.ops.rms_norm import rms_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, width, device="cuda", generator=g, dtype=torch.bfloat16) * 3
    w = torch.randn(width, device="cuda", generator=g, dtype=torch.bfloat16)
    x[7] = 0.0  # a zero row: the scale floor
    y, (q, scale) = F8.rms_norm_quantized(x, w, 1e-6, offset, casting)
    want = rms_norm(x, w, 1e-6, offset, casting)
    # the same arithmetic compiled into another kernel may sum a row's squares in another order: rstd moves by
    # ~sqrt(H) 2^-24 (at most H 2^-24), which now and then moves an output across a bf16 rounding boundary, by one
    # bf16 step (2^-7 relative at most). Measured on an H200: 1 output in 1.5M, at H = 5120 with gemma's casting
    torch.testing.assert_close(y, want, rtol=2**-7, atol=0)
    assert (y != want).float().mean() < 0.05
    want_q, want_scale = F8.quantize_rows(y)  # the kernel's own output, quantised apart
    torch.testing.assert_close(scale, want_scale, rtol=2**-23, atol=0)
    torch.testing.assert_close(q.float(), want_q.float(), rtol=2**-3, atol=2**-9)
    assert (q.view(torch.uint8) != want_q.view(torch.uint8)).float().mean() < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels' e4m3 cast is checked on a GPU")
@pytest.mark.parametrize("width", [4096, 14336])
def test_triton_kernels_match_the_reference(width):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 2 * width, device="cuda", generator=g, dtype=torch.bfloat16) * 3
    for triton_out, torch_out in (
        (F8.quantize_rows(x[:, :width].contiguous()), F8.quantize_rows_torch(x[:, :width])),
        (F8.gated_act_quantized(x, "silu"), F8.gated_act_quantized_torch(x, "silu")),
        (F8.gated_act_quantized(x, "gelu_pytorch_tanh"), F8.gated_act_quantized_torch(x, "gelu_pytorch_tanh")),
    ):
        (q, s), (q_ref, s_ref) = triton_out, torch_out
        torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
        same = (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item()
        assert same > 0.999, same  # an fp32 division rounded differently may move a value across a tie
        assert ((q.float() - q_ref.float()).abs() <= E4M3_STEP * q_ref.float().abs().clamp_min(2.0**-6)).all()


def test_a_vlm_teacher_keeps_its_vision_tower():
    """Only the language decoder is quantised: a VLM's vision tower stays as loaded."""
    model = tiny_model("qwen2_5_vl", dtype=torch.bfloat16, seed=0).to(DEVICE).eval().requires_grad_(False)
    vision = {n: type(m) for n, m in model.named_modules() if "visual" in n and isinstance(m, torch.nn.Linear)}
    summary = quantize_teacher_fp8(model)
    assert vision and {n: type(m) for n, m in model.named_modules() if n in vision} == vision
    assert summary.quantized and not any("visual" in n for n in summary.quantized)
    assert torch.isfinite(model(input_ids=torch.randint(0, 200, (1, 10), device=DEVICE)).logits.float()).all()
