"""generation.residual_fusion: a decode twin's Llama-laid-out layers add each residual in the kernel of the norm that
reads the sum (ops.rms_norm.add_rms_norm). The registry's claim about each layer's layout holds for the installed
transformers; the kernel adds and normalises as torch does; the fused twin computes what the unfused twin computes
(to the bit where the maths is the same ops, float32 and float64) and decodes what the model decodes; a norm
returns a fused output only for the very sum it was made from."""

import ast
import inspect
import textwrap

import pytest
import torch

from liger_patch_kd.generation import Sampling, decode, release_sessions, residual_fusion
from liger_patch_kd.generation import kernel_twin as kernel_twin_module
from liger_patch_kd.generation.engine import session_of
from liger_patch_kd.generation.kernel_twin import kernel_twin
from liger_patch_kd.models.registry import REGISTRY
from liger_patch_kd.ops.backend import triton_available
from liger_patch_kd.ops.rms_norm import add_rms_norm, rms_norm_torch

from .helpers import DEVICE, claimed_classes
from .test_engine_kernels import ENGINE_ARCHS, _engine_model, _prompts

pytestmark = pytest.mark.usefixtures("clean_patches")

FUSED_ARCHS = [arch for arch in ENGINE_ARCHS if REGISTRY[arch].residual_layers]
# the statements of a layer laid out as Llama's; the attention's keywords are the layer's own, passed on as named
LLAMA_LAYOUT = [
    "residual = hidden_states",
    "hidden_states = self.input_layernorm(hidden_states)",
    "hidden_states, _ = self.self_attn(...)",
    "hidden_states = residual + hidden_states",
    "residual = hidden_states",
    "hidden_states = self.post_attention_layernorm(hidden_states)",
    "hidden_states = self.mlp(hidden_states)",
    "hidden_states = residual + hidden_states",
    "return hidden_states",
]


def _layout(cls) -> list[str]:
    """The statements of `cls.forward`, each unparsed, the attention call's keywords reduced to '...' where they
    pass on every parameter of the forward as itself, and **kwargs (what the fused forward passes on)."""
    function = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))).body[0]
    arguments = function.args
    own = {a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs} - {"self", "hidden_states"}
    statements = []
    for node in function.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # the docstring
            continue
        call = getattr(node, "value", None)
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "self.self_attn":
            named = {k.arg for k in call.keywords if isinstance(k.value, ast.Name) and k.value.id == k.arg}
            rest = [k for k in call.keywords if k.arg is None]
            passed_on = named == own | {"hidden_states"} and len(named) + len(rest) == len(call.keywords)
            if passed_on and len(rest) == 1 and arguments.kwarg is not None and not call.args:
                call.keywords = []
                statements.append(ast.unparse(node).replace("self.self_attn()", "self.self_attn(...)"))
                continue
        statements.append(ast.unparse(node))
    return statements


@pytest.mark.parametrize("arch", sorted(a for a, spec in REGISTRY.items() if spec.residual_layers))
def test_each_layer_the_registry_names_is_laid_out_as_llamas_in_the_installed_transformers(arch):
    for cls in claimed_classes(arch, "residual_layers"):
        assert _layout(cls) == LLAMA_LAYOUT, cls.__name__
        assert list(inspect.signature(inspect.unwrap(cls.forward)).parameters)[:2] == ["self", "hidden_states"]


def test_a_layer_laid_out_otherwise_is_told_apart():
    """The check above can fail: Gemma-2's layer normalises the attention's output before its add."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2DecoderLayer

    assert _layout(Gemma2DecoderLayer) != LLAMA_LAYOUT


BACKENDS = ["torch", "triton"] if triton_available() else ["torch"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "x_dtype, residual_dtype, weight_dtype, casting",
    [
        (torch.float64, torch.float64, torch.float64, "llama"),
        (torch.float32, torch.float32, torch.float32, "llama"),
        (torch.bfloat16, torch.float32, torch.float32, "llama"),  # an autocast product's output, an fp32 residual
        (torch.float32, torch.float32, torch.float32, "gemma"),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16, "olmo"),
    ],
)
def test_the_fused_add_and_norm_are_torchs_add_then_the_norm(backend, x_dtype, residual_dtype, weight_dtype,
                                                             casting):  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 48, generator=g).to(x_dtype).to(DEVICE)
    residual = torch.randn(4, 3, 48, generator=g).to(residual_dtype).to(DEVICE)
    weight = torch.rand(48, generator=g).to(weight_dtype).to(DEVICE)
    offset = 1.0 if casting == "gemma" else 0.0
    summed, normed = add_rms_norm(x, residual, weight, 1e-6, offset, casting, backend=backend)
    want_sum = residual + x
    want = rms_norm_torch(want_sum, weight, 1e-6, offset, casting)
    assert summed.dtype == want_sum.dtype and normed.dtype == want.dtype and normed.shape == x.shape
    bf16 = torch.bfloat16 in (x_dtype, residual_dtype, weight_dtype)
    interpreted = backend == "triton" and DEVICE.type == "cpu"
    if not (bf16 and interpreted):  # the interpreter rounds float32 to bfloat16 otherwise than a GPU (and torch)
        assert torch.equal(summed, want_sum)  # one rounding of the exact sum, as torch's add
    # the norm: float32 maths in the kernel (a reduction in another order: a few float32 ulps); exact in torch
    ulps = {torch.float64: 0, torch.float32: 4, torch.bfloat16: 2}[want.dtype]
    if backend == "torch":
        assert torch.equal(normed, want)
    else:
        scale = want.abs().max().item()
        eps = torch.finfo(torch.float32 if want.dtype == torch.float64 else want.dtype).eps
        bound = (4 if want.dtype == torch.float64 else ulps + (1 if interpreted else 0)) * eps * scale
        assert (normed.double() - want.double()).abs().max().item() <= bound


def test_a_fused_norm_output_in_autocasts_dtype_is_the_norm_cast_once():
    g = torch.Generator().manual_seed(1)
    x, residual = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    weight = torch.rand(64, generator=g)
    summed, normed = add_rms_norm(x, residual, weight, 1e-5, out_dtype=torch.bfloat16, backend="torch")
    assert normed.dtype == torch.bfloat16
    assert torch.equal(normed, rms_norm_torch(residual + x, weight, 1e-5).to(torch.bfloat16))


def test_mismatched_shapes_are_one_line_naming_both():
    with pytest.raises(ValueError, match=r"x \(2, 8\) and residual \(2, 4\)"):
        add_rms_norm(torch.ones(2, 8), torch.ones(2, 4), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"weight \(4,\) must be \(8,\)"):
        add_rms_norm(torch.ones(2, 8), torch.ones(2, 8), torch.ones(4), 1e-6)


def _unfused(monkeypatch):
    monkeypatch.setattr(kernel_twin_module, "fold_residual_adds", lambda twin, spec: 0)


@pytest.mark.parametrize("arch", FUSED_ARCHS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_fused_twin_computes_what_the_unfused_twin_computes(arch, dtype, monkeypatch):
    """float64: the kernels' PyTorch paths, the same ops in the same order (to the bit). float32: the Triton
    kernels (the interpreter on a CPU): the fused kernel adds in float32 as torch does and normalises with the norm
    kernel's own code (to the bit)."""
    if dtype == torch.float32 and DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    model = _engine_model(arch, dtype, seed=3).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in _prompts())
    fused = kernel_twin(model)
    with monkeypatch.context() as m:
        _unfused(m)
        plain = kernel_twin(model)
    layer_classes = tuple(REGISTRY[arch].classes(REGISTRY[arch].residual_layers))
    folded = [[isinstance(m, layer_classes) and "forward" in m.__dict__ for m in t.modules()] for t in (fused, plain)]
    assert any(folded[0]) and not any(folded[1])
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=mask).logits
        got = fused(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma"])
def test_under_autocast_the_fused_twin_computes_what_the_unfused_twin_computes(arch, monkeypatch):
    """float32 weights under bf16 autocast, the kernels' PyTorch paths: the fused norms written in bf16 for the
    products (q/k/v, gate/up, the head) are autocast's own cast of them, so the logits are the same bits."""
    model = _engine_model(arch, torch.float32, seed=8)
    ids, mask = _prompts()
    fused = kernel_twin(model)
    with monkeypatch.context() as m:
        _unfused(m)
        plain = kernel_twin(model)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        want = plain(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
        got = fused(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_fused_decoding_samples_what_the_model_samples(monkeypatch):
    """Through the engine (eager steps), sampled tokens and their log-probs: fused and unfused runs alike."""
    runs = []
    for fold in (True, False):
        model = _engine_model("qwen3", torch.float64, seed=4)
        ids, mask = _prompts()
        with monkeypatch.context() as m:
            if not fold:
                _unfused(m)
            torch.manual_seed(9)
            runs.append(decode(model, ids, mask, max_new_tokens=6, sampling=Sampling(temperature=0.9), pad_id=0,
                               logprobs=True, capture="eager"))  # fmt: skip
            folded = sum("forward" in layer.__dict__ for layer in session_of(model).model.model.layers)
            assert folded == (len(model.model.layers) if fold else 0)
        release_sessions(model)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_a_norm_takes_the_fused_output_only_for_that_very_sum():
    model = _engine_model("llama", torch.float64, seed=5)
    twin = kernel_twin(model)
    norm = twin.model.layers[0].post_attention_layernorm
    spec = REGISTRY["llama"]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, model.config.hidden_size, generator=g, dtype=torch.float64)
    residual = torch.randn(x.shape, generator=g, dtype=torch.float64)

    def own(h):
        return rms_norm_torch(h, norm.weight, norm.variance_epsilon)

    with torch.no_grad():
        summed = residual_fusion.add_for_norm(spec, residual, x, norm, read_in_autocast=False)
        left = norm.__dict__[residual_fusion.PRENORMED][2]
        assert norm(summed) is left  # the very sum: the output the fused kernel made, nothing computed
        assert residual_fusion.PRENORMED not in norm.__dict__  # taken once
        summed = residual_fusion.add_for_norm(spec, residual, x, norm, read_in_autocast=False)
        left = norm.__dict__[residual_fusion.PRENORMED][2]
        other = summed.clone()  # equal values, another tensor
        out = norm(other)
        assert out is not left and torch.equal(out, own(other))
        summed = residual_fusion.add_for_norm(spec, residual, x, norm, read_in_autocast=False)
        summed.mul_(2)  # changed in place after the fused kernel read it
        assert torch.equal(norm(summed), own(summed))
    with torch.enable_grad():  # a forward with gradients adds and normalises as the model does
        assert torch.equal(residual_fusion.add_for_norm(spec, residual, x, norm, False), residual + x)
        assert residual_fusion.PRENORMED not in norm.__dict__


def test_the_users_layers_keep_their_forward():
    model = _engine_model("llama", torch.float64, seed=6)
    kernel_twin(model)
    assert not any("forward" in module.__dict__ for module in model.modules())


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bf16", "fp32-autocast"])
def test_on_a_gpu_the_fused_twin_computes_what_the_unfused_twin_computes_in_bf16(weights, monkeypatch):
    """The compiled kernels round float32 to bfloat16 as torch does: with bf16 weights, and with float32 weights
    under bf16 autocast (where the fused norms are written in bf16 for their products), to the bit."""
    if DEVICE.type != "cuda":
        pytest.skip("compiled kernels: a GPU")
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    model = _engine_model("llama", torch.float32, seed=7).to(DEVICE, dtype)
    ids, mask = (t.to(DEVICE) for t in _prompts())
    fused = kernel_twin(model)
    with monkeypatch.context() as m:
        _unfused(m)
        plain = kernel_twin(model)
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=weights != "bf16"):
        want = plain(input_ids=ids, attention_mask=mask).logits
        got = fused(input_ids=ids, attention_mask=mask).logits
    assert got.dtype == want.dtype and torch.equal(got, want)


def _steered_decode(write: str, mode: str, fold: bool, monkeypatch):
    """Greedy decode of a float64 Llama whose first layer has the user's activation-steering hook: it adds a vector
    to the layer's output in place (under inference mode, which keeps no version counter; or through `.data`,
    which the counter does not see)."""
    import contextlib

    model = _engine_model("llama", torch.float64, seed=3)
    steer = 5 * torch.randn(model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def hook(module, args, output):
        (output.data if write == "data" else output).add_(steer)

    model.model.layers[0].register_forward_hook(hook)
    ids, mask = _prompts()
    with monkeypatch.context() as m:
        if not fold:
            _unfused(m)
        with torch.inference_mode() if mode == "inference" else contextlib.nullcontext():
            tokens, logprobs = decode(model, ids, mask, max_new_tokens=4, sampling=Sampling(temperature=0.0),
                                      pad_id=0, capture="eager", logprobs=True)  # fmt: skip
    release_sessions(model)
    return tokens.clone(), logprobs.clone()


@pytest.mark.parametrize("mode, write", [("inference", "in_place"), ("no_grad", "data")])
def test_a_hook_that_changes_a_sum_in_place_unseen_gets_the_norm_of_what_it_left(mode, write, monkeypatch):
    """Found by an adversarial pass: the handed-over norm was that of the sum before the hook's change. Where a hook
    of the user's runs between the fused add and its norm, the norm computes its own."""
    fused = _steered_decode(write, mode, True, monkeypatch)
    unfused = _steered_decode(write, mode, False, monkeypatch)
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1])


def test_a_16_bit_norm_under_another_16_bit_autocast_keeps_its_own_dtype(monkeypatch):
    """Found by an adversarial pass: a bf16 model's norm under fp16 autocast is bf16 values that autocast casts; the
    fused kernel wrote the float32 norm straight to fp16 (other values). Only a float32 norm is written in autocast's
    dtype."""
    monkeypatch.setenv("LIGER_KD_BACKEND", "triton" if triton_available() else "torch")
    model = _engine_model("llama", torch.bfloat16, seed=5).to(DEVICE)
    twin = kernel_twin(model)
    norm = twin.model.layers[0].post_attention_layernorm
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, model.config.hidden_size, generator=g).to(torch.bfloat16).to(DEVICE)
    residual = torch.randn(x.shape, generator=g).to(torch.bfloat16).to(DEVICE)
    with torch.no_grad(), torch.autocast(DEVICE.type, torch.float16):
        summed = residual_fusion.add_for_norm(REGISTRY["llama"], residual, x, norm, read_in_autocast=True)
        assert norm(summed).dtype == torch.bfloat16
