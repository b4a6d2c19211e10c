"""generation.decode_attention: one-token decode steps attend with the query heads packed per key/value head, equal
(float64) to attention over the repeated cache, and everything else goes to transformers' SDPA function as is."""

import re

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import liger_patch_kd.trainer.rollouts as R
from liger_patch_kd.generation import packed_decode_attention
from liger_patch_kd.generation.decode_attention import packed_gqa_sdpa
from liger_patch_kd.trainer.rollouts import RolloutSettings, generate_rollouts

from .tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")

BATCH, HEADS, KV_HEADS, DIM, LENGTH = 3, 8, 2, 16, 11


class _Layer(torch.nn.Module):
    num_key_value_groups = HEADS // KV_HEADS


def _qkv(q_len=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, q_len, DIM, generator=g, dtype=torch.float64)
    k, v = (torch.randn(BATCH, KV_HEADS, LENGTH, DIM, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def _reference(q, k, v, mask, scaling):
    """Attention over the cache repeated per query head, in float64: (batch, q_len, heads, dim)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scaling
    if mask is not None:
        mask = mask[..., : k.shape[-2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _padding_mask(batch=BATCH, extra=0):
    attend = torch.ones(batch, 1, 1, LENGTH + extra, dtype=torch.bool)
    attend[0, ..., :4] = False  # left padding of different widths
    if batch > 1:
        attend[1, ..., :1] = False
    return attend


MASKS = {
    "none": lambda: None,
    "boolean padding": _padding_mask,
    "additive": lambda: torch.zeros(BATCH, 1, 1, LENGTH, dtype=torch.float64).masked_fill(~_padding_mask(), -1e30),
    "one mask for the batch": lambda: _padding_mask(batch=1),
    "longer than the cache (sliced)": lambda: _padding_mask(extra=5),
}


@pytest.mark.parametrize("mask", MASKS)
def test_a_decode_step_equals_attention_over_the_repeated_cache(mask):
    q, k, v = _qkv()
    attention_mask = MASKS[mask]()
    out, weights = packed_gqa_sdpa(_Layer(), q, k, v, attention_mask, scaling=DIM**-0.5)
    assert weights is None and out.shape == (BATCH, 1, HEADS, DIM)
    torch.testing.assert_close(out, _reference(q, k, v, attention_mask, DIM**-0.5), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "case",
    ["prefill (q_len > 1)", "a mask per head", "no grouping"],
)
def test_what_it_does_not_cover_is_transformers_own_sdpa(case):
    layer, q_len, mask = _Layer(), 1, None
    if case.startswith("prefill"):
        q_len = 4
    elif case == "a mask per head":
        mask = _padding_mask().expand(BATCH, HEADS, 1, LENGTH).clone()
    q, k, v = _qkv(q_len)
    if case == "no grouping":
        layer.num_key_value_groups = 1
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    ours, _ = packed_gqa_sdpa(layer, q, k, v, mask, scaling=0.3)
    theirs, _ = hf_sdpa.sdpa_attention_forward(layer, q, k, v, mask, scaling=0.3)
    assert torch.equal(ours, theirs)


def test_inside_a_compiled_step_it_copies_no_cache(monkeypatch):
    """transformers' path under torch.compile (is_torchdynamo_compiling) repeats the cache for every head; the
    packed path never calls repeat_kv, and both give the same attention."""
    calls = []
    repeat = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda x, n: calls.append(n) or repeat(x, n))
    # transformers without an eager packed path (before 5.2x) has no such check: it always repeats with a mask
    monkeypatch.setattr(hf_sdpa, "is_torchdynamo_compiling", lambda: True, raising=False)
    q, k, v = _qkv()
    mask = _padding_mask()
    theirs, _ = hf_sdpa.sdpa_attention_forward(_Layer(), q, k, v, mask, scaling=0.25)
    assert calls == [4, 4]  # keys and values, 4 query heads each
    ours, _ = packed_gqa_sdpa(_Layer(), q, k, v, mask, scaling=0.25)
    assert calls == [4, 4]
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_the_block_swaps_sdpa_and_puts_it_back_even_on_error():
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with packed_decode_attention():
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is packed_gqa_sdpa
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before
    with pytest.raises(RuntimeError, match="inside"), packed_decode_attention():
        raise RuntimeError("inside")
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before


def test_blocks_nest_and_overlap_and_the_last_one_restores():
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    outer = packed_decode_attention()
    outer.__enter__()
    with packed_decode_attention():
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is packed_gqa_sdpa
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is packed_gqa_sdpa  # the outer block is still open
    outer.__exit__(None, None, None)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before


def _sdpa_model():
    model = tiny_model("llama")  # 4 query heads over 2 key/value heads
    model.config._attn_implementation = "sdpa"
    return model


TEXT_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2", "glm4", "phi3", "gemma", "gemma2",
              "gemma3_text", "granite", "cohere", "cohere2", "mixtral", "qwen3_moe", "gpt_oss"]  # fmt: skip


@pytest.mark.parametrize("arch", TEXT_ARCHS)
def test_a_model_decodes_the_same_logits_inside_the_block(arch):
    """Every text architecture of the registry (sliding windows, soft-caps, sinks, query / key norms, MoE): a
    padded batch's prefill and two decode steps give the same logits with and without the packed attention."""
    model = tiny_model(arch)
    model.config._attn_implementation = "sdpa"
    model.config.output_router_logits = (
        False  # the MoE auxiliary loss is training's, and its mask misreads decode steps
    )
    ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0

    def decode_logits():
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            logits, cache, attend = [out.logits], out.past_key_values, mask
            for _ in range(2):
                step = logits[-1][:, -1:].argmax(-1)
                attend = torch.cat([attend, torch.ones_like(step)], 1)
                out = model(input_ids=step, attention_mask=attend, past_key_values=cache, use_cache=True)
                logits.append(out.logits)
            return torch.cat(logits, 1)

    try:
        plain = decode_logits()
    except ValueError as refused:  # SDPA cannot run it at all (Gemma-2's attention soft-cap): nor inside the block
        with pytest.raises(ValueError, match=re.escape(str(refused)[:60])), packed_decode_attention():
            decode_logits()
        return
    with packed_decode_attention():
        packed = decode_logits()
    torch.testing.assert_close(packed, plain, rtol=1e-12, atol=1e-12)


def test_rollouts_sample_the_same_tokens_with_and_without_it(monkeypatch):
    model = _sdpa_model()
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    settings = RolloutSettings(max_new_tokens=6, seed=3)
    packed = generate_rollouts(model, prompts, settings, pad_id=0, eos_ids={2}, start_id=1, step=0)
    import contextlib

    monkeypatch.setattr(R, "packed_decode_attention", contextlib.nullcontext)
    plain = generate_rollouts(model, prompts, settings, pad_id=0, eos_ids={2}, start_id=1, step=0)
    assert [r.completion for r in packed] == [r.completion for r in plain]
