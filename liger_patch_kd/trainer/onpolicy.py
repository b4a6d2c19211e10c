"""On-policy steps in the Trainer: which optimizer steps train on generated completions, and the swap of a step's
micro-batches for rollouts, made in one generation pass before the step's first forward.

KDTrainer.get_batch_samples (the Trainer's hook that fetches an optimizer step's micro-batches together) calls
`OnPolicySteps.replace`: the prompts of all the step's micro-batches go to `generate_rollouts` at once
(`kd_rollout_batch_size` prompts per call), and micro-batch i is replaced by the rollouts of its own prompts, so
the step keeps its gradient-accumulation structure and the Trainer counts the scored completion tokens of the
whole step for an exact num_items_in_batch. In process, all of a step's rollouts come from the weights the step
starts with: they are exactly on-policy. From an engine (kd_generation_url, engine.py) they come from the weights
last pushed to it, up to kd_sync_steps - 1 steps old.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..models import unwrap_model
from .engine import rollout_source
from .privileged import privileged_rollout_batch
from .rollouts import BEHAVIOUR, Rollout, behaviour_logprobs, prompts_of, rollout_batch

GENERATED = "kd_generated"  # key marking a generated micro-batch (compute_loss pops it)
HAS_COMPLETION = "kd_has_completion"  # PromptCollator's per-row flag


def special_ids(generator: nn.Module, tokenizer: Any) -> tuple[int, set[int], int]:
    """(pad id, EOS ids, the token an empty prompt starts with) from the generation config, then the tokenizer."""
    gen = unwrap_model(generator).generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    pads = (gen.pad_token_id, getattr(tokenizer, "pad_token_id", None), *sorted(eos_ids))
    pad = next((x for x in pads if x is not None), 0)
    start = next((x for x in (gen.bos_token_id, getattr(tokenizer, "bos_token_id", None)) if x is not None), pad)
    return pad, eos_ids, start


class OnPolicySteps:
    """Decides, per optimizer step, whether it trains on generated completions (every step with kd_seq_kd; a
    kd_lmbda fraction otherwise, drawn from a generator seeded with args.seed), and makes them."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.settings = args.rollout_settings()
        self.rng = random.Random(args.seed)
        self.seconds: list[float] = []  # time inside generate() per generated step
        self.source = rollout_source(args)  # in this process, or an engine at kd_generation_url (engine.py)
        # the pg loss importance-corrects with the behaviour log-probs an engine returns
        self.behaviour = bool(args.kd_generation_url) and args.kd_onpolicy_loss == "pg"

    @property
    def enabled(self) -> bool:
        return bool(self.args.kd_seq_kd or self.args.kd_lmbda > 0)

    @property
    def staleness(self) -> list[int]:
        """Per generated step, how many optimizer steps old the weights that sampled it were (0 in process)."""
        return getattr(self.source, "staleness", [])

    def close(self) -> None:
        if hasattr(self.source, "close"):
            self.source.close()

    def step_generates(self) -> bool:
        if self.args.kd_seq_kd or self.args.kd_lmbda >= 1:
            return True
        return self.args.kd_lmbda > 0 and self.rng.random() < self.args.kd_lmbda

    def replace(
        self,
        generator: nn.Module,
        batches: list[dict[str, Any]],
        *,
        tokenizer: Any,
        step: int,
        device: torch.device,
        attach_teacher: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        make_rows: Callable[[list[Rollout], dict[str, Any]], dict[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        """The step's micro-batches with each row's completion sampled by `generator` (num_generations rows per
        prompt, adjacent); `attach_teacher` adds a served teacher's top-k to each (on the CPU). `make_rows`
        (rollouts, the micro-batch they replace) -> batch builds them (default rollout_batch; across tokenizers
        cross_tokenizer_rollouts.rows_maker)."""
        model = unwrap_model(generator)
        pad, eos_ids, start = special_ids(model, tokenizer)
        prompts = [prompts_of(batch) for batch in batches]
        teacher_prompts = [teacher_prompts_of(batch) for batch in batches]  # None: the teacher reads the student's
        # sequence-level KD: the teacher writes the completions after its own prompt, where the rows give it one
        sources = [own if self.args.kd_seq_kd and own is not None else mine
                   for own, mine in zip(teacher_prompts, prompts)]  # fmt: skip
        began = time.perf_counter()
        rollouts = self.source(
            generator, [p for group in sources for p in group], self.settings, pad_id=pad, eos_ids=eos_ids,
            start_id=start, step=step,
        )  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.seconds.append(time.perf_counter() - began)
        out, first = [], 0
        per_batch = [len(group) * self.settings.num_generations for group in prompts]
        n = self.settings.num_generations
        for count, source, own, mine in zip(per_batch, batches, teacher_prompts, prompts):
            chunk = rollouts[first : first + count]
            first += count
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
            if attach_teacher is not None:
                batch = attach_teacher(batch)
            out.append({**{k: v.to(device) for k, v in batch.items()}, GENERATED: True})
        return out


def teacher_prompts_of(batch: dict[str, Any]) -> list[list[int]] | None:
    """Each row's teacher prompt (PromptCollator's teacher rows: the teacher's tokens before its completion), or
    None when the batch has no teacher rows of its own."""
    if batch.get("teacher_input_ids") is None:
        return None
    teacher_rows = {"input_ids": batch["teacher_input_ids"], "labels": batch["teacher_labels"],
                    "attention_mask": batch.get("teacher_attention_mask")}  # fmt: skip
    return prompts_of(teacher_rows)


def require_completions(batches: list[dict[str, Any]], args: Any) -> None:
    """An off-policy step trains on the dataset's completions: prompt-only rows have none."""
    for batch in batches:
        flags = batch.get(HAS_COMPLETION)
        if flags is not None and not bool(flags.all()):
            raise ValueError(
                f"this optimizer step trains on the dataset's completions (kd_lmbda={args.kd_lmbda}), but some rows "
                f"are prompts without a completion; give every row a 'completion', or set kd_lmbda=1 (every step "
                f"generated) or kd_seq_kd=True"
            )
