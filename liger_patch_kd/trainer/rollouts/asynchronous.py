"""Asynchronous on-policy rollouts (kd_async_rollouts = k): while the student trains on step s's rollouts, the
engine at kd_generation_url is already generating those of steps s + 1 ... s + k.

The next steps' prompts without touching the Trainer's sampler: the Trainer draws each optimizer step's
micro-batches from the epoch's iterator through get_batch_samples, in order; here the micro-batches of the next k
steps are drawn from that same iterator a few calls early (the same batches in the same order, grouped as the
Trainer groups them: gradient_accumulation_steps per step, the epoch's remainder last), held, and handed over when
the Trainer asks for their step. The sampler and its seed per epoch, the micro-batches per step and
num_items_in_batch stay the Trainer's; a run resumed from a checkpoint skips the steps trained and draws the held
ones again. The look-ahead stops at the epoch's end (the next epoch's iterator does not exist yet: its first step is
requested and waited for) and at max_steps. Which steps generate (kd_lmbda < 1) is drawn in step order, as in the
synchronous mode.

One worker thread (a ThreadPoolExecutor of one: jobs run in the order sent) sends the weight loads and the
generation requests in order; the trainer's thread writes the weights (WeightSync.stage, at the start of the step
whose weights they are) and takes the rollouts. So with kd_sync_steps = 1 and k = 1, step s >= 1 trains on
completions generated with the weights step s - 1 started with (staleness 1, logged per step as
kd_rollout_staleness); in general k to k + kd_sync_steps - 1, less at the start of an epoch. The pg loss is
importance-corrected with the engine's behaviour log-probs; the divergence (GKD / JSD) and k1 / k3 losses train
off-policy by that many steps. Seeds are per step (rollouts.call_seed): a fixed schedule gives the same run.

Faults lose nothing: a job that fails (the engine gone after its retries, a malformed reply) is raised in the
trainer's thread at the latest at the next step, the error noting which job it was; the jobs after it are not sent
(a generation request after a failed load would be answered by the wrong weights); no step trains without its
rollouts and none trains twice. close() (the end of train(), or its error) cancels what was not sent, waits for
the request in flight (bounded by kd_teacher_timeout) and joins the thread.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from torch import nn

WORKER_NAME = "liger-kd-rollouts"  # the worker thread's name prefix
_SKIPPED = object()  # a job not sent because an earlier one failed


@dataclass
class HeldStep:
    """An optimizer step drawn ahead: its micro-batches and, when it generates, its request (plan, staleness, the
    future of its CPU batches)."""

    step: int
    batches: list[dict[str, Any]]
    plan: Any = None  # onpolicy.RolloutPlan; None: the step trains on the dataset's completions
    staleness: int | None = None
    future: Future | None = None


class AsyncRollouts:
    """The look-ahead and the worker of one OnPolicySteps (`steps`: its source is an EngineRollouts)."""

    def __init__(self, steps: Any, depth: int) -> None:
        self.steps, self.depth = steps, depth
        self.staleness: list[int] = []  # per generated step trained, in order
        self._held: deque[HeldStep] = deque()
        self._iterator: Iterator | None = None
        self._exhausted = False
        self._worker: ThreadPoolExecutor | None = None
        self._failure: BaseException | None = None

    def step_batches(
        self, iterator: Iterator, count: int, generator: nn.Module, *, tokenizer: Any, step: int, last_step: int,
        attach_teacher: Callable | None = None,
    ) -> tuple[list[dict[str, Any]], bool]:  # fmt: skip
        """(step `step`'s micro-batches, whether they are its rollouts (on the CPU) or the dataset's rows); before
        waiting for the rollouts, the steps up to step + depth (and below `last_step`) are drawn and theirs
        requested."""
        self._raise_failure()
        if iterator is not self._iterator:  # a new epoch (or one the Trainer stopped early): held steps go
            self._drop_held()
            self._iterator, self._exhausted = iterator, False
        current = self._held.popleft() if self._held else self._draw(count, step, generator, tokenizer)
        if current is None:
            return [], False
        if current.step != step or len(current.batches) != count:
            raise RuntimeError(
                f"kd_async_rollouts drew {len(current.batches)} micro-batches ahead for step {current.step}, and the "
                f"Trainer asks for {count} of step {step}: the dataloader's length does not match the batches it "
                f"yields; set kd_async_rollouts=0"
            )
        began = time.perf_counter()
        send = [current] if current.plan is not None and current.future is None else []
        last = self._held[-1].step if self._held else step
        while not self._exhausted and last + 1 <= step + self.depth and last + 1 < last_step:
            held = self._draw(self.steps.args.gradient_accumulation_steps, last + 1, generator, tokenizer)
            if held is None:
                break
            self._held.append(held)
            last = held.step
            send += [held] if held.plan is not None else []
        if send:
            self._send_requests(send, generator, step, attach_teacher)
        if current.plan is None:
            return current.batches, False
        batches = current.future.result()
        if batches is _SKIPPED:
            self._raise_failure()
        self.steps.seconds.append(time.perf_counter() - began)  # what the trainer waited, not the engine's time
        self.staleness.append(current.staleness)
        return batches, True

    def close(self) -> None:
        """Cancel what was not sent, wait for the request in flight, join the worker thread; the engine is pushed
        again before the next train()'s first rollouts when a staged load may not have run."""
        worker, self._worker = self._worker, None
        self._held.clear()
        if worker is not None:
            worker.shutdown(wait=True, cancel_futures=True)
            self.steps.source.sync.forget_staged()
        self._iterator, self._exhausted, self._failure = None, False, None  # the job in flight has ended

    # ------------------------------------------------------------------------------------------- internals
    def _draw(self, count: int, step: int, generator: nn.Module, tokenizer: Any) -> HeldStep | None:
        batches = take(self._iterator, count)
        self._exhausted = len(batches) < count
        if not batches:
            return None
        plan = self.steps.plan(generator, batches, tokenizer) if self.steps.generates(step) else None
        return HeldStep(step, batches, plan)

    def _send_requests(self, held: list[HeldStep], generator: nn.Module, step: int, attach: Callable | None) -> None:
        """This step's push when it is due (written now, loaded by the worker after the requests already sent),
        then each held step's generation request, in step order."""
        source, settings = self.steps.source, self.steps.settings
        if source.sync.due(step):
            self._send(source.sync.stage(generator, step), f"the weights of step {step} (its push)")
        for h in held:
            plan = h.plan
            self.steps.announce(generator, plan, h.step)  # once a run, at INFO
            h.staleness, request = source.ask(
                generator, plan.sources, settings, eos_ids=plan.eos_ids, start_id=plan.start, step=h.step
            )
            job = lambda p=plan, r=request: self.steps.build(p, r(), attach)  # noqa: E731  (bound now, run later)
            h.future = self._send(job, f"step {h.step}'s rollouts")

    def _send(self, job: Callable[[], Any], what: str) -> Future:
        def run() -> Any:
            if self._failure is not None:
                return _SKIPPED
            try:
                return job()
            except BaseException as e:
                e.add_note(f"(kd_async_rollouts={self.depth}: raised in the background while sending {what}; no "
                           f"step trained without its rollouts)")  # fmt: skip
                self._failure = e
                raise

        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=WORKER_NAME)
        return self._worker.submit(run)

    def _drop_held(self) -> None:
        for held in self._held:  # requests not sent yet are cancelled; one in flight runs, its rows unused
            if held.future is not None:
                held.future.cancel()
        self._held.clear()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure


def take(iterator: Iterator, count: int) -> list[Any]:
    """Up to `count` items of `iterator` (fewer at its end), as the Trainer's get_batch_samples draws them."""
    return list(itertools.islice(iterator, count))
