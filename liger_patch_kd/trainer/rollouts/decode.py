"""A lean sampling loop for in-process rollouts: the model's own forward and KV cache, token by token, without
generate()'s per-step bookkeeping.

On a CPU, a small student's decode step is per-op overhead, and generate() adds its own per step (input
preparation and clones, mask and position updates, processor and stopping-criteria lists, the deferred stop
check). For what rollouts ask — plain sampling with temperature / top-k / top-p, the dynamic cache — this loop
does the same steps in the same order: the same forward inputs (position ids from the mask, the mask dropped
when the prompts have no padding, last-position logits), transformers' own logits warpers, one
torch.multinomial draw per step on the global generator, padding after EOS. So a seed gives the same tokens as
generate() (tests/test_decode.py checks it), in less time. Anything else (a GPU, a static cache, a model whose
generate is not transformers' own) goes to generate(). Rollouts sample the model's own distribution at the given
temperature / top-k / top-p whatever the loop: `sampling_only` sets aside what a checkpoint's generation config asks
for beyond that.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.utils import logging

from ...generation import decode_forward_options, prefill_mask
from ...ops.backend import no_autocast

logger = logging.get_logger(__name__)

# generation-config entries that change nothing here: special ids, bookkeeping, and what rollouts pass explicitly
SPECIAL_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
NEUTRAL_GENERATION_KEYS = frozenset({
    *SPECIAL_ID_KEYS, "transformers_version", "_from_model_config", "do_sample", "temperature", "top_p", "top_k",
    "max_length", "max_new_tokens", "cache_implementation", "output_attentions", "output_hidden_states", "use_cache",
})  # fmt: skip
# the generation configs sampling_only has looked at (warned about if need be): id -> a weak reference, so that a
# later config given a freed one's id is looked at too (GenerationConfig defines __eq__, so no WeakSet)
_CHECKED: dict[int, weakref.ref] = {}


@contextlib.contextmanager
def sampling_only(model: nn.Module) -> Iterator[None]:
    """Within the block every generation config in the model's tree holds only its special ids, so generate()
    applies nothing beyond what the rollouts pass it (temperature, top-k, top-p, a padded head's suppressed rows).

    A checkpoint's generation_config.json carries decoding preferences (Qwen2.5-Instruct's repetition_penalty 1.05; a
    minimum length, suppressed or bad words, beams): generate() would apply them and the samples would come from
    another distribution than the one the behaviour log-probs, a rollout store's manifest and the on-policy
    estimators take them from, and the decode engine (which samples exactly the given settings) could not run.
    Warns once per generation config that they are set aside. PEFT reads and writes the base model's config,
    which is swapped here too: its tree holds it."""
    swapped = []
    for module in model.modules():
        gen = vars(module).get("generation_config")
        if isinstance(gen, GenerationConfig):
            swapped.append((module, gen))
    for module, gen in swapped:
        seen = _CHECKED.get(id(gen))
        extra = () if seen is not None and seen() is gen else \
            tuple(sorted(set(gen.to_diff_dict()) - NEUTRAL_GENERATION_KEYS))  # fmt: skip
        _CHECKED[id(gen)] = weakref.ref(gen)
        if extra:
            logger.warning(
                f"the generator's generation_config asks for {', '.join(f'{k}={getattr(gen, k)!r}' for k in extra)}: "
                "rollouts sample the model's own distribution at their own settings only (kd_generation_temperature; "
                "liger-kd precompute's --generation-temperature / --top-p / --generation-top-k), what the on-policy "
                "losses and a rollout store's behaviour log-probs assume, so these are not applied"
            )
        module.generation_config = GenerationConfig(**{k: getattr(gen, k) for k in SPECIAL_ID_KEYS
                                                       if getattr(gen, k, None) is not None})  # fmt: skip
    try:
        yield
    finally:
        for module, gen in swapped:
            module.generation_config = gen


@contextlib.contextmanager
def weights_precision(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Within the block the model decodes in its weights' dtype: autocast off on `device`, and a mixed-precision
    wrapper around its forward (accelerate's, for bf16=True / fp16=True: it re-enables autocast inside) set aside.
    For transformers' static cache (generate_rollouts enters it for that cache only).

    Why: under autocast, one layer's keys and values need not share a dtype (fp32 weights with bf16 autocast: the
    projections give bf16, and Llama's RoPE multiplies the keys by fp32 cos / sin, so keys are fp32 and values
    bf16), and transformers' static cache (5.17) allocates both in the first keys' dtype: the first decode step
    then fails (`index_copy_(): ... Float and BFloat16`). With autocast off, every key, value and cache tensor has
    the weights' dtype. A cache that allocates keys and values each in its own arriving dtype (the dynamic cache,
    generation/kv_cache.SlotCache) needs none of this and decodes under the autocast in force."""
    own = model.__dict__.get("forward")
    unwrapped = model.__dict__.get("_original_forward")  # what accelerate's prepare_model wrapped
    if own is not None and unwrapped is not None:
        model.forward = unwrapped
    try:
        with no_autocast(device):
            yield
    finally:
        if own is not None and unwrapped is not None:
            model.forward = own


def lean_decode_applies(model: nn.Module, cache: str, device: torch.device) -> bool:
    """Whether the lean loop does exactly what generate() would: the dynamic cache, a decoder-only model whose
    generate() is transformers' own (not replaced on the class or the instance), taking `logits_to_keep` and
    `position_ids` (its generation config is set aside by sampling_only around every rollout call). CPU only: that
    is where it was measured to win; on CUDA its stop check would sync every step, which generate()'s deferred
    check avoids."""
    from transformers.generation.utils import GenerationMixin

    config = getattr(model, "config", None)
    gen = getattr(model, "generation_config", None)
    if device.type != "cpu" or cache != "dynamic" or config is None or gen is None:
        return False
    if getattr(config, "is_encoder_decoder", False):
        return False
    if "generate" in vars(model) or getattr(type(model), "generate", None) is not GenerationMixin.generate:
        return False
    if not {"logits_to_keep", "position_ids"} <= set(inspect.signature(type(model).forward).parameters):
        return False  # generate() would not pass them: the loop's inputs would not be its inputs
    return True  # generate_rollouts decodes under sampling_only: the model's generation config asks for nothing


def _warpers(temperature: float, top_k: int, top_p: float, suppress: list[int], device):
    """transformers' own processors, in generate()'s order (suppression, then temperature, top-k, top-p)."""
    from transformers import SuppressTokensLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    processors = [SuppressTokensLogitsProcessor(suppress, device=device)] if suppress else []
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k != 0:
        processors.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return processors


def sample_tokens(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    pad_token_id: int,
    eos_token_id: list[int] | None,
    suppress_tokens: list[int] | None = None,
    on_token: Callable[[], object] | None = None,
) -> torch.Tensor:
    """(B, W + n) prompt + sampled ids, as generate(do_sample=True, cache_implementation="dynamic") returns them.

    Args:
        model: a decoder-only causal LM for which lean_decode_applies holds (in eval mode, its own forward).
        input_ids: (B, W) left-padded prompts; attention_mask: (B, W), 0 on the padding.
        max_new_tokens, temperature, top_k (0 = off), top_p: as generate() takes them (same names, so one dict
            of keywords serves both).
        pad_token_id: what a row gets after its EOS; eos_token_id: the ids that end a row (None: none does).
        suppress_tokens: ids never sampled (a head's padding rows).
        on_token: called once per decode step (a progress bar's tick).

    Returns:
        (B, W + n) int64, n <= max_new_tokens: the loop stops when every row has ended.
    """
    warpers = _warpers(temperature, top_k, top_p, list(suppress_tokens or ()), input_ids.device)
    eos = torch.tensor(sorted(eos_token_id or ()), dtype=torch.long, device=input_ids.device)
    with torch.inference_mode():  # less per-op work than no_grad; nothing made here is trained through
        sequences = _sample_loop(model, input_ids, attention_mask, max_new_tokens, warpers, pad_token_id, eos, on_token)
    return sequences.clone()  # outside inference mode: an ordinary tensor


def _sample_loop(model, input_ids, attention_mask, max_new_tokens: int, warpers, pad_token_id: int, eos, on_token=None):
    """generate()'s sampling loop, step for step: the same forward inputs, draws and padding after EOS."""
    batch, device = input_ids.shape[0], input_ids.device
    cache_key = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    mask = None if bool((attention_mask == 1).all()) else attention_mask  # generate() drops an all-ones mask
    # the prefill's mask: the 2D one, or one in which no padding row is fully masked (eager float64: NaN otherwise)
    first_mask = None if mask is None else prefill_mask(model, mask)
    unfinished = torch.ones(batch, dtype=torch.long, device=device)
    sequences, step_ids, cache = input_ids, input_ids, None
    for _ in range(max_new_tokens):
        step_mask = first_mask if cache is None else mask
        out = model(input_ids=step_ids, attention_mask=step_mask, position_ids=positions, use_cache=True,
                    logits_to_keep=1, return_dict=True, **{cache_key: cache},
                    **decode_forward_options(model))  # fmt: skip
        cache = getattr(out, cache_key)
        scores = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        for warp in warpers:
            scores = warp(sequences, scores)
        tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        if len(eos):
            tokens = tokens * unfinished + pad_token_id * (1 - unfinished)
        sequences = torch.cat([sequences, tokens[:, None]], dim=-1)
        if on_token is not None:
            on_token()
        if len(eos):
            unfinished = unfinished & ~torch.isin(tokens, eos)
            if not bool(unfinished.any()):
                break
        step_ids, positions = tokens[:, None], positions[:, -1:] + 1
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=-1)
    return sequences
