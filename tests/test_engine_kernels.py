"""The decode engine runs the project's RMSNorm / RoPE / gated-MLP kernels whether or not the model is patched
(generation/kernel_twin.py), and decodes what the model decodes: for every registry architecture with a tiny config
that the engine can run, greedy tokens equal transformers' generate() and each token's log-prob equals the model's
own forward's, in float64 (the kernels' PyTorch paths) and in float32 through the Triton kernels (the interpreter).
The user's model is left as it was: no forward bound on it, transformers' RoPE function unchanged, the same
training forward."""

import pytest
import torch
from transformers import GenerationConfig

from liger_patch_kd.generation import Sampling, decode, decode_applies, decode_forward_options, release_sessions
from liger_patch_kd.generation import few_row_linear as few_row_module
from liger_patch_kd.generation.engine import session_of
from liger_patch_kd.generation.kernel_twin import kernel_twin
from liger_patch_kd.models import apply_kd_patch
from liger_patch_kd.models import patch as patch_module
from liger_patch_kd.models.registry import REGISTRY

from .tiny_models import ALL_ARCHS, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")

# Mistral's window off, as its later checkpoints have it (the engine refuses a sliding window; Gemma-2/3, Cohere-2
# and GPT-OSS always have one, and transformers' own masks need it set)
FULL_ATTENTION = {"mistral": dict(sliding_window=None)}


def _engine_model(arch: str, dtype: torch.dtype, seed: int = 0):
    """The tiny model of `arch` with SDPA attention and full attention, or None where the engine cannot run it (no
    SDPA in transformers, or decode_applies refuses it for another reason)."""
    try:
        model = tiny_model(arch, dtype=dtype, seed=seed, **FULL_ATTENTION.get(arch, {}))
        model.set_attn_implementation("sdpa")
    except (ValueError, TypeError):  # no SDPA for this class in transformers, or a config it does not take
        return None
    model.generation_config.eos_token_id = None  # generate() runs every row to max_new_tokens, as decode() does
    return model.eval() if decode_applies(model) is None else None


ENGINE_ARCHS = [arch for arch in ALL_ARCHS if _engine_model(arch, torch.float64) is not None]


def test_the_engine_covers_most_of_the_registry():
    """The list below is what decode_applies takes on the tiny configs: an architecture dropping out is a change
    to look at, not a test to skip."""
    assert set(ENGINE_ARCHS) >= {"llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2", "glm4", "phi3", "gemma",
                                 "granite", "cohere", "mixtral", "qwen3_moe", "qwen2_5_vl", "qwen3_vl"}  # fmt: skip


def _prompts():
    ids = torch.randint(5, 200, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    return ids.masked_fill(mask == 0, 0), mask


def _forward_logprobs(model, ids, mask, tokens):
    """Each new token's log-prob under the model's own forward over prompt + tokens (no cache)."""
    full = torch.cat([ids, tokens], 1)
    full_mask = torch.cat([mask, torch.ones_like(tokens)], 1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(
            input_ids=full, attention_mask=full_mask, position_ids=positions, **decode_forward_options(model)
        ).logits
    steps = logits[:, ids.shape[1] - 1 : -1].double().log_softmax(-1)
    return steps.gather(-1, tokens[..., None])[..., 0]


class KernelCalls:
    """Counts the kernels' calls from the bound forwards (models/patch.py's names for them)."""

    def __init__(self, monkeypatch):
        self.counts = {"rms_norm": 0, "rope": 0, "gated_act": 0}
        for name, attr in (("rms_norm", "rms_norm_kernel"), ("rope", "rope_kernel"), ("gated_act", "gated_act")):
            original = getattr(patch_module, attr)
            monkeypatch.setattr(patch_module, attr, self._counted(name, original))
        # at a few rows the decode twin's MLP runs its activation inside the gate/up product (mlp_fusion.py)
        launch = few_row_module.launch

        def launched(x, weight, up_weight=None, **options):
            self.counts["gated_act"] += up_weight is not None
            return launch(x, weight, up_weight, **options)

        monkeypatch.setattr(few_row_module, "launch", launched)

    def _counted(self, name, original):
        def wrapper(*args, **kwargs):
            self.counts[name] += 1
            return original(*args, **kwargs)

        return wrapper


def _expected_kernels(arch: str) -> set[str]:
    spec = REGISTRY[arch]
    kernels = set()
    if spec.rms_norm:
        kernels.add("rms_norm")
    if spec.mlp:
        kernels.add("gated_act")
    if spec.rope:
        kernels.add("rope")
    return kernels


# The engine returns float32 log-probs, a float32 log-softmax over 257 logits of magnitude < 8: a few float32 ulps
# there (2**-21 ~ 4.8e-7 each). float64 models, the kernels' PyTorch paths: the same ops in the same order as
# transformers, so that float32 step is the whole difference (3e-7 measured). float32 models through the Triton
# kernels: each op's rounding (2**-24 relative) besides, through two layers and the head: still a few ulps of the
# log-probs (4e-7 measured), so 10x that leaves room for another CPU's BLAS and nothing for a wrong formula.
TOLERANCE = {torch.float64: 2e-6, torch.float32: 5e-6}


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_engine_decodes_what_the_unpatched_model_decodes_through_the_kernels(arch, dtype, monkeypatch):
    if dtype == torch.float32:
        if torch.cuda.is_available():  # the interpreter is set only on machines without CUDA (conftest.py)
            pytest.skip("the float32 case runs the Triton kernels through the interpreter on CPU tensors; on a GPU "
                        "the compiled kernels decode in tests/test_generation.py's CUDA tests")  # fmt: skip
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")  # the Triton kernels, through the interpreter on a CPU
    model = _engine_model(arch, dtype, seed=2)
    ids, mask = _prompts()
    new = 6
    config = GenerationConfig(do_sample=False, max_new_tokens=new, pad_token_id=0, eos_token_id=None,
                              bos_token_id=None)  # fmt: skip
    with torch.no_grad():
        want = model.generate(
            input_ids=ids, attention_mask=mask, generation_config=config, **decode_forward_options(model)
        )[:, ids.shape[1] :]
    calls = KernelCalls(monkeypatch)
    got, logprobs = decode(model, ids, mask, max_new_tokens=new, sampling=Sampling(temperature=0.0), pad_id=0,
                           logprobs=True, capture="eager")  # fmt: skip
    assert {name for name, count in calls.counts.items() if count} == _expected_kernels(arch)
    assert torch.equal(got, want)
    torch.testing.assert_close(logprobs.double(), _forward_logprobs(model, ids, mask, got), rtol=0,
                               atol=TOLERANCE[dtype])  # fmt: skip
    release_sessions(model)


def _instance_forwards(model):
    return {name for name, module in model.named_modules() if "forward" in module.__dict__}


def test_the_users_model_is_left_as_it_was():
    model = _engine_model("llama", torch.float64, seed=3)
    from transformers.models.llama import modeling_llama

    rope, norm_forward = modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm.forward
    ids, mask = _prompts()
    model.train()
    before = model(input_ids=ids, attention_mask=mask).logits
    model.eval()
    decode(model, ids, mask, max_new_tokens=4, sampling=Sampling(), pad_id=0, fuse_projections=True)
    twin = session_of(model).model
    assert twin is not model and _instance_forwards(twin) and not _instance_forwards(model)
    assert modeling_llama.apply_rotary_pos_emb is rope and modeling_llama.LlamaRMSNorm.forward is norm_forward
    twin_params = dict(twin.named_parameters())
    assert all(twin_params[name] is p for name, p in model.named_parameters())  # shared, not copied
    model.train()
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, before, rtol=0, atol=0)
    release_sessions(model)


def test_a_patched_and_an_unpatched_model_decode_the_same_tokens_and_the_patch_stays():
    ids, mask = _prompts()
    sampling = Sampling(temperature=0.8, top_k=40)
    runs = []
    for patched in (False, True):
        model = _engine_model("qwen3", torch.float64, seed=4)
        if patched:
            apply_kd_patch(model=model)
        forwards = _instance_forwards(model)
        torch.manual_seed(5)
        runs.append(decode(model, ids, mask, max_new_tokens=6, sampling=sampling, pad_id=0, logprobs=True))
        assert _instance_forwards(model) == forwards  # a patched model keeps its KD forward and kernels
        release_sessions(model)
    assert torch.equal(runs[0][0], runs[1][0])
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=TOLERANCE[torch.float64])


def test_without_kernels_the_step_runs_the_models_own_modules(monkeypatch):
    model = _engine_model("llama", torch.float64, seed=6)
    ids, mask = _prompts()
    calls = KernelCalls(monkeypatch)
    greedy = Sampling(temperature=0.0)
    plain, _ = decode(model, ids, mask, max_new_tokens=5, sampling=greedy, pad_id=0, kernels=False)
    assert not any(calls.counts.values()) and session_of(model).model is model
    fused, _ = decode(model, ids, mask, max_new_tokens=5, sampling=greedy, pad_id=0)
    assert all(calls.counts.values()) and torch.equal(plain, fused)
    release_sessions(model)


def test_a_forward_bound_on_the_users_module_is_bound_to_its_twin():
    """accelerate's mixed-precision wrapper is a method bound on the model instance: the twin's runs on the twin
    (the kernels), and the user's stays bound to the user's model."""
    import types

    model = _engine_model("llama", torch.float64, seed=7)
    seen = []

    def wrapped_forward(self, *args, **kwargs):
        seen.append(self)
        return type(self).forward(self, *args, **kwargs)

    model.forward = types.MethodType(wrapped_forward, model)
    twin = kernel_twin(model)
    ids, mask = _prompts()
    with torch.no_grad():
        twin(input_ids=ids, attention_mask=mask)
    assert seen == [twin] and model.forward.__self__ is model


def test_the_students_benchmark_runs_its_smoke_mode(tmp_path, monkeypatch):
    """benchmarks/onpolicy/bench_decode_students --smoke: every student row at the rows asked, in one table and its
    JSON, the unpatched ones before the patch (which is reverted at the end)."""
    import json
    import sys

    from benchmarks.onpolicy import bench_decode_students

    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench", "--smoke", "--rows", "2", "--out", str(out)])
    bench_decode_students.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["student"], r["rows"]) for r in rows] == [(s, 2) for s in bench_decode_students.STUDENTS]
    assert all(r["ms_per_step"] > 0 and r["of_patched"] > 0 for r in rows)


def _zero_act_output(module, args, output):
    return torch.zeros_like(output)


def _swap_class(base: type, forward):
    """A subclass of `base` with a forward of its own."""
    return type(f"My{base.__name__}", (base,), {"forward": forward})


def _user_change(change: str, model, monkeypatch):
    """Apply one of the user's changes to what the model computes (the adversarial pass's cases)."""
    from transformers.models.llama import modeling_llama

    layers = model.model.layers
    if change == "hook on act_fn":
        for layer in layers:
            layer.mlp.act_fn.register_forward_hook(_zero_act_output)
    elif change == "act_fn replaced":
        for layer in layers:
            layer.mlp.act_fn = torch.nn.ReLU()
    elif change == "MLP subclass with its own forward":
        cls = _swap_class(modeling_llama.LlamaMLP, lambda self, x: self.down_proj(self.up_proj(x) * 0.5))
        for layer in layers:
            layer.mlp.__class__ = cls
    elif change == "RMSNorm forward set on the class":
        original = modeling_llama.LlamaRMSNorm.forward
        monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", lambda self, x: original(self, x) * 2.0)
    elif change == "apply_rotary_pos_emb replaced":
        monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", lambda q, k, cos, sin, *a, **kw: (q, -k))
    elif change == "decoder layer subclass with its own forward":
        def forward(self, hidden_states, *args, **kwargs):
            return modeling_llama.LlamaDecoderLayer.forward(self, hidden_states * 0.5, *args, **kwargs)

        cls = _swap_class(modeling_llama.LlamaDecoderLayer, forward)
        for layer in layers:
            layer.__class__ = cls
    elif change == "MLP forward set on the instance":
        for layer in layers:
            mlp = layer.mlp
            mlp.forward = lambda x, mlp=mlp: mlp.down_proj(mlp.up_proj(x) * 0.5)
    elif change == "MLP wrapped in a module of the user's":
        class Negated(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                return -self.inner(x)

        for layer in layers:
            layer.mlp = Negated(layer.mlp)
    elif change == "MLP forward set as a functools.partial":  # how accelerate's hooks set a forward
        import functools

        for layer in layers:
            layer.mlp.forward = functools.partial(lambda mlp, x: mlp.down_proj(mlp.up_proj(x) * 0.5), layer.mlp)
    elif change == "RMSNorm epsilon changed":
        for module in model.modules():
            if isinstance(module, modeling_llama.LlamaRMSNorm):
                module.variance_epsilon = 0.5
    elif change == "attention scaling changed":
        for layer in layers:
            layer.self_attn.scaling *= 16


USER_CHANGES = ["hook on act_fn", "act_fn replaced", "MLP subclass with its own forward",
                "RMSNorm forward set on the class", "apply_rotary_pos_emb replaced",
                "decoder layer subclass with its own forward"]  # fmt: skip


def _model_to_change(change: str):
    """The tiny Llama the change tests decode; for the RoPE change its attention sharper and louder than a tiny
    random model's, where RoPE barely counts."""
    model = _engine_model("llama", torch.float64, seed=3)
    with torch.no_grad():
        for layer in model.model.layers if change == "apply_rotary_pos_emb replaced" else ():
            for proj, scale in (("q_proj", 6.0), ("k_proj", 6.0), ("o_proj", 20.0)):
                getattr(layer.self_attn, proj).weight.mul_(scale)
    return model


@pytest.mark.parametrize("change", USER_CHANGES)
def test_the_engine_decodes_what_a_changed_model_computes(change, monkeypatch):
    """A kernel replaces only the computation it knows: where the user changed what a module computes (a hook on
    the activation, which the gated-MLP kernel never calls; a replaced activation; a subclass or a class with a
    forward of its own; their own RoPE function), the twin keeps the model's forward there, and decodes the
    tokens and log-probs of the model's own generate() and forward (found by an adversarial pass: each of these
    once decoded from the unchanged architecture's kernels instead)."""
    model = _model_to_change(change)
    ids, mask = _prompts()
    config = GenerationConfig(do_sample=False, max_new_tokens=6, pad_token_id=0, eos_token_id=None,
                              bos_token_id=None)  # fmt: skip
    with torch.no_grad():
        unchanged = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :]
    _user_change(change, model, monkeypatch)
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :]
    assert not torch.equal(want, unchanged)  # the change does change what the model computes
    got, logprobs = decode(model, ids, mask, max_new_tokens=6, sampling=Sampling(temperature=0.0), pad_id=0,
                           logprobs=True, capture="eager")  # fmt: skip
    assert torch.equal(got, want)
    torch.testing.assert_close(logprobs.double(), _forward_logprobs(model, ids, mask, got), rtol=0,
                               atol=TOLERANCE[torch.float64])  # fmt: skip
    release_sessions(model)


def _decodes_as_generate(model, ids, mask, new: int = 6) -> torch.Tensor:
    """Greedy decode() of `new` tokens, checked against the model's own generate() (tokens) and forward (log-probs,
    to TOLERANCE): returns the tokens."""
    config = GenerationConfig(do_sample=False, max_new_tokens=new, pad_token_id=0, eos_token_id=None,
                              bos_token_id=None)  # fmt: skip
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :]
    got, logprobs = decode(model, ids, mask, max_new_tokens=new, sampling=Sampling(temperature=0.0), pad_id=0,
                           logprobs=True, capture="eager")  # fmt: skip
    assert torch.equal(got, want)
    torch.testing.assert_close(logprobs.double(), _forward_logprobs(model, ids, mask, got), rtol=0,
                               atol=TOLERANCE[torch.float64])  # fmt: skip
    return got


LATER_CHANGES = [*USER_CHANGES, "MLP forward set on the instance", "MLP forward set as a functools.partial",
                 "MLP wrapped in a module of the user's",
                 "RMSNorm epsilon changed", "attention scaling changed"]  # fmt: skip


@pytest.mark.parametrize("change", LATER_CHANGES)
def test_a_change_made_after_the_session_is_decoded(change, monkeypatch):
    """The twin and a graph are snapshots of the module tree; a change made after a session was kept (found by an
    adversarial pass: each decoded from the snapshot, up to 0.15 nats and other tokens) makes the session of the
    model as it is now, whose tokens and log-probs are the changed model's own."""
    model = _model_to_change(change)
    ids, mask = _prompts()
    before, before_logprobs = decode(model, ids, mask, max_new_tokens=6, sampling=Sampling(temperature=0.0),
                                     pad_id=0, logprobs=True, capture="eager")  # fmt: skip
    _user_change(change, model, monkeypatch)
    want = _decodes_as_generate(model, ids, mask)
    # the change changes what the model computes: other tokens, or the first call's tokens at other log-probs
    moved = (_forward_logprobs(model, ids, mask, before) - before_logprobs.double()).abs().max()
    assert not torch.equal(before, want) or moved > 10 * TOLERANCE[torch.float64]
    release_sessions(model)


def test_cohere_logit_scale_changed_after_the_session_is_decoded():
    """Cohere scales its logits by the CausalLM's plain `logit_scale` (an adversarial pass: a kept session decoded
    with the old one, 0.46 nats off, while training read the new one)."""
    model = _engine_model("cohere", torch.float64, seed=3)
    ids, mask = _prompts()
    decode(model, ids, mask, max_new_tokens=4, sampling=Sampling(temperature=0.0), pad_id=0, capture="eager")
    model.logit_scale = 3.0
    _decodes_as_generate(model, ids, mask, new=4)
    release_sessions(model)


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_decoding_and_training_leave_the_session_key_as_it_was(arch):
    """The key reads the model's state at every call: nothing a decode call or a training forward does may change
    it, or every call would build and capture a session anew."""
    from liger_patch_kd.generation.engine import sessions_of

    model = _engine_model(arch, torch.float64, seed=1)
    ids, mask = _prompts()
    decode(model, ids, mask, max_new_tokens=3, sampling=Sampling(temperature=0.0), pad_id=0, capture="eager")
    session = session_of(model)
    model.train()
    model(input_ids=ids, attention_mask=mask, labels=ids, **decode_forward_options(model)).loss.backward()
    model.eval()
    decode(model, ids, mask, max_new_tokens=3, sampling=Sampling(temperature=0.0), pad_id=0, capture="eager")
    assert sessions_of(model) == [session]
    release_sessions(model)


def test_a_hook_on_the_activation_added_to_a_kept_session_is_run():
    """The activation's hooks are read at every call: one added after the session was made is run too."""
    model = _engine_model("llama", torch.float64, seed=3)
    ids, mask = _prompts()
    greedy = Sampling(temperature=0.0)
    decode(model, ids, mask, max_new_tokens=6, sampling=greedy, pad_id=0, capture="eager")
    handles = [layer.mlp.act_fn.register_forward_hook(_zero_act_output) for layer in model.model.layers]
    config = GenerationConfig(do_sample=False, max_new_tokens=6, pad_token_id=0, eos_token_id=None,
                              bos_token_id=None)  # fmt: skip
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :]
    got, _ = decode(model, ids, mask, max_new_tokens=6, sampling=greedy, pad_id=0, capture="eager")
    assert torch.equal(got, want)
    for handle in handles:
        handle.remove()
    release_sessions(model)


@pytest.mark.parametrize("change", ["hook on act_fn", "MLP subclass with its own forward",
                                    "decoder layer subclass with its own forward"])  # fmt: skip
def test_the_training_patch_keeps_what_a_changed_model_computes(change, monkeypatch):
    """apply_kd_patch's kernels likewise: the patched model's logits are the changed model's own."""
    model = _engine_model("llama", torch.float64, seed=3)
    ids, mask = _prompts()
    _user_change(change, model, monkeypatch)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    apply_kd_patch(model=model)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_peft_adapter_switches_decode_with_the_adapters_in_force():
    """PEFT keeps which adapters compute in plain attributes that set_adapter / disable_adapter() / merge_adapter()
    reassign; a kept session's twin (shallow copies) once decoded with the adapters of the call that made it. The
    switches are in the session's key: each state decodes what generate() gives in it, and going back to a state
    finds its session."""
    peft = pytest.importorskip("peft")
    model = _engine_model("llama", torch.float64, seed=4)
    lora = dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                init_lora_weights=False)  # fmt: skip  (random B: each adapter changes what the model computes)
    torch.manual_seed(0)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(**lora))
    wrapped.add_adapter("other", peft.LoraConfig(**lora))
    inner = wrapped.base_model.model  # the LM with the adapter layers in it: what the engine decodes
    ids, mask = _prompts()

    def both():
        return _decodes_as_generate(inner, ids, mask)

    first = both()
    wrapped.set_adapter("other")
    second = both()
    with wrapped.disable_adapter():
        base = both()
    wrapped.set_adapter("default")
    assert torch.equal(both(), first)
    assert len({tuple(t.flatten().tolist()) for t in (first, second, base)}) == 3  # each state decodes its own
    release_sessions(inner)
