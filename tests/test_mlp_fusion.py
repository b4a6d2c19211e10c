"""generation.mlp_fusion and few_row_linear.few_row_gated: a decode step's gated MLP computes its gate/up product and
activation in one kernel. The kernel gives the unfused arithmetic's bits (products rounded to x's dtype, then the
activation kernel's float32 arithmetic); a fused session decodes what an unfused one decodes, for separate gate/up
projections, Phi-3's gate_up_proj and GELU-tanh MLPs; a hook, gradients, a call outside the engine run the forward
the module had; the user's modules keep theirs."""

import re

import pytest
import torch

from liger_patch_kd.generation import Sampling, decode, release_sessions
from liger_patch_kd.generation import few_row_linear as few_row_module
from liger_patch_kd.generation import kernel_twin as kernel_twin_module
from liger_patch_kd.generation.few_row_linear import few_row_gated, few_row_linear
from liger_patch_kd.generation.kernel_twin import kernel_twin
from liger_patch_kd.ops.backend import triton_available
from liger_patch_kd.ops.swiglu import gated_act

from .helpers import DEVICE
from .test_engine_kernels import _engine_model, _prompts

pytestmark = [
    pytest.mark.usefixtures("clean_patches"),
    pytest.mark.skipif(not triton_available(), reason="the fused step is a Triton kernel"),
]

@pytest.fixture(autouse=True)
def every_product(monkeypatch):
    """The tiny models' products are far narrower than few_row_linear.MIN_OUT_FEATURES (which products take the
    kernel at a real model's shapes): every product takes it here, so that each path is checked through it."""
    monkeypatch.setattr(few_row_module, "MIN_OUT_FEATURES", 0)


DTYPES = [torch.float32, torch.bfloat16] + ([torch.float64] if DEVICE.type == "cpu" else [])
# what a decode step runs through the kernel: float64 on a CPU (the interpreter), bfloat16 on a GPU
STEP_DTYPE = torch.float64 if DEVICE.type == "cpu" else torch.bfloat16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows, n, k", [(8, 100, 300), (1, 16, 64), (33, 48, 520)])
def test_the_gated_kernel_gives_the_unfused_bits(dtype, activation, rows, n, k, monkeypatch):
    """Against each product through the kernel, then ops.swiglu's activation kernel on their outputs: equal. On a
    CPU the interpreter's activation kernel stores bfloat16 by truncating, where a GPU (and the fused kernel's
    output here) rounds to nearest: there the two may differ by one bfloat16 ulp."""
    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    g = torch.Generator().manual_seed(rows + n)
    x, gate, up = (torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)
                   for shape in ((rows, k), (n, k), (n, k)))  # fmt: skip
    fused = few_row_gated(x, gate, up, activation)
    unfused = gated_act(few_row_linear(x, gate), few_row_linear(x, up), activation)
    assert fused.dtype == dtype and fused.shape == (rows, n)
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        ulp = torch.finfo(dtype).eps * fused.double().abs().clamp(min=torch.finfo(dtype).tiny)
        assert ((fused.double() - unfused.double()).abs() <= ulp).all()
    else:
        assert torch.equal(fused, unfused)


def test_views_of_one_fused_weight_and_bad_input():
    """gate and up as the two halves of a gate_up copy (Phi-3's layout), against float64: each product's float32 or
    float64 sum of k terms is off by at most k eps (|x| @ |w|.T), through silu (slope at most 1.1) and the product
    of the two within 3 k eps A B (A, B those bounds); a one-line error for mismatched weights and an unknown
    activation."""
    dtype, k = (torch.float64 if DEVICE.type == "cpu" else torch.float32), 64
    x, both = torch.randn(4, k, dtype=dtype, device=DEVICE), torch.randn(96, k, dtype=dtype, device=DEVICE)
    gate, up = both.chunk(2)
    xd, gated, upd = x.double(), gate.double(), up.double()
    want = torch.nn.functional.silu(xd @ gated.T) * (xd @ upd.T)
    bound = 3 * k * torch.finfo(dtype).eps * (xd.abs() @ gated.abs().T) * (xd.abs() @ upd.abs().T)
    assert ((few_row_gated(x, gate, up).double() - want).abs() <= bound).all()
    for bad, message in [((x, gate, up[:-1]), "gate and up weights of one shape and dtype"),
                         ((x, gate, up, "relu"), "activation one of")]:  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(message)) as error:
            few_row_gated(*bad)
        assert "\n" not in str(error.value)


def test_gated_step_takes_the_kernel_only_where_a_decode_step_would(monkeypatch):
    """gated_step: the gated kernel's bits inside the engine's decode with gradients off, for gate and up wide enough
    together; None (the caller computes its own way) outside the engine, with gradients, below MIN_OUT_FEATURES,
    for mismatched weights or an activation the kernel does not know."""
    from liger_patch_kd.generation.decode_attention import decode_kernel
    from liger_patch_kd.generation.few_row_linear import gated_step

    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    x, gate, up = (torch.randn(*shape, dtype=STEP_DTYPE, device=DEVICE) for shape in ((4, 64), (48, 64), (48, 64)))
    with torch.no_grad():
        assert gated_step(x, gate, up, "silu") is None  # outside the engine's decode
        with decode_kernel():
            assert torch.equal(gated_step(x, gate, up, "silu"), few_row_gated(x, gate, up, "silu"))
            assert gated_step(x, gate, up[:-1], "silu") is None
            assert gated_step(x, gate, up, "relu") is None
            monkeypatch.setattr(few_row_module, "MIN_OUT_FEATURES", 2 * 48 + 1)
            assert gated_step(x, gate, up, "silu") is None
            monkeypatch.setattr(few_row_module, "MIN_OUT_FEATURES", 2 * 48)
            assert gated_step(x, gate, up, "silu") is not None
    with decode_kernel():
        assert gated_step(x, gate.requires_grad_(), up, "silu") is None  # gradients on


def _counted_gated(calls: list):
    """few_row_linear.launch, appending to `calls` at each launch of the gated kernel (an up weight given)."""
    launch = few_row_module.launch

    def counted(x, weight, up_weight=None, **options):
        if up_weight is not None:
            calls.append(1)
        return launch(x, weight, up_weight, **options)

    return counted


def _decode(model, monkeypatch, fuse: bool, **options):
    """(tokens, log-probs) of a decode call, and how many fused MLP launches it made."""
    with monkeypatch.context() as m:
        if not fuse:
            m.setattr(kernel_twin_module, "fuse_decode_mlp", lambda twin, spec: 0)
        calls = []
        m.setattr(few_row_module, "launch", _counted_gated(calls))
        ids, mask = (t.to(DEVICE) for t in _prompts())
        torch.manual_seed(5)
        out = decode(model, ids, mask, max_new_tokens=6, sampling=Sampling(temperature=0.9), pad_id=0,
                     logprobs=True, capture="eager", **options)  # fmt: skip
    release_sessions(model)
    return out, len(calls)


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma", "qwen3"])
def test_a_fused_session_decodes_what_an_unfused_one_decodes(arch, monkeypatch):
    """float64 on a CPU (the interpreter): log-probs to float64 rounding; bfloat16 on a GPU: the same bits (the
    fused kernel sums each product as the unfused one does). One fused launch a layer a decode step; none in the
    prefill (3 prompts of 6 tokens: 18 rows, more than mlp_fusion.FUSED_ROWS)."""
    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    model = _engine_model(arch, STEP_DTYPE, seed=7).to(DEVICE)
    (tokens, logprobs), launches = _decode(model, monkeypatch, fuse=True)
    (plain, plain_logprobs), unfused_launches = _decode(model, monkeypatch, fuse=False)
    assert torch.equal(tokens, plain)
    torch.testing.assert_close(logprobs, plain_logprobs, rtol=0, atol=1e-10 if DEVICE.type == "cpu" else 0.0)
    layers = model.config.get_text_config().num_hidden_layers
    assert launches == layers * (tokens.shape[1] - 1) and unfused_launches == 0


def test_fused_projections_and_autocast_copies_are_the_weights_it_reads(monkeypatch):
    """With fuse_projections (gate/up in one copy), and with float32 weights under bfloat16 autocast (the copies
    cast once a call): the fused MLP reads those copies and decodes what the unfused one does, to the bit but where
    the CPU's interpreted activation kernel truncates its bfloat16 output (test above): there to bfloat16's
    rounding."""
    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    model = _engine_model("llama", torch.float32, seed=8).to(DEVICE)
    for autocast, options in ((False, {"fuse_projections": True}), (True, {})):
        model = model.to(torch.float32 if autocast else STEP_DTYPE)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
            (tokens, logprobs), launches = _decode(model, monkeypatch, fuse=True, **options)
            (plain, plain_logprobs), _ = _decode(model, monkeypatch, fuse=False, **options)
        assert launches > 0 and torch.equal(tokens, plain)
        tol = 5e-2 if autocast and DEVICE.type == "cpu" else 0.0
        torch.testing.assert_close(logprobs, plain_logprobs, rtol=0, atol=tol)


def test_a_hook_gradients_or_a_call_outside_the_engine_run_the_forward_the_module_had(monkeypatch):
    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    model = _engine_model("llama", STEP_DTYPE, seed=9).to(DEVICE)
    seen = []
    handle = model.model.layers[0].mlp.up_proj.register_forward_hook(lambda *a: seen.append(1))
    (_, _), launches = _decode(model, monkeypatch, fuse=True)
    handle.remove()
    layers = model.config.num_hidden_layers
    assert seen and launches and launches % (layers - 1) == 0  # every layer but the hooked one
    twin = kernel_twin(model)
    ids, mask = (t.to(DEVICE) for t in _prompts())
    calls = []
    monkeypatch.setattr(few_row_module, "launch", _counted_gated(calls))
    with torch.no_grad():
        got = twin(input_ids=ids[:, -1:], attention_mask=mask[:, -1:]).logits
        want = model(input_ids=ids[:, -1:], attention_mask=mask[:, -1:]).logits
    twin(input_ids=ids[:, -1:], attention_mask=mask[:, -1:]).logits.sum().backward()
    assert not calls
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 if DEVICE.type == "cpu" else 2e-2)
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("arch", ["phi3", "llama"])
def test_a_forward_of_someone_elses_on_gate_or_up_keeps_the_fused_mlp_away(arch, monkeypatch):
    """accelerate's hook (an instance-level forward) on Phi-3's gate_up_proj, a user's wrapper on Llama's
    gate_proj: the fused MLP would compute x @ W.T without them; those layers run the forward they had, and the
    session decodes what the model's own forward gives."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    from .test_engine_kernels import _forward_logprobs

    class Halved(ModelHook):
        def post_forward(self, module, output):
            return output * 0.5

    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    model = _engine_model(arch, STEP_DTYPE, seed=7).to(DEVICE)
    for layer in model.model.layers:
        if arch == "phi3":
            add_hook_to_module(layer.mlp.gate_up_proj, Halved())
        else:
            gate = layer.mlp.gate_proj
            gate.forward = lambda x, _f=gate.forward: _f(x) * 0.5
    (tokens, logprobs), launches = _decode(model, monkeypatch, fuse=True)
    assert launches == 0
    ids, mask = (t.to(DEVICE) for t in _prompts())
    want = _forward_logprobs(model, ids, mask, tokens)
    torch.testing.assert_close(logprobs.double(), want, rtol=0, atol=2e-6 if DEVICE.type == "cpu" else 0.1)
