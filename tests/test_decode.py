"""trainer.rollouts.decode: the lean sampling loop makes, for a seed, exactly the tokens generate() makes (left padding,
EOS ending rows at different steps, temperature / top-k / top-p, suppressed ids, sliding-window and soft-capped models),
and rollouts fall back to generate() wherever the loop would not be generate()'s equal."""

import logging
import math

import pytest
import torch
from transformers import GenerationConfig

import liger_patch_kd.trainer.rollouts.generate as R
from liger_patch_kd.trainer.rollouts.decode import lean_decode_applies, sample_tokens, sampling_only
from liger_patch_kd.trainer.rollouts.generate import RolloutSettings, generate_rollouts

from .tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")

CPU = torch.device("cpu")
EOS = list(range(2, 40))  # many ending ids, so random tiny models end rows early, at different steps


def _prompts():
    ids = torch.randint(40, 200, (5, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = mask[3, :5] = 0  # left padding of different widths
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=1.0, top_k=0, top_p=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)],
    ids=["plain", "warped"],
)
@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
def test_lean_loop_samples_what_generate_samples(arch, sampling, padded):
    model = tiny_model(arch, dtype=torch.float32, seed=1).eval()
    ids, mask = _prompts()
    if not padded:
        mask = torch.ones_like(mask)
    options = dict(max_new_tokens=7, pad_token_id=0, eos_token_id=EOS, suppress_tokens=[5, 9], **sampling)
    assert lean_decode_applies(model, "dynamic", CPU)
    torch.manual_seed(3)
    expected = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, cache_implementation="dynamic",
                              **options)  # fmt: skip
    torch.manual_seed(3)
    got = sample_tokens(model, ids, mask, **options)
    assert torch.equal(got, expected)
    new = got[:, ids.shape[1] :]
    assert not torch.isin(new, torch.tensor([5, 9])).any()  # suppressed ids never sampled
    assert got.requires_grad is False and not got.is_inference()


def test_without_eos_every_row_runs_to_max_new_tokens():
    model = tiny_model("llama", dtype=torch.float32, seed=1).eval()
    ids, mask = _prompts()
    options = dict(max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(5)
    expected = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, cache_implementation="dynamic",
                              **options)  # fmt: skip
    torch.manual_seed(5)
    got = sample_tokens(model, ids, mask, **options)
    assert got.shape == (5, 12) and torch.equal(got, expected)


def test_the_loop_applies_only_where_it_equals_generate():
    model = tiny_model("llama", dtype=torch.float32, seed=1)
    assert lean_decode_applies(model, "dynamic", CPU) and not lean_decode_applies(model, "static", CPU)
    assert not lean_decode_applies(model, "dynamic", torch.device("cuda"))  # generate() and its deferred stop check
    model.generation_config.repetition_penalty = 1.2  # set aside around every rollout call (sampling_only)
    assert lean_decode_applies(model, "dynamic", CPU)
    model.generate = lambda **kw: None  # a generate replaced on the instance is the caller's: it runs
    assert not lean_decode_applies(model, "dynamic", CPU)


def test_rollouts_are_the_same_through_the_loop_and_through_generate(monkeypatch):
    """generate_rollouts with the lean loop and with generate() forced: the same rollouts for a seed (sorted and
    padded prompts, two generations each, an empty prompt, a padded head's extra ids suppressed)."""
    model = tiny_model("llama", dtype=torch.float32, seed=1).train()
    prompts = [[50, 60, 70], [80], [], [90, 91, 92, 93, 94]]
    settings = RolloutSettings(max_new_tokens=6, num_generations=2, seed=3, cache="dynamic", vocab_size=200)
    kw = dict(pad_id=0, eos_ids=set(EOS), start_id=1, step=2)
    calls = []
    real = R.sample_tokens
    monkeypatch.setattr(R, "sample_tokens", lambda *a, **k: calls.append(1) or real(*a, **k))
    lean = generate_rollouts(model, prompts, settings, **kw)
    assert calls == [1]  # one call for every prompt's rows
    monkeypatch.setattr(R, "lean_decode_applies", lambda *a: False)
    assert generate_rollouts(model, prompts, settings, **kw) == lean
    assert all(t < 200 for r in lean for t in r.completion)
    assert any(r.finished for r in lean) and model.training  # EOS ended some rows; train mode is put back


def _greedy_alone(model, prompt, steps):
    """Greedy tokens of one prompt by itself (no padding, no cache): the reference a batched sampler must match."""
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            seq.append(out[-1])
    return out


def test_eager_float64_left_padding_samples_what_each_prompt_gives_alone():
    """transformers' eager attention takes a float64 model's softmax in float32, where the mask's minimum is -inf:
    a left-padded batch's padding rows (fully masked) were NaN, and the next layer spread it to the real rows
    ("probability tensor contains either inf, nan"). The prefill now leaves no padding row fully masked."""
    from liger_patch_kd.server.generation import GenerationEngine, GenerationRequest

    model = tiny_model("llama", dtype=torch.float64, seed=1).eval()
    model.config._attn_implementation = "eager"
    prompts = [[45, 46, 47], [49, 50, 51, 52, 53, 54]]
    expected = [_greedy_alone(model, p, 5) for p in prompts]
    ids = torch.tensor([[0, 0, 0, *prompts[0]], prompts[1]])
    greedy = dict(max_new_tokens=5, temperature=1.0, top_k=1, top_p=1.0, pad_token_id=0, eos_token_id=None)
    got = sample_tokens(model, ids, (ids != 0).long(), **greedy)  # in-process rollouts' loop
    assert got[:, 6:].tolist() == expected
    rollouts = generate_rollouts(model, prompts, RolloutSettings(max_new_tokens=5, top_k=1), pad_id=0, eos_ids=set(),
                                 start_id=1)  # fmt: skip
    assert [r.completion for r in rollouts] == expected
    engine = GenerationEngine(model, "m")  # the server's sampler
    req = GenerationRequest(prompts=prompts, n=1, temperature=0.0, top_p=1.0, top_k=0, max_tokens=5, seed=1,
                            logprobs=0, stop_ids=(), return_token_ids=True, model=None)  # fmt: skip
    choices = engine.complete(req)["choices"]
    assert [c["token_ids"] for c in choices] == expected
    assert all(math.isfinite(lp) for c in choices for lp in c["logprobs"]["token_logprobs"])
    # generate() builds its own masks: refused in one line before sampling, naming the fix
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        generate_rollouts(model, prompts, RolloutSettings(max_new_tokens=5, cache="static"), pad_id=0, eos_ids=set(),
                          start_id=1)  # fmt: skip


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_models_that_output_router_logits_decode(arch):
    """A mixture-of-experts config with output_router_logits=True computes its load-balancing loss in every forward
    from the attention mask, which a decode step's one token a row does not match (transformers' generate() fails
    the same way). Every decoder turns the router output off: greedy tokens equal each prompt's alone, on every
    path (the rollouts' lean loop, generate(), the captured engine, the server's sampler)."""
    from liger_patch_kd.generation import Sampling, decode, release_sessions
    from liger_patch_kd.server.generation import GenerationEngine, GenerationRequest

    model = tiny_model(arch, dtype=torch.float32, seed=2).eval()
    model.config.output_router_logits = True
    model.config._attn_implementation = "sdpa"  # the captured engine builds SDPA's masks
    prompts = [[45, 46, 47], [49, 50, 51, 52, 53, 54]]
    expected = [_greedy_alone(model, p, 4) for p in prompts]
    for cache in ("dynamic", "static"):  # the lean loop, then transformers' generate()
        rollouts = generate_rollouts(model, prompts, RolloutSettings(max_new_tokens=4, top_k=1, cache=cache),
                                     pad_id=0, eos_ids=set(), start_id=1)  # fmt: skip
        assert [r.completion for r in rollouts] == expected, cache
    ids = torch.tensor([[0, 0, 0, *prompts[0]], prompts[1]])
    tokens, _ = decode(model, ids, (ids != 0).long(), max_new_tokens=4, sampling=Sampling(top_k=1), pad_id=0)
    release_sessions(model)
    assert tokens.tolist() == expected
    req = GenerationRequest(prompts=prompts, n=1, temperature=0.0, top_p=1.0, top_k=0, max_tokens=4, seed=1,
                            logprobs=None, stop_ids=(), return_token_ids=True, model=None)  # fmt: skip
    assert [c["token_ids"] for c in GenerationEngine(model, "m").complete(req)["choices"]] == expected


def test_sampling_only_sets_aside_every_generation_config_of_the_tree_and_puts_it_back():
    """Inside: each generation config of the model's tree (PEFT reads the base model's, and writes it back before
    generate()) holds only the special ids; after, even when the block raises, the very objects are back."""
    peft = pytest.importorskip("peft")
    base = tiny_model("llama", dtype=torch.float32, seed=1)
    own = base.generation_config
    own.repetition_penalty, own.min_new_tokens, own.eos_token_id = 1.2, 3, 2
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(RuntimeError, match="inside"):
        with sampling_only(model):
            inside = model.generation_config  # through PEFT's delegation: the base model's
            assert inside is not own and inside.eos_token_id == 2
            assert inside.repetition_penalty in (None, 1.0) and not inside.min_new_tokens
            raise RuntimeError("inside")
    assert base.generation_config is own and model.generation_config is own and own.repetition_penalty == 1.2


def test_every_generation_config_with_extras_is_warned_about(caplog):
    """One warning per generation config that asks for more than sampling, also when configs are made and freed in
    turn (a sweep, a notebook: a freed config's id comes back; keyed by id alone, 3 of 20 were warned about)."""
    model = tiny_model("llama", dtype=torch.float32, seed=1)
    with caplog.at_level(logging.WARNING, logger="liger_patch_kd"):
        for i in range(1, 21):
            model.generation_config = GenerationConfig(eos_token_id=2, repetition_penalty=1.0 + i / 10)
            with sampling_only(model):
                pass
    said = [r.getMessage() for r in caplog.records if "generation_config asks for" in r.getMessage()]
    assert len(said) == 20, f"{len(said)} warnings for 20 configs with a repetition penalty"


def test_the_set_aside_warning_names_the_rollout_temperature_option(caplog):
    """The warning names the rollouts' temperature option (kd_generation_temperature), not the loss's."""
    model = tiny_model("llama", dtype=torch.float32, seed=1)
    model.generation_config = GenerationConfig(eos_token_id=2, repetition_penalty=1.37)
    with caplog.at_level(logging.WARNING, logger="liger_patch_kd"):
        with sampling_only(model):
            pass
    (said,) = [r.getMessage() for r in caplog.records if "generation_config asks for" in r.getMessage()]
    assert "kd_generation_temperature" in said, said
