"""The one-GPU training step the step benchmarks share (bench_train_step, bench_served_teacher, bench_privileged,
bench_fp8_teacher, bench_multi_gpu, profile_step): the Llama shapes, the models, each method's step and one timed
row."""

from __future__ import annotations

import gc
import re
import time

import torch

from liger_patch_kd import reference as R
from liger_patch_kd.models import apply_kd_patch_to_llama, quantize_teacher_fp8, revert_kd_patch
from liger_patch_kd.models.recompute import limit_recompute

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


def loss_options(name: str) -> dict:
    """The KDLossConfig options a row's name asks for (only those it turns on)."""
    if "fp8 logits (both)" in name:
        return {"teacher_logits_fp8": True, "student_logits_fp8": True}
    return {"teacher_logits_fp8": True} if "fp8 logits" in name else {}


def recomputed_layers(name: str) -> int | None:
    """The student layers a row recomputes ("recompute 10/16": the first 10), None for all of them."""
    found = re.search(r"recompute (\d+)/", name)
    return int(found.group(1)) if found else None


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
