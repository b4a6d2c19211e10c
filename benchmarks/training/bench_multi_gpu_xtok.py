"""Cross-tokenizer distillation through KDTrainer on one process or sharded over several (FSDP2, DDP): the loss and
gradient norm of every step, tokens/s per process, and how each model was wrapped.

    python -m benchmarks.training.bench_multi_gpu_xtok --micro-batch 8 --out runs/xtok_1gpu.json  # 1 process
    accelerate launch --config_file examples/accelerate_fsdp2.yaml -m benchmarks.training.bench_multi_gpu_xtok \\
        --micro-batch 4 --out runs/xtok_fsdp2.json                                                      # 2 GPUs
    python -m benchmarks.training.bench_multi_gpu_xtok --compare runs/xtok_1gpu.json runs/xtok_fsdp2.json  # the table

The demo's tokenizers (a byte-level BPE student, a character-level teacher: the teacher's tokens are not the
student's) and random-initialised Llama models of the given sizes (a wider teacher), prompt / completion rows cut
from the packaged corpus. Each process reads its own micro-batch of the same global batch (a sequential sampler),
so 2 processes at micro-batch 4 and 1 at micro-batch 8 train on the same rows and must log the same losses and
gradient norms. On a CPU, under accelerate launch, the processes talk over gloo (bench_multi_gpu's tiny mode).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from torch.utils.data import SequentialSampler

from ..common import environment, print_table, write_json
from ..common.multi_gpu import StepProbe, allow_fsdp_on_cpu, end_distributed, make_callback


def rows(count: int, length: int = 90) -> list[dict]:
    """prompt / completion rows: consecutive windows of the corpus, the first third of each the prompt."""
    from liger_patch_kd.demo import load_corpus

    text = load_corpus()
    windows = [text[i * length : (i + 1) * length] for i in range(count)]
    return [{"prompt": w[: length // 3], "completion": w[length // 3 :]} for w in windows]


def run(args) -> dict:
    from liger_patch_kd.demo import build_model, load_corpus
    from liger_patch_kd.demo.cross_tokenizer import CharTokenizerWithOffsets, train_bpe_tokenizer
    from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments

    class SequentialKDTrainer(KDTrainer):
        def _get_train_sampler(self, *unused, **unused_kw):
            return SequentialSampler(self.train_dataset)  # the same global batch at every step, any world size

    from accelerate.state import PartialState

    device = PartialState().device  # initialises the process group under accelerate launch / torchrun
    world = int(os.environ.get("WORLD_SIZE", "1"))
    char = CharTokenizerWithOffsets(load_corpus())
    bpe = train_bpe_tokenizer(load_corpus()[:8000], 300)
    student = build_model(bpe.get_vocab_size(), args.hidden, args.layers, seed=1, device=device)
    teacher = build_model(len(char), 2 * args.hidden, args.layers, seed=2, device=device).eval().requires_grad_(False)
    probe = StepProbe(device)
    training_args = KDTrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="bench_xtok_"), max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch, learning_rate=1e-3, lr_scheduler_type="constant",
        max_grad_norm=1.0, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, bf16=args.bf16,
        dataloader_num_workers=0,
        remove_unused_columns=False, seed=0, use_kd_patch=True, kd_cross_tokenizer_loss="hybrid", kd_uld_top_k=32,
        kd_hard_weight=0.2, kd_teacher_tokenizer="given as teacher_tokenizer",
    )  # fmt: skip
    trainer = SequentialKDTrainer(
        model=student, teacher_model=teacher, args=training_args, processing_class=bpe, teacher_tokenizer=char,
        train_dataset=rows(world * args.micro_batch * args.steps), callbacks=[make_callback(probe)],
    )  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    tokens = sum(len(r["prompt"]) + len(r["completion"]) for r in rows(args.micro_batch * args.steps))  # characters
    return dict(
        world_size=world, micro_batch=args.micro_batch, global_batch=world * args.micro_batch, steps=args.steps,
        bf16=args.bf16, log=probe.logs, seconds=time.perf_counter() - start,
        characters_per_s_per_process=tokens / max(sum(probe.step_s), 1e-9),
        student_wrapped_as=_wrapping(trainer.model_wrapped), teacher_wrapped_as=_wrapping(trainer.teacher_model),
    )  # fmt: skip


def _wrapping(model) -> str:
    """The wrapper class and how many of its parameters are sharded (DTensor)."""
    params = list(model.parameters())
    return f"{type(model).__name__}: {sum(type(p).__name__ == 'DTensor' for p in params)}/{len(params)} sharded"


def compare(paths: list[str]) -> dict:
    """The runs against the one-process run of the same global batch: the largest relative differences."""
    runs = [json.load(open(p)) for p in paths]
    base = next(r for r in runs if r["world_size"] == 1)
    table = []
    for r in runs:
        pairs = list(zip(base["log"], r["log"], strict=True))
        table.append(dict(
            world_size=r["world_size"], micro_batch=r["micro_batch"], student=r["student_wrapped_as"],
            characters_per_s_per_process=r["characters_per_s_per_process"],
            loss_max_rel_diff=max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in pairs),
            grad_norm_max_rel_diff=max(abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] for a, b in pairs),
        ))  # fmt: skip
    columns = ["world_size", "micro_batch", "student", "characters_per_s_per_process", "loss_max_rel_diff",
               "grad_norm_max_rel_diff"]  # fmt: skip
    return dict(rows=table, table=print_table(table, columns), sources=paths)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/xtok.json")
    parser.add_argument("--micro-batch", type=int, default=4, help="per process")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=32, help="the student's; the teacher's is twice as wide")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (fp32 master weights)")
    parser.add_argument("--compare", nargs="+", default=None, help="JSON files of earlier runs: print a table")
    args = parser.parse_args(argv)
    if args.compare:
        write_json(args.out, compare(args.compare))
        print(json.load(open(args.out))["table"])
        return
    if not torch.cuda.is_available() and "LOCAL_RANK" in os.environ:  # accelerate launch on a CPU: gloo
        allow_fsdp_on_cpu()
    result = run(args)
    if int(os.environ.get("RANK", "0")) == 0:
        write_json(args.out, dict(environment=environment(), results=[result], **result))
        losses = [x["loss"] for x in result["log"]]
        print(f"xtok: {result['world_size']} x mb {args.micro_batch}: losses {losses}, student "
              f"{result['student_wrapped_as']}, teacher {result['teacher_wrapped_as']}", flush=True)  # fmt: skip
    end_distributed()  # the group torn down before interpreter exit (see its docstring)


if __name__ == "__main__":
    main()
