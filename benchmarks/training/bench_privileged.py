"""A teacher that reads its own, longer prompt: what the pairing costs in a fused KD step.

    python -m benchmarks.training.bench_privileged  # H200: table + its JSON in benchmarks/results/
    python -m benchmarks.training.bench_privileged --tiny               # CPU smoke test (no figures)

Llama-1B-shaped student, Llama-8B-shaped teacher (bench_train_step's "llama" shapes), bf16, 4 rows of a
`--prompt`-token student prompt and a `--completion`-token completion. Rows of the table, forward + backward of the
patched student (gradient checkpointing on, as bench_train_step):
- same prompt: plain KD, the teacher reads the student's rows;
- same prompt, paired: the same rows given as the teacher's own (teacher_input_ids == input_ids), so the only
  difference from the row above is the pairing (one host sync, an index, a gather of the teacher's hidden states);
- teacher prompt x4: the teacher reads a prompt four times longer (a document, a hint) before the same completion.
`pairing ms` is completion_index + the gather alone, timed apart.
"""

from __future__ import annotations

import argparse

import torch

from liger_patch_kd.models import apply_kd_patch_to_llama
from liger_patch_kd.models.privileged import PrivilegedInputs

from ..common import cuda_time_ms, environment, peak_extra_gib, print_table, write_json
from ..common.train_step import SHAPES, build


def rows(batch: int, prompt: int, teacher_prompt: int, completion: int, vocab: int, device) -> dict:
    g = torch.Generator().manual_seed(0)
    s_prompt = torch.randint(3, vocab, (batch, prompt), generator=g)
    t_prompt = torch.randint(3, vocab, (batch, teacher_prompt), generator=g)
    done = torch.randint(3, vocab, (batch, completion), generator=g)
    ids, t_ids = torch.cat([s_prompt, done], 1), torch.cat([t_prompt, done], 1)
    labels, t_labels = ids.clone(), t_ids.clone()
    labels[:, :prompt], t_labels[:, :teacher_prompt] = -100, -100
    out = dict(input_ids=ids, labels=labels, teacher_input_ids=t_ids, teacher_labels=t_labels)
    return {k: v.to(device) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with tiny shapes")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--completion", type=int, default=1536)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/bench_privileged.json")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shapes = SHAPES["tiny" if args.tiny else "llama"]
    prompt, completion = (8, 16) if args.tiny else (args.prompt, args.completion)
    student = build(shapes[0], device, dtype, seed=1)
    teacher = build(shapes[1], device, dtype, seed=2).eval().requires_grad_(False)
    apply_kd_patch_to_llama(model=student, beta=0.5)
    student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    student.config.use_cache = teacher.config.use_cache = False
    student.train()
    vocab = shapes[0]["vocab_size"]
    cases = {
        "same prompt": (rows(args.batch, prompt, prompt, completion, vocab, device), False),
        "same prompt, paired": (rows(args.batch, prompt, prompt, completion, vocab, device), True),
        "teacher prompt x4": (rows(args.batch, prompt, 4 * prompt, completion, vocab, device), True),
    }
    results = []
    for name, (batch, paired) in cases.items():
        if name == "same prompt, paired":
            batch = {**batch, "teacher_input_ids": batch["input_ids"], "teacher_labels": batch["labels"]}
        given = batch if paired else {k: batch[k] for k in ("input_ids", "labels")}

        def step(given=given):
            student(**given, teacher_model=teacher).loss.backward()

        row = {
            "rows": name,
            "teacher tokens": int(batch["teacher_input_ids"].numel() if paired else batch["input_ids"].numel()),
        }
        if args.tiny:
            step()
        else:
            row["ms"] = cuda_time_ms(step, warmup=2, reps=6)
            row["peak extra GiB"] = peak_extra_gib(step)
            targets = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
            hidden = torch.randn(
                *batch["teacher_input_ids"].shape, shapes[1]["hidden_size"], device=device, dtype=dtype
            )
            inputs = PrivilegedInputs(batch["teacher_input_ids"], batch["teacher_labels"])
            row["pairing ms"] = cuda_time_ms(lambda: inputs.aligner(targets, -100)(hidden), warmup=2, reps=10)
        results.append(row)
        student.zero_grad(set_to_none=True)
    print_table(results, ["rows", "teacher tokens", "ms", "peak extra GiB", "pairing ms"])
    if not args.tiny:
        write_json(args.out, {"environment": environment(), "results": results})


if __name__ == "__main__":
    main()
