"""A better student, sooner: the student's exact-match accuracy on a task with a right answer, against optimizer
steps and GPU-seconds, for each distillation recipe, beside TRL's trainers on the same models, data and seeds.

    python -m benchmarks.accuracy.bench_time_to_accuracy --out runs/bench_time_to_accuracy.json
    python -m benchmarks.accuracy.bench_time_to_accuracy --smoke            # CPU, tiny sizes, the pipeline only
    python -m benchmarks.accuracy.plot_time_to_accuracy                     # the PNG from the JSON

The task is liger_patch_kd.demo.arithmetic's (3 two-digit operands, worked steps, `#### N`); its BPE tokenizer is
trained here. A teacher (Llama 8 x 320) is trained on the ground truth with a plain loop and scored greedily on
the held-out problems; each seed's student (Llama 4 x 192, init = seed) gets a short fine-tune on the task's format
(`--format-steps`), then every recipe continues from a copy of that student for `--steps` optimizer steps of
`--batch` prompts (constant learning rate after a short warm-up, so a shorter run is a prefix of a longer one),
or until its training seconds pass `--cap-seconds`. The ground-truth SFT row runs until its seconds reach the
longest distillation row's of the same seed, so every recipe can be compared with it at equal GPU-seconds.

Seconds are training seconds: the optimizer steps, the rollouts they generate and the teacher's forwards, with
the GPU's queue drained at every step; scoring at checkpoints (greedy decode of every held-out prompt, every
`--steps // --checkpoints` steps) is timed apart. A warm-up run of each recipe first compiles the kernels.
`--label-noise F` gives the students' rows (their format fine-tune, the SFT row and every recipe's rows) a noisy
ground truth: a share F of their answers wrong (arithmetic.with_wrong_answers), the teacher trained on the right
ones. `--labelled N` gives the students worked solutions for the first N training problems only, and the prompts of
all of them (a user's usual position: many prompts, few solutions): the rows that need a solution (the format
fine-tune, SFT, off-policy KD, the GKD mix) train on those N; the rows that need only prompts (PROMPTS_ONLY:
sequence KD, on-policy GKD and pg, the offline store, the served row, TRL's two trainers) on every prompt. The
teacher learns from every solution. The target is 90 % of the teacher's accuracy. Our recipes are
KDTrainingArguments (RECIPES); TRL's GKDTrainer and DistillationTrainer (trl >= 1.16) run the on-policy
objective of our GKD row (lmbda 1, beta 0.5, temperature 1), capped at `--trl-cap-seconds`.

The offline on-policy rows (FROM_STORE) train on a rollout store made, for each seed, from that seed's format-tuned
student through precompute_rollouts (what `liger-kd precompute --rollouts-from` runs), into a temporary folder
removed after the run. The store holds `--store-steps` (default `--steps`) x `--batch` completions, as many as the
live on-policy GKD row samples over that many steps (set it to what the live row reaches in its cap):
`--store-generations` per prompt (default 1, so its prompts are as many and as varied as the live row's) from
`--store-steps` x `--batch` / `--store-generations` training prompts drawn with the seed, sampled at temperature 1
in calls of `--store-batch` rows (default `--batch`, a live step's), scored by the teacher (its top `--store-top-k`
log-probs at each position; the rest of its mass, near nothing on this task, is the loss's tail bucket), under the
live rows' bf16 autocast on a GPU. Its
seconds (generation, teacher scoring, writing) are the start of the row's clock: its curve has a second step-0
point there, and its cap counts them. Both rows train with the live GKD row's objective (the beta 0.5 divergence,
on the stored top-k instead of the live teacher's full distribution) at its learning rate, for one pass over the
store (`--store-steps` steps; `--store-epochs E`: E passes, the store scored once and trained on E times): the same
objective on as many samples as the live row sees in that many steps, so the two differ only in whose samples they
are (the starting student's rather than the current one's) and in what they cost. The `pg` / k1 estimators would
match the live reverse-KL row instead, not the GKD row the comparison is about. The refresh row regenerates a
quarter of every step's rows with the current student and rescores them (`kd_store_refresh_steps=1`,
`kd_store_refresh_fraction=0.25`; it keeps the teacher in the loop for those rows). The summary asks, for each of
them, whether it reaches the live GKD row's final accuracy (less its seed spread) in at most half the GPU-seconds
the live row takes to reach it.

The served row (SERVED_GKD) is the live GKD row with its teacher behind `liger-kd serve`'s app, started in this
process on a loopback port (a copy of the teacher, in bf16 on a GPU as `liger-kd serve` loads it) and asked for
its final hidden states (kd_teacher_protocol="hidden": the in-process objective exactly). The server shares the
GPU and the interpreter with the trainer, so its seconds include that contention.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import tempfile
import time
import traceback

import torch

from ..common import environment, print_table, write_json
from ..common.accuracy import (
    accuracy_at,
    checkpoint_clock,
    gkd_columns,
    mean_std,
    recipe_summary,
    seconds_clock,
    seed_pairs,
    sync,
    time_to,
    within_fraction_of_seconds,
)
from ..common.step_phases import PhaseTimer, print_summary

SFT = "SFT on ground truth"
OURS_GKD = "on-policy GKD (lmbda 1, beta 0.5)"
RECIPES = {  # name -> KDTrainingArguments overrides (on top of use_kd_patch=True and the shared options)
    SFT: dict(),  # no teacher: cross-entropy on the dataset's completions (the Trainer's own loss)
    "SFT on teacher samples (seq KD)": dict(kd_seq_kd=True, kd_soft_weight=0.0, kd_hard_weight=1.0),
    "off-policy KD, forward KL (beta 0)": dict(kd_beta=0.0),
    "off-policy KD, JSD (beta 0.5)": dict(kd_beta=0.5),
    OURS_GKD: dict(kd_lmbda=1.0, kd_beta=0.5),
    "GKD mix (lmbda 0.5, warm-up 25 %)": dict(kd_lmbda=0.5, kd_beta=0.5, kd_onpolicy_warmup_steps=0.25),
    "on-policy reverse KL (pg)": dict(kd_lmbda=1.0, kd_onpolicy_loss="pg", learning_rate=3e-4),
}
# offline on-policy: trained on a rollout store of the starting student's samples, made at the run's start
OFFLINE = "offline on-policy (rollout store, beta 0.5)"
OFFLINE_REFRESH = "offline on-policy, 25 % refreshed a step (beta 0.5)"
RECIPES[OFFLINE] = dict(kd_beta=0.5)
RECIPES[OFFLINE_REFRESH] = dict(kd_beta=0.5, kd_store_refresh_steps=1, kd_store_refresh_fraction=0.25)
FROM_STORE = (OFFLINE, OFFLINE_REFRESH)
# the live GKD row with its teacher behind `liger-kd serve`'s app (in this process), asked for its final hidden states
SERVED_GKD = "on-policy GKD, served teacher (hidden states)"
RECIPES[SERVED_GKD] = dict(kd_lmbda=1.0, kd_beta=0.5, kd_teacher_protocol="hidden")
TRL_GKD, TRL_DISTILL = "TRL GKDTrainer (lmbda 1, beta 0.5)", "TRL DistillationTrainer (beta 0.5)"
TRL_RECIPES = (TRL_GKD, TRL_DISTILL)
# the recipes that need no solution, only prompts: the student or the teacher writes the completions they train on
PROMPTS_ONLY = ("SFT on teacher samples (seq KD)", OURS_GKD, "on-policy reverse KL (pg)", SERVED_GKD, *FROM_STORE,
                *TRL_RECIPES)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give a whole number >= 1")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_time_to_accuracy.json")
    p.add_argument("--smoke", action="store_true", help="tiny sizes for a CPU check of the pipeline")
    p.add_argument("--summarize", metavar="JSON", default=None, help="print and store the summary of a results "
                   "JSON whose run was cut short (a device call's limit): its recipes and seeds as far as they "
                   "got")  # fmt: skip
    p.add_argument("--resume", action="store_true", help="keep the runs already in --out (an earlier device call's, "
                   "same options) and run only the recipe and seed pairs it lacks: the benchmark split over calls, "
                   "the teacher and the format-tuned students kept in --teacher-dir between them")  # fmt: skip
    p.add_argument("--device", default=None)
    p.add_argument("--dataloader-workers", type=int, default=0, help="every recipe's dataloader_num_workers (ours "
                   "and TRL's alike): rows read, tokenized and collated beside the steps")  # fmt: skip
    p.add_argument("--kd-patch-config", type=json.loads, default=None, help="our students' kernel toggles, JSON "
                   "(KDTrainingArguments.kd_patch_config), e.g. '{\"rope\": false, \"swiglu\": false, \"rms_norm\": "
                   "false}': the fused loss without the small kernels, whose launches cost a tiny model's host more "
                   "than they save")
    p.add_argument("--no-teacher-graphs", action="store_true", help="our in-process teacher runs eagerly "
                   "(without it, on a GPU, kd_teacher_cuda_graphs replays its forward from CUDA graphs)")
    p.add_argument("--phases", action="store_true", help="time each recipe's steps by phase (the batch and its "
                   "rollouts, the teacher, the loss, backward; benchmarks/common/step_phases.py) and profile a few "
                   "of them: a diagnosis, not a figure to compare (the device drained around each phase)")  # fmt: skip
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--recipes", nargs="+", default=None, help="names (or unique prefixes) of the recipes to run")
    p.add_argument("--operands", type=int, default=3, help="numbers per problem (ArithmeticTask.operands)")
    p.add_argument("--digits", type=int, default=2, help="digits per number (ArithmeticTask.digits)")
    p.add_argument("--train-problems", type=int, default=150_000)
    p.add_argument("--label-noise", type=float, default=0.0, help="the share of the students' training rows (their "
                   "format fine-tune, SFT and every recipe's rows) whose answer is wrong "
                   "(arithmetic.with_wrong_answers); the teacher is trained on the right ones, as a stronger model "
                   "trained elsewhere knows better than a user's noisy labels")  # fmt: skip
    p.add_argument("--labelled", type=int, default=0, help="only the first N training problems carry a worked "
                   "solution the students see (0: all): the rows that need one (format fine-tune, SFT, off-policy "
                   "KD, the GKD mix) train on those, the rows that need only prompts (PROMPTS_ONLY) on every "
                   "prompt; the teacher learns from every solution")  # fmt: skip
    p.add_argument("--held-out", type=int, default=512, help="different held-out problems scored")
    p.add_argument("--held-out-every", type=int, default=50, help="one prompt in this many is held out "
                   "(ArithmeticTask.held_out_every; the demo's one-digit task takes 10)")  # fmt: skip
    p.add_argument("--teacher-shape", type=int, nargs=2, default=[320, 8], metavar=("HIDDEN", "LAYERS"))
    p.add_argument("--student-shape", type=int, nargs=2, default=[192, 4], metavar=("HIDDEN", "LAYERS"))
    p.add_argument("--teacher-steps", type=int, default=3000)
    p.add_argument("--teacher-batch", type=int, default=256)
    p.add_argument("--teacher-lr", type=float, default=1e-3)
    p.add_argument("--format-steps", type=int, default=200)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3, help="every recipe's learning rate (pg's is its own)")
    p.add_argument("--format-lr", type=float, default=None, help="the format fine-tune's learning rate (default: "
                   "--lr); a lower --lr than this continues the students more gently")  # fmt: skip
    p.add_argument("--checkpoints", type=int, default=5)
    p.add_argument("--cap-seconds", type=float, default=40.0)
    p.add_argument("--trl-cap-seconds", type=float, default=15.0)
    p.add_argument("--teacher-dir", default=None, help="load the teacher (and each seed's "
                   "format-tuned student) from here if it holds them, else save them there")  # fmt: skip
    p.add_argument("--store-steps", type=int, default=None, help="the offline rows' store holds this many steps' "
                   "rows (x --batch completions) and they train one pass over it (default: --steps)")  # fmt: skip
    p.add_argument("--store-epochs", type=positive_int, default=1, help="passes the offline rows make over their store "
                   "(scored once, trained this many times): they train --store-steps x this many steps, which must "
                   "fit in --steps")  # fmt: skip
    p.add_argument("--store-generations", type=int, default=1, help="completions per prompt in the offline rows' "
                   "rollout store (which holds --store-steps x --batch completions)")  # fmt: skip
    p.add_argument("--store-top-k", type=int, default=32, help="teacher log-probs per position in the rollout store")
    p.add_argument("--store-batch", type=int, default=None, help="prompts per generation call while the rollout "
                   "store is made (default: --batch, a live step's; past 256 rows the store is sampled through "
                   "transformers' generate() instead of the captured decode engine)")  # fmt: skip
    return p


SMOKE = dict(train_problems=2000, held_out=24, teacher_shape=[64, 2], student_shape=[32, 2], teacher_steps=30,
             teacher_batch=16, format_steps=10, steps=4, batch=8, checkpoints=2, cap_seconds=60.0,
             trl_cap_seconds=60.0)  # fmt: skip


def selected(names: list[str] | None) -> list[str]:
    everything = [*RECIPES, *TRL_RECIPES]
    if not names:
        return everything
    chosen = []
    for name in names:
        hits = [r for r in everything if r == name or r.startswith(name)]
        if len(hits) != 1:
            raise SystemExit(f"--recipes: {name!r} matches {hits or 'nothing'}; recipes are {everything}")
        chosen.append(hits[0])
    return chosen


def trained_teacher(a, task_data, device):
    """The teacher: loaded from --teacher-dir when it holds one, else trained (and saved there when given)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from liger_patch_kd.demo.arithmetic import ModelShape, fit_on_ground_truth

    tok, prompts, completions = task_data["tokenizer"], task_data["prompts"], task_data["completions"]
    folder = Path(a.teacher_dir) if a.teacher_dir else None
    if folder is not None and (folder / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval(), None
    teacher = ModelShape(*a.teacher_shape).build(len(tok), seed=0, device=device)
    fit = fit_on_ground_truth(teacher, prompts, completions, steps=a.teacher_steps, batch=a.teacher_batch,
                              lr=a.teacher_lr, seed=0, device=device,
                              log_every=max(1, a.teacher_steps // 5))  # fmt: skip
    # its weights rounded to bf16, as it is saved (two shards under 16 MiB): a loaded teacher is this same one
    teacher.to(torch.bfloat16).to(torch.float32)
    if folder is not None:
        teacher.to(torch.bfloat16).save_pretrained(folder, max_shard_size="12MB")
        teacher.to(torch.float32)
    return teacher, fit["seconds"]


def format_tuned_student(a, task_data: dict, seed: int, device):
    """Seed `seed`'s student after its format fine-tune, kept in --teacher-dir beside the teacher (loaded from there
    when it holds one made with these student options): GPU training is not bitwise repeatable, and near the
    student's sudden jump in accuracy two fine-tunes of one seed can start the recipes 0.1 and 0.7 apart, so a
    resumed run's recipes must start from the very students of the first call's."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from liger_patch_kd.demo.arithmetic import ModelShape, fit_on_ground_truth

    lr = a.format_lr or a.lr
    noise = f"_noise{a.label_noise:g}" if a.label_noise else ""
    noise += f"_labelled{a.labelled}" if a.labelled else ""
    name = f"student_seed{seed}_{a.student_shape[0]}x{a.student_shape[1]}_format{a.format_steps}_lr{lr:g}{noise}"
    folder = Path(a.teacher_dir) / name if a.teacher_dir else None
    if folder is not None and (folder / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
    student = ModelShape(*a.student_shape).build(len(task_data["tokenizer"]), seed=seed, device=device)
    fit_on_ground_truth(student, task_data["labelled_prompts"], task_data["labels"], steps=a.format_steps,
                        batch=a.batch, lr=lr, seed=seed, device=device)  # fmt: skip
    if folder is not None:  # fp32, as trained: the loaded student is this same one
        student.save_pretrained(folder)
    return student


def shared_args(a, device, seed: int, steps: int, overrides: dict) -> dict:
    """The options every recipe (ours and TRL's) trains with."""
    options = dict(
        output_dir=tempfile.mkdtemp(prefix="tta_"), max_steps=steps, per_device_train_batch_size=a.batch,
        learning_rate=a.lr, lr_scheduler_type="constant_with_warmup", warmup_steps=max(1, a.steps // 20),
        weight_decay=0.0, logging_steps=steps, report_to="none", save_strategy="no", disable_tqdm=True, seed=seed,
        use_cpu=device.type == "cpu", bf16=device.type == "cuda", dataloader_pin_memory=False,
        gradient_checkpointing=False, dataloader_num_workers=a.dataloader_workers,
        dataloader_persistent_workers=a.dataloader_workers > 0,
    )  # fmt: skip
    options.update({k: v for k, v in overrides.items() if k == "learning_rate"})
    return options


def teacher_graphs(a, device) -> bool:
    """Our in-process teacher's forward replayed from CUDA graphs (kd_teacher_cuda_graphs): our best configuration
    on a GPU, unless --no-teacher-graphs."""
    return device.type == "cuda" and not a.no_teacher_graphs


def fresh_memory(device) -> int | None:
    """The decode engine's caches of earlier runs freed and the peak count restarted: the bytes allocated now (the
    teachers and this student's weights); None off CUDA."""
    if device.type != "cuda":
        return None
    from liger_patch_kd.generation import release_sessions

    release_sessions()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def store_prompts(a, steps: int) -> int:
    """The prompts of an offline row's store of `steps` steps' rows: steps x --batch completions in whole prompts of
    --store-generations each, at least one."""
    return max(1, steps * a.batch // a.store_generations)


def store_pass_steps(a, steps: int) -> int:
    """Optimizer steps of one pass over that store: its completions in batches of --batch (more than `steps` where
    one prompt's --store-generations outnumber a step's rows)."""
    return -(-store_prompts(a, steps) * a.store_generations // a.batch)


def check_store_passes(a, names: list[str]) -> None:
    """The offline rows train --store-epochs whole passes over a store of --store-steps steps' rows: a count that
    does not fit in --steps (which would cut the passes short, the JSON still saying --store-epochs) is refused in
    one line before anything is made."""
    if not any(name in FROM_STORE for name in names):
        return
    store_steps = a.store_steps or a.steps
    wanted = store_pass_steps(a, store_steps) * a.store_epochs
    if wanted <= a.steps:
        return
    given = f"--store-steps {a.store_steps}" if a.store_steps else f"--store-steps {store_steps} (--steps, its default)"
    if a.store_epochs == 1:
        raise SystemExit(f"{given}: one pass over the offline rows' store takes {wanted} steps, more than --steps "
                         f"{a.steps}, which would cut it short: give --store-steps {a.steps} or less, or --steps "
                         f"{wanted}")  # fmt: skip
    fits = a.steps // a.store_epochs
    fix = f"--store-steps {fits} or less, or --steps {wanted}" if fits else f"--steps {wanted}"
    raise SystemExit(f"--store-epochs {a.store_epochs}: that many passes over the offline rows' store of {given} "
                     f"take {wanted} steps, more than --steps {a.steps}, which would cut them short: give {fix}")


def rollout_store(a, data, student, teacher, seed: int, steps: int, device, folder: str) -> dict:
    """An offline row's rollout store, written to `folder` by precompute_rollouts (what `liger-kd precompute
    --rollouts-from` runs) from this seed's format-tuned `student`, scored by `teacher`: steps x batch completions,
    as the module's docstring says. Returns {seconds (generation, scoring and writing, the queue drained),
    completions, prompts, generations, top_k, bytes}."""
    import random
    from pathlib import Path

    from liger_patch_kd.teacher import tokenizer_fingerprint
    from liger_patch_kd.trainer.offline_onpolicy import RolloutSettings, ScoreOptions, precompute_rollouts

    generations = a.store_generations
    wanted = store_prompts(a, steps)
    if wanted > len(data["prompts"]):
        raise ValueError(f"--store-generations {generations}: a store of {steps} x {a.batch} completions needs "
                         f"{wanted} prompts, and --train-problems is {len(data['prompts'])}: raise --train-problems "
                         f"or --store-generations")  # fmt: skip
    picks = random.Random(seed).sample(range(len(data["prompts"])), wanted)
    settings = RolloutSettings(max_new_tokens=data["max_new_tokens"], num_generations=generations, seed=seed)
    # under the autocast the live rows train in (bf16=True on a GPU): the teacher scores and the student samples in
    # the precision they do live, as a bf16 checkpoint loaded by `liger-kd precompute` (dtype "auto") would
    precision = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    sync(device)
    began = time.perf_counter()
    with precision:
        precompute_rollouts(
            student, teacher, [data["prompts"][i] for i in picks], folder, settings=settings,
            score=ScoreOptions(top_k=a.store_top_k), prompts_per_call=max(1, (a.store_batch or a.batch) // generations),
            tokenizer=data["tokenizer"], student_name=f"format-tuned student, seed {seed}", teacher_name="teacher",
            tokenizer_fp=tokenizer_fingerprint(data["tokenizer"]), progress=False,
        )  # fmt: skip
    sync(device)
    seconds = time.perf_counter() - began
    size = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
    return dict(seconds=seconds, completions=wanted * generations, prompts=wanted, generations=generations,
                top_k=a.store_top_k, bytes=size)  # fmt: skip


def run_recipe(name: str, a, data, student, teacher, seed: int, device, *, steps: int, cap: float, every: int,
               base_accuracy: float, teacher_url: str | None = None) -> dict:  # fmt: skip
    """One recipe from one seed's fine-tuned student: {seed, curve, peak_mib, eval_seconds, wall_seconds}, and for
    an offline row its store's figures (`store`), the steps that refreshed rows (`refreshed_steps`) and the last
    logged kd_behaviour_kl (`behaviour_kl`).
    `teacher_url`: the served teacher's, for SERVED_GKD."""
    if name not in FROM_STORE:
        return train_recipe(name, a, data, student, teacher, seed, device, steps=steps, cap=cap, every=every,
                            base_accuracy=base_accuracy, teacher_url=teacher_url)  # fmt: skip
    import shutil

    store_steps = min(steps, a.store_steps or steps)  # the warm-up's few steps: a store of that many (run checks)
    steps = min(steps, store_pass_steps(a, store_steps) * a.store_epochs)  # --store-epochs whole passes
    folder = tempfile.mkdtemp(prefix="tta_store_")  # this run's own folder: removed with what it wrote
    try:
        before = fresh_memory(device)
        store = rollout_store(a, data, student, teacher, seed, store_steps, device, folder)
        store_peak = None if before is None else torch.cuda.max_memory_allocated() / 2**20
        run = train_recipe(name, a, data, student, teacher, seed, device, steps=steps, cap=cap, every=every,
                           base_accuracy=base_accuracy, store=(folder, store["seconds"]))  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if store_peak is not None:  # the peak over both phases, beyond what was allocated before the store
        run["peak_mib"] = max(run["peak_mib"], store_peak)
        run["extra_mib"] = run["peak_mib"] - before / 2**20
    run["store"] = store
    return run


def train_recipe(name: str, a, data, student, teacher, seed: int, device, *, steps: int, cap: float, every: int,
                 base_accuracy: float, store: tuple[str, float] | None = None,
                 teacher_url: str | None = None) -> dict:  # fmt: skip
    """run_recipe's training: `store` (folder, seconds) for an offline row, its seconds the clock's start;
    `teacher_url` for the served row."""
    from liger_patch_kd.demo.arithmetic import completion_batch, exact_match
    from liger_patch_kd.demo.toys import quiet

    tok, held_out = data["tokenizer"], data["held_out"]
    clock = checkpoint_clock(lambda m: exact_match(m, tok, held_out, data["max_new_tokens"]), every, cap, device,
                             base_accuracy, one_time_seconds=store[1] if store else 0.0)  # fmt: skip
    if name in TRL_RECIPES:
        trainer = trl_trainer(name, a, data, student, teacher, shared_args(a, device, seed, steps, {}), clock)
    elif name == SFT:  # KDTrainer wants a teacher: the plain Trainer's cross-entropy on the same patched student
        from transformers import Trainer

        from liger_patch_kd import KDTrainingArguments, apply_kd_patch

        apply_kd_patch(model=student, **(a.kd_patch_config or {}))
        args = KDTrainingArguments(**shared_args(a, device, seed, steps, {}), remove_unused_columns=False)
        trainer = Trainer(model=student, args=args, train_dataset=data["token_rows"], callbacks=[clock],
                          data_collator=lambda rows: completion_batch(
                              [r["prompt_ids"] for r in rows], [r["completion_ids"] for r in rows], "cpu"))  # fmt: skip
    elif store is not None:  # the stored rows: no rollouts; the teacher only where rows are refreshed
        from liger_patch_kd import KDTrainer, KDTrainingArguments
        from liger_patch_kd.teacher import TeacherLogprobsDataset

        kd = {k: v for k, v in RECIPES[name].items() if k != "learning_rate"}
        if kd.get("kd_store_refresh_steps"):
            kd["kd_teacher_cuda_graphs"] = teacher_graphs(a, device)
        args = KDTrainingArguments(**shared_args(a, device, seed, steps, RECIPES[name]), use_kd_patch=True,
                                   kd_patch_config=a.kd_patch_config, **kd)  # fmt: skip
        trainer = KDTrainer(model=student, teacher_model=teacher if args.kd_store_refresh_steps else None, args=args,
                            train_dataset=TeacherLogprobsDataset(store[0]), processing_class=tok,
                            callbacks=[clock])  # fmt: skip
    else:
        from liger_patch_kd import KDTrainer, KDTrainingArguments

        kd = {k: v for k, v in RECIPES[name].items() if k != "learning_rate"}
        if name == SERVED_GKD:
            kd["kd_teacher_url"] = teacher_url
        else:
            kd["kd_teacher_cuda_graphs"] = teacher_graphs(a, device)
        args = KDTrainingArguments(**shared_args(a, device, seed, steps, RECIPES[name]), use_kd_patch=True,
                                   kd_max_new_tokens=data["max_new_tokens"], kd_patch_config=a.kd_patch_config,
                                   **kd)  # fmt: skip
        rows = data["prompt_rows"] if name in PROMPTS_ONLY else data["rows"]
        trainer = KDTrainer(model=student, teacher_model=None if name == SERVED_GKD else teacher, args=args,
                            train_dataset=rows, processing_class=tok, callbacks=[clock])  # fmt: skip
    phases = PhaseTimer(trainer, device).install() if a.phases else None
    peak = extra = None
    before = fresh_memory(device)  # both teachers and this student's weights
    began = time.perf_counter()
    quiet(trainer).train()
    if before is not None:
        peak = torch.cuda.max_memory_allocated() / 2**20
        extra = peak - before / 2**20
    out = dict(seed=seed, curve=clock.curve, peak_mib=peak, extra_mib=extra, eval_seconds=clock.eval_seconds,
               wall_seconds=time.perf_counter() - began)  # fmt: skip
    if phases is not None:
        out["phases"] = phases.summary()
        if out["phases"]["steps"]:  # the warm-up's few steps record none
            print_summary(f"{name}, seed {seed}", out["phases"])
    offline = getattr(trainer, "offline", None)
    if name == SERVED_GKD:  # what the server sent: proof the row trained against it
        out["served_tokens"] = trainer.teacher_source.client.tokens_received
    if store is not None:
        out["refreshed_steps"] = list(offline.refresh.refreshed_steps) if offline and offline.refresh else []
        # how far the student moved from the one that sampled the store, at the logging step (None if capped before)
        logged = [h["kd_behaviour_kl"] for h in trainer.state.log_history if "kd_behaviour_kl" in h]
        out["behaviour_kl"] = logged[-1] if logged else None
    return out


def trl_trainer(name: str, a, data, student, teacher, options: dict, clock):
    """TRL's trainer for `name` on the same student copy, teacher (an unpatched copy), rows and options."""
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset

    if name == TRL_GKD:
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        args = GKDConfig(**options, lmbda=1.0, beta=0.5, temperature=1.0, max_new_tokens=data["max_new_tokens"])
        rows = Dataset.from_list(data["prompt_token_rows"])  # lmbda 1: every completion is generated
        return GKDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows,
                          processing_class=data["tokenizer"], data_collator=gkd_columns(data["tokenizer"].pad_token_id),
                          callbacks=[clock])  # fmt: skip
    from trl import DistillationConfig, DistillationTrainer

    args = DistillationConfig(**options, beta=0.5, temperature=1.0, max_completion_length=data["max_new_tokens"])
    rows = Dataset.from_dict({"prompt": [r["prompt"] for r in data["prompt_rows"]]})
    return DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows,
                               processing_class=data["tokenizer"], callbacks=[clock])  # fmt: skip


def task_data(a) -> dict:
    """arithmetic.split_task at the options' sizes, as the recipes read it: `prompts` / `completions` every training
    problem's, right (the teacher's training data); `labelled_prompts` / `labels` / `rows` / `token_rows` what the
    students are given with a solution (the first --labelled problems, or all; with --label-noise a share of them
    ending in a wrong answer); `prompt_rows` / `prompt_token_rows` every prompt, for PROMPTS_ONLY (with
    --labelled: no solution in them)."""
    from liger_patch_kd.demo.arithmetic import ArithmeticTask, split_task

    if not 0 <= a.labelled <= a.train_problems:
        raise SystemExit(f"--labelled {a.labelled}: give 0 (every problem labelled) up to --train-problems "
                         f"{a.train_problems}")  # fmt: skip
    task = ArithmeticTask(operands=a.operands, digits=a.digits, held_out_every=a.held_out_every)
    split = split_task(task, a.train_problems, a.labelled, a.held_out, held_out_name="--held-out",
                       label_noise=a.label_noise)  # fmt: skip
    rows, token_rows = split.labelled_rows(), split.labelled_token_rows()
    if a.labelled:  # the unlabelled prompts: no completion in them at all
        only_prompts = split.prompt_only_rows()
        # TRL's GKDTrainer (lmbda 1) trains on generated completions only, but divides its loss by the Trainer's
        # num_items_in_batch, counted on the batch's own labels before it generates (none: a division by zero):
        # a placeholder of each problem's solution length keeps its normaliser what it is with every solution given
        eos = split.tokenizer.eos_token_id
        only_prompt_tokens = [dict(prompt_ids=p, completion_ids=[eos] * len(c))
                              for p, c in zip(split.prompts, split.completions)]  # fmt: skip
    else:
        only_prompts, only_prompt_tokens = rows, token_rows
    return dict(task=task, tokenizer=split.tokenizer, rows=rows, token_rows=token_rows, prompts=split.prompts,
                completions=split.completions, labelled_prompts=split.labelled_prompts, labels=split.labels,
                prompt_rows=only_prompts, prompt_token_rows=only_prompt_tokens, held_out=split.held_out,
                max_new_tokens=split.max_new_tokens)  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    a = parser().parse_args(argv)
    if a.summarize:
        return summarize_file(a.summarize)
    if a.smoke:
        for key, value in SMOKE.items():
            setattr(a, key, value)
        a.seeds = a.seeds[:1]
    from liger_patch_kd.demo.toys import demo_threads

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # a CPU: one thread (tiny models; spinning threads cost more than they give); `servers`: the served teacher's
    with demo_threads(device), contextlib.ExitStack() as servers:
        return run(a, device, servers)


def run(a, device: torch.device, servers: contextlib.ExitStack) -> dict:
    from liger_patch_kd.demo.arithmetic import exact_match

    names = selected(a.recipes)
    check_store_passes(a, names)
    earlier = earlier_runs(a) if a.resume else {}  # refused here, before anything trains, if it is another run's
    began = time.perf_counter()
    data = task_data(a)
    tok, held_out = data["tokenizer"], data["held_out"]
    solved = f" ({len(data['rows'])} with a worked solution)" if a.labelled else ""
    print(f"task: {len(data['prompts'])} training problems{solved}, {len(held_out)} held out, vocabulary {len(tok)} "
          f"({time.perf_counter() - began:.0f} s)", flush=True)  # fmt: skip
    teacher, teacher_seconds = trained_teacher(a, data, device)
    teacher_accuracy = exact_match(teacher, tok, held_out, data["max_new_tokens"])
    target = 0.9 * teacher_accuracy
    params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    print(f"teacher: {params(teacher) / 1e6:.1f}M parameters, exact match {teacher_accuracy:.3f} "
          f"(trained in {teacher_seconds or 0:.0f} s); target {target:.3f}", flush=True)  # fmt: skip
    trl_teacher = copy.deepcopy(teacher)  # KDTrainer patches its teacher's kernels in place; TRL's stays plain
    failed: dict[str, str] = {}  # recipe -> its error: the other recipes still run, the JSON says which failed
    teacher_url = None
    if SERVED_GKD in names:  # served in bf16 on a GPU, as `liger-kd serve` loads the teacher saved in bf16
        from ..common.served import served_teacher

        try:
            dtype = torch.bfloat16 if device.type == "cuda" else None
            teacher_url = servers.enter_context(served_teacher(trl_teacher, top_k=min(64, len(tok)), dtype=dtype))
        except Exception as error:
            traceback.print_exc()
            failed[SERVED_GKD] = f"{type(error).__name__}: {error}"[:500]
    students, base = {}, {}
    for seed in a.seeds:
        students[seed] = format_tuned_student(a, data, seed, device)
        base[seed] = exact_match(students[seed], tok, held_out, data["max_new_tokens"])
    print(f"students: {params(students[a.seeds[0]]) / 1e6:.2f}M parameters, after {a.format_steps} format steps: "
          f"{ {s: round(v, 3) for s, v in base.items()} }", flush=True)  # fmt: skip
    every = max(1, a.steps // a.checkpoints)

    def attempt(name: str, seed: int, **options) -> dict | None:
        try:
            return run_recipe(name, a, data, copy.deepcopy(students[seed]), trl_teacher if name in TRL_RECIPES
                              else teacher, seed, device, teacher_url=teacher_url, **options)  # fmt: skip
        except Exception as error:  # reported, not hidden: printed with its traceback and kept in the JSON
            traceback.print_exc()
            failed[name] = f"{type(error).__name__}: {error}"[:500]
            return None

    todo = {(name, seed) for name in names for seed in a.seeds
            if not any(r["seed"] == seed for r in earlier.get(name, []))}  # fmt: skip
    if not a.smoke:  # compile the kernels and capture the graphs once, outside every timed run
        for name in names:
            if name not in failed and any(n == name for n, _ in todo):
                attempt(name, a.seeds[0], steps=3, cap=1e9, every=10**9, base_accuracy=0.0)
        print(f"warm-up done ({time.perf_counter() - began:.0f} s)", flush=True)
    runs: dict[str, list[dict]] = {**earlier, **{name: list(earlier.get(name, [])) for name in names}}
    payload = dict(environment=environment(), config=vars(a), vocab=len(tok), teacher=dict(
        accuracy=teacher_accuracy, parameters=params(teacher), train_seconds=teacher_seconds), target=target,
        student=dict(parameters=params(students[a.seeds[0]]), format_accuracy=base), runs=runs,
        failed=failed)  # fmt: skip
    for seed in a.seeds:
        # the longest distillation row of this seed so far (an earlier call's rows count too)
        longest = max([r["curve"][-1]["seconds"] for name, rs in runs.items() if name not in (*TRL_RECIPES, SFT)
                       for r in rs if r["seed"] == seed] or [0.0])  # fmt: skip
        for name in sorted(names, key=lambda n: n == SFT):  # SFT last: it runs as long as the longest
            if name in failed or (name, seed) not in todo:
                continue
            sft = name == SFT
            steps = a.steps * (2 if a.smoke else 20) if sft else a.steps
            cap = (longest or a.cap_seconds) if sft else a.trl_cap_seconds if name in TRL_RECIPES else a.cap_seconds
            run = attempt(name, seed, steps=steps, cap=cap, every=every, base_accuracy=base[seed])
            if run is None:
                continue
            if name not in TRL_RECIPES and not sft:
                longest = max(longest, run["curve"][-1]["seconds"])
            runs[name].append(run)
            end = run["curve"][-1]
            store = f" (store {run['store']['seconds']:.1f} s)" if "store" in run else ""
            print(f"  seed {seed} {name}: {end['step']} steps, {end['seconds']:.1f} s{store}, exact match "
                  f"{end['accuracy']:.3f} (eval {run['eval_seconds']:.1f} s; {time.perf_counter() - began:.0f} s "
                  f"so far)", flush=True)  # fmt: skip
            write_json(a.out, payload)  # a run cut short keeps what it reached
    payload["summary"] = summarize(runs, target, teacher_accuracy, a.steps, seconds_clock(payload))
    payload["total_seconds"] = time.perf_counter() - began
    write_json(a.out, payload)
    return payload


# the options that define what a run measures: an earlier call's runs are kept only when these are the same
SAME_EXPERIMENT = ("operands", "digits", "train_problems", "label_noise", "labelled", "held_out", "held_out_every",
                   "teacher_shape", "student_shape", "teacher_steps", "teacher_batch", "teacher_lr", "format_steps",
                   "format_lr", "steps", "batch", "lr", "checkpoints", "cap_seconds", "trl_cap_seconds", "store_steps",
                   "store_epochs", "store_generations", "store_top_k")  # fmt: skip


def earlier_runs(a) -> dict[str, list[dict]]:
    """--resume: the runs already in a.out, by recipe (none when the file is absent); a file written with other
    SAME_EXPERIMENT options is refused in one line before anything trains."""
    import json
    from pathlib import Path

    if not Path(a.out).exists():
        return {}
    payload = json.loads(Path(a.out).read_text())
    mine, defaults = vars(a), vars(parser().parse_args([]))  # an option newer than the file: its default then
    differ = [k for k in SAME_EXPERIMENT if payload.get("config", {}).get(k, defaults.get(k)) != mine.get(k)]
    if differ:
        theirs = payload["config"]
        listed = ", ".join(f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} here" for k in differ)
        raise SystemExit(f"--resume: {a.out} was written with other options ({listed}); run with the same options "
                         f"or another --out")  # fmt: skip
    return {name: list(r) for name, r in payload.get("runs", {}).items() if r}


def summarize_file(path: str) -> dict:
    """The summary of the results in `path`, written back into it: a run cut before its end keeps every finished
    recipe and seed (written as each ended) but not the summary, which needs only those."""
    import json

    with open(path) as f:
        payload = json.load(f)
    runs = {name: r for name, r in payload["runs"].items() if r}
    payload["summary"] = summarize(runs, payload["target"], payload["teacher"]["accuracy"], payload["config"]["steps"],
                                   seconds_clock(payload))  # fmt: skip
    payload["summary"]["cut_short"] = "total_seconds" not in payload  # a finished run records its total
    write_json(path, payload)
    return payload


def fig(pair: tuple[float | None, float | None], digits: int = 3) -> str | None:
    """`mean ± std` (the mean alone for one seed), None for no value."""
    mean, spread = pair
    if mean is None:
        return None
    return f"{mean:.{digits}f}" + (f" ± {spread:.{digits}f}" if spread else "")


def summarize(runs: dict[str, list[dict]], target: float, teacher_accuracy: float, steps: int,
              clock: str = "GPU") -> dict:  # fmt: skip
    """The table (printed) and its figures: per recipe, and the two comparisons the benchmark is for. `clock`: "GPU"
    or "CPU", what the seconds were counted on (the table's column names say it)."""
    reference = runs.get(SFT)
    recipes = {name: recipe_summary(r, target, reference if name != SFT else None) for name, r in runs.items() if r}
    for name in FROM_STORE:  # the one-time cost: in their GPU-seconds, apart from their seconds per step
        if name in recipes:
            recipes[name]["store_seconds"] = mean_std([r["store"]["seconds"] for r in runs[name]])
            recipes[name]["seconds_per_step"] = mean_std([
                (r["curve"][-1]["seconds"] - r["store"]["seconds"]) / max(1, r["curve"][-1]["step"])
                for r in runs[name]])  # fmt: skip
    rows = []
    for name, s in recipes.items():
        rows.append({"recipe": name, "steps": fig(s["final_step"], 0), f"{clock}-s": fig(s["train_seconds"], 1),
                     "of which store": fig(s.get("store_seconds", (None, None)), 1),
                     "ms/step": None if s["seconds_per_step"][0] is None else f"{1000 * s['seconds_per_step'][0]:.0f}",
                     "exact match": fig(s["final_accuracy"]), f"SFT at same {clock}-s": fig(
                         s.get("sft_accuracy_at_same_seconds", (None, None))),
                     f"{clock}-s to target": fig(s["seconds_to_target"], 1),
                     "steps to target": fig(s["steps_to_target"], 0),
                     "reached": s["reached_target"], "peak MiB": fig(s["peak_mib"], 0),
                     "MiB beyond weights": fig(s["extra_mib"], 0)})  # fmt: skip
    print(f"\nteacher exact match {teacher_accuracy:.3f}; target (90 % of it) {target:.3f}; mean ± std over seeds")
    print_table(rows, list(rows[0]) if rows else [])
    out = dict(recipes=recipes, table=rows)
    if reference:
        at_budget = [accuracy_at(r["curve"], steps, "step") for r in reference]
        at_budget = [x for x in at_budget if x is not None]
        out["sft_at_recipe_steps"] = mean_std(at_budget)
        if at_budget:
            print(f"SFT on ground truth after {steps} steps: {mean_std(at_budget)[0]:.3f} "
                  f"({teacher_accuracy - mean_std(at_budget)[0]:.3f} below the teacher)")  # fmt: skip
    out["speedup"] = {}
    for trl in TRL_RECIPES:
        if runs.get(OURS_GKD) and runs.get(trl):
            out["speedup"][trl] = speedup(runs[OURS_GKD], runs[trl], target)
            print(f"{OURS_GKD} against {trl}: {out['speedup'][trl]['text']}")
    # the offline rows' question: the live GKD row's accuracy (within its seed spread) at <= half its GPU-seconds?
    out["offline_vs_live"] = {}
    for name in FROM_STORE:
        if runs.get(name) and runs.get(OURS_GKD):
            verdict = within_fraction_of_seconds(runs[name], runs[OURS_GKD], fraction=0.5)
            verdict["question"] = (f"{name} reaches {OURS_GKD}'s accuracy (within the seed spread) at <= half its "
                                   f"{clock}-seconds?")  # fmt: skip
            out["offline_vs_live"][name] = verdict
            print(f"{verdict['question']} {verdict['text']}")
    return out


def speedup(ours: list[dict], theirs: list[dict], target: float) -> dict:
    """Training seconds to one accuracy, ours against TRL's, seed by seed (both trainers of a seed start from that
    seed's student; seed_pairs): the level is the target, or the lower final accuracy of the two runs where
    either ends below it, so both runs reach it. A seed whose starting student already has that level says nothing
    (neither trainer moved it there) and is left out; the ratio is TRL's mean seconds over ours, and ratio_by_seed
    each seed's own."""
    levels, mine, other = [], [], []
    for run, their in seed_pairs(ours, theirs):
        level = min(target, run["curve"][-1]["accuracy"], their["curve"][-1]["accuracy"])
        if run["curve"][0]["accuracy"] >= level:
            continue
        levels.append(level)
        mine.append(time_to(run["curve"], level))
        other.append(time_to(their["curve"], level))
    if not levels:
        text = "undecided: on no seed did both trainers take the starting student above where it began"
        return dict(accuracy=None, seeds=0, ours_seconds=None, trl_seconds=None, ratio=None, text=text)
    mine_mean, other_mean = mean_std(mine)[0], mean_std(other)[0]
    ratio = other_mean / mine_mean if mine_mean else None
    # each seed's own ratio: how much of the spread is where a seed's curve crosses its level, not the step's cost
    by_seed = [theirs_s / ours_s if ours_s else None for ours_s, theirs_s in zip(mine, other)]
    level = mean_std(levels)[0]
    text = (f"accuracy {level:.3f} (mean over {len(levels)} seed(s)) in {mine_mean:.1f} s against {other_mean:.1f} s"
            + (f": {ratio:.1f}x" if ratio else "")
            + (f" (by seed {', '.join('-' if r is None else f'{r:.1f}x' for r in by_seed)})" if len(by_seed) > 1
               else ""))  # fmt: skip
    return dict(accuracy=level, levels=levels, seeds=len(levels), ours_seconds=mine_mean, trl_seconds=other_mean,
                ratio=ratio, ratio_by_seed=by_seed, text=text)  # fmt: skip


if __name__ == "__main__":
    main()
