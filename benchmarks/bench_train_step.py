"""One distillation training step, end to end, on one GPU: tokens/s and peak memory against the alternatives.

    python -m benchmarks.bench_train_step --out runs/bench_train_step.json

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
import re
import tempfile
import time
from pathlib import Path

import torch

from liger_patch_kd import reference as R
from liger_patch_kd.models import apply_kd_patch_to_llama, quantize_teacher_fp8, revert_kd_patch
from liger_patch_kd.models.recompute import limit_recompute

from .common import environment, print_table, write_json

SHAPES = {
    # name: (student kwargs, teacher kwargs); both LlamaConfig
    "llama": (
        dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
        dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    ),
    "qwen-vocab": (  # Qwen's 151936 vocabulary on the same bodies
        dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
             num_key_value_heads=8, vocab_size=151936, tie_word_embeddings=True, head_dim=128),
        dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=151936, head_dim=128),
    ),
    "tiny": (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
        dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512),
    ),
}  # fmt: skip
TOP_K = 64


def build(kwargs: dict, device, dtype, seed: int, max_positions: int = 8192):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(max_position_embeddings=max(8192, max_positions), attn_implementation="sdpa", **kwargs)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model


FP8_ROW = "liger_patch_kd fp8 teacher"
STORE_ROW = f"offline top-{TOP_K} (store, shuffled, 2 workers)"
FP8_SELECTIVE_ROW = f"{FP8_ROW}, recompute 10/16"
FP8_LOGITS_ROW = f"{FP8_ROW}, fp8 logits"
# the FP8 teacher frees ~8 GiB of weights: spent on activations (fewer layers recomputed) with both logit
# products in FP8 as well, the fastest configuration within the memory of Liger's best row
FP8_BEST_ROWS = [f"{FP8_ROW}, fp8 logits (both), recompute {k}/16" for k in (10, 6)]
# ... and the teacher's decoder products with fast accumulation (kd_teacher_precision="fp8_fast_accum")
FP8_FAST_ROWS = [f"{FP8_ROW} fast accum, fp8 logits (both), recompute {k}/16" for k in (10, 9, 8)]
TORCHAO_ROW = "trl/liger+kernels both, torchao fp8 teacher"
# the on-policy issue's rows, through KDTrainer at bench_onpolicy's shapes (its child process, its defaults)
ONPOLICY_ROWS = {
    "KDTrainer off-policy (bench_onpolicy)": "off-policy",
    "KDTrainer on-policy (bench_onpolicy)": "on-policy",
}


def loss_options(name: str) -> dict:
    """The KDLossConfig options a row's name asks for (only those it turns on)."""
    if "fp8 logits (both)" in name:
        return {"teacher_logits_fp8": True, "student_logits_fp8": True}
    return {"teacher_logits_fp8": True} if "fp8 logits" in name else {}


def recomputed_layers(name: str) -> int | None:
    """The student layers a row recomputes ("recompute 10/16": the first 10), None for all of them."""
    found = re.search(r"recompute (\d+)/", name)
    return int(found.group(1)) if found else None


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


def make_optimizer(student) -> torch.optim.Optimizer:
    """Every row's optimizer: AdamW, fused on CUDA (HF Trainer's default, adamw_torch_fused)."""
    return torch.optim.AdamW(student.parameters(), lr=1e-5, fused=next(student.parameters()).is_cuda)


def fp8_copy(shape: dict, device, dtype, seq: int = 8192, fast_accum: bool = False):
    """The teacher again (same seed, same weights), quantised to FP8 for its row."""
    teacher = build(shape, device, dtype, seed=2, max_positions=seq).eval().requires_grad_(False)
    teacher.config.use_cache = False
    summary = quantize_teacher_fp8(teacher, fast_accum=fast_accum)
    print(f"fp8 teacher: {summary.bytes_before / 2**30:.1f} -> {summary.bytes_after / 2**30:.1f} GiB", flush=True)
    return teacher


def onpolicy_row(name: str, tiny: bool) -> dict:
    """A bench_onpolicy row (KDTrainer, bf16, 8 rows of 512 prompt + 512 completion tokens per micro-batch,
    accumulation 8, one warm-up and one timed step) in its own process; tokens_per_s is its scored (completion)
    tokens per second, which for the on-policy row includes generating them."""
    from .bench_onpolicy import SHAPE_KEYS
    from .common import run_row_in_child

    shape = argparse.Namespace(prompt=512, completion=512, micro_batch=8, accumulation=8, steps=1, tiny=tiny)
    if tiny:
        shape.prompt, shape.completion, shape.micro_batch, shape.accumulation = 8, 8, 2, 2
    result = run_row_in_child("benchmarks.bench_onpolicy", ONPOLICY_ROWS[name], shape, SHAPE_KEYS)
    row = dict(method=name, micro_batch=shape.micro_batch, seq=shape.prompt + shape.completion)
    if "error" in result:
        return {**row, "tokens_per_s": f"error: {result['error'][:80]}"}
    return {**row, "tokens_per_s": result["scored_tokens_per_s"], "step_s": result["step_s"],
            "generate_s": result["generate_s"], "peak_GiB": result["peak_GiB"]}  # fmt: skip


def method_step(name: str, student, teacher, batch: dict):
    """A function doing forward + backward for `name` (the optimizer step is added by the caller)."""
    ids, labels = batch["input_ids"], batch["labels"]
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    if name == "plain HF":

        def step():
            logits = student(input_ids=ids).logits
            with torch.no_grad():
                t_logits = teacher(input_ids=ids).logits
            return R.generalized_jsd(logits.float(), t_logits.float(), targets, beta=0.5)

    elif name.startswith("trl/liger"):
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        loss_fn = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.5, compiled=True)

        def step():
            hidden = student.model(input_ids=ids).last_hidden_state
            with torch.no_grad():
                t_hidden = teacher.model(input_ids=ids).last_hidden_state
            return loss_fn(hidden.flatten(0, 1), student.lm_head.weight, t_hidden.flatten(0, 1), teacher.lm_head.weight,
                           targets.flatten())  # fmt: skip

    elif name.startswith("offline"):

        def step():
            return student(
                input_ids=ids,
                labels=labels,
                teacher_token_ids=batch["topk_ids"].to(ids.device, non_blocking=True),
                teacher_logprobs=batch["topk_logprobs"].to(ids.device, non_blocking=True),
            ).loss

    else:

        def step():
            return student(input_ids=ids, labels=labels, teacher_model=teacher).loss

    def full_step():
        loss = step()
        loss.backward()
        # what HF Trainer's training_step hands back: the graph goes with the step. (A loss tensor kept past its
        # backward keeps what its graph holds; for the fused loss that is the teacher side of the chunk loop, the
        # teacher's hidden states and the quantised heads, until the tensor is dropped.)
        return loss.detach()

    return full_step


def prepare_student(name: str, student):
    if name.startswith("trl/liger+kernels"):
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False, model=student)  # fmt: skip
    elif name.startswith("liger_patch_kd") or name.startswith("offline"):
        apply_kd_patch_to_llama(
            model=student, beta=0.5 if not name.startswith("offline") else 0.0, **loss_options(name)
        )
    if "no recompute" not in name:
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        layers = recomputed_layers(name)
        if layers is not None:  # the first layers recompute, the rest keep their activations (as KDTrainer does)
            limit_recompute(student, min(layers, student.config.num_hidden_layers))  # --tiny has 2
    student.config.use_cache = False
    student.train()


def run_one(name, shapes, micro_batch, seq, device, dtype, teacher, warmup, reps) -> dict:
    row = dict(method=name, micro_batch=micro_batch, seq=seq)
    student = build(shapes[0], device, dtype, seed=1, max_positions=seq)
    try:
        prepare_student(name, student)
        if name.startswith("liger_patch_kd"):  # the product patches the teacher's kernels too (KDTrainer does)
            apply_kd_patch_to_llama(model=teacher)
        elif name == "trl/liger+kernels both":  # irreversible: main() runs this row last
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False, model=teacher)  # fmt: skip
    except Exception as e:
        revert_kd_patch(model=teacher)
        row["tokens_per_s"] = f"error: {type(e).__name__}: {str(e)[:80]}"
        print(row, flush=True)
        return row
    opt = make_optimizer(student)
    vocab = shapes[0]["vocab_size"]
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, vocab, (micro_batch, seq), generator=g).to(device)
    batch = {"input_ids": ids, "labels": ids}
    if name.startswith("offline"):  # top-k log-probs arrive from host memory each step, as from a data loader
        logits = torch.randn(micro_batch * seq, TOP_K, generator=g).sort(-1, descending=True).values
        batch["topk_logprobs"] = (
            (torch.log_softmax(logits, -1) - 0.5).to(torch.bfloat16).reshape(micro_batch, seq, TOP_K)
        )
        # distinct ids per row: a random start plus a stride that cannot wrap onto itself within K slots
        start = torch.randint(0, vocab, (micro_batch, seq, 1), generator=g)
        batch["topk_ids"] = ((start + torch.arange(TOP_K) * (vocab // TOP_K - 1)) % vocab).int()
        if device.type == "cuda":
            batch = {k: v.pin_memory() if v.device.type == "cpu" else v for k, v in batch.items()}
    step = method_step(name, student, None if name.startswith("offline") else teacher, batch)
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for i in range(warmup + reps):
            if i == warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
            loss = step()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / reps
        row.update(tokens_per_s=micro_batch * seq / seconds, step_s=seconds, loss=float(loss))
        if device.type == "cuda":
            row["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    except torch.OutOfMemoryError:
        row["tokens_per_s"] = "OOM"
    except Exception as e:  # a method that breaks (e.g. a Liger / transformers mismatch) is reported, not fatal
        import traceback

        traceback.print_exc()
        row["tokens_per_s"] = f"error: {type(e).__name__}: {str(e)[:80]}"
    finally:
        del student, opt, step, batch
        revert_kd_patch(model=teacher)
        revert_kd_patch()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(row, flush=True)
    return row


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
                        from .bench_served_teacher import store_row  # it imports this module

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
