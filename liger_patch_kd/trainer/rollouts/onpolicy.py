"""On-policy steps in the Trainer: which optimizer steps train on generated completions, and the swap of a step's
micro-batches for rollouts, made in one generation pass before the step's first forward.

KDTrainer.get_batch_samples (the Trainer's hook that fetches an optimizer step's micro-batches together) calls
`OnPolicySteps.step_batches`, which draws them and, on a generated step, calls `replace`: the prompts of all the
step's micro-batches go to `generate_rollouts` at once (`kd_rollout_batch_size` prompts per call), and micro-batch i
is replaced by the rollouts of its own prompts, so the step keeps its gradient-accumulation structure and the
Trainer counts the scored completion tokens of the whole step for an exact num_items_in_batch. In process, all of a
step's rollouts come from the weights the step starts with: they are exactly on-policy. From an engine
(kd_generation_url, engine.py) they come from the weights last pushed to it, up to kd_sync_steps - 1 steps old; with
kd_async_rollouts = k the next k steps' rollouts are requested while this step trains (asynchronous.py), k to k +
kd_sync_steps - 1 steps old.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from transformers.utils import logging

from ...batch.columns import (
    BEHAVIOUR,
    GENERATED,
    HAS_COMPLETION,
    TEACHER_ATTENTION_MASK,
    TEACHER_INPUT_IDS,
    TEACHER_LABELS,
    TEACHER_POSITION_IDS,
)
from ...batch.privileged import privileged_rollout_batch
from ...generation.special_tokens import special_ids
from ...models import unwrap_model
from .asynchronous import AsyncRollouts, take
from .engine import rollout_source
from .generate import (
    Rollout,
    behaviour_logprobs,
    check_context,
    describe_generation,
    prompts_of,
    rollout_batch,
    rollout_settings,
    shows_progress,
)

AttachTeacher = Callable[[dict[str, Any]], dict[str, Any]]  # a served teacher's top-k added to a batch
MakeRows = Callable[[list[Rollout], dict[str, Any]], dict[str, Any]]  # (rollouts, the micro-batch) -> batch

logger = logging.get_logger(__name__)


class OnPolicySteps:
    """Decides, per optimizer step, whether it trains on generated completions (every step with kd_seq_kd; a
    kd_lmbda fraction otherwise, a draw that is a function of (args.seed, the step) alone: step_generates), and
    makes them."""

    def __init__(self, args: Any, precision: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        self.args = args
        # the autocast the student's forward runs in (the Trainer's accelerator.autocast: bf16=True / fp16=True), in
        # force around the rollouts made in this process: the decode engine reads it before its first step (the
        # weight copies it casts once a call, its cache's dtype), where a forward wrapper's autocast is entered only
        # inside each step
        self.precision = precision or contextlib.nullcontext
        self.settings = rollout_settings(args)
        self.warmup_steps = 0  # kd_onpolicy_warmup_steps, as steps: set when the run's length is known
        self.seconds: list[float] = []  # time inside generate() per generated step
        self.source = rollout_source(args)  # in this process, or an engine at kd_generation_url (engine.py)
        # the pg loss importance-corrects with the behaviour log-probs an engine returns
        self.behaviour = bool(args.kd_generation_url) and args.kd_onpolicy_loss == "pg"
        # kd_async_rollouts: the next steps' rollouts requested from the engine while this one trains
        self.pipeline = AsyncRollouts(self, args.kd_async_rollouts) if args.kd_async_rollouts else None
        self.announced = False  # the first generated step says how rollouts are made (announce)

    @property
    def enabled(self) -> bool:
        return bool(self.args.kd_seq_kd or self.args.kd_lmbda > 0)

    @property
    def staleness(self) -> list[int]:
        """Per generated step trained, how many optimizer steps old the weights that sampled it were (0 in
        process)."""
        return self.pipeline.staleness if self.pipeline is not None else getattr(self.source, "staleness", [])

    def close(self) -> None:
        """The end of train(), or its error: the background worker joined first, then the engine's pushed
        weights removed."""
        try:
            if self.pipeline is not None:
                self.pipeline.close()
        finally:
            if hasattr(self.source, "close"):
                self.source.close()

    def generates(self, step: int) -> bool:
        """Whether optimizer step `step` trains on generated completions: kd_lmbda's schedule (step_generates),
        masked by the warm-up (kd_onpolicy_warmup_steps), so the steps after it are those of a run without one."""
        return step >= self.warmup_steps and self.step_generates(step)

    def step_generates(self, step: int) -> bool:
        """Whether optimizer step `step` trains on generated completions. A kd_lmbda mix draws from a generator
        seeded with (seed, step) alone, not one stream consumed step by step: a run resumed from a checkpoint, or
        steps drawn ahead (kd_async_rollouts), see the same schedule as one run from the start."""
        if self.args.kd_seq_kd or self.args.kd_lmbda >= 1:
            return True
        draw = random.Random(schedule_seed(self.args.seed, step)).random()
        return self.args.kd_lmbda > 0 and draw < self.args.kd_lmbda

    def step_batches(
        self, iterator: Iterator, count: int, generator: nn.Module, *, tokenizer: Any, step: int, last_step: int,
        device: torch.device, attach_teacher: AttachTeacher | None = None, make_rows: MakeRows | None = None,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """Optimizer step `step`'s `count` micro-batches from the epoch's `iterator` (the Trainer's
        get_batch_samples), their completions sampled when the step generates: now (replace), or requested
        kd_async_rollouts steps ahead (asynchronous.py; `last_step` bounds that look-ahead)."""
        self.warmup_steps = self.args.onpolicy_warmup(last_step)
        if self.pipeline is not None:  # an engine: never across tokenizers (check_generation_args), no make_rows
            batches, generated = self.pipeline.step_batches(
                iterator, count, generator, tokenizer=tokenizer, step=step, last_step=last_step,
                attach_teacher=attach_teacher,
            )  # fmt: skip
            if generated:
                return on_device(batches, device)
            require_completions(batches, self.args)
            return batches
        batches = take(iterator, count)
        if not batches:  # the epoch is over: nothing to generate, no draw spent
            return batches
        if not self.generates(step):
            require_completions(batches, self.args)
            return batches
        return self.replace(generator, batches, tokenizer=tokenizer, step=step, device=device,
                            attach_teacher=attach_teacher, make_rows=make_rows)  # fmt: skip

    def replace(
        self,
        generator: nn.Module,
        batches: list[dict[str, Any]],
        *,
        tokenizer: Any,
        step: int,
        device: torch.device,
        attach_teacher: AttachTeacher | None = None,
        make_rows: MakeRows | None = None,
    ) -> list[dict[str, Any]]:
        """The step's micro-batches with each row's completion sampled by `generator` (num_generations rows per
        prompt, adjacent); `attach_teacher` adds a served teacher's top-k to each (on the CPU). `make_rows`
        (rollouts, the micro-batch they replace) -> batch builds them (default rollout_batch; across tokenizers
        cross_tokenizer_rollouts.rows_maker)."""
        plan = self.plan(generator, batches, tokenizer)
        self.announce(generator, plan, step)
        # in process, a progress bar over the decode steps when the Trainer's bars show (generate_rollouts)
        progress = {"progress": True} if not self.args.kd_generation_url and shows_progress(self.args) else {}
        began = time.perf_counter()
        # an engine at kd_generation_url decodes in its own precision: nothing of this process computes the rollouts
        with contextlib.nullcontext() if self.args.kd_generation_url else self.precision():
            rollouts = self.source(
                generator, plan.sources, self.settings, pad_id=plan.pad, eos_ids=plan.eos_ids, start_id=plan.start,
                step=step, **progress,
            )  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.seconds.append(time.perf_counter() - began)
        return on_device(self.build(plan, rollouts, attach_teacher, make_rows), device)

    def plan(self, generator: nn.Module, batches: list[dict[str, Any]], tokenizer: Any) -> RolloutPlan:
        """What a generated step asks for, read off its micro-batches."""
        pad, eos_ids, start = special_ids(unwrap_model(generator), tokenizer)
        prompts = [prompts_of(batch) for batch in batches]
        teacher_prompts = [teacher_prompts_of(batch) for batch in batches]  # None: the teacher reads the student's
        # sequence-level KD: the teacher writes the completions after its own prompt, where the rows give it one
        sources = [own if self.args.kd_seq_kd and own is not None else mine
                   for own, mine in zip(teacher_prompts, prompts)]  # fmt: skip
        # in process or from an engine alike: refused before any generation, not deep inside it
        check_context(generator, [p or [start] for group in sources for p in group], self.settings.max_new_tokens)
        return RolloutPlan(batches, prompts, teacher_prompts, [p for group in sources for p in group], pad, eos_ids,
                           start)  # fmt: skip

    def announce(self, generator: nn.Module, plan: RolloutPlan, step: int) -> None:
        """Once a run, at INFO before its first generated step waits for its rollouts: how many, how long, and how
        they are made (in process: the decode loop, captured / eager; or served by an engine), since the Trainer's
        progress bar stands still meanwhile."""
        if self.announced:
            return
        self.announced = True
        if not logger.isEnabledFor(logging.INFO):
            return
        who = "the teacher (kd_seq_kd)" if self.args.kd_seq_kd else "the student"
        if self.args.kd_generation_url:
            rows = len(plan.sources) * self.settings.num_generations
            how = (f"{rows} completions ({len(plan.sources)} prompts x {self.settings.num_generations}) of up to "
                   f"{self.settings.max_new_tokens} new tokens, served: the engine at {self.args.kd_generation_url} "
                   f"(weights pushed every {self.args.kd_sync_steps} step(s))")  # fmt: skip
        else:
            how = describe_generation(generator, len(plan.sources), self.settings)
        when = (f"requested {self.args.kd_async_rollouts} step(s) ahead" if self.pipeline is not None
                else "the step trains once they are made")  # fmt: skip
        logger.info("on-policy step %d: %s samples %s; %s (trainer.kd_rollout_seconds: seconds per generated step)",
                    step, who, how, when)  # fmt: skip

    def build(
        self, plan: RolloutPlan, rollouts: list[Rollout], attach_teacher: AttachTeacher | None = None,
        make_rows: MakeRows | None = None,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """The rollouts as the plan's micro-batches, on the CPU: micro-batch i holds its own prompts' rollouts."""
        out, first = [], 0
        n, pad, start = self.settings.num_generations, plan.pad, plan.start
        for source, own, mine in zip(plan.batches, plan.teacher_prompts, plan.prompts):
            chunk = rollouts[first : first + len(mine) * n]
            first += len(mine) * n
            if make_rows is not None:  # across tokenizers (cross_tokenizer_rollouts.rows_maker)
                batch = make_rows(chunk, source)
            elif own is None:
                batch = rollout_batch(chunk, pad, behaviour=self.behaviour)
            else:  # the teacher scores each completion after its own prompt (self-distillation: OPSD / SDFT)
                if self.args.kd_seq_kd:  # written after the teacher's prompt: the student's row has its own
                    students = [p or [start] for p in mine for _ in range(n)]
                    chunk = [replace(r, prompt=p) for p, r in zip(students, chunk)]
                batch = privileged_rollout_batch(chunk, [p for p in own for _ in range(n)], pad)
                if self.behaviour:  # the student's side is rollout_batch's layout: the engine's log b pairs alike
                    batch[BEHAVIOUR] = behaviour_logprobs(chunk, batch["input_ids"].shape)
            out.append(batch if attach_teacher is None else attach_teacher(batch))
        return out


@dataclass(frozen=True)
class RolloutPlan:
    """A generated step's request, read off its micro-batches: per micro-batch its rows' prompts and teacher
    prompts (None: the teacher reads the student's), the prompts generated from (all micro-batches, in order), and
    the generator's pad, EOS and start ids."""

    batches: list[dict[str, Any]]
    prompts: list[list[list[int]]]
    teacher_prompts: list[list[list[int]] | None]
    sources: list[list[int]]
    pad: int
    eos_ids: set[int]
    start: int


def schedule_seed(seed: int, step: int) -> str:
    """The kd_lmbda draw's seed for optimizer step `step`: a string, which random.Random hashes (SHA-512) whole,
    so neighbouring steps draw independently; the same in every run and process with `seed`."""
    return f"kd_lmbda {seed} {step}"


def on_device(batches: list[dict[str, Any]], device: torch.device) -> list[dict[str, Any]]:
    """Generated micro-batches moved to `device`, marked as generated for compute_loss."""
    return [{**{k: v.to(device) for k, v in batch.items()}, GENERATED: True} for batch in batches]


def teacher_prompts_of(batch: dict[str, Any]) -> list[list[int]] | None:
    """Each row's teacher prompt (PromptCollator's teacher rows: the teacher's tokens before its completion), or
    None when the batch has no teacher rows of its own."""
    if batch.get(TEACHER_INPUT_IDS) is None:
        return None
    teacher_rows = {"input_ids": batch[TEACHER_INPUT_IDS], "labels": batch[TEACHER_LABELS],
                    "attention_mask": batch.get(TEACHER_ATTENTION_MASK),
                    "position_ids": batch.get(TEACHER_POSITION_IDS)}  # fmt: skip
    return prompts_of(teacher_rows)


def require_completions(batches: list[dict[str, Any]], args: Any) -> None:
    """An off-policy step trains on the dataset's completions: prompt-only rows have none."""
    for batch in batches:
        flags = batch.get(HAS_COMPLETION)
        if flags is not None and not bool(flags.all()):
            raise ValueError(
                f"this optimizer step trains on the dataset's completions (kd_lmbda={args.kd_lmbda}, "
                f"kd_onpolicy_warmup_steps={args.kd_onpolicy_warmup_steps}), but some rows are prompts without a "
                f"completion; give every row a 'completion', or set kd_lmbda=1 (every step generated) or "
                f"kd_seq_kd=True, with kd_onpolicy_warmup_steps=0"
            )
