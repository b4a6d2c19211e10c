"""`liger-kd demo --several-teachers`: one student routed between two specialist teachers, on CPU in minutes.

The packaged corpus is split by a marker into two halves of different style: sentences that open with a clause
("At dawn, ...", "When the otter sleeps, ...") and plain ones ("The grey owl watches ..."). Three teachers of one
size and one budget are trained: one on each half, one on everything. One student recipe per row, same inits, same
steps, on the training text of both halves: CE only, distilled from either specialist alone, from the teacher of
everything, and routed (each window scored against its own half's specialist, `KDTrainer(teacher_model={...})` with
a `teacher` column). Reported per half: held-out CE and KL(specialist || student) per token on that half's held-out
text, mean ± standard deviation over the student seeds. Each KD recipe's temperature (1 or 2) is chosen on a
validation split (24 windows per half, never trained on) by its seed-1 student's mean CE; beta 0 and the learning
rate and schedule are the main demo's, fixed in advance. Nothing is tuned on the held-out text.
"""

from __future__ import annotations

import re
import statistics
import tempfile
from pathlib import Path

import torch

from ..models import revert_kd_patch
from .same_tokenizer import evaluate
from .toys import PAD, CharTokenizer, build_model, demo_threads, load_corpus, quiet, training_args, windows

HALVES = ("clauses", "plain")
TEMPERATURES = (1.0, 2.0)  # the KD temperatures each KD recipe chooses from on the validation split
VALIDATION = 24  # windows per half kept out of training to choose the temperature
CLAUSE_OPENERS = ("When", "At", "After", "In", "Before", "Under")  # "At dawn, ...", "When the fox sleeps, ..."


def split_corpus(text: str) -> dict[str, str]:
    """The corpus' sentences by half, in order: 'clauses' (opening with a clause) and 'plain' (the rest)."""
    halves: dict[str, list[str]] = {half: [] for half in HALVES}
    for line in text.splitlines():
        for sentence in re.split(r"(?<=[.!?])\s+", line.strip()):
            if sentence:
                halves["clauses" if sentence.split()[0] in CLAUSE_OPENERS else "plain"].append(sentence)
    return {half: " ".join(sentences) for half, sentences in halves.items()}


def run_multi_teacher_demo(quick: bool = False, device: str | None = None, seeds: tuple[int, ...] | None = None):
    """The table's rows: {"recipe", "ce_<half>", "kl_<half>" (means), and "<key>_by_seed"}."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with tempfile.TemporaryDirectory(prefix="liger_kd_multi_demo_") as work, demo_threads(dev):
        return _run(Path(work), quick, dev, seeds)


def _run(work: Path, quick: bool, dev: torch.device, seeds) -> list[dict]:
    from transformers import Trainer

    from .. import teacher as TD
    from ..trainer import KDTrainer

    seq, batch = 48, 8
    teacher_steps, student_steps = (150, 100) if quick else (300, 200)
    seeds = tuple(seeds or ((1,) if quick else (1, 2, 3)))
    text = load_corpus()
    tok = CharTokenizer(text)
    train, validation, held_out = {}, {}, {}
    for half, stream in split_corpus(text).items():
        cut = int(len(stream) * 0.9)
        seen = windows(tok.encode(stream[:cut]), seq)
        train[half], validation[half] = seen[:-VALIDATION], seen[-VALIDATION:]  # validation chooses T, untrained on
        held_out[half] = windows(tok.encode(stream[cut:]), seq)[:48]
    rows = {half: [{"input_ids": torch.tensor(w), "teacher": half} for w in train[half]] for half in HALVES}
    everything = rows["clauses"] + rows["plain"]
    plain_rows = [{"input_ids": r["input_ids"]} for r in everything]
    collator = TD.TeacherDataCollator(pad_token_id=PAD)
    vocab = len(tok)
    sizes = {half: len(train[half]) for half in HALVES}
    print(f"halves of the corpus (windows of {seq} characters): {sizes}; validation {VALIDATION}, held-out 48 per half")

    teachers = {}
    for name, data in (("clauses", rows["clauses"]), ("plain", rows["plain"]), ("everything", everything)):
        teacher = build_model(vocab, 128, 3, seed=0, device=dev)
        args = training_args(work / f"teacher_{name}", teacher_steps, batch, dev)
        quiet(Trainer(model=teacher, args=args, train_dataset=[{"input_ids": r["input_ids"]} for r in data],
                      data_collator=collator)).train()  # fmt: skip
        teachers[name] = teacher.eval()
        ces = {half: evaluate(teacher, teacher, held_out[half], dev)[0] for half in HALVES}
        print(f"teacher trained on {name}: held-out CE " + ", ".join(f"{h} {c:.3f}" for h, c in ces.items()))

    specialists = {half: teachers[half] for half in HALVES}
    recipes = {
        "CE only": None,
        "teacher 'clauses' alone": (teachers["clauses"], plain_rows),
        "teacher 'plain' alone": (teachers["plain"], plain_rows),
        "one teacher of everything": (teachers["everything"], plain_rows),
        "routed to its half's teacher": (specialists, everything),
    }

    def run(recipe, seed: int, temperature: float) -> dict[str, float]:
        """One student: trained by `recipe`, scored per half on validation (val_*) and held-out text."""
        student = build_model(vocab, 64, 2, seed=seed, device=dev)
        kd = {} if recipe is None else dict(use_kd_patch=True, kd_beta=0.0, kd_temperature=temperature)
        args = training_args(work / "student", student_steps, batch, dev, seed=seed - 1, **kd)
        if recipe is None:
            trainer = Trainer(model=student, args=args, train_dataset=plain_rows, data_collator=collator)
        else:
            trainer = KDTrainer(model=student, teacher_model=recipe[0], args=args, train_dataset=recipe[1],
                                data_collator=collator)  # fmt: skip
        quiet(trainer).train()
        revert_kd_patch(model=student)
        scores = {}
        for half in HALVES:
            scores[f"ce_{half}"], scores[f"kl_{half}"] = evaluate(student, specialists[half], held_out[half], dev)
            scores[f"val_ce_{half}"] = evaluate(student, specialists[half], validation[half], dev)[0]
        return scores

    results = []
    for name, recipe in recipes.items():
        # the KD temperature of each KD recipe: the one of TEMPERATURES whose seed-1 student has the lowest mean
        # validation CE over the two halves (that run is kept as seed 1's)
        tried = {t: run(recipe, seeds[0], t) for t in (TEMPERATURES if recipe is not None else (1.0,))}
        chosen = min(tried, key=lambda t: sum(tried[t][f"val_ce_{h}"] for h in HALVES))
        if len(tried) > 1:
            by_t = ", ".join(f"T={t:g} {sum(r[f'val_ce_{h}'] for h in HALVES) / 2:.4f}" for t, r in tried.items())
            print(f"  {name}: mean validation CE {by_t}; chosen T={chosen:g}")
        runs = [tried[chosen]] + [run(recipe, seed, chosen) for seed in seeds[1:]]
        for seed, r in zip(seeds, runs):
            print(f"  {name}, seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in r.items() if "val" not in k))
        row = dict(recipe=name, seeds=list(seeds), temperature=chosen)
        for key in (k for k in runs[0] if not k.startswith("val_")):
            row[f"{key}_by_seed"] = [r[key] for r in runs]
            row[key] = sum(row[f"{key}_by_seed"]) / len(runs)
        results.append(row)

    spread = f"mean ± sd over student seeds {list(seeds)}" if len(seeds) > 1 else f"seed {seeds[0]}"
    print(f"\nheld-out CE (nats/char) and KL(that half's teacher || student) per token, by half; {spread}")
    w = 17 if len(seeds) > 1 else 9
    header = "".join(f"{label:>{w}}" for label in ("CE clauses", "CE plain", "KL clauses", "KL plain"))
    print(f"{'recipe':36}{header}")
    for r in results:
        cells = [_mean_sd(r[f"{k}_by_seed"], d, w) for k, d in (("ce_clauses", 3), ("ce_plain", 3),
                                                                      ("kl_clauses", 4), ("kl_plain", 4))]  # fmt: skip
        label = r["recipe"] if r["recipe"] == "CE only" else f"{r['recipe']} (T={r['temperature']:g})"
        print(f"{label:36}{''.join(cells)}")
    return results


def _mean_sd(values: list[float], digits: int, width: int) -> str:
    text = f"{statistics.mean(values):.{digits}f}"
    if len(values) > 1:
        text += f" ± {statistics.stdev(values):.{digits}f}"
    return f"{text:>{width}}"
