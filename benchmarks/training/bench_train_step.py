"""One distillation training step, end to end, on one GPU: tokens/s and peak memory against the alternatives.

    python -m benchmarks.training.bench_train_step --out runs/bench_train_step.json

Random-initialised models from configs (no downloads): a Llama-3.2-1B-shaped student (tied embeddings) and a
Llama-3.1-8B-shaped teacher, bf16, sdpa, AdamW (fused on CUDA: HF Trainer's default), sequence 4096, gradient
checkpointing on the student unless a row says otherwise. For each micro-batch, in one run:
  plain HF            both models produce logits, reference.generalized_jsd on them
  trl/liger           decoder hidden states into Liger's chunked fused JSD (compiled), TRL's way
  trl/liger+kernels   the same plus Liger's RoPE / RMSNorm / SwiGLU on the student
  trl/liger+kernels both  ... and on the teacher: the best a Liger user can do, as this project patches both
  liger_patch_kd      apply_kd_patch_to_llama with every kernel on student and teacher, the patched forward
                      with teacher_model=
  ... no recompute    the same without gradient checkpointing (the flat-memory loss leaves the room)
  ... fp8 teacher     the same with the teacher quantised by quantize_teacher_fp8 (a second copy of it; the
                      shared bf16 teacher waits in host memory while rows with their own copy run)
  ... recompute 10/16 the FP8 row with only the first 10 student layers recomputed: the memory the FP8 teacher
                      frees goes to keeping activations
  ... fp8 logits      the FP8 teacher with its logit product in the loss in FP8 too (teacher_logits_fp8)
  ... fp8 logits (both), recompute k/16   both logit products in FP8 (student_logits_fp8 too) and k of the 16
                      student layers recomputed: the fastest configuration within Liger's best row's memory
  ... fast accum, ... the same with the teacher's decoder products accumulated fast (fp8_fast_accum)
  trl/liger+kernels both, torchao fp8 teacher   Liger's kernels on both models and the teacher's decoder quantised
                      by torchao (Float8DynamicActivationFloat8WeightConfig, PerRow): what a Liger user would do
  offline top-64      the patched forward against top-64 teacher log-probs, no teacher in memory
  offline ... (store) the same read from a store on disk through a shuffling 2-worker DataLoader
  KDTrainer off-/on-policy (bench_onpolicy)   the on-policy issue's rows at their own shape (8 rows of 512 + 512
                      tokens per micro-batch, accumulation 8): tokens_per_s there counts scored (completion)
                      tokens, generated ones included for on-policy
`--tiny` runs the same code on CPU with tiny shapes (a smoke test, no figures). Long contexts: `--seq 16384 32768
--micro-batches 1`. Every row starts from freshly reset peak-memory statistics. Liger-Kernel and torchao are
imported only by their rows, which are skipped with the reason printed when they are absent.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

import torch

from ..common import environment, print_table, write_json
from ..common.train_step import (
    FP8_BEST_ROWS,
    FP8_FAST_ROWS,
    FP8_LOGITS_ROW,
    FP8_ROW,
    FP8_SELECTIVE_ROW,
    SHAPES,
    STORE_ROW,
    TOP_K,
    build,
    fp8_copy,
    run_one,
)

TORCHAO_ROW = "trl/liger+kernels both, torchao fp8 teacher"
# the on-policy issue's rows, through KDTrainer at bench_onpolicy's shapes (its child process, its defaults)
ONPOLICY_ROWS = {
    "KDTrainer off-policy (bench_onpolicy)": "off-policy",
    "KDTrainer on-policy (bench_onpolicy)": "on-policy",
}


def torchao_missing() -> str | None:
    try:
        import liger_kernel  # noqa: F401
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_  # noqa: F401
    except ImportError as e:
        return f"{TORCHAO_ROW!r} skipped: Liger-Kernel and torchao are both needed ({e})"
    return None


def torchao_copy(shape: dict, device, dtype, seq: int):
    """The teacher again (same seed), Liger's kernels on it, its decoder's linears quantised by torchao (per-row FP8,
    dynamic activations); lm_head stays bf16, as Liger's loss reads its weight."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    teacher = build(shape, device, dtype, seed=2, max_positions=seq).eval().requires_grad_(False)
    teacher.config.use_cache = False
    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=False, model=teacher)  # fmt: skip
    quantize_(teacher.model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return teacher


def onpolicy_row(name: str, tiny: bool) -> dict:
    """A bench_onpolicy row (KDTrainer, bf16, 8 rows of 512 prompt + 512 completion tokens per micro-batch,
    accumulation 8, one warm-up and one timed step) in its own process; tokens_per_s is its scored (completion)
    tokens per second, which for the on-policy row includes generating them."""
    from ..common import run_row_in_child
    from ..common.onpolicy import SHAPE_KEYS

    shape = argparse.Namespace(prompt=512, completion=512, micro_batch=8, accumulation=8, steps=1, tiny=tiny)
    if tiny:
        shape.prompt, shape.completion, shape.micro_batch, shape.accumulation = 8, 8, 2, 2
    result = run_row_in_child("benchmarks.onpolicy.bench_onpolicy", ONPOLICY_ROWS[name], shape, SHAPE_KEYS)
    row = dict(method=name, micro_batch=shape.micro_batch, seq=shape.prompt + shape.completion)
    if "error" in result:
        return {**row, "tokens_per_s": f"error: {result['error'][:80]}"}
    return {**row, "tokens_per_s": result["scored_tokens_per_s"], "step_s": result["step_s"],
            "generate_s": result["generate_s"], "peak_GiB": result["peak_GiB"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_train_step.json")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096], help="one or more sequence lengths")
    parser.add_argument("--shapes", nargs="+", default=["llama", "qwen-vocab"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with tiny shapes")
    parser.add_argument("--no-fp8", action="store_true", help="leave out the FP8-teacher row (GPUs before Ada)")
    parser.add_argument("--methods", nargs="+", default=None, help="a subset of the rows, by name")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shape_names = ["tiny"] if args.tiny else args.shapes
    seqs = [32] if args.tiny else args.seq
    notes = []
    try:
        import liger_kernel  # noqa: F401

        liger = ["trl/liger", "trl/liger+kernels", "trl/liger+kernels both"]
    except ImportError as e:
        liger = []
        notes.append(f"Liger-Kernel not importable ({e}): its rows are skipped")
    torchao = [] if args.tiny or torchao_missing() else [TORCHAO_ROW]
    if not args.tiny and torchao_missing():
        notes.append(torchao_missing())
    if args.tiny:
        liger = []
    fp8_rows = [FP8_ROW, FP8_SELECTIVE_ROW, FP8_LOGITS_ROW, *FP8_BEST_ROWS, *FP8_FAST_ROWS]
    methods = [
        "plain HF",
        *liger[:1],
        "liger_patch_kd",
        "liger_patch_kd no recompute",
        *([] if args.no_fp8 else fp8_rows),
        f"offline top-{TOP_K}",
        STORE_ROW,
        *ONPOLICY_ROWS,
        *liger[1:],  # last: Liger's patch of the teacher cannot be undone
        *([] if args.no_fp8 else torchao),  # its own teacher copy, patched by Liger as well
    ]
    if args.methods:
        unknown = sorted(set(args.methods) - set(methods))
        if unknown:
            notes.append(f"--methods not run (unknown here, or skipped above): {unknown}")
        methods = [m for m in methods if m in args.methods]
    for note in notes:
        print(f"note: {note}", flush=True)
    rows = []
    for shape in shape_names:
        teacher = build(SHAPES[shape][1], device, dtype, seed=2, max_positions=max(seqs)).eval().requires_grad_(False)
        teacher.config.use_cache = False
        micro_batches = args.micro_batches if shape in ("llama", "tiny") else [4]
        for name in methods:
            if name == TORCHAO_ROW:
                row_teacher = torchao_copy(SHAPES[shape][1], device, dtype, max(seqs))
            elif name.startswith(FP8_ROW):
                row_teacher = fp8_copy(SHAPES[shape][1], device, dtype, max(seqs), fast_accum="fast accum" in name)
            else:
                row_teacher = teacher
            # a row with its own teacher copy is measured without the shared bf16 teacher on the GPU: its peak
            # memory is what a user of that configuration holds (one teacher), not two teachers
            teacher.to("cpu" if row_teacher is not teacher else device)
            for seq in seqs:
                failed = False
                for mb in micro_batches:
                    if failed:  # a larger micro-batch than one that ran out of memory will too
                        rows.append(dict(shape=shape, method=name, micro_batch=mb, seq=seq, tokens_per_s="OOM"))
                        continue
                    if device.type == "cuda":  # every row's peak is its own
                        gc.collect()
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                    if name in ONPOLICY_ROWS:
                        if mb != micro_batches[0] or seq != seqs[0]:
                            continue  # one shape of its own
                        row = onpolicy_row(name, args.tiny)
                    elif name == STORE_ROW:
                        from ..common.offline import store_row

                        with tempfile.TemporaryDirectory() as workdir:
                            row = store_row(SHAPES[shape], mb, seq, device, dtype, args.warmup, args.reps,
                                            Path(workdir))  # fmt: skip
                    else:
                        row = run_one(name, SHAPES[shape], mb, seq, device, dtype, row_teacher, args.warmup, args.reps)
                    row["shape"] = shape
                    rows.append(row)
                    failed = row["tokens_per_s"] == "OOM" or str(row["tokens_per_s"]).startswith("error")
            del row_teacher
        del teacher
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(
        f"\nsequence {', '.join(map(str, seqs))}, bf16, AdamW; student gradient checkpointing unless 'no recompute'"
        + "".join(f"; {n}" for n in notes)
    )
    table = print_table(rows, ["shape", "method", "seq", "micro_batch", "tokens_per_s", "peak_GiB", "loss"])
    write_json(args.out, dict(environment=environment(), notes=notes, rows=rows, table=table))


if __name__ == "__main__":
    main()
