"""On-policy rollouts as data: a step's prompts become (prompt, completion) rows in few, large generate() calls.

The generator (the student for on-policy KD, the teacher for sequence-level KD) samples completions for every prompt of
an optimizer step at once (all gradient-accumulation micro-batches together, `batch_size` prompts per call), which is
where generation gets its speed: tokens/s grow roughly with the rows of a call up to a hundred or more
(benchmarks/onpolicy/bench_rollouts.py measures it). The rows then train in micro-batches like any other rows: labels on
the completion only (EOS included, padding never), the prompt masked.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.utils import logging

from ...batch.columns import BEHAVIOUR
from ...batch.teacher_data import JoinedRows, pad_joined, positions_in_rows
from ...generation import (
    Sampling,
    decode,
    decode_applies,
    decode_forward_options,
    left_padded,
    masked_rows_give_nan,
    packed_decode_attention,
    release_if_large,
    text_config,
)
from ...models import transformers_code, unwrap_model
from ...utils.seeding import seeded
from ..arguments import checks_arguments
from .decode import lean_decode_applies, sample_tokens, sampling_only, weights_precision

CACHES = ("auto", "dynamic", "static", "graph")
# A static KV cache (and the compiled decode step transformers builds for it) is allocated for one prompt width:
# prompts are left-padded to a multiple of this, so a run sees a few widths (a few compilations), not one per batch.
STATIC_WIDTH_MULTIPLE = 64
STATIC_UP_TO_ROWS = 256  # "auto" takes the static cache up to this many rows on CUDA (see RolloutSettings.cache)
# A rollout progress bar appears only once generation has run this long: short calls (a GPU's, mostly) print nothing
PROGRESS_DELAY_S = 2.0
# How each decode loop of generate_rollouts (decode_loop) is named where a run says how it generates
LOOP_NAMES = {
    ("graph", "cuda"): "captured: the decode engine's step as a CUDA graph",
    ("graph", "cpu"): "eager: the decode engine's step, not captured off CUDA",
    ("lean", "cpu"): "eager: the lean sampling loop over the model's own forward, dynamic KV cache",
    ("static", "cuda"): "compiled: transformers' generate() with a static KV cache (each new shape compiles once)",
    ("static", "cpu"): "eager: transformers' generate() with a static KV cache",
    ("dynamic", "cuda"): "eager: transformers' generate() with a dynamic KV cache",
    ("dynamic", "cpu"): "eager: transformers' generate() with a dynamic KV cache",
}


@dataclass(frozen=True)
class RolloutSettings:
    """How completions are sampled.

    max_new_tokens: completion length limit (a completion ends at EOS, which it keeps, or here).
    temperature, top_p, top_k: sampling (top_k 0 = off); temperature 1 with top_p 1 and top_k 0 is the
        generator's own distribution, which on-policy KD assumes.
    num_generations: completions per prompt (each prompt's row is repeated this many times, adjacent).
    batch_size: prompts per generate() call; None: every prompt of the step in one call.
    cache: "dynamic", "static" (transformers compiles the decode step), "graph" (generation/engine.py: a slot
        KV cache per (rows, length) bucket and the whole one-token step, sampling included, captured once as a CUDA
        graph and replayed across optimizer steps; on a CPU the same step runs eagerly) or "auto": graph on CUDA up
        to 256 rows where the engine can decode the generator (cache_for), else what follows. Before graph: static
        on CUDA up to 256 rows,
        dynamic above (not measured there: it needs no compilation per shape) and on a CPU. With decode steps'
        grouped-query heads packed (generation/decode_attention.py) the static cache is faster than the dynamic one
        at 64, 128 and 256 rows (benchmarks/onpolicy/bench_rollouts.py, results in benchmarks/results/).
        Compiling costs tens of seconds per new shape, once, and on a CPU more than it saves.
    seed: with the step number, seeds each call, so the same seed gives the same completions.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    num_generations: int = 1
    batch_size: int | None = None
    cache: str = "auto"
    seed: int = 0
    vocab_size: int | None = None  # the real ids (kd_vocab_size): a head's padding rows are never sampled

    def __post_init__(self) -> None:
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens (kd_max_new_tokens) must be an int >= 1; got {self.max_new_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature (kd_generation_temperature) must be > 0; got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p!r}")
        if not (isinstance(self.num_generations, int) and self.num_generations >= 1):
            raise ValueError(f"num_generations (kd_num_generations) must be an int >= 1; got {self.num_generations!r}")
        if self.batch_size is not None and not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ValueError(f"batch_size (kd_rollout_batch_size) must be None or an int >= 1; got {self.batch_size!r}")
        if self.cache not in CACHES:
            raise ValueError(f"cache (kd_generation_cache) must be one of {CACHES}; got {self.cache!r}")


@dataclass(frozen=True)
class Rollout:
    prompt: list[int]
    completion: list[int]  # up to and including the first EOS, or max_new_tokens long
    finished: bool  # ended at EOS
    logprobs: tuple[float, ...] | None = None  # an engine's log-prob of each completion token (the behaviour policy)


def rollout_settings(args: Any) -> RolloutSettings:
    """How generated steps sample their completions, from KDTrainingArguments' kd_* generation options."""
    return RolloutSettings(
        max_new_tokens=args.kd_max_new_tokens, temperature=args.kd_generation_temperature,
        num_generations=args.kd_num_generations, batch_size=args.kd_rollout_batch_size,
        cache=args.kd_generation_cache, seed=args.seed,
    )  # fmt: skip


@checks_arguments(rank=0)
def check_rollout_args(args: Any) -> None:
    """The generation options (kd_max_new_tokens, ...), validated when the arguments are made."""
    rollout_settings(args)


def call_seed(seed: int, step: int, call: int) -> int:
    """One seed per generate() call: distinct across steps and calls, the same in every run with `seed`."""
    return (seed * 1_000_003 + step) * 1_009 + call


def cache_for(rows: int, device: torch.device, choice: str, engine_applies: bool = False) -> str:
    """The cache of a call: `choice`, or for "auto" the decode engine's captured step on CUDA up to 256 rows where
    it can decode the generator (measured faster than the static cache at 8 and 64 rows, prefill included:
    benchmarks/results/bench_rollouts_graph.json), the static cache there otherwise, else dynamic."""
    if choice != "auto":
        return choice
    if device.type != "cuda" or rows > STATIC_UP_TO_ROWS:
        return "dynamic"
    return "graph" if engine_applies else "static"


def decode_loop(generator: nn.Module, rows: int, device: torch.device, choice: str, refusal: str | None) -> str:
    """How generate_rollouts decodes a call of `rows` rows: "graph" (the decode engine), "lean" (decode.sample_tokens:
    generate()'s tokens with less work per step), or "static" / "dynamic" (transformers' generate() with that cache).
    `choice` is kd_generation_cache, `refusal` generation.decode_applies' answer (None: the engine decodes it)."""
    cache = cache_for(rows, device, choice, engine_applies=refusal is None)
    return "lean" if lean_decode_applies(generator, cache, device) else cache


def call_plan(generator: nn.Module, rows: int, settings: RolloutSettings) -> tuple[int, int, str | None]:
    """How generate_rollouts splits `rows` rows: (rows per call, calls, generation.decode_applies' answer where the
    cache choice asks for the engine, else "not asked for"); one home for it and for describe_generation's words."""
    per_call = settings.batch_size * settings.num_generations if settings.batch_size else rows
    calls = math.ceil(rows / per_call) if per_call else 0
    refusal = decode_applies(generator) if settings.cache in ("graph", "auto") else "not asked for"
    return per_call, calls, refusal


def describe_generation(generator: nn.Module, prompts: int, settings: RolloutSettings) -> str:
    """generate_rollouts' plan for `prompts` prompts in words (rows, calls, the decode loop of the first call), for
    a run to say once how its rollouts are made."""
    generator = unwrap_model(generator)
    device = next(generator.parameters(), torch.empty(0)).device
    rows = prompts * settings.num_generations
    per_call, calls, refusal = call_plan(generator, rows, settings)
    per_call = min(rows, per_call)  # what a call holds: all of them where they are fewer than a call takes
    loop = decode_loop(generator, per_call, device, settings.cache, refusal)
    where = "cuda" if device.type == "cuda" else "cpu"
    call_rows = f"{per_call} rows" if calls == 1 else f"up to {per_call} rows each"
    return (f"{rows} completions ({prompts} prompts x {settings.num_generations}) of up to "
            f"{settings.max_new_tokens} new tokens in {calls} call{'s' * (calls != 1)} ({call_rows}) on "
            f"{device}, {LOOP_NAMES.get((loop, where), loop)}")  # fmt: skip


def shows_progress(args: Any) -> bool:
    """Whether in-process rollouts show a progress bar: the Trainer's own bars are on (disable_tqdm false) and this is
    the process whose bars show (the first)."""
    return not getattr(args, "disable_tqdm", True) and getattr(args, "process_index", 0) == 0


def _progress_tick(tick: Callable[[], Any]) -> Any:
    """A generate() stopping criterion that stops nothing and calls `tick` once per decode step (on a CPU only,
    where reading nothing back from a device costs nothing)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Tick(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: Any) -> torch.Tensor:
            tick()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([Tick()])


def engine_sequences(generator: nn.Module, ids, mask, settings: RolloutSettings, pad_id: int, eos_ids: set[int],
                     padding: list[int]) -> torch.Tensor:  # fmt: skip
    """(B, W + n) prompt + sampled ids through the decode engine (generate()'s layout: padding after EOS)."""
    limit = settings.vocab_size if padding else None  # a padded head's extra rows are never drawn
    sampling = Sampling(settings.temperature, settings.top_k, settings.top_p, vocab_limit=limit)
    tokens, _ = decode(generator, ids, mask, max_new_tokens=settings.max_new_tokens, sampling=sampling, pad_id=pad_id,
                       eos_ids=sorted(eos_ids), capture="graph", fuse_projections=True)  # fmt: skip
    return torch.cat([ids, tokens], dim=1)


def prompts_of(batch: dict[str, torch.Tensor], ignore_index: int = -100) -> list[list[int]]:
    """Each sequence's prompt: its attended tokens before its first scored label (all of them when none is scored).
    A row is one sequence, or several packed end to end (DataCollatorWithFlattening, PrivilegedCollator(packing=
    True)): its position_ids restart at 0 where each begins, and each gives its own prompt, in order."""
    if batch.get("position_ids") is None:  # one sequence a row: read in a few array operations
        return unpacked_prompts(batch, ignore_index)
    # as lists, one copy each off the device: per-row tensor ops on a GPU batch cost launches and a sync per row
    input_ids, labels = batch["input_ids"].tolist(), batch["labels"].tolist()
    mask, positions = (None if batch.get(name) is None else batch[name].tolist()
                       for name in ("attention_mask", "position_ids"))  # fmt: skip
    prompts = []
    for row in range(len(input_ids)):
        keep = [i for i, m in enumerate(mask[row]) if m] if mask is not None else range(len(input_ids[row]))
        ids, lab = [input_ids[row][i] for i in keep], [labels[row][i] for i in keep]
        starts = [0] if positions is None else [j for j, i in enumerate(keep) if positions[row][i] == 0]
        starts = starts if starts[:1] == [0] else [0, *starts]  # a row that does not start at position 0: one more
        for begin, end in zip(starts, [*starts[1:], len(ids)]):
            cut = next((j for j in range(begin, end) if lab[j] != ignore_index), end) - begin
            prompts.append(ids[begin : begin + cut])
    return prompts


def unpacked_prompts(batch: dict[str, torch.Tensor], ignore_index: int = -100) -> list[list[int]]:
    """prompts_of for rows of one sequence each: a row's attended tokens before its first scored label (all of
    them when none is scored), from one copy of each column off the device."""
    ids = batch["input_ids"].cpu().numpy()
    mask = np.ones(ids.shape, dtype=bool) if batch.get("attention_mask") is None else \
        batch["attention_mask"].cpu().numpy().astype(bool)  # fmt: skip
    scored = (batch["labels"].cpu().numpy() != ignore_index) & mask
    attended = mask.sum(1)
    # the attended tokens before the first scored one: its rank among the attended positions
    before = np.cumsum(mask, axis=1) - mask
    first = np.where(scored.any(1), before[np.arange(len(ids)), scored.argmax(1)], attended)
    kept = ids[mask].tolist()  # every row's attended tokens, row after row
    starts = np.concatenate([[0], np.cumsum(attended)[:-1]]).tolist()
    return [kept[start : start + n] for start, n in zip(starts, first.tolist())]


def check_context(generator: nn.Module, prompts: list[list[int]], max_new_tokens: int) -> None:
    """ValueError unless every prompt plus max_new_tokens fits the generator's context (its config's
    max_position_embeddings; no limit when it has none), as an engine refuses the same prompt (vLLM's
    max_model_len). Checked before a step's rollouts are generated, in process or by an engine."""
    text = text_config(unwrap_model(generator))
    context = getattr(text, "max_position_embeddings", None)
    if not isinstance(context, int):
        return
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]), default=None)
    if longest is None or len(prompts[longest]) + max_new_tokens <= context:
        return
    size = len(prompts[longest])
    fix = (f"set kd_max_prompt_length <= {context - max_new_tokens} (it keeps each prompt's last tokens) or a "
           f"smaller kd_max_new_tokens" if context > max_new_tokens
           else f"set kd_max_new_tokens below {context}")  # fmt: skip
    raise ValueError(
        f"prompt {longest} of this step has {size} tokens + kd_max_new_tokens {max_new_tokens} = "
        f"{size + max_new_tokens}, more than the generator's context (max_position_embeddings {context}); {fix}"
    )


def eos_cuts(tokens: torch.Tensor, eos_ids: set[int]) -> tuple[list[int], list[bool]]:
    """For (B, n) sampled ids: each row's completion length (up to and including its first EOS, else n) and whether
    it ended at EOS."""
    if tokens.shape[1] == 0:
        return [0] * len(tokens), [False] * len(tokens)
    hits = torch.isin(tokens, torch.tensor(sorted(eos_ids), dtype=tokens.dtype))
    ended = hits.any(dim=1)
    first = hits.to(torch.uint8).argmax(dim=1)  # the first maximum: the first EOS
    return torch.where(ended, first + 1, tokens.shape[1]).tolist(), ended.tolist()


@torch.no_grad()
def generate_rollouts(
    generator: nn.Module,
    prompts: list[list[int]],
    settings: RolloutSettings,
    *,
    pad_id: int,
    eos_ids: set[int],
    start_id: int,
    step: int = 0,
    progress: bool = False,
) -> list[Rollout]:
    """Completions for `prompts` (token lists), each repeated settings.num_generations times, in prompt order.

    Args:
        generator: a Hugging Face causal LM (already unwrapped from DDP / PEFT wrappers where generate lives).
        prompts: token ids per prompt; an empty prompt starts from `start_id` (BOS), which is then its prompt.
        settings: sampling and batching (RolloutSettings).
        pad_id: the id used for left padding (never scored, masked out of attention).
        eos_ids: ids that end a completion (kept as its last token, so the loss scores stopping).
        start_id: the token an empty prompt begins with.
        step: the optimizer step, mixed into the seed.
        progress: show a progress bar over the decode steps (transformers' tqdm, cleared when done), once generation
            has run PROGRESS_DELAY_S seconds: advanced per token on a CPU, per call elsewhere (no host sync added).

    Returns:
        one Rollout per (prompt, generation), prompt-major: rows [i * n, (i + 1) * n) belong to prompt i.

    Runs under no_grad with the generator in eval mode (dropout off, as sampling from the policy means) and puts it
    back in the mode it was in; through generate(), a patched model generates with transformers' own code
    (models.transformers_code: its forward and kernels); the decode engine (cache "graph") runs the project's kernels
    for a patched and an unpatched model alike (generation/kernel_twin.py). On a CPU, with the dynamic cache and
    plain sampling, decode.sample_tokens makes the same tokens as generate() with less work per step; otherwise
    generate() runs. Prompts are sorted by length
    before batching (less padding) and the output put back in order; each call is seeded from (seed, step, call),
    so results do not depend on the global RNG.
    """
    device = next(generator.parameters(), torch.empty(0)).device
    check_context(generator, [p if p else [start_id] for p in prompts], settings.max_new_tokens)
    rows = [p if p else [start_id] for p in prompts for _ in range(settings.num_generations)]
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    per_call, calls, refusal = call_plan(generator, len(rows), settings)
    out: list[Rollout | None] = [None] * len(rows)
    padding = []  # a head padded past the real ids (kd_vocab_size): its extra rows are no tokens the loss knows
    if settings.vocab_size:
        head = unwrap_model(generator).get_output_embeddings()
        padding = list(range(settings.vocab_size, getattr(head, "out_features", 0)))  # nn.Linear: never sharded
    if settings.cache == "graph" and refusal is not None:
        raise ValueError(f"kd_generation_cache='graph' cannot decode this generator: {refusal}; use 'static' or "
                         f"'dynamic'")  # fmt: skip
    bar = logging.tqdm(total=calls * settings.max_new_tokens, desc=f"rollouts (step {step})", unit="tok",
                       leave=False, delay=PROGRESS_DELAY_S) if progress else None  # fmt: skip
    per_token = bar is not None and device.type == "cpu"
    was_training = generator.training
    generator.eval()
    try:
        # the model's own distribution at the settings' temperature / top-k / top-p, whatever its generation config
        # asks for beyond that; decode steps without the grouped-query cache copy
        with sampling_only(generator), packed_decode_attention():
            for call, first in enumerate(range(0, len(order), per_call)):
                chunk = order[first : first + per_call]
                batch = [rows[i] for i in chunk]
                loop = decode_loop(generator, len(batch), device, settings.cache, refusal)
                cache = "dynamic" if loop == "lean" else loop
                ticks = per_token and loop != "graph"  # the engine's step is its own loop: its call counts at its end
                width = max(len(p) for p in batch)
                if cache == "static":
                    width = -(-width // STATIC_WIDTH_MULTIPLE) * STATIC_WIDTH_MULTIPLE
                ids, mask = left_padded(batch, pad_id, width, device)
                devices = [device] if device.type == "cuda" else []
                options = dict(
                    max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, top_p=settings.top_p,
                    top_k=settings.top_k, pad_token_id=pad_id, eos_token_id=sorted(eos_ids) or None,
                    **({"suppress_tokens": padding} if padding else {}),
                )  # fmt: skip
                # generate() and the lean loop: transformers' own forward and modules (compilable); the captured
                # step runs its own twin of the model, through the kernels whether or not it is patched
                # (generation/kernel_twin.py), and leaves the model as it is
                code = contextlib.nullcontext() if cache == "graph" else transformers_code(generator)
                # transformers' static cache decodes in the weights' dtype, autocast off (decode.weights_precision:
                # under autocast a layer's keys and values can differ in dtype, which that cache does not hold)
                precision = weights_precision(generator, device) if cache == "static" else contextlib.nullcontext()
                with precision, code, seeded(call_seed(settings.seed, step, call), devices):
                    if cache == "graph":  # the captured decode step (generation/engine.py)
                        generated = engine_sequences(generator, ids, mask, settings, pad_id, eos_ids, padding)
                    elif loop == "lean":  # generate()'s tokens, less work per step
                        tick = {"on_token": bar.update} if ticks else {}
                        generated = sample_tokens(generator, ids, mask, **options, **tick)
                    else:
                        if masked_rows_give_nan(generator) and not bool(mask.all()):  # generate() builds its own
                            raise ValueError(  # masks: the padding rows' NaN (generation/padding.py) reaches it
                                "attn_implementation='eager' in float64 gives NaN logits for left-padded prompts in "
                                f"generate() (kd_generation_cache={settings.cache!r}): load the student with "
                                "attn_implementation='sdpa'")
                        tick = {"stopping_criteria": _progress_tick(bar.update)} if ticks else {}
                        generated = generator.generate(
                            input_ids=ids, attention_mask=mask, do_sample=True, cache_implementation=cache,
                            **options, **tick, **decode_forward_options(generator),
                        )
                tails = generated[:, width:].cpu()  # one copy off the device for the call, not one per row
                if bar is not None:  # the call's share, less the steps ticked (fewer ran when every row ended early)
                    bar.update(settings.max_new_tokens - (tails.shape[1] if ticks else 0))
                ends, finished = eos_cuts(tails, eos_ids)
                for row, (index, tail, end, done) in enumerate(zip(chunk, tails.tolist(), ends, finished)):
                    out[index] = Rollout(rows[index], tail[:end], done)
                del generated, ids, mask  # the KV cache went with generate(); nothing of the call outlives it
        # the training step that follows gets a large session's memory back (the calls of one step share it)
        release_if_large(generator)
    finally:
        generator.train(was_training)
        if bar is not None:
            bar.close()
    return out  # type: ignore[return-value]


def rollout_batch(
    rollouts: list[Rollout], pad_id: int, ignore_index: int = -100, behaviour: bool = False
) -> dict[str, torch.Tensor]:
    """Right-padded training rows: input_ids = prompt + completion, labels = the completion (prompt and padding
    ignore_index), attention_mask; with `behaviour`, BEHAVIOUR (B, T) float32: each completion token's log-prob
    under the policy that sampled it, at the token's own position like its label (0 elsewhere).

    Built on the rows joined end to end (numpy, no per-row copies): a step turns hundreds of rollouts into rows. The
    ids are whole numbers already: prompts read off a collated batch (prompts_of), completions drawn by a sampler."""
    lengths, completion = completion_positions(rollouts)
    ids = np.fromiter(chain.from_iterable(chain(r.prompt, r.completion) for r in rollouts), dtype=np.int64,
                      count=int(lengths.sum()))  # fmt: skip
    width = int(lengths.max(initial=0))
    batch = {
        "input_ids": torch.from_numpy(pad_joined(JoinedRows(ids, lengths), width, pad_id, np.int64)),
        "attention_mask": torch.from_numpy((np.arange(width) < lengths[:, None]).astype(np.int64)),
        "labels": torch.from_numpy(pad_joined(JoinedRows(np.where(completion, ids, ignore_index), lengths), width,
                                              ignore_index, np.int64)),  # the prompt is never scored
    }  # fmt: skip
    if behaviour:
        batch[BEHAVIOUR] = behaviour_logprobs(rollouts, batch["input_ids"].shape)
    return batch


def behaviour_logprobs(rollouts: list[Rollout], shape: torch.Size) -> torch.Tensor:
    """(B, T) float32 for right-padded rows prompt + completion: each completion token's log-prob under the policy
    that sampled it, at the token's own position like its label (0 elsewhere)."""
    for row, r in enumerate(rollouts):
        if r.logprobs is None or len(r.logprobs) != len(r.completion):
            raise ValueError(f"rollout {row} has no behaviour log-prob per completion token (from the engine)")
    lengths, completion = completion_positions(rollouts)
    values = np.zeros(int(lengths.sum()), dtype=np.float32)  # numpy: no torch dispatch per row
    values[completion] = np.fromiter(chain.from_iterable(r.logprobs for r in rollouts), dtype=np.float32,
                                     count=int(completion.sum()))  # fmt: skip
    return torch.from_numpy(pad_joined(JoinedRows(values, lengths), shape[1], 0.0, np.float32))


def completion_positions(rollouts: list[Rollout]) -> tuple[np.ndarray, np.ndarray]:
    """(each rollout's length, prompt + completion; for the rollouts joined end to end, whether each position holds
    a completion token)."""
    prompts = np.fromiter((len(r.prompt) for r in rollouts), dtype=np.int64, count=len(rollouts))
    lengths = prompts + np.fromiter((len(r.completion) for r in rollouts), dtype=np.int64, count=len(rollouts))
    return lengths, positions_in_rows(lengths) >= np.repeat(prompts, lengths)
