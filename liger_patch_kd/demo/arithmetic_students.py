"""The demo's students on a task with a right answer: how many held-out problems each recipe's student answers,
when worked solutions are few and prompts are many.

The task is arithmetic.py's at a size a CPU trains in seconds: three one-digit numbers joined by + and -, with
worked steps (`Q: 3+5-2=? A: 3+5=8; 8-2=6. #### 6`). One prompt in ten is held out by a stable hash, so every
held-out problem is a new combination of sums the training problems show. A teacher (Llama 3 x 96) learns it from
every training problem's solution with arithmetic.fit_on_ground_truth: it stands for a larger model that already
knows the task. The student (Llama 2 x 64) is given what a user usually has: worked solutions for a few problems
(`labelled`, the first of the training problems) and the prompts of all of them. It gets a short fine-tune on the
labelled problems (the task's format, the start on-policy distillation assumes: samples of a random student are
noise); then every recipe continues from a copy of that student for the same steps of the same batch size through
the demo's KDTrainingArguments (toys.training_args): SFT on the labelled problems (the Trainer's cross-entropy, no
teacher), on-policy KD on every prompt (GKD with lmbda 1: the student writes each completion and the teacher
grades every token of it; no solution needed), and SFT again, given as many seconds as the on-policy row took (a
recipe that costs more per step must beat this one, not only the equal-steps one). Each is scored by
arithmetic.exact_match: greedy decoding of the held-out prompts, the final answer checked exactly. With every
problem labelled (`labelled=0`) SFT is the one to beat on this task: the teacher's soft labels say little more
than a right answer does.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from ..models import revert_kd_patch
from .arithmetic import (
    ArithmeticTask,
    ModelShape,
    completion_batch,
    exact_match,
    fit_on_ground_truth,
    split_task,
)
from .toys import quiet, training_args

SFT = "SFT on the labelled problems"
ON_POLICY = "on-policy KD, all prompts (lmbda 1)"
SFT_SAME_SECONDS = "SFT, on-policy's seconds"


@dataclass(frozen=True)
class ArithmeticDemoSizes:
    """The arithmetic part's sizes: the task, the models and every training budget."""

    operands: int = 3
    digits: int = 1
    held_out_every: int = 10
    train_problems: int = 3000  # drawn with repeats: about 1,350 different ones; the teacher learns from all
    labelled: int = 150  # the first of them: the only worked solutions the student's recipes see (0: all of them)
    held_out: int = 150  # all different, of the 180 or so the split holds out
    teacher_hidden: int = 96
    teacher_layers: int = 3
    teacher_steps: int = 500
    teacher_lr: float = 3e-3
    student_hidden: int = 64
    student_layers: int = 2
    format_steps: int = 120  # the shared start: SFT on the labelled problems, before the recipes part ways
    format_lr: float = 5e-3
    steps: int = 300  # each recipe's, from the shared start, at toys.training_args' learning rate
    batch: int = 32

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "float":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                    raise ValueError(f"ArithmeticDemoSizes.{f.name}={value!r}: a learning rate must be a number > 0")
                continue
            least = 0 if f.name in ("format_steps", "labelled") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"ArithmeticDemoSizes.{f.name}={value!r}: it must be a whole number >= {least}")
        if self.labelled > self.train_problems:
            raise ValueError(f"ArithmeticDemoSizes.labelled={self.labelled} is more than train_problems="
                             f"{self.train_problems}: label at most every training problem (0 labels all of them)")
        # the task's own checks (operands >= 2, held_out_every >= 2), named by the task
        ArithmeticTask(self.operands, self.digits, self.held_out_every)

    @classmethod
    def tiny(cls) -> ArithmeticDemoSizes:
        """The pipeline only (tests): a few steps of each, nothing learnt."""
        return cls(train_problems=200, labelled=20, held_out=8, teacher_hidden=32, teacher_layers=1, teacher_steps=2,
                   student_hidden=32, student_layers=1, format_steps=1, steps=2, batch=4)  # fmt: skip


def task_data(sizes: ArithmeticDemoSizes) -> dict:
    """arithmetic.split_task at the demo's sizes, as the rows each recipe reads: `labelled_rows` prompt + completion
    and `labelled_token_rows` their ids (the labelled problems'), `prompt_rows` every training prompt alone."""
    task = ArithmeticTask(sizes.operands, sizes.digits, sizes.held_out_every)
    split = split_task(task, sizes.train_problems, sizes.labelled, sizes.held_out,
                       held_out_name="ArithmeticDemoSizes.held_out")  # fmt: skip
    return dict(tokenizer=split.tokenizer, prompts=split.prompts, completions=split.completions,
                held_out=split.held_out, labelled_prompts=split.labelled_prompts, labelled_completions=split.labels,
                labelled_distinct=len({p.prompt for p in split.given}), labelled_rows=split.labelled_rows(),
                labelled_token_rows=split.labelled_token_rows(), prompt_rows=split.prompt_only_rows(),
                max_new_tokens=split.max_new_tokens)  # fmt: skip


def recipes(sizes: ArithmeticDemoSizes, max_new_tokens: int) -> dict[str, tuple[dict | None, str]]:
    """name -> (the KDTrainingArguments options of its KDTrainer, or None for the plain Trainer's cross-entropy;
    the task_data rows it trains on: the labelled problems' tokens for SFT, "prompt_rows" for on-policy KD). The
    on-policy row (beta 0, forward KL, as in the demo's first table) samples every completion from the student
    (kd_lmbda 1), each up to the longest training completion; SFT_SAME_SECONDS, run after the others, is the SFT row
    given the on-policy row's seconds."""
    return {
        SFT: (None, "labelled_token_rows"),
        ON_POLICY: (dict(use_kd_patch=True, kd_beta=0.0, kd_lmbda=1.0, kd_max_new_tokens=max_new_tokens),
                    "prompt_rows"),
        SFT_SAME_SECONDS: (None, "labelled_token_rows"),
    }


def _format_tuned_student(sizes: ArithmeticDemoSizes, data: dict, seed: int, device):
    student = ModelShape(sizes.student_hidden, sizes.student_layers).build(len(data["tokenizer"]), seed, device)
    if sizes.format_steps:
        fit_on_ground_truth(student, data["labelled_prompts"], data["labelled_completions"], steps=sizes.format_steps,
                            batch=sizes.batch, lr=sizes.format_lr, seed=seed, device=device)  # fmt: skip
    return student


def _train_recipe(kd: dict | None, rows: str, student, teacher, data: dict, sizes: ArithmeticDemoSizes, seed: int,
                  out: Path, device, steps: int) -> float:  # fmt: skip
    """Train `student` in place with one recipe for `steps` steps on task_data[`rows`]; its training seconds."""
    from transformers import Trainer

    from ..trainer import KDTrainer

    # seed s: student init s, data order (and on-policy sampling) s - 1, as in the demo's table
    if kd is None:
        args = training_args(out, steps, sizes.batch, device, seed=seed - 1, remove_unused_columns=False)
        trainer = Trainer(model=student, args=args, train_dataset=data[rows],
                          data_collator=lambda got: completion_batch(
                              [r["prompt_ids"] for r in got], [r["completion_ids"] for r in got], "cpu"))  # fmt: skip
    else:
        args = training_args(out, steps, sizes.batch, device, seed=seed - 1, **kd)
        trainer = KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=data[rows],
                            processing_class=data["tokenizer"])  # fmt: skip
    start = time.perf_counter()
    quiet(trainer).train()
    seconds = time.perf_counter() - start
    revert_kd_patch(model=student)
    return seconds


def run_arithmetic_students(sizes: ArithmeticDemoSizes, seeds: tuple[int, ...], out: Path, device) -> dict:
    """Train the teacher and, per seed, the shared start and every recipe's student; score each on the held-out
    problems. Returns {"teacher_accuracy", "start_accuracy_by_seed", "held_out", "labelled" (how many labelled
    problems, "labelled_distinct" of them different), "train_problems", "rows": [{"recipe", "exact_match_by_seed",
    "seconds_by_seed", "steps_by_seed"}]}. Prints a line per phase."""
    bad = [s for s in seeds if isinstance(s, bool) or not isinstance(s, int) or s < 1]
    if not seeds or bad:
        raise ValueError(f"seeds={tuple(seeds)!r}: give whole numbers >= 1 (seed s initialises the student with s and "
                         f"orders its data with s - 1)")  # fmt: skip
    device = torch.device(device)
    data = task_data(sizes)
    tok, held_out, longest = data["tokenizer"], data["held_out"], data["max_new_tokens"]
    labelled = len(data["labelled_rows"])
    print(f"  task: {sizes.operands} numbers of {sizes.digits} digit(s), + and -, worked steps; "
          f"{len(data['prompt_rows'])} training prompts, {labelled} of them with a worked solution "
          f"({data['labelled_distinct']} different); {len(held_out)} held out\n  teacher: Llama "
          f"{sizes.teacher_layers} x {sizes.teacher_hidden}, {sizes.teacher_steps} steps of {sizes.batch} on every "
          f"solution (it stands for a model that knows the task) ...", flush=True)  # fmt: skip
    start = time.perf_counter()
    teacher = ModelShape(sizes.teacher_hidden, sizes.teacher_layers).build(len(tok), seed=0, device=device)
    fit_on_ground_truth(teacher, data["prompts"], data["completions"], steps=sizes.teacher_steps, batch=sizes.batch,
                        lr=sizes.teacher_lr, seed=0, device=device)  # fmt: skip
    teacher_accuracy = exact_match(teacher, tok, held_out, longest)
    print(f"  teacher exact match {teacher_accuracy:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    chosen = recipes(sizes, longest)
    result = dict(teacher_accuracy=teacher_accuracy, start_accuracy_by_seed=[], held_out=len(held_out),
                  labelled=labelled, labelled_distinct=data["labelled_distinct"], train_problems=sizes.train_problems,
                  rows=[dict(recipe=name, exact_match_by_seed=[], seconds_by_seed=[], steps_by_seed=[])
                        for name in chosen])  # fmt: skip
    for seed in seeds:
        start_student = _format_tuned_student(sizes, data, seed, device)
        result["start_accuracy_by_seed"].append(exact_match(start_student, tok, held_out, longest))
        seconds_of: dict[str, float] = {}
        for row, (kd, rows) in zip(result["rows"], chosen.values()):
            steps = sizes.steps
            if row["recipe"] == SFT_SAME_SECONDS:  # SFT's seconds per step, scaled to the on-policy row's seconds
                steps = max(steps, round(steps * seconds_of[ON_POLICY] / seconds_of[SFT]))
            student = copy.deepcopy(start_student)
            seconds_of[row["recipe"]] = _train_recipe(kd, rows, student, teacher, data, sizes, seed, out, device, steps)
            row["exact_match_by_seed"].append(exact_match(student, tok, held_out, longest))
            row["seconds_by_seed"].append(seconds_of[row["recipe"]])
            row["steps_by_seed"].append(steps)
            print(f"  {row['recipe']}, seed {seed}: exact match {row['exact_match_by_seed'][-1]:.3f} "
                  f"({steps} steps, {seconds_of[row['recipe']]:.0f} s)", flush=True)  # fmt: skip
    return result
