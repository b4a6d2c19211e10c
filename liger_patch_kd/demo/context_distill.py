"""Context distillation on the packaged corpus: the teacher sees a hint the student does not.

    python -m liger_patch_kd.demo.context_distill          # a few minutes on one CPU core
    liger-kd demo --context                                 # the same

Every row is one sentence of the corpus. The student reads it after BOS alone; the teacher reads it after BOS and
the sentence before it (its hint, `teacher_input_ids`). Both score the same tokens (the sentence and EOS), paired
by the KD forward (models/privileged.py). A small teacher is trained with CE on (previous sentence, sentence)
rows; the students, smaller, start from the same inits and see the same rows in the same order:

- CE only: the sentence's tokens, no teacher;
- context KD: the KD loss (and, as the validation split chooses, some CE) against the teacher reading the hint;
- KD without the hint: the same setting, the teacher reading what the student reads (what the hint adds).

The setting of the KD rows (beta, hard weight) is the one of a small grid with the lowest validation CE (seed 1);
the table reports the test split: held-out CE of the sentence given BOS (nats per token) and KL(teacher with the
hint || student) per token, mean ± standard deviation over three seeds (student init s, data order s - 1).
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import reference
from ..batch.columns import TEACHER_ATTENTION_MASK, TEACHER_INPUT_IDS, TEACHER_LABELS
from ..models import revert_kd_patch
from ..models.privileged import PrivilegedInputs
from .toys import BOS, EOS, CharTokenizer, build_model, demo_threads, load_corpus, quiet, training_args

# (kd_beta, kd_hard_weight) tried on the validation split
GRID = ((0.0, 0.0), (0.0, 0.5), (0.5, 0.5))


@dataclass
class ContextDemoSizes:
    teacher_steps: int = 400
    student_steps: int = 200
    batch: int = 16
    seeds: tuple[int, ...] = (1, 2, 3)
    grid: tuple[tuple[float, float], ...] = GRID

    @classmethod
    def quick(cls) -> ContextDemoSizes:
        return cls(teacher_steps=40, student_steps=20, batch=8, seeds=(1,), grid=GRID[:1])


def sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=\.)\s+", text) if s.strip()]


def rows_of(tok: CharTokenizer, sents: list[str], hint: bool = True) -> list[dict]:
    """One token-level row per sentence after the first: the student's BOS + sentence + EOS, the teacher's BOS +
    previous sentence + space + sentence + EOS (hint=False: the student's own row)."""
    rows = []
    for prev, cur in zip(sents, sents[1:]):
        completion = tok.encode(cur) + [EOS]
        teacher_prompt = [BOS] + tok.encode(prev + " ") if hint else [BOS]
        rows.append({"input_ids": [BOS] + completion, "labels": [-100] + completion,
                     TEACHER_INPUT_IDS: teacher_prompt + completion})  # fmt: skip
    return rows


def teacher_side(rows: list[dict]) -> list[dict]:
    """The rows with the teacher's as the scored side (to measure a model reading the hint)."""
    out = []
    for r in rows:
        hint = len(r[TEACHER_INPUT_IDS]) - len(r["input_ids"])
        labels = [-100] * (hint + 1) + r["labels"][1:]
        out.append({"input_ids": r[TEACHER_INPUT_IDS], "labels": labels, TEACHER_INPUT_IDS: r[TEACHER_INPUT_IDS]})
    return out


@torch.no_grad()
def evaluate(student, teacher, rows: list[dict], device) -> tuple[float, float]:
    """Held-out CE (nats per scored token) of the student on its rows, and KL(teacher reading the hint || student)
    per scored token, the teacher's logits paired with the student's by the KD forward's own pairing."""
    from ..trainer import PrivilegedCollator

    student.eval()
    batch = {k: v.to(device) for k, v in PrivilegedCollator()(rows).items()}
    targets = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    s = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    t = teacher(input_ids=batch[TEACHER_INPUT_IDS], attention_mask=batch[TEACHER_ATTENTION_MASK]).logits.float()
    align = PrivilegedInputs(batch[TEACHER_INPUT_IDS], batch[TEACHER_LABELS]).aligner(targets, -100)
    ce = reference.cross_entropy_per_row(s, targets)[targets != -100].mean()
    kl = reference.generalized_jsd(s, align(t), targets, beta=0.0)
    return float(ce), float(kl)


def cell(values: list[float], width: int = 18) -> str:
    """`mean ± sample sd` over the seeds (the value alone for one seed), right-aligned."""
    text = f"{statistics.mean(values):.4f}" + (f" ± {statistics.stdev(values):.4f}" if len(values) > 1 else "")
    return f"{text:>{width}}"


def run_context_demo(device: str | None = None, sizes: ContextDemoSizes | None = None) -> dict:
    """Train, choose, test; print the table. Returns {"chosen": (beta, hard_weight), "validation": {setting: CE},
    "teacher_ce": (with hint, without), "rows": {recipe: {"held_out_ce_by_seed", "kl_by_seed"}}}."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with tempfile.TemporaryDirectory(prefix="liger_kd_context_") as work, demo_threads(dev):
        return _run(Path(work), dev, sizes or ContextDemoSizes())


def _train_student(work: Path, teacher, rows, seed: int, sizes: ContextDemoSizes, device, setting=None):
    from transformers import Trainer

    from ..teacher import TeacherDataCollator
    from ..trainer import KDTrainer

    student = build_model(teacher.config.vocab_size, 64, 2, seed=seed, device=device)
    if setting is None:  # CE only, on the student's own rows
        args = training_args(work / "student", sizes.student_steps, sizes.batch, device, seed=seed - 1)
        own = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows]
        quiet(Trainer(model=student, args=args, train_dataset=own, data_collator=TeacherDataCollator())).train()
        return student
    beta, hard = setting
    args = training_args(work / "student", sizes.student_steps, sizes.batch, device, seed=seed - 1,
                         use_kd_patch=True, kd_beta=beta, kd_hard_weight=hard)  # fmt: skip
    quiet(KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows)).train()
    revert_kd_patch(model=student)
    return student


def _run(work: Path, device, sizes: ContextDemoSizes) -> dict:
    from transformers import Trainer

    from ..teacher import TeacherDataCollator

    text = load_corpus()
    tok = CharTokenizer(text)
    sents = sentences(text)
    cut_val, cut_test = int(len(sents) * 0.8), int(len(sents) * 0.9)
    train, val, test = sents[:cut_val], sents[cut_val:cut_test], sents[cut_test:]
    rows, rows_plain = rows_of(tok, train), rows_of(tok, train, hint=False)
    val_rows, test_rows = rows_of(tok, val), rows_of(tok, test)

    print(f"context distillation: {len(rows)} training sentences, {len(val_rows)} validation, {len(test_rows)} test")
    teacher = build_model(len(tok), 128, 2, seed=0, device=device)
    teacher_rows = [{"input_ids": r[TEACHER_INPUT_IDS]} for r in rows]  # CE on the hint and the sentence
    quiet(Trainer(model=teacher, args=training_args(work / "teacher", sizes.teacher_steps, sizes.batch, device),
                  train_dataset=teacher_rows, data_collator=TeacherDataCollator())).train()  # fmt: skip
    teacher.eval()
    with_hint = evaluate(teacher, teacher, teacher_side(test_rows), device)[0]
    without = evaluate(teacher, teacher, rows_of(tok, test, hint=False), device)[0]
    print(f"teacher test CE: {with_hint:.3f} nats/token reading the previous sentence, {without:.3f} without")

    validation = {}
    for setting in sizes.grid:
        student = _train_student(work, teacher, rows, sizes.seeds[0], sizes, device, setting)
        validation[setting] = evaluate(student, teacher, val_rows, device)[0]
        print(f"  validation: beta {setting[0]}, hard weight {setting[1]}: CE {validation[setting]:.4f}")
    chosen = min(validation, key=validation.get)
    recipes = {"CE only": (None, rows), f"context KD (beta {chosen[0]}, CE {chosen[1]})": (chosen, rows),
               "KD, teacher without the hint": (chosen, rows_plain)}  # fmt: skip
    results = {}
    for name, (setting, data) in recipes.items():
        runs = []
        for seed in sizes.seeds:
            student = _train_student(work, teacher, data, seed, sizes, device, setting)
            runs.append(evaluate(student, teacher, test_rows, device))
            print(f"  {name}, seed {seed}: test CE {runs[-1][0]:.4f}, KL {runs[-1][1]:.4f}")
        results[name] = {"held_out_ce_by_seed": [r[0] for r in runs], "kl_by_seed": [r[1] for r in runs]}

    seeds = sizes.seeds
    spread = f"mean ± sd over student seeds {list(seeds)}" if len(seeds) > 1 else f"seed {seeds[0]}"
    print(f"\ntest split, nats per token ({spread}); KL to the teacher reading the previous sentence")
    print(f"{'recipe':36}{'test CE':>18}{'KL':>18}")
    for name, r in results.items():
        print(f"{name:36}{cell(r['held_out_ce_by_seed'])}{cell(r['kl_by_seed'])}")
    return {"chosen": chosen, "validation": validation, "teacher_ce": (with_hint, without), "rows": results}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few steps, one seed (CI)")
    parser.add_argument("--device", default=None, help="torch device; None: cuda when available, else cpu")
    args = parser.parse_args(argv)
    run_context_demo(args.device, ContextDemoSizes.quick() if args.quick else None)


if __name__ == "__main__":
    main()
