"""Cross-tokenizer distillation from nothing: the demo's character-level teacher into a student with its own
byte-level BPE tokenizer, against the same student on CE alone.

The setting is limited student data, where soft targets carry something CE cannot: the corpus's first 90 % is
training text, the last 10 % test text. The teacher (Llama 4 x 128, characters) learns from all training windows
(600 steps x 16 with --quick, 1200 in full). Each student (Llama 2 x 64, a 384-token BPE trained on its own
data) sees only a fixed random 10 % of those windows (79 of 786, ~5 KB) for 200 steps x 8 (--quick) or x 16,
so CE alone fits its subset and stops improving on held-out text. Every row of a seed has the same init, batches,
learning rate and schedule; loss = soft_weight * KD + hard_weight * CE (forward KL, temperature 1).

Settings (10 %, 200 steps, chain weight 2, temperature 1) were chosen with `--validation`: teacher and students
train on the first 80 % and are scored on 80-90 %, never on the test text. There, at quick sizes: 200 steps, CE
only 0.7731 nats/char, chain x 2 0.6654, x 3 0.6730; 300 steps, CE only 0.9026 (it overfits its subset), chain
x 1 0.6803, x 2 0.6533, x 2 at temperature 2 0.6793. In full (x 16), 200 steps: CE only 0.8366 (0.777 at 100),
next-byte 0.7248, hybrid 0.8167, chain x 2 0.6412; 100 steps left every row undertrained (chain 0.848, CE 0.878).

Test text, 2-core CPU, one thread, held-out nats/char (mean, then inits 1 2 3; the best quarter of CE's curve in
brackets, an early-stopping bound that peeks at held-out text):

    --quick (90 s)       teacher 0.4838   CE only 0.7078 (0.7051 0.6980 0.7204) [0.708]
                                          CE + 2 x byte-chain KD 0.6315 (0.6255 0.6241 0.6449)
    full (242 s)         teacher 0.4473   CE only 0.7490 (0.7621 0.7553 0.7295) [0.733]
                                          CE + next-byte KD 0.6585 (0.6707 0.6539 0.6510)
                                          CE + GOLD-style hybrid 0.7295 (0.7307 0.7246 0.7333)
                                          CE + 2 x byte-chain KD 0.6071 (0.6177 0.5964 0.6072)

The byte chain beats CE alone on every init in both (by 0.076 and 0.142 nats/char, against a spread between
inits of 0.022 and 0.033), and beats the best point of CE's curve too. With the whole training text for the
student as well (the earlier setting) the student catches up and no recipe helped beyond the spread.

`run_cross_tokenizer_demo(teacher=None)` trains the teacher itself when none is given, so it runs alone;
`liger-kd demo` calls it with its own teacher (step 5: CE only and the byte chain at --quick student sizes;
with its 300-step teacher, 0.4407 here: CE only 0.7078, chain 0.6238 (0.6271 0.6144 0.6301); one init under
`liger-kd demo --quick`, whose weaker teacher helps less).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..align import CrossTokenizerCollator, CrossTokenizerConfig, VocabMap, byte_level_to_text, encode_with_offsets
from ..trainer.teachers.other_tokenizer import compute_cross_tokenizer_loss
from .toys import (
    BOS,
    EOS,
    PAD,
    CharTokenizer,
    DemoSizes,
    build_model,
    demo_threads,
    load_corpus,
    train_bpe_tokenizer,
)


class CharTokenizerWithOffsets(CharTokenizer):
    """The demo's character tokenizer, with the character offsets the aligner needs."""

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        kept = [(i, self.index[c]) for i, c in enumerate(text) if c in self.index]
        return [t for _, t in kept], [(i, i + 1) for i, _ in kept]


@dataclass
class CrossTokenizerDemoSizes:
    """Every student row gets the same steps, batch, learning rate, init, data and data order. The teacher (when
    the demo trains it) learns from the whole training split for `teacher_steps`; the students see only a fixed
    random `student_fraction` of its windows (the regime where soft targets carry something CE cannot: what the
    teacher learned from text the student never saw), for `steps`, i.e. several passes over their subset."""

    chars: int = 64  # characters per training window (both tokenizers see the same text)
    steps: int = 200
    batch: int = 16
    lr: float = 3e-3
    bpe_vocab: int = 384
    teacher_steps: int = 1200
    student_fraction: float = 0.10
    seeds: tuple[int, ...] = (1, 2, 3)  # student inits; each row reports the mean and every seed's value

    def __post_init__(self) -> None:
        if not 0 < self.student_fraction <= 1:
            raise ValueError(f"student_fraction must be in (0, 1]; got student_fraction={self.student_fraction!r}")

    @classmethod
    def quick(cls) -> CrossTokenizerDemoSizes:
        return cls(batch=8, teacher_steps=600)


def _text_windows(text: str, chars: int) -> list[str]:
    return [text[i : i + chars] for i in range(0, len(text) - chars, chars)]


def demo_splits(text: str, validation: bool = False) -> tuple[str, str]:
    """(training text, held-out text): the corpus's first 90 % and last 10 %. With `validation`, the held-out
    text is the last ninth of the training text instead (80-90 %), and training uses what comes before it:
    settings are chosen there, never on the test text."""
    test_start = int(len(text) * 0.9)
    if not validation:
        return text[:test_start], text[test_start:]
    validation_start = int(len(text) * 0.8)
    return text[:validation_start], text[validation_start:test_start]


def student_subset(windows: list[str], fraction: float) -> list[str]:
    """A fixed random `fraction` of the teacher's training windows (in corpus order): the student's data, the
    same for every row and init."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1]; got fraction={fraction!r}")
    count = max(1, round(len(windows) * fraction))
    chosen = torch.randperm(len(windows), generator=torch.Generator().manual_seed(0))[:count].sort().values
    return [windows[i] for i in chosen.tolist()]


@torch.no_grad()
def held_out_ce(model, tokenizer, texts: list[str], device) -> tuple[float, float]:
    """CE on held-out text: nats per token (of this model's tokenizer) and nats per character."""
    model.eval()
    total, tokens, chars = 0.0, 0, 0
    for text in texts:
        ids = torch.tensor([[BOS] + encode_with_offsets(tokenizer, text)[0]], device=device)
        logits = model(input_ids=ids).logits[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        tokens += ids.shape[1] - 1
        chars += len(text)
    model.train()
    return total / tokens, total / chars


def _train_teacher(char_tok, train_texts, sizes: DemoSizes, device):
    """The demo's character teacher, Llama 4 x 128, cosine schedule from 3e-3."""
    teacher = build_model(len(char_tok), 128, 4, seed=0, device=device)
    opt = torch.optim.AdamW(teacher.parameters(), lr=3e-3)
    windows = [[BOS] + char_tok.encode(t) for t in train_texts]
    gen = torch.Generator().manual_seed(0)
    print(f"  training the teacher (characters): {sizes.teacher_steps} steps x {sizes.batch} windows", flush=True)
    start, quarters = time.perf_counter(), {sizes.teacher_steps * k // 4 for k in (1, 2, 3)}
    for step in range(sizes.teacher_steps):
        idx = torch.randint(len(windows), (sizes.batch,), generator=gen).tolist()
        ids = torch.tensor([windows[i] for i in idx], device=device)
        for g in opt.param_groups:
            g["lr"] = 3e-3 * 0.5 * (1 + math.cos(math.pi * step / sizes.teacher_steps))
        loss = teacher(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step + 1 in quarters:  # progress: the teacher is most of a run's time
            print(f"    step {step + 1}/{sizes.teacher_steps}: loss {loss.item():.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    return teacher.eval().requires_grad_(False)


def _train_student(bpe, teacher, collator, texts, cfg, vocab_map, sizes, seed, held_out, dev) -> dict:
    """One student row on its `texts`: held-out nats/token and nats/char, nats/char on (up to 64 of) its own
    training windows (the gap shows overfitting), held-out nats/char after each quarter of the steps (`curve`,
    to show whether CE alone would have done better stopped early), seconds (training only). CE only when `cfg`
    is None."""
    student = build_model(bpe.get_vocab_size(), 64, 2, seed=seed, device=dev)
    student.config.eos_token_id = EOS
    opt = torch.optim.AdamW(student.parameters(), lr=sizes.lr)
    examples = [{"prompt": "", "completion": t} for t in texts]
    gen = torch.Generator().manual_seed(0)
    checkpoints = {sizes.steps * k // 4 for k in (1, 2, 3)} - {0}
    curve, seconds = [], 0.0
    start = time.perf_counter()
    for step in range(sizes.steps):
        idx = torch.randint(len(examples), (sizes.batch,), generator=gen).tolist()
        batch = {k: v.to(dev) for k, v in collator([examples[i] for i in idx]).items()}
        for g in opt.param_groups:
            g["lr"] = sizes.lr * min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * step / sizes.steps))
        if cfg is None:
            loss = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           labels=batch["labels"]).loss  # fmt: skip
        else:
            loss = compute_cross_tokenizer_loss(student, teacher, batch, cfg, vocab_map).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step + 1 in checkpoints:
            seconds += time.perf_counter() - start
            curve.append(held_out_ce(student, bpe, held_out, dev)[1])
            start = time.perf_counter()
    seconds += time.perf_counter() - start
    per_token, per_char = held_out_ce(student, bpe, held_out, dev)
    train_per_char = held_out_ce(student, bpe, texts[:64], dev)[1]
    return dict(per_token=per_token, per_char=per_char, train_per_char=train_per_char, curve=[*curve, per_char],
                seconds=seconds)  # fmt: skip


# loss = soft_weight * KD + hard_weight * CE, both explicit; forward KL (beta 0) everywhere
DEFAULT_RECIPES = {
    "CE + next-byte KD": CrossTokenizerConfig(kind="next_byte", beta=0.0, soft_weight=1.0, hard_weight=1.0),
    "CE + GOLD-style hybrid": CrossTokenizerConfig(kind="hybrid", beta=0.0, soft_weight=1.0, hard_weight=1.0),
    "CE + 2 x byte-chain KD": CrossTokenizerConfig(kind="chain", beta=0.0, soft_weight=2.0, hard_weight=1.0),
}
QUICK_RECIPES = {"CE + 2 x byte-chain KD": DEFAULT_RECIPES["CE + 2 x byte-chain KD"]}  # --quick: the one that helps


def run_cross_tokenizer_demo(
    teacher=None,
    quick: bool = False,
    device: str | None = None,
    recipes: dict[str, CrossTokenizerConfig] | None = None,
    sizes: CrossTokenizerDemoSizes | None = None,
    validation: bool = False,
) -> dict:
    """Train the BPE student on its subset of the training text, from each init, on CE only and on CE + each
    cross-tokenizer KD recipe from the character teacher (trained on the whole training text); returns (and
    prints) held-out CE of each, CE on its own training windows, wall time and the vocabulary overlap.
    `validation`: hold out the validation split (demo_splits) instead of the test text, for choosing settings;
    a given `teacher` must then have been trained without it. On a CPU it runs on one thread unless
    OMP_NUM_THREADS is set (toys.demo_threads)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sizes = sizes or (CrossTokenizerDemoSizes.quick() if quick else CrossTokenizerDemoSizes())
    recipes = (QUICK_RECIPES if quick else DEFAULT_RECIPES) if recipes is None else recipes
    with demo_threads(dev):
        return _run(teacher, dev, sizes, recipes, validation)


def _run(teacher, dev, sizes: CrossTokenizerDemoSizes, recipes: dict, validation: bool) -> dict:
    text = load_corpus()
    train_text, held_out_text = demo_splits(text, validation)
    char_tok = CharTokenizerWithOffsets(text)
    train_texts = _text_windows(train_text, sizes.chars)
    student_texts = student_subset(train_texts, sizes.student_fraction)
    bpe = train_bpe_tokenizer("".join(student_texts), sizes.bpe_vocab)  # the student's tokenizer: its own data
    held_out = _text_windows(held_out_text, sizes.chars)[:64]
    if teacher is None:
        teacher = _train_teacher(char_tok, _text_windows(train_text, 63),
                                 DemoSizes(teacher_steps=sizes.teacher_steps, batch=16), dev)  # fmt: skip
    teacher = teacher.to(dev).eval().requires_grad_(False)
    teacher_ce = held_out_ce(teacher, char_tok, held_out, dev)[1]
    vocab_map = VocabMap.build(bpe, char_tok, normalize=byte_level_to_text, teacher_vocab_size=len(char_tok))
    collator = CrossTokenizerCollator(bpe, char_tok, student_pad_id=PAD, teacher_pad_id=PAD,
                                      student_prefix_ids=(BOS,), teacher_prefix_ids=(BOS,))  # fmt: skip
    print(
        f"\ncross-tokenizer: char teacher ({len(char_tok)} symbols, {len(train_texts)} windows) -> BPE student "
        f"({bpe.get_vocab_size()} tokens, {len(vocab_map)} shared strings) on {len(student_texts)} of those windows "
        f"({sizes.student_fraction:.0%}), {sizes.steps} steps x {sizes.batch} windows of {sizes.chars} chars, "
        f"student seeds {list(sizes.seeds)}; held-out: {'validation' if validation else 'test'} text"
    )
    print(f"  teacher (characters)       held-out CE {teacher_ce:.4f} nats/char")
    results = {"vocab_overlap": len(vocab_map), "teacher_ce_per_char": teacher_ce, "recipes": {}}
    for name, cfg in {"CE only": None, **recipes}.items():
        runs = [_train_student(bpe, teacher, collator, student_texts, cfg, vocab_map, sizes, seed, held_out, dev)
                for seed in sizes.seeds]  # fmt: skip
        mean = {key: sum(r[key] for r in runs) / len(runs) for key in ("per_token", "per_char", "train_per_char",
                                                                         "seconds")}  # fmt: skip
        curve = [sum(values) / len(runs) for values in zip(*(r["curve"] for r in runs))]
        results["recipes"][name] = dict(ce_per_token=mean["per_token"], ce_per_char=mean["per_char"],
                                        train_ce_per_char=mean["train_per_char"], seconds=mean["seconds"],
                                        ce_per_char_by_seed=[r["per_char"] for r in runs],
                                        ce_per_char_by_quarter=curve)  # fmt: skip
        by_seed = " ".join(f"{r['per_char']:.4f}" for r in runs)
        print(
            f"  {name:26} held-out {mean['per_char']:.4f} nats/char ({by_seed}), {mean['per_token']:.3f} nats/token; "
            f"by quarter {' '.join(f'{c:.3f}' for c in curve)}; own training text {mean['train_per_char']:.4f}; "
            f"{mean['seconds']:.1f} s",
            flush=True,
        )
    return results


if __name__ == "__main__":
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description="char teacher -> BPE student, against CE alone")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default=None)
    parser.add_argument("--validation", action="store_true", help="hold out the validation split, not the test text")
    parser.add_argument("--out", default=None, help="write the table's figures as JSON here")
    cli = parser.parse_args()
    start = time.perf_counter()
    results = run_cross_tokenizer_demo(quick=cli.quick, device=cli.device, validation=cli.validation)
    results["total_seconds"] = time.perf_counter() - start
    print(f"  done in {results['total_seconds']:.0f} s" + (f"; results as JSON in {cli.out}" if cli.out else ""))
    if cli.out:
        Path(cli.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cli.out).write_text(json.dumps(results, indent=1))
