"""generation.attention_fusion: a decode twin's Llama-laid-out attention rotates q and k, writes the cache's new column
and attends in one kernel at the engine's decode steps. The registry's claim about each class's layout holds for
the installed transformers; a fused session decodes what an unfused one decodes (tokens, log-probs) and what the
uncached reference loop samples; every step outside the engine's decode (a prefill, a forward with gradients, a
caller outside the engine's kernel block) runs the forward the module had; the user's modules keep theirs."""

import ast
import inspect
import textwrap

import pytest
import torch

from liger_patch_kd.generation import Sampling, decode, release_sessions
from liger_patch_kd.generation import kernel_twin as kernel_twin_module
from liger_patch_kd.generation.engine import session_of
from liger_patch_kd.generation.kernel_twin import kernel_twin
from liger_patch_kd.models.registry import REGISTRY
from liger_patch_kd.ops.backend import triton_available

from .helpers import DEVICE, claimed_classes
from .test_engine_kernels import ENGINE_ARCHS, _engine_model, _prompts
from .test_generation import decodes_as_the_reference

pytestmark = [
    pytest.mark.usefixtures("clean_patches"),
    pytest.mark.skipif(not triton_available(), reason="the fused step is a Triton kernel"),
]

FUSED_ARCHS = [arch for arch in ENGINE_ARCHS if REGISTRY[arch].attention]
# the statements of an attention forward laid out as Llama's (the cache argument named `cache` or `past_key_values`,
# a sliding_window keyword to the attention function dropped: the fused step takes no window)
LLAMA_LAYOUT = [
    "input_shape = hidden_states.shape[:-1]",
    "hidden_shape = (*input_shape, -1, self.head_dim)",
    "query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
    "key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
    "value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
    "cos, sin = position_embeddings",
    "query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)",
    "if CACHE is not None:\n    key_states, value_states = CACHE.update(key_states, value_states, self.layer_idx, ...)",
    "attention_interface: Callable = ...",
    "attn_output, attn_weights = attention_interface(self, query_states, key_states, value_states, attention_mask, "
    "dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)",
    "attn_output = attn_output.reshape(*input_shape, -1).contiguous()",
    "attn_output = self.o_proj(attn_output)",
    "return (attn_output, attn_weights)",
]
NORMS_LAYOUT = [
    *LLAMA_LAYOUT[:2],
    "query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)",
    "key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)",
    *LLAMA_LAYOUT[4:],
]


def _layout(cls) -> list[str]:
    """The statements of `cls.forward`, unparsed, with the cache's name, the update's trailing arguments (the cache
    kwargs of one transformers or another: SlotCache.update takes and ignores them), the attention function's lookup
    and a sliding_window keyword normalised."""
    function = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))).body[0]
    cache = next((a.arg for a in function.args.args if a.arg in ("cache", "past_key_values")), None)
    statements = []
    for node in function.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # the docstring
            continue
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "attention_interface":
            statements.append("attention_interface: Callable = ...")
            continue
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and ast.unparse(call.func) == "attention_interface":
                call.keywords = [k for k in call.keywords if k.arg != "sliding_window"]
            if isinstance(call, ast.Call) and ast.unparse(call.func) == f"{cache}.update":
                call.args, call.keywords = call.args[:3] + [ast.Name("...")], []
        text = ast.unparse(node)
        statements.append(text.replace(f"{cache} is not None", "CACHE is not None").replace(f"{cache}.update",
                                                                                             "CACHE.update"))
    return statements


@pytest.mark.parametrize("arch", sorted(a for a, spec in REGISTRY.items() if spec.attention))
def test_each_attention_the_registry_names_is_laid_out_as_claimed_in_the_installed_transformers(arch):
    want = NORMS_LAYOUT if REGISTRY[arch].attention_norms else LLAMA_LAYOUT
    assert all(_layout(cls) == want for cls in claimed_classes(arch, "attention"))


@pytest.mark.parametrize("module, name", [("olmo2", "Olmo2Attention"), ("smollm3", "SmolLM3Attention"),
                                          ("qwen3", "Qwen3Attention"), ("llama", "LlamaAttention")])  # fmt: skip
def test_a_layout_of_another_kind_is_told_apart(module, name):
    """The check above can fail: OLMo-2 normalises whole projections, SmolLM3 skips RoPE on some layers, and each
    of Llama's and Qwen3's layouts is not the other's."""
    import importlib

    cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    layout = _layout(cls)
    assert layout != (LLAMA_LAYOUT if name == "Qwen3Attention" else NORMS_LAYOUT)
    if name not in ("Qwen3Attention", "LlamaAttention"):
        assert layout != LLAMA_LAYOUT


def _calls(monkeypatch, module, name: str) -> list:
    """Record every call of `module.<name>`, still calling it."""
    calls, function = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or function(*a, **k))
    return calls


def _unfused(monkeypatch):
    monkeypatch.setattr(kernel_twin_module, "fuse_decode_attention", lambda twin, spec: 0)


def _decode(model, monkeypatch, fuse: bool, **options):
    with monkeypatch.context() as m:
        if not fuse:
            _unfused(m)
        ids, mask = (t.to(DEVICE) for t in _prompts())
        torch.manual_seed(9)
        out = decode(model, ids, mask, max_new_tokens=7, sampling=Sampling(temperature=0.9), pad_id=0,
                     logprobs=True, capture="eager", **options)  # fmt: skip
        twin = session_of(model).model
        bound = sum("forward" in m.__dict__ and m.forward.__func__.__name__ == "forward"
                    and m.forward.__func__.__module__.endswith("attention_fusion") for m in twin.modules())  # fmt: skip
    release_sessions(model)
    return out, bound


@pytest.mark.parametrize("arch", FUSED_ARCHS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_fused_session_decodes_what_an_unfused_one_decodes(arch, dtype, monkeypatch):
    """float64 on a CPU: the interpreter's float64 kernels, attention summed in another order (the new column first),
    so log-probs agree to float64 rounding; float32 (compiled on a GPU): to float32 rounding."""
    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    if dtype == torch.float64 and DEVICE.type == "cuda":
        pytest.skip("Triton lowers no float64 product on a GPU: float64 attends through SDPA there")
    model = _engine_model(arch, dtype, seed=4).to(DEVICE)
    (fused, fused_lp), bound = _decode(model, monkeypatch, fuse=True)
    (plain, plain_lp), unbound = _decode(model, monkeypatch, fuse=False)
    layers = model.config.get_text_config().num_hidden_layers
    assert bound == layers and unbound == 0
    assert torch.equal(fused, plain)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(fused_lp, plain_lp, rtol=0, atol=tol)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_fused_session_samples_what_the_uncached_reference_samples(arch, monkeypatch):
    if DEVICE.type == "cuda":
        pytest.skip("float64 through the interpreter")
    monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    model = _engine_model(arch, torch.float64, seed=1)
    decodes_as_the_reference(model, Sampling(temperature=0.8, top_k=30))  # top-k: torch's draw, as the reference
    assert sum("forward" in m.__dict__ for m in session_of(model).model.modules()
               if isinstance(m, tuple(REGISTRY[arch].classes(REGISTRY[arch].attention))))  # fmt: skip
    release_sessions(model)


def test_a_step_outside_the_engines_decode_runs_the_forward_the_module_had(monkeypatch):
    """A prefill (every position), a forward with gradients, a one-position call outside the engine: the rotating
    forward, no fused launch."""
    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    import liger_patch_kd.generation.attention_fusion as fusion

    model = _engine_model("llama", torch.float32, seed=2).to(DEVICE)
    twin = kernel_twin(model)
    ids, mask = (t.to(DEVICE) for t in _prompts())
    launches = _calls(monkeypatch, fusion, "rope_write_attend")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        got = twin(input_ids=ids, attention_mask=mask).logits
        got_one = twin(input_ids=ids[:, -1:], attention_mask=mask[:, -1:]).logits
        want_one = model(input_ids=ids[:, -1:], attention_mask=mask[:, -1:]).logits
    twin(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert not launches
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_one, want_one, rtol=1e-5, atol=1e-5)


def test_the_users_attention_modules_keep_their_forward():
    model = _engine_model("llama", torch.float64, seed=0)
    kernel_twin(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_rope_function_of_the_users_keeps_the_fused_step_away(monkeypatch):
    """apply_rotary_pos_emb replaced by the user (not transformers'): bind_kernels leaves the attention forward as
    it is, and so does the fusion: the user's rotation runs."""
    import transformers.models.llama.modeling_llama as modeling

    calls = []
    original = modeling.apply_rotary_pos_emb

    def mine(q, k, cos, sin, *args, **kwargs):
        calls.append(1)
        return original(q, k, cos, sin, *args, **kwargs)

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", mine)
    twin = kernel_twin(_engine_model("llama", torch.float64, seed=0))
    attention = [m for m in twin.modules() if type(m).__name__ == "LlamaAttention"]
    assert attention and not any("forward" in m.__dict__ for m in attention)


def test_a_student_patched_by_apply_kd_patch_is_fused(monkeypatch):
    """KDTrainer patches its student (apply_kd_patch: the modeling module's apply_rotary_pos_emb is the kernel):
    its session's attention is fused all the same, and decodes what the unfused one decodes."""
    from liger_patch_kd.models import apply_kd_patch

    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    model = _engine_model("llama", torch.float32, seed=5).to(DEVICE)
    apply_kd_patch(model=model)
    (fused, fused_lp), bound = _decode(model, monkeypatch, fuse=True)
    (plain, plain_lp), _ = _decode(model, monkeypatch, fuse=False)
    assert bound == model.config.num_hidden_layers
    assert torch.equal(fused, plain)
    torch.testing.assert_close(fused_lp, plain_lp, rtol=0, atol=2e-5)


@pytest.mark.parametrize("arch, kv_heads, autocast", [("llama", 4, False), ("qwen3", 2, True)])
def test_a_step_the_kernel_does_not_take_projects_once(arch, kv_heads, autocast, monkeypatch):
    """Plain multi-head attention (told before the projections) and Qwen3's float32 q/k norms under bf16 autocast
    (told after them: dtypes the kernel does not take): each projection runs once a step, and the tokens are the
    unfused session's."""
    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    model = _engine_model(arch, torch.float32, seed=6).to(DEVICE)
    if not autocast:  # the tiny config's 4 query heads over 4 key/value heads: no groups
        model = tiny_mha(arch, kv_heads)
    import liger_patch_kd.generation.attention_fusion as fusion

    tails = _calls(monkeypatch, fusion, "rope") if autocast else None  # the forward's remaining steps
    runs = []
    for fuse in (True, False):
        calls = []
        hooks = [layer.self_attn.q_proj.register_forward_hook(lambda *a: calls.append(1))
                 for layer in model.model.layers]  # fmt: skip
        context = torch.autocast(DEVICE.type, torch.bfloat16) if autocast else torch.enable_grad()
        with context:
            (tokens, logprobs), _ = _decode(model, monkeypatch, fuse=fuse)
        for hook in hooks:
            hook.remove()
        runs.append((tokens, logprobs, len(calls)))
    assert runs[0][2] == runs[1][2]
    assert tails is None or tails  # Qwen3 under autocast: told after the projections
    assert torch.equal(runs[0][0], runs[1][0])
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=0)


def tiny_mha(arch, heads):
    """A tiny Llama with as many key/value heads as query heads (tiny_model's configs all group them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    assert arch == "llama"
    torch.manual_seed(6)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=heads, vocab_size=257, max_position_embeddings=128)  # fmt: skip
    model = LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = None
    return model.eval().to(DEVICE)


def test_a_users_wrapper_of_the_patched_kernel_keeps_the_fused_step_away(monkeypatch):
    """apply_kd_patch, then the user's own apply_rotary_pos_emb made with functools.wraps around the kernel (which
    copies the kernel's attributes): the wrapper is theirs, so it runs at every decode step, as unfused."""
    import functools

    import transformers.models.llama.modeling_llama as modeling

    from liger_patch_kd.models import apply_kd_patch

    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    model = _engine_model("llama", torch.float32, seed=5).to(DEVICE)
    apply_kd_patch(model=model)
    kernel, calls = modeling.apply_rotary_pos_emb, []

    @functools.wraps(kernel)
    def mine(q, k, cos, sin, *args, **kwargs):
        calls.append(q.shape[2])
        return kernel(q, k, cos, sin, *args, **kwargs)

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", mine)
    _, bound = _decode(model, monkeypatch, fuse=True)
    assert bound == 0 and calls.count(1) == 6 * model.config.num_hidden_layers  # every decode step, every layer


def test_a_strided_new_key_runs_the_forwards_remaining_steps(monkeypatch):
    """A hook on k_proj handing on the same values as a stride-2 view: the kernel reads the head dim as contiguous,
    so the step runs the forward's remaining steps (which copy it into the cache) and decodes as unfused."""
    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    model = _engine_model("llama", torch.float32, seed=7).to(DEVICE)
    for layer in model.model.layers:
        layer.self_attn.k_proj.register_forward_hook(lambda module, args, out: torch.stack([out, out], -1)[..., 0])
    (fused, fused_lp), _ = _decode(model, monkeypatch, fuse=True)
    (plain, plain_lp), _ = _decode(model, monkeypatch, fuse=False)
    assert torch.equal(fused, plain)
    torch.testing.assert_close(fused_lp, plain_lp, rtol=0, atol=0)


@pytest.mark.parametrize("kernels", [True, False])
def test_a_student_patched_at_class_level_decodes_in_the_engine(kernels, monkeypatch):
    """apply_kd_patch_to_llama() (the classes, before a model is loaded, as Liger's own functions are used): the
    KD forward hands a call without labels to transformers' forward, so the engine decodes it, fused, the same
    tokens as the unpatched model (decode_applies read the class's KD forward and refused it)."""
    from liger_patch_kd.generation import decode_applies
    from liger_patch_kd.models import apply_kd_patch_to_llama

    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    model = _engine_model("llama", torch.float32, seed=5).to(DEVICE)
    (want, want_lp), _ = _decode(model, monkeypatch, fuse=True, kernels=kernels)
    apply_kd_patch_to_llama()
    assert decode_applies(model) is None
    (got, got_lp), bound = _decode(model, monkeypatch, fuse=True, kernels=kernels)
    assert bound == (model.config.num_hidden_layers if kernels else 0)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=2e-5)
