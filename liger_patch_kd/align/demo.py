"""Cross-tokenizer distillation from nothing: the demo's character-level teacher into a student with its own
byte-level BPE tokenizer (trained here on the packaged corpus), against the same student on CE alone.

`run_cross_tokenizer_demo(teacher=None)` trains the teacher itself when none is given (as `liger-kd demo`
does), so it runs alone; the lead calls it from demo.py with the demo's teacher to add the table row.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..demo import BOS, EOS, PAD, CharTokenizer, DemoSizes, _model, load_corpus
from .collator import CrossTokenizerCollator
from .config import CrossTokenizerConfig
from .offsets import encode_with_offsets
from .trainer_hooks import compute_cross_tokenizer_loss
from .vocab import VocabMap, byte_level_to_text


class CharTokenizerWithOffsets(CharTokenizer):
    """The demo's character tokenizer, with the character offsets the aligner needs."""

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        kept = [(i, self.index[c]) for i, c in enumerate(text) if c in self.index]
        return [t for _, t in kept], [(i, i + 1) for i, _ in kept]


def train_bpe_tokenizer(text: str, vocab_size: int = 384):
    """A byte-level BPE (GPT-2 / Llama-3 / Qwen style) trained on `text`, with <pad> <s> </s> as ids 0 1 2."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator([text], vocab_size=vocab_size, min_frequency=2, special_tokens=["<pad>", "<s>", "</s>"],
                            show_progress=False)  # fmt: skip
    return tok._tokenizer


@dataclass
class CrossTokenizerDemoSizes:
    """Every student row gets the same steps, batch, learning rate, init and data order. Distillation can only
    help a student that the teacher is well ahead of: a byte-level BPE student learns this small corpus fast
    (2 x 64 reaches 0.45 nats/char in 250 steps x 16), so the teacher (when the demo trains it) gets
    `teacher_steps` and the students a budget at which CE alone is still far behind it."""

    chars: int = 96  # characters per training window (both tokenizers see the same text)
    steps: int = 100
    batch: int = 16
    lr: float = 3e-3
    bpe_vocab: int = 384
    teacher_steps: int = 1200
    seeds: tuple[int, ...] = (1, 2, 3)  # student inits; each row reports the mean and every seed's value

    @classmethod
    def quick(cls) -> CrossTokenizerDemoSizes:
        return cls(chars=64, steps=60, batch=8, teacher_steps=600)


def _text_windows(text: str, chars: int) -> list[str]:
    return [text[i : i + chars] for i in range(0, len(text) - chars, chars)]


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
    teacher = _model(len(char_tok), 128, 4, seed=0, device=device)
    opt = torch.optim.AdamW(teacher.parameters(), lr=3e-3)
    windows = [[BOS] + char_tok.encode(t) for t in train_texts]
    gen = torch.Generator().manual_seed(0)
    for step in range(sizes.teacher_steps):
        idx = torch.randint(len(windows), (sizes.batch,), generator=gen).tolist()
        ids = torch.tensor([windows[i] for i in idx], device=device)
        for g in opt.param_groups:
            g["lr"] = 3e-3 * 0.5 * (1 + math.cos(math.pi * step / sizes.teacher_steps))
        teacher(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return teacher.eval().requires_grad_(False)


def _train_student(bpe, teacher, collator, examples, cfg, vocab_map, sizes, seed, held_out, dev):
    """One student row: (held-out nats/token, nats/char, seconds). CE only when `cfg` is None."""
    student = _model(bpe.get_vocab_size(), 64, 2, seed=seed, device=dev)
    student.config.eos_token_id = EOS
    opt = torch.optim.AdamW(student.parameters(), lr=sizes.lr)
    gen = torch.Generator().manual_seed(0)
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
    seconds = time.perf_counter() - start
    return (*held_out_ce(student, bpe, held_out, dev), seconds)


# loss = soft_weight * KD + hard_weight * CE, both explicit; forward KL (beta 0) everywhere
DEFAULT_RECIPES = {
    "CE + next-byte KD": CrossTokenizerConfig(kind="next_byte", beta=0.0, soft_weight=1.0, hard_weight=1.0),
    "CE + GOLD-style hybrid": CrossTokenizerConfig(kind="hybrid", beta=0.0, soft_weight=1.0, hard_weight=1.0),
    "CE + 2 x byte-chain KD": CrossTokenizerConfig(kind="chain", beta=0.0, soft_weight=2.0, hard_weight=1.0),
}


def run_cross_tokenizer_demo(
    teacher=None,
    quick: bool = False,
    device: str | None = None,
    recipes: dict[str, CrossTokenizerConfig] | None = None,
    sizes: CrossTokenizerDemoSizes | None = None,
) -> dict:
    """Train the BPE student from one init on CE only and on CE + each cross-tokenizer KD recipe from the
    character teacher; returns (and prints) held-out CE of each, wall time and the vocabulary overlap."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sizes = sizes or (CrossTokenizerDemoSizes.quick() if quick else CrossTokenizerDemoSizes())
    recipes = DEFAULT_RECIPES if recipes is None else recipes
    text = load_corpus()
    split = int(len(text) * 0.9)
    char_tok = CharTokenizerWithOffsets(text)
    bpe = train_bpe_tokenizer(text[:split], sizes.bpe_vocab)
    train_texts = _text_windows(text[:split], sizes.chars)
    held_out = _text_windows(text[split:], sizes.chars)[:64]
    if teacher is None:
        teacher = _train_teacher(char_tok, _text_windows(text[:split], 63),
                                 DemoSizes(teacher_steps=sizes.teacher_steps, batch=16), dev)  # fmt: skip
    teacher = teacher.to(dev).eval().requires_grad_(False)
    teacher_ce = held_out_ce(teacher, char_tok, held_out, dev)[1]
    vocab_map = VocabMap.build(bpe, char_tok, normalize=byte_level_to_text, teacher_vocab_size=len(char_tok))
    collator = CrossTokenizerCollator(bpe, char_tok, student_pad_id=PAD, teacher_pad_id=PAD,
                                      student_prefix_ids=(BOS,), teacher_prefix_ids=(BOS,))  # fmt: skip
    examples = [{"prompt": "", "completion": t} for t in train_texts]
    print(
        f"\ncross-tokenizer: char teacher ({len(char_tok)} symbols) -> BPE student ({bpe.get_vocab_size()} tokens, "
        f"{len(vocab_map)} shared strings), {sizes.steps} steps x {sizes.batch} windows of {sizes.chars} chars, "
        f"student seeds {list(sizes.seeds)}"
    )
    print(f"  teacher (characters)       held-out CE {teacher_ce:.4f} nats/char")
    results = {"vocab_overlap": len(vocab_map), "teacher_ce_per_char": teacher_ce, "recipes": {}}
    for name, cfg in {"CE only": None, **recipes}.items():
        runs = [_train_student(bpe, teacher, collator, examples, cfg, vocab_map, sizes, seed, held_out, dev)
                for seed in sizes.seeds]  # fmt: skip
        per_token, per_char, seconds = (sum(r[i] for r in runs) / len(runs) for i in range(3))
        results["recipes"][name] = dict(ce_per_token=per_token, ce_per_char=per_char, seconds=seconds,
                                        ce_per_char_by_seed=[r[1] for r in runs])  # fmt: skip
        by_seed = " ".join(f"{r[1]:.4f}" for r in runs)
        print(
            f"  {name:26} held-out CE {per_token:.3f} nats/token, {per_char:.4f} nats/char ({by_seed}), {seconds:.1f} s"
        )
    return results


if __name__ == "__main__":
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description="char teacher -> BPE student, against CE alone")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    cli = parser.parse_args()
    start = time.perf_counter()
    results = run_cross_tokenizer_demo(quick=cli.quick, device=cli.device)
    results["total_seconds"] = time.perf_counter() - start
    print(json.dumps(results, indent=1))
    if cli.out:
        Path(cli.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cli.out).write_text(json.dumps(results, indent=1))
