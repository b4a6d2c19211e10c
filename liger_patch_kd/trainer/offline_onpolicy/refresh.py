"""Refreshing a rollout store while training on it: every `kd_store_refresh_steps` optimizer steps, a
`kd_store_refresh_fraction` of that step's rows (ceil(fraction x rows) in all, the first rows of its micro-batches)
get a new completion sampled by the current student from the same prompt, with the store's sampling settings, and
are rescored by the teacher (top-k / samples as the store holds them, the teacher's and the behaviour log-probs of
the new tokens). The rows are replaced in memory, in the batches that train next; the store's files are never
rewritten. The new completions are sampled, and their behaviour log-probs taken, as an on-policy step's are, and the
teacher scores them in the precision its forward has in the Trainer's loss: both under `precision`, the Trainer's
autocast (a bf16=True run with float32 weights samples and rescores in bf16 autocast, as its student's and live
teacher's forwards run, not in float32). Steps 0 apart, every 1 with fraction 1 is fully online (every
step on the current student's samples); none (0) is fully offline. Each refresh is logged at INFO (the step, the
rows), and the Trainer's logs carry kd_refreshed_rows: the rows refreshed since the previous log."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import torch
from transformers.utils import logging

from ...batch.columns import BEHAVIOUR_LOGPROBS, TEACHER_LOGPROBS, TEACHER_TOKEN_IDS, TEACHER_TOKEN_LOGPROBS
from ...batch.rollout_store import RolloutStoreCollator, rows_of
from ...models import unwrap_model
from ...teacher.store import LOGPROB_DTYPES
from ...teacher.store.rollouts import IGNORE_INDEX, rollouts_of
from ...teacher.store.samples import samples_of
from ..rollouts.generate import Rollout, RolloutSettings, generate_rollouts, shows_progress
from ..rollouts.onpolicy import special_ids
from .scoring import ScoredRow, ScoreOptions, score_rollouts

logger = logging.get_logger(__name__)


def prompt_of(item: dict[str, torch.Tensor]) -> list[int]:
    """A stored row's prompt: its tokens before the first scored label."""
    scored = (item["labels"] != IGNORE_INDEX).nonzero()
    cut = int(scored[0]) if len(scored) else len(item["labels"])
    return item["input_ids"][:cut].tolist()


class StoreRefresh:
    """Replaces a slice of a step's stored rows with the current student's rollouts, scored by the teacher."""

    def __init__(self, meta: dict, args: Any, collator: RolloutStoreCollator) -> None:
        section = rollouts_of(meta)
        sampling = section["sampling"]
        self.every, self.fraction = args.kd_store_refresh_steps, args.kd_store_refresh_fraction
        self.settings = RolloutSettings(
            max_new_tokens=section["max_new_tokens"], temperature=sampling["temperature"], top_p=sampling["top_p"],
            top_k=sampling["top_k"], num_generations=1, cache=args.kd_generation_cache, seed=args.seed,
            batch_size=args.kd_rollout_batch_size,  # the calls' size bounds generation memory, as on-policy
        )  # fmt: skip
        self.score = ScoreOptions(top_k=meta["top_k"], samples=samples_of(meta),
                                  temperature=meta.get("temperature", 1.0), seed=meta.get("sample_seed", 0))
        self.dtype = LOGPROB_DTYPES[meta.get("logprob_dtype", "float32")]
        self.collator = collator
        self.progress = shows_progress(args)  # a progress bar over the decode steps (generate_rollouts)
        self.refreshed_steps: list[int] = []
        self.unlogged_rows = 0  # rows refreshed since the Trainer's last log (take_unlogged_rows)

    def due(self, step: int) -> bool:
        return bool(self.every) and step > 0 and step % self.every == 0

    def __call__(self, batches: list[dict[str, Any]], student, teacher, *, tokenizer: Any, step: int,
                 vocab_size: int | None,
                 precision: Callable[[], AbstractContextManager] = contextlib.nullcontext,
                 ) -> list[dict[str, Any]]:  # fmt: skip
        """The step's micro-batches, the slice of each replaced (all of the step's new rollouts sampled in one call,
        seeded from (seed, step) as an on-policy step's are; sampled and scored under `precision()`)."""
        if not batches or not self.due(step):
            return batches
        rows = [rows_of(batch) for batch in batches]
        counts = self.counts([len(r) for r in rows])
        prompts = [prompt_of(item) for r, n in zip(rows, counts) for item in r[:n]]
        generator = unwrap_model(student)
        pad, eos_ids, start = special_ids(generator, tokenizer)
        settings = replace(self.settings, vocab_size=vocab_size)
        with precision():  # what an on-policy step's rollouts decode under (rollouts/onpolicy.py: OnPolicySteps)
            rollouts: list[Rollout] = generate_rollouts(generator, prompts, settings, pad_id=pad, eos_ids=eos_ids,
                                                        start_id=start, step=step, progress=self.progress)  # fmt: skip
        scored = iter(score_rollouts(generator, teacher, rollouts, self.score, vocab_size=vocab_size,
                                     teacher_precision=precision))  # fmt: skip
        out = []
        for batch, own, n in zip(batches, rows, counts):
            if n == 0:  # none of its rows due: the batch as it came
                out.append(batch)
                continue
            items = [self.item(next(scored)) for _ in range(n)] + own[n:]
            fresh = self.collator(items)
            device = batch["input_ids"].device
            out.append({k: v.to(device) if torch.is_tensor(v) else v for k, v in fresh.items()})
        self.refreshed_steps.append(step)
        self.unlogged_rows += len(prompts)
        # the step counted as the Trainer's logs count it (from 1: `step` optimizer steps are done before it)
        logger.info("kd_store_refresh_steps=%d: optimizer step %d regenerated %d of its %d stored rows with the "
                    "current student, rescored by the teacher", self.every, step + 1, len(prompts),
                    sum(len(r) for r in rows))  # fmt: skip
        return out

    def take_unlogged_rows(self) -> int:
        """The rows refreshed since the last call (the Trainer's log: kd_refreshed_rows), the count then reset."""
        rows, self.unlogged_rows = self.unlogged_rows, 0
        return rows

    def counts(self, sizes: list[int]) -> list[int]:
        """Rows refreshed in each micro-batch of `sizes` rows: ceil(fraction x the step's rows) in all, the first
        rows of each micro-batch, spread as the running total ceil(fraction x rows so far) says (a micro-batch of
        one row does not round the share up to all of it)."""
        counts, done, seen = [], 0, 0
        for size in sizes:
            seen += size
            due = math.ceil(self.fraction * seen - 1e-9)  # fraction <= 1: at most `size` more than before
            counts.append(due - done)
            done = due
        return counts

    def item(self, row: ScoredRow) -> dict[str, torch.Tensor]:
        """A scored rollout as a store item (the store's dtypes, so refreshed rows train as stored ones do)."""
        item = {"input_ids": row.input_ids, "labels": row.columns["labels"].long(),
                BEHAVIOUR_LOGPROBS: row.columns[BEHAVIOUR_LOGPROBS],
                TEACHER_TOKEN_LOGPROBS: row.columns[TEACHER_TOKEN_LOGPROBS]}  # fmt: skip
        if self.score.top_k:
            item[TEACHER_TOKEN_IDS] = row.topk_ids.to(torch.int32)
            item[TEACHER_LOGPROBS] = row.topk_logprobs.to(self.dtype)
        if row.samples is not None:
            ids, counts, logprobs = row.samples
            item.update(teacher_sample_ids=ids.to(torch.int32), teacher_sample_counts=counts.to(torch.int32),
                        teacher_sample_logprobs=logprobs.to(self.dtype))  # fmt: skip
        return item
