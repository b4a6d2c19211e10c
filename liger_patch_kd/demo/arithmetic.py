"""A task with a right answer: multi-step arithmetic with worked steps, generated from a seed.

    Q: 37+48-19=? A: 37+48=85; 85-19=66. #### 66

Each problem chains `operands` numbers of `digits` digits with + and - (a - only where the running total stays
>= 0, so every answer is a natural number); the completion writes one step per operator and ends with `#### N`.
Problems are split by a stable hash of their prompt (`held_out_every`: one prompt in that many is held out), so a
held-out problem is never a training one, whatever the seeds. `exact_match` greedy-decodes a batch of prompts and
checks the number after `####` against the answer (`final_answer`: the completion must end with it, nothing after).

The tokenizer is a byte-level BPE trained on the task's text with every digit its own token (pre_tokenizers.Digits):
numbers spelled digit by digit keep arithmetic learnable for small models, so the merges only join the task's
words and signs. The models are small Llamas (toys.build_model). `fit_on_ground_truth` is a plain training loop
(no Trainer) for the teacher and the student's short fine-tune on the task's format.
"""

from __future__ import annotations

import math
import random
import re
import time
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .toys import BOS, EOS, PAD, build_model

ANSWER = re.compile(r"#### (0|[1-9][0-9]*)")  # the number as written: no sign, no leading zero


@dataclass(frozen=True)
class Problem:
    prompt: str  # "Q: 37+48-19=? A:"
    completion: str  # " 37+48=85; 85-19=66. #### 66" (EOS is the tokenizer's, appended when tokenized)
    answer: int


@dataclass(frozen=True)
class ArithmeticTask:
    """`operands` numbers of `digits` digits each, joined by + or -; one prompt in `held_out_every` is held out."""

    operands: int = 3
    digits: int = 2
    held_out_every: int = 50

    def __post_init__(self) -> None:
        if self.operands < 2 or self.digits < 1 or self.held_out_every < 2:
            raise ValueError(
                f"ArithmeticTask needs operands >= 2, digits >= 1 and held_out_every >= 2; got operands="
                f"{self.operands}, digits={self.digits}, held_out_every={self.held_out_every}"
            )

    def draw(self, rng: random.Random) -> Problem:
        low, high = 10 ** (self.digits - 1), 10**self.digits - 1
        numbers = [rng.randint(low, high) for _ in range(self.operands)]
        total, steps, expression = numbers[0], [], str(numbers[0])
        for number in numbers[1:]:
            sign = "-" if rng.random() < 0.5 and total >= number else "+"
            after = total - number if sign == "-" else total + number
            steps.append(f"{total}{sign}{number}={after}")
            expression += f"{sign}{number}"
            total = after
        return Problem(f"Q: {expression}=? A:", f" {'; '.join(steps)}. #### {total}", total)

    def is_held_out(self, problem: Problem) -> bool:
        return zlib.crc32(problem.prompt.encode()) % self.held_out_every == 0

    def problems(self, n: int, seed: int, held_out: bool = False) -> list[Problem]:
        """`n` problems of one side of the split, drawn from random.Random(seed): the same list for the same
        arguments on every machine."""
        rng, out = random.Random(seed), []
        while len(out) < n:
            problem = self.draw(rng)
            if self.is_held_out(problem) == held_out:
                out.append(problem)
        return out


def distinct_held_out(task: ArithmeticTask, n: int, seed: int, name: str) -> list[Problem]:
    """`n` different held-out problems, in the order random.Random(seed) draws them: a small task repeats problems
    often, and a repeated one would count twice. `name`: the caller's option that asked for `n`, for the error when
    the task holds out fewer."""
    seen: dict[str, Problem] = {}
    for problem in task.problems(20 * n, seed=seed, held_out=True):
        seen.setdefault(problem.prompt, problem)
        if len(seen) == n:
            return list(seen.values())
    raise ValueError(f"{name}={n}: the task (operands={task.operands}, digits={task.digits}, "
                     f"held_out_every={task.held_out_every}) gave only {len(seen)} different held-out problems in "
                     f"{20 * n} draws; ask for fewer, or a larger task (more digits or operands, a smaller "
                     f"held_out_every)")  # fmt: skip


def with_wrong_answers(problems: list[Problem], fraction: float, seed: int) -> list[Problem]:
    """A copy of `problems` in which `fraction` of them (drawn with random.Random(seed)) end in a wrong answer: the
    last step's result and the `####` number both moved by 1 to 9 (never below 0), so the worked steps still read
    as one solution, wrong at its end. Each such Problem's `answer` is the number its completion writes (the label
    the data holds). A noisy ground truth, for benchmarks in which a teacher knows better than the labels."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1]; got {fraction}")
    rng, out = random.Random(seed), []
    for problem in problems:
        if rng.random() >= fraction:
            out.append(problem)
            continue
        wrong = problem.answer + rng.choice([d for d in range(-9, 10) if d and problem.answer + d >= 0])
        steps = problem.completion.rsplit(" #### ", 1)[0]
        head, _ = steps.rsplit("=", 1)
        out.append(Problem(problem.prompt, f"{head}={wrong}. #### {wrong}", wrong))
    return out


def final_answer(completion: str) -> int | None:
    """The number after the last `####` when the completion ends with it (spaces aside), else None."""
    found = list(ANSWER.finditer(completion))
    if not found or completion[found[-1].end() :].strip():
        return None
    return int(found[-1].group(1))


def is_correct(completion: str, problem: Problem) -> bool:
    return final_answer(completion) == problem.answer


def build_tokenizer(problems: list[Problem], vocab_size: int = 512):
    """A byte-level BPE trained on the problems' text, digits one token each, <pad> <s> </s> as ids 0 1 2 (no
    special token added when encoding): a transformers PreTrainedTokenizerFast. The byte alphabet fills 256 ids;
    the merges the text offers (its words and signs; digits never merge) stop it short of `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    core.train_from_iterator((p.prompt + p.completion for p in problems), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    if (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) != (PAD, BOS, EOS):
        raise RuntimeError("the special tokens did not land on ids 0 1 2")  # the models' config assumes them
    return tokenizer


def tokenized(tokenizer, problems: list[Problem]) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, completion ids + EOS) per problem, prompt and completion encoded apart as KDTrainer's prompt
    collator and TRL's trainers encode them."""
    prompts = tokenizer([p.prompt for p in problems], add_special_tokens=False)["input_ids"]
    completions = tokenizer([p.completion for p in problems], add_special_tokens=False)["input_ids"]
    return prompts, [c + [EOS] for c in completions]


def prompt_rows(problems: list[Problem]) -> list[dict[str, str]]:
    """TRL-style {"prompt", "completion"} rows (KDTrainer tokenizes them with processing_class)."""
    return [{"prompt": p.prompt, "completion": p.completion} for p in problems]


@dataclass(frozen=True)
class TaskSplit:
    """One draw of the task for a teacher and its students, built by `split_task`: the teacher learns every training
    problem's solution, the students are given solutions for the first few only (`given`) and every prompt."""

    task: ArithmeticTask
    tokenizer: object  # build_tokenizer's, trained on the first 20,000 training problems
    train: list[Problem]  # every training problem, right (the teacher's data)
    held_out: list[Problem]  # different held-out problems, none counted twice
    prompts: list[list[int]]  # every training prompt's ids
    completions: list[list[int]]  # every training solution's ids + EOS
    given: list[Problem]  # the problems the students get a solution for (some answers wrong with label noise)
    labels: list[list[int]]  # their completions' ids + EOS

    @property
    def labelled_prompts(self) -> list[list[int]]:
        return self.prompts[: len(self.given)]

    @property
    def max_new_tokens(self) -> int:
        """Room for the longest solution either side holds, and one token more (an EOS a model may add)."""
        return max(map(len, self.completions + self.labels)) + 1

    def labelled_rows(self) -> list[dict[str, str]]:
        """TRL-style {"prompt", "completion"} rows of the given solutions."""
        return prompt_rows(self.given)

    def labelled_token_rows(self) -> list[dict[str, list[int]]]:
        return [dict(prompt_ids=p, completion_ids=c) for p, c in zip(self.labelled_prompts, self.labels)]

    def prompt_only_rows(self) -> list[dict[str, str]]:
        """Every training prompt with no solution in it: the rows of recipes that need none (on-policy KD)."""
        return [{"prompt": p.prompt} for p in self.train]


def split_task(task: ArithmeticTask, train_problems: int, labelled: int, held_out: int, *, held_out_name: str,
               label_noise: float = 0.0) -> TaskSplit:  # fmt: skip
    """`train_problems` training problems (seed 0), solutions given for the first `labelled` (0: all of them; with
    `label_noise` a share of those answers wrong, seed 2: with_wrong_answers), `held_out` different held-out
    problems (seed 1; `held_out_name` is the caller's option for that count, named in distinct_held_out's error)."""
    if not 0 <= labelled <= train_problems:
        raise ValueError(f"labelled={labelled}: give 0 (every problem labelled) up to train_problems={train_problems}")
    train = task.problems(train_problems, seed=0)
    held = distinct_held_out(task, held_out, seed=1, name=held_out_name)
    tokenizer = build_tokenizer(train[:20_000])
    prompts, completions = tokenized(tokenizer, train)
    right = train[: labelled or len(train)]
    given = with_wrong_answers(right, label_noise, seed=2) if label_noise else right
    labels = tokenized(tokenizer, given)[1] if label_noise else completions[: len(given)]
    return TaskSplit(task, tokenizer, train, held, prompts, completions, given, labels)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int

    def build(self, vocab: int, seed: int, device):
        """A Llama of this shape (toys.build_model: 4 heads, 2 key-value heads, MLP 3 x hidden, tied embeddings)."""
        return build_model(vocab, self.hidden, self.layers, seed=seed, device=device)


TEACHER_SHAPE = ModelShape(hidden=320, layers=8)  # about 10M parameters besides the embeddings
STUDENT_SHAPE = ModelShape(hidden=192, layers=4)  # about 1.8M: five to six times smaller


def completion_batch(prompts: list[list[int]], completions: list[list[int]], device) -> dict[str, torch.Tensor]:
    """Right-padded prompt + completion rows: input_ids, attention_mask, labels (-100 on prompt and padding)."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        ids[row, : len(p) + len(c)] = torch.tensor(p + c)
        labels[row, len(p) : len(p) + len(c)] = torch.tensor(c)
        mask[row, : len(p) + len(c)] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def fit_on_ground_truth(model, prompts, completions, *, steps: int, batch: int, lr: float, seed: int, device,
                        log_every: int = 0) -> dict:  # fmt: skip
    """Cross-entropy on the completions (prompts masked), AdamW, linear warm-up then cosine to a tenth, bf16
    autocast on CUDA; batches drawn with replacement from a generator seeded `seed`. A plain loop over rows padded
    once (no Trainer): the teacher and the students' format fine-tune are not what the benchmark compares.
    Returns {"seconds", "final_loss"}."""
    model.train()
    rows = completion_batch(prompts, completions, device)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps))))))  # fmt: skip
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.device(device).type == "cuda")
    start, loss = time.perf_counter(), torch.zeros(())
    for step in range(steps):
        picks = torch.randint(len(prompts), (batch,), generator=gen).to(rows["input_ids"].device)
        ids, mask, labels = (rows[key][picks] for key in ("input_ids", "attention_mask", "labels"))
        with autocast:
            logits = model(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if log_every and (step + 1) % log_every == 0:
            seconds = time.perf_counter() - start
            print(f"    step {step + 1}/{steps}: loss {loss.item():.4f} ({seconds:.0f} s)", flush=True)
    model.eval()
    return {"seconds": time.perf_counter() - start, "final_loss": float(loss.detach())}


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 512):
    """The model's greedy completion of each prompt, as text (up to EOS): the project's decode engine where it
    applies (a captured CUDA graph on a GPU), else transformers' generate."""
    from ..generation import Sampling, decode, decode_applies, left_padded

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    texts: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            ids, mask = left_padded(prompts[start : start + batch_size], PAD, device=device)
            if decode_applies(model) is None:
                new, _ = decode(model, ids, mask, max_new_tokens=max_new_tokens, sampling=Sampling(temperature=0.0),
                                pad_id=PAD, eos_ids=(EOS,))  # fmt: skip
            else:
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=PAD, eos_token_id=EOS)  # fmt: skip
                new = out[:, ids.shape[1] :]
            for row in new.tolist():
                row = row[: row.index(EOS)] if EOS in row else row
                texts.append(tokenizer.decode(row, skip_special_tokens=True))
    finally:
        model.train(was_training)
    return texts


def exact_match(model, tokenizer, problems: list[Problem], max_new_tokens: int | None = None,
                batch_size: int = 512) -> float:  # fmt: skip
    """The fraction of `problems` whose greedy completion ends with `#### <the right answer>`."""
    prompts, completions = tokenized(tokenizer, problems)
    longest = max_new_tokens or max(map(len, completions)) + 2
    texts = greedy_completions(model, tokenizer, prompts, longest, batch_size)
    return sum(is_correct(t, p) for t, p in zip(texts, problems)) / len(problems)
