"""What the time-to-accuracy benchmark needs besides its recipes: a callback that scores the student at checkpoints
on a clock that stops while it scores, the columns TRL's GKDTrainer reads, and the summary figures (time to an
accuracy, means over seeds, accuracy at a given time, one recipe against another at the other's accuracy)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def checkpoint_clock(evaluate: Callable[[object], float], every: int, cap_seconds: float, device: torch.device,
                     base_accuracy: float, one_time_seconds: float = 0.0):  # fmt: skip
    """A TrainerCallback: training seconds counted from train()'s start, the queue drained at each optimizer step,
    the scoring left out; `evaluate(model)` every `every` steps, at the last step and when the training seconds pass
    `cap_seconds` (which then stops the run). `clock.curve` lists {step, seconds, accuracy}, from step 0 (the
    student before the recipe: `base_accuracy`); `clock.eval_seconds` the seconds spent scoring.

    `one_time_seconds`: work the recipe did before train() (a rollout store's generation and scoring), counted
    as the clock's start: the curve gets a second step-0 point at those seconds, every later point includes them,
    and so does the cap."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.curve = [dict(step=0, seconds=0.0, accuracy=base_accuracy)]
            if one_time_seconds:
                self.curve.append(dict(step=0, seconds=float(one_time_seconds), accuracy=base_accuracy))
            self.train_seconds, self.eval_seconds = float(one_time_seconds), 0.0
            self.started = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            sync(device)
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            sync(device)
            now = time.perf_counter()
            self.train_seconds += now - self.started
            over = self.train_seconds >= cap_seconds
            if state.global_step % every == 0 or state.global_step >= state.max_steps or over:
                accuracy = evaluate(model)
                self.curve.append(dict(step=state.global_step, seconds=self.train_seconds, accuracy=accuracy))
                control.should_training_stop = control.should_training_stop or over
            self.eval_seconds += time.perf_counter() - now
            self.started = time.perf_counter()

    return Clock()


def gkd_columns(pad_id: int) -> Callable[[list[dict]], dict[str, torch.Tensor]]:
    """A collator for TRL's GKDTrainer over rows {"prompt_ids", "completion_ids"} (the tokens every recipe trains
    on): input_ids / attention_mask / labels right-padded (labels -100 on the prompt and the padding) and the
    prompts left-padded for its generate() (prompts / prompt_attention_mask), the columns its
    DataCollatorForChatML makes from chat messages."""

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
        prompt_width = max(len(r["prompt_ids"]) for r in rows)
        out = {name: torch.full((len(rows), w), fill, dtype=torch.long) for name, w, fill in (
            ("input_ids", width, pad_id), ("attention_mask", width, 0), ("labels", width, -100),
            ("prompts", prompt_width, pad_id), ("prompt_attention_mask", prompt_width, 0))}  # fmt: skip
        for i, r in enumerate(rows):
            p, c = list(r["prompt_ids"]), list(r["completion_ids"])
            n = len(p) + len(c)
            out["input_ids"][i, :n] = torch.tensor(p + c)
            out["attention_mask"][i, :n] = 1
            out["labels"][i, len(p) : n] = torch.tensor(c)
            out["prompts"][i, prompt_width - len(p) :] = torch.tensor(p)
            out["prompt_attention_mask"][i, prompt_width - len(p) :] = 1
        return out

    return collate


def seconds_clock(payload: dict) -> str:
    """"GPU" or "CPU": what a results payload's seconds were counted on: the device its config asked for, else (the
    device chosen by what the machine has) whether its environment names a GPU."""
    device = payload.get("config", {}).get("device")
    if device:
        return "GPU" if str(device).startswith("cuda") else "CPU"
    return "GPU" if payload.get("environment", {}).get("gpu") else "CPU"


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (0 for one value; None, None for none)."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    spread = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, spread


def time_to(curve: list[dict], accuracy: float, key: str = "seconds") -> float | None:
    """The first `key` (seconds or step) at which the curve reaches `accuracy`, interpolated linearly between the
    checkpoint before and the one that reaches it; None if it never does."""
    for before, after in zip(curve, curve[1:]):
        if before["accuracy"] >= accuracy:
            return float(before[key])
        if after["accuracy"] >= accuracy:
            share = (accuracy - before["accuracy"]) / (after["accuracy"] - before["accuracy"])
            return float(before[key] + share * (after[key] - before[key]))
    return float(curve[0][key]) if len(curve) == 1 and curve[0]["accuracy"] >= accuracy else None


def accuracy_at(curve: list[dict], value: float, key: str = "seconds") -> float | None:
    """The curve's accuracy at `key` = value, interpolated between checkpoints; None past its last checkpoint."""
    for before, after in zip(curve, curve[1:]):
        if before[key] <= value <= after[key]:
            span = after[key] - before[key]
            share = (value - before[key]) / span if span else 1.0
            return before["accuracy"] + share * (after["accuracy"] - before["accuracy"])
    return curve[-1]["accuracy"] if curve and math.isclose(curve[-1][key], value) else None


def recipe_summary(runs: list[dict], target: float, reference: list[dict] | None) -> dict:
    """One recipe's figures over its seeds: final accuracy, steps and training seconds, time and steps to
    `target` (over the seeds that reach it), peak memory, and, with `reference` (the ground-truth SFT runs of the
    same seeds), that recipe's accuracy at this recipe's final training seconds (None past its last checkpoint)."""
    finals = [r["curve"][-1] for r in runs]
    reach_s = [t for t in (time_to(r["curve"], target) for r in runs) if t is not None]
    reach_steps = [t for t in (time_to(r["curve"], target, "step") for r in runs) if t is not None]
    out = dict(
        seeds=[r["seed"] for r in runs],
        final_accuracy=mean_std([f["accuracy"] for f in finals]),
        final_step=mean_std([f["step"] for f in finals]),
        train_seconds=mean_std([f["seconds"] for f in finals]),
        seconds_per_step=mean_std([f["seconds"] / max(1, f["step"]) for f in finals]),
        seconds_to_target=mean_std(reach_s),
        steps_to_target=mean_std(reach_steps),
        reached_target=f"{len(reach_s)}/{len(runs)}",
        peak_mib=mean_std([r["peak_mib"] for r in runs if r.get("peak_mib") is not None]),
        extra_mib=mean_std([r["extra_mib"] for r in runs if r.get("extra_mib") is not None]),
    )
    if reference is not None:
        sft = [accuracy_at(ref["curve"], run["curve"][-1]["seconds"]) for run, ref in seed_pairs(runs, reference)]
        out["sft_accuracy_at_same_seconds"] = mean_std([a for a in sft if a is not None])
        out["sft_compared_seeds"] = sum(a is not None for a in sft)
    return out


def seed_pairs(runs: list[dict], reference: list[dict]) -> list[tuple[dict, dict]]:
    """(run, the reference's run of its seed) for each run whose seed the reference has, in the runs' order: each
    seed's recipes start from that seed's student, so runs compare seed with seed (runs without a "seed" pair by
    position)."""
    seed = lambda i, r: r.get("seed", i)  # noqa: E731
    theirs = {seed(i, r): r for i, r in enumerate(reference)}
    return [(r, theirs[seed(i, r)]) for i, r in enumerate(runs) if seed(i, r) in theirs]


def within_fraction_of_seconds(candidate: list[dict], reference: list[dict], fraction: float = 0.5) -> dict:
    """Does `candidate` reach `reference`'s accuracy, within the seed spread, in at most `fraction` of the GPU-seconds
    `reference` takes to reach it? (Offline on-policy against live on-policy: the candidate's curves include its
    one-time cost.)

    Seed by seed (seed_pairs), since each seed's recipes start from that seed's
    student and students of different seeds can start far apart: a seed's accuracy level is its reference run's
    final accuracy less the seed spread, the standard deviation over the reference's seeds of what training added
    (final less starting accuracy; none for one seed). Each side's time to that level is time_to's; a reference run
    that never reaches it counts with its final seconds (`reference_bound`: the mean is then a lower bound, which only
    makes the test harder to pass). A seed whose reference run starts at or above its level says nothing (training
    never took it there) and is left out. `answer` is True when the candidate reaches the level on every seed left
    and its mean seconds are <= fraction x the reference's; False otherwise; None without runs on either side or
    without a seed left."""
    if not candidate or not reference:
        return dict(accuracy=None, answer=None, text="no runs to compare")
    gains = [r["curve"][-1]["accuracy"] - r["curve"][0]["accuracy"] for r in reference]
    spread = mean_std(gains)[1] or 0.0
    levels, own, theirs, bound = [], [], [], False
    for mine, ref in seed_pairs(candidate, reference):
        level = ref["curve"][-1]["accuracy"] - spread
        if ref["curve"][0]["accuracy"] >= level:  # the starting student already has it: nothing to compare
            continue
        reached = time_to(ref["curve"], level)
        bound |= reached is None
        levels.append(level)
        own.append(time_to(mine["curve"], level))
        theirs.append(reached if reached is not None else ref["curve"][-1]["seconds"])
    if not levels:
        return dict(accuracy=None, spread=spread, seeds=0, answer=None,
                    text=f"undecided: on no seed did the reference rise above its starting student by more than "
                         f"the seed spread ({spread:.3f}), so there is no time to accuracy to compare")  # fmt: skip
    reached = [t for t in own if t is not None]
    own_mean, their_mean = mean_std(reached)[0], mean_std(theirs)[0]
    answer = len(reached) == len(own) and own_mean <= fraction * their_mean
    ratio = own_mean / their_mean if own_mean is not None and their_mean else None
    seconds = "never" if own_mean is None else f"{own_mean:.1f} s"
    share = "" if ratio is None else f", {ratio:.2f} of its GPU-seconds"
    text = (f"accuracy {mean_std(levels)[0]:.3f} (mean over {len(levels)} seed(s) of the reference's final less the "
            f"seed spread {spread:.3f}) in {seconds} against {'>= ' if bound else ''}{their_mean:.1f} s{share}; "
            f"{len(reached)}/{len(own)} seeds reach it: {'yes' if answer else 'no'}")  # fmt: skip
    return dict(accuracy=mean_std(levels)[0], levels=levels, spread=spread, seconds=own_mean,
                reference_seconds=their_mean, ratio=ratio, reached=f"{len(reached)}/{len(own)}",
                reference_bound=bound, fraction=fraction, answer=answer, text=text)  # fmt: skip
