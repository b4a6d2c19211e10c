"""Distillation through KDTrainer on one GPU or sharded over several (FSDP2, FSDP1, DeepSpeed ZeRO-3): tokens/s
and peak memory per GPU, the loss and gradient norm of every step, and the memory of the fused loss itself.

    python -m benchmarks.training.bench_multi_gpu --micro-batches 8 --out runs/multi_1gpu.json  # 1 GPU, no sharding
    accelerate launch --config_file examples/accelerate_fsdp2.yaml -m benchmarks.training.bench_multi_gpu \\
        --micro-batches 4 --out runs/multi_fsdp2.json                                             # 2 GPUs, same batch
    accelerate launch --config_file examples/accelerate_fsdp2.yaml -m benchmarks.training.bench_multi_gpu \\
        --teacher 70b --meta-init --micro-batches 1 2 --out runs/multi_70b.json                   # 70B teacher
    python -m benchmarks.training.bench_multi_gpu --summarize runs/multi_*.json --out runs/multi_summary.json

Random-initialised Llama models from configs (bench_train_step's shapes: a Llama-3.2-1B-shaped student, fp32
master weights, and a Llama-3.1-8B-shaped bf16 teacher; `--teacher 70b` is Llama-3.1-70B-shaped), sequence 4096,
bf16 mixed precision, AdamW, gradient checkpointing on the student, beta 0.5, every kernel on. Each process
reads its own micro-batch of the same global batch (a sequential sampler), so a 2-GPU run at micro-batch 4 and a
1-GPU run at micro-batch 8 see the same rows at every step and must log the same losses and gradient norms.

`--meta-init` never materialises the whole teacher: it is built on the meta device, sharded with FSDP2,
allocated shard by shard (`to_empty`) and initialised per shard. The fused loss is timed and its extra memory
measured inside every step, with the shapes of both lm_head weights it received (whole, not shards).
`--tiny` runs the same code on CPU processes (gloo) with tiny shapes: a smoke test, no figures.
`benchmarks/run_gpu_x2.sh` runs the whole 2-GPU sequence, one JSON file per run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile
import time

import torch
from torch.utils.data import SequentialSampler

from ..common import environment, print_table, write_json
from ..common.multi_gpu import StepProbe, allow_fsdp_on_cpu, end_distributed, make_callback
from ..common.train_step import SHAPES, build

STUDENTS = {
    "1b": SHAPES["llama"][0],
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "tiny": SHAPES["tiny"][0],
}  # fmt: skip
TEACHERS = {
    "8b": SHAPES["llama"][1],
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "tiny": SHAPES["tiny"][1],
}  # fmt: skip


# ------------------------------------------------------------------------------------------------ models
def build_sharded_random(shape: dict, device: torch.device, dtype: torch.dtype, seed: int):
    """A random model that is never whole in memory: built on the meta device, FSDP2-sharded (decoder layers,
    then the root, as KDTrainer shards), then each process allocates and initialises only its shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from liger_patch_kd import distributed

    model = build(shape, "meta", dtype, seed)
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    layers = distributed.decoder_layer_types(model)
    distributed.fsdp2_shard(model, layers, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=dtype))
    model.to_empty(device=device)
    rank = torch.distributed.get_rank()
    generator = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p  # the shard itself, not a copy
            if "norm" in name:
                local.fill_(1.0)
            else:
                local.normal_(0.0, model.config.initializer_range, generator=generator)
        for module in model.modules():  # to_empty left the rotary tables (non-persistent buffers) uninitialised
            if hasattr(module, "inv_freq"):
                fresh = type(module)(config=module.config)
                for name, buffer in fresh.named_buffers(recurse=False):
                    getattr(module, name).copy_(buffer)
    return model


# ------------------------------------------------------------------------------------------------- a run
def run(args, micro_batch: int, student, teacher, device, init_s: dict) -> tuple[dict, dict]:
    from liger_patch_kd.models.signals import base as signal_losses
    from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments

    class SequentialKDTrainer(KDTrainer):
        def _get_train_sampler(self, *unused, **unused_kw):
            return SequentialSampler(self.train_dataset)  # the same global batch at every step, any world size

    world = int(os.environ.get("WORLD_SIZE", "1"))
    steps = args.warmup + args.steps
    vocab = student.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, vocab, (world * micro_batch * steps, args.seq), generator=g)
    dataset = [{"input_ids": r, "labels": r} for r in rows]
    probe = StepProbe(device)
    # a live teacher's loss is called by the signals' linear_terms (models/signals/base.py)
    original_loss = signal_losses.fused_linear_jsd
    signal_losses.fused_linear_jsd = probe.wrap_loss(original_loss)
    try:
        training_args = KDTrainingArguments(
            output_dir=tempfile.mkdtemp(prefix="bench_multi_"), max_steps=steps,
            per_device_train_batch_size=micro_batch, learning_rate=1e-5, lr_scheduler_type="constant",
            max_grad_norm=1.0, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
            bf16=not args.tiny and args.student_dtype == "float32",
            dataloader_num_workers=0, dataloader_pin_memory=probe.cuda, use_kd_patch=True,
            kd_beta=0.5, seed=0, kd_teacher_precision=args.teacher_precision, **_recompute_student(),
            kd_recompute_layers=args.recompute_layers,
        )  # fmt: skip
        trainer = SequentialKDTrainer(
            model=student, teacher_model=teacher, args=training_args, train_dataset=dataset,
            data_collator=lambda batch: {k: torch.stack([b[k] for b in batch]) for k in batch[0]},
            callbacks=[make_callback(probe)],
        )  # fmt: skip
        memory_at_start = torch.cuda.memory_allocated() / 2**30 if probe.cuda else None
        trainer.train()
    finally:
        signal_losses.fused_linear_jsd = original_loss
    timed = probe.step_s[args.warmup :]
    per_step_tokens = micro_batch * args.seq
    loss_timed = probe.loss_calls[args.warmup :] or probe.loss_calls
    mine = dict(
        rank=int(os.environ.get("RANK", "0")),
        gpu=torch.cuda.get_device_name() if probe.cuda else "cpu",
        step_s=probe.step_s,
        tokens_per_s=per_step_tokens * len(timed) / sum(timed),
        peak_GiB=probe.peak_bytes() / 2**30,
        reserved_GiB=torch.cuda.max_memory_reserved() / 2**30 if probe.cuda else None,
        models_GiB=memory_at_start,
        loss_calls=len(probe.loss_calls),
        loss_ms=_mean([c.get("ms") for c in loss_timed]),
        loss_extra_GiB=max((c.get("extra_GiB") or 0.0) for c in probe.loss_calls) if probe.loss_calls else None,
        loss_extra_beyond_grads_GiB=max((c.get("extra_beyond_grads_GiB") or 0.0) for c in probe.loss_calls)
        if probe.loss_calls
        else None,
        lm_heads_seen_by_loss=probe.loss_calls[0] if probe.loss_calls else None,
        student_wrapped_as=_wrapping(trainer.model_wrapped),
        teacher_wrapped_as=_wrapping(trainer.teacher_model),
    )
    ranks = _gather(mine)
    launch = describe_launch(trainer.accelerator)
    vocab_bytes = 4 * vocab
    rows_per_gpu = micro_batch * args.seq
    return dict(
        micro_batch_per_gpu=micro_batch,
        global_batch=micro_batch * world,
        seq=args.seq,
        world_size=world,
        warmup_steps=args.warmup,
        timed_steps=args.steps,
        tokens_per_s_per_gpu=_mean([r["tokens_per_s"] for r in ranks]),
        tokens_per_s_total=sum(r["tokens_per_s"] for r in ranks),
        step_s_median=sorted(ranks[0]["step_s"][args.warmup :])[len(ranks[0]["step_s"][args.warmup :]) // 2],
        peak_GiB_per_gpu=[round(r["peak_GiB"], 2) for r in ranks],
        loss_extra_GiB_per_gpu=[r["loss_extra_GiB"] for r in ranks],
        # what the plain loss would hold for the same rows: both models' fp32 logits, before softmax and grads
        materialised_logits_GiB=2 * rows_per_gpu * vocab_bytes / 2**30,
        lm_heads_whole=all(
            r["lm_heads_seen_by_loss"]
            and not r["lm_heads_seen_by_loss"]["sharded"]
            and r["lm_heads_seen_by_loss"]["student_weight"][0] == vocab
            and r["lm_heads_seen_by_loss"]["teacher_weight"][0] == vocab
            for r in ranks
        ),  # fmt: skip
        log=probe.logs,
        init_s=init_s,
        per_rank=ranks,
    ), launch


def _recompute_student() -> dict:
    """Gradient checkpointing on the student, non-reentrant, under the argument name this transformers has
    (5.2x renamed gradient_checkpointing to activation_checkpointing)."""
    from transformers import TrainingArguments

    name = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ else None
    name = name or "gradient_checkpointing"
    return {name: True, f"{name}_kwargs": {"use_reentrant": False}}


def _wrapping(model) -> str:
    """The wrapper class and how many of its parameters are sharded (DTensor, FSDP1 flat or ZeRO-3 partitioned)."""
    params = list(model.parameters())
    sharded = sum(type(p).__name__ in ("DTensor", "FlatParameter") or hasattr(p, "ds_id") for p in params)
    return f"{type(model).__name__}: {sharded}/{len(params)} parameters sharded"


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _gather(obj) -> list:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        out = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(out, obj)
        return out
    return [obj]


def launch_kind() -> str:
    """ "fsdp2", "fsdp1", "deepspeed" or "none", from the variables accelerate launch sets (read before any
    accelerate state exists: creating one here would fix its mixed precision before the Trainer's)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "fsdp" + os.environ.get("FSDP_VERSION", "1")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return "deepspeed"
    return "none"


def describe_launch(accelerator) -> dict:
    """What ran: launcher, world size, distributed type and plugin settings, versions."""
    import accelerate

    state = accelerator.state
    info = dict(
        launcher=os.environ.get("BENCH_LAUNCHER", "python"),
        world_size=state.num_processes,
        distributed_type=str(state.distributed_type),
        mixed_precision=str(state.mixed_precision),
        NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE"),
        accelerate=accelerate.__version__,
    )
    if getattr(state, "fsdp_plugin", None) is not None:
        plugin = state.fsdp_plugin
        info.update(fsdp_version=plugin.fsdp_version, reshard_after_forward=str(plugin.reshard_after_forward),
                    use_orig_params=getattr(plugin, "use_orig_params", None))  # fmt: skip
    if getattr(state, "deepspeed_plugin", None) is not None:
        import deepspeed

        info.update(deepspeed=deepspeed.__version__, zero_stage=state.deepspeed_plugin.zero_stage)
    return info


# ------------------------------------------------------------------------------------------------ summary
def summarize(paths: list[str]) -> dict:
    """One table over the runs: tokens/s per GPU against the 1-GPU run, memory, and how far each run's losses
    and gradient norms are from the 1-GPU run's on the same global batches."""
    runs = []
    for path in sorted(set(paths)):
        with open(path) as f:
            data = json.load(f)
        if "results" in data:
            models = {k: data.get(k) for k in ("student", "teacher", "meta_init")}
            runs += [dict(label=data["label"], models=models, **r) for r in data["results"]]

    def same_work(a, b):  # same models (weights), sequence and global batch: the same losses are expected
        return all(a[k] == b[k] for k in ("models", "seq", "global_batch"))

    rows = []
    for r in runs:
        base = next((b for b in runs if b["world_size"] == 1 and same_work(b, r)), None)
        row = dict(label=r["label"], gpus=r["world_size"], micro_batch=r["micro_batch_per_gpu"],
                   global_batch=r["global_batch"], tokens_per_s_per_gpu=r["tokens_per_s_per_gpu"],
                   peak_GiB=max(r["peak_GiB_per_gpu"]),
                   loss_extra_GiB=max([x for x in r["loss_extra_GiB_per_gpu"] if x is not None], default=None),
                   lm_heads_whole=r["lm_heads_whole"])  # fmt: skip
        if base is not None and r is not base:
            row["vs_1gpu"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
            pairs = list(zip(base["log"], r["log"]))
            row["loss_max_rel_diff"] = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in pairs)
            norms = [(a["grad_norm"], b["grad_norm"]) for a, b in pairs if a["grad_norm"] and b["grad_norm"]]
            row["grad_norm_max_rel_diff"] = max((abs(a - b) / a for a, b in norms), default=None)
        rows.append(row)
    columns = ["label", "gpus", "micro_batch", "global_batch", "tokens_per_s_per_gpu", "vs_1gpu", "peak_GiB",
               "loss_extra_GiB", "lm_heads_whole", "loss_max_rel_diff", "grad_norm_max_rel_diff"]  # fmt: skip
    return dict(rows=rows, table=print_table(rows, columns), sources=sorted(set(paths)))


# ----------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/multi_gpu.json")
    parser.add_argument("--label", default=None, help="name of the run in the summary (default: from --out)")
    parser.add_argument("--student", choices=sorted(STUDENTS), default="1b")
    parser.add_argument("--teacher", choices=sorted(TEACHERS), default="8b")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4], help="per GPU; several: one run each")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    parser.add_argument(
        "--student-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="float32: fp32 master weights + bf16 autocast; bfloat16: bf16 weights, no autocast",
    )
    parser.add_argument("--teacher-precision", choices=["bf16", "fp8"], default="bf16", help="fp8: an FP8 teacher")
    parser.add_argument("--meta-init", action="store_true", help="build the teacher sharded (FSDP2 only)")
    parser.add_argument(
        "--recompute-layers", type=int, default=None, help="only the first N student layers recompute (default: all)"
    )
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with tiny shapes")
    parser.add_argument("--summarize", nargs="+", default=None, help="JSON files of earlier runs: print a table")
    args = parser.parse_args(argv)
    if args.summarize:
        write_json(args.out, summarize([p for pattern in args.summarize for p in glob.glob(pattern)]))
        return
    if args.tiny:
        args.student, args.teacher, args.seq = "tiny", "tiny", min(args.seq, 32)
        if not torch.cuda.is_available() and "LOCAL_RANK" in os.environ:  # launched by accelerate or torchrun
            allow_fsdp_on_cpu()
    if "LOCAL_RANK" not in os.environ and torch.cuda.device_count() > 1:
        raise ValueError(
            f"{torch.cuda.device_count()} GPUs visible to a single process: the Trainer would wrap the student in "
            f"DataParallel. Run on one GPU with CUDA_VISIBLE_DEVICES=0, or launch one process per GPU "
            f"(accelerate launch --num_processes N)"
        )
    from accelerate.state import PartialState

    state = PartialState()  # initialises the process group under accelerate launch / torchrun
    device = state.device
    dtype = torch.float32 if args.tiny else torch.bfloat16
    kind = launch_kind()
    if args.meta_init and kind != "fsdp2":
        raise ValueError(f"--meta-init shards the teacher with FSDP2; this launch is {kind}")
    if len(args.micro_batches) > 1 and kind not in ("fsdp2", "none"):
        raise ValueError("several --micro-batches in one launch need FSDP2 or one GPU (FSDP1 / DeepSpeed wrap once)")
    init_s = {}
    t0 = time.perf_counter()
    if args.meta_init:
        teacher = build_sharded_random(TEACHERS[args.teacher], device, dtype, seed=2)
    else:
        teacher = build(TEACHERS[args.teacher], device, dtype, seed=2)
    teacher.eval().requires_grad_(False)
    teacher.config.use_cache = False
    probe_sync(device)
    init_s["teacher"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    # fp32 master weights and bf16 autocast (the default), or bf16 weights throughout as bench_train_step's loop
    student_dtype = torch.float32 if args.tiny or args.student_dtype == "float32" else torch.bfloat16
    student = build(STUDENTS[args.student], device, student_dtype, seed=1)
    student.config.use_cache = False
    init_s["student"] = time.perf_counter() - t0
    results = []
    label = args.label or os.path.splitext(os.path.basename(args.out))[0]
    for mb in args.micro_batches:
        result, launch = run(args, mb, student, teacher, device, init_s)
        results.append(result)
        if state.is_main_process:  # after each micro-batch, so a timeout loses only the one running
            payload = dict(label=label, environment={**environment(), **launch}, student=args.student,
                           student_dtype=args.student_dtype, teacher_precision=args.teacher_precision,
                           recompute_layers=args.recompute_layers,
                           teacher=args.teacher, meta_init=args.meta_init, results=results)  # fmt: skip
            write_json(args.out, payload)
            r = results[-1]
            print(f"{label}: mb {mb}/GPU x {r['world_size']}: {r['tokens_per_s_per_gpu']:.0f} tokens/s per GPU, "
                  f"peak {r['peak_GiB_per_gpu']} GiB, fused loss +{r['loss_extra_GiB_per_gpu']} GiB, "
                  f"lm_heads whole: {r['lm_heads_whole']}, losses {[x['loss'] for x in r['log']]}",
                  flush=True)  # fmt: skip
    end_distributed()  # the group torn down before interpreter exit (see its docstring)


def probe_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
