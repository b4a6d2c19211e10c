"""Where one online distillation step spends its GPU time: a PyTorch profiler summary of the patched step.

    python -m benchmarks.training.profile_step --out runs/profile_step.json
    python -m benchmarks.training.profile_step --method "liger_patch_kd fp8 teacher, fp8 logits (both), recompute 10/16"

Same setup as bench_train_step (Llama-1B-shaped student with gradient checkpointing, Llama-8B-shaped teacher,
bf16, sequence 4096, micro-batch 4, every kernel on); `--method` names any of its liger_patch_kd rows (the FP8
ones build their teacher as the table does). Prints the top CUDA kernels and the time per category.
"""

from __future__ import annotations

import argparse
import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

from liger_patch_kd.models import apply_kd_patch_to_llama

from ..common import environment, write_json
from ..common.train_step import FP8_ROW, SHAPES, build, fp8_copy, make_optimizer, method_step, prepare_student

CATEGORIES = [  # first match wins
    ("fused KD loss kernel", r"_jsd_chunk|_topk_chunk"),
    ("FP8 quantisation", r"_quantize_rows|_gated_quantized|_quantize"),
    ("FP8 matmul", r"e4m3|f8f8|fp8|qqtst"),
    ("matmul", r"gemm|nvjet|cutlass|sm90_xmma|cublas|matmul"),
    ("attention", r"flash|fmha|attention|sdpa|efficient"),
    ("our RMSNorm/RoPE/MLP kernels", r"_rms_norm|_gated|_rope"),
    ("optimizer", r"adam|foreach|multi_tensor"),
]


def idle_gaps(prof, top: int = 10) -> tuple[float, list[dict]]:
    """The GPU's idle time between consecutive kernels of the profiled step (ms) and its largest gaps, each with
    the kernels either side: where the host kept the GPU waiting."""
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    gaps, end = [], None
    for before, after in zip(kernels, kernels[1:]):
        end = max(end or before.time_range.end, before.time_range.end)
        if after.time_range.start > end:
            gaps.append(dict(ms=(after.time_range.start - end) / 1e3, before=before.name[:60], after=after.name[:60]))
    gaps.sort(key=lambda g: -g["ms"])
    return sum(g["ms"] for g in gaps), gaps[:top]


def synchronizing_calls(step, opt) -> dict[str, int]:
    """Where one step synchronises the host with the GPU (torch's sync debug mode), by the innermost frame of this
    project or transformers that led there."""
    import traceback
    import warnings

    seen: dict[str, int] = {}

    def record(message, *args, **kwargs):
        ours = [f for f in traceback.extract_stack() if re.search(r"liger_patch_kd|transformers", f.filename)]
        where = "?"
        if ours:
            where = f"{ours[-1].filename.split('site-packages/')[-1]}:{ours[-1].lineno} {ours[-1].line}"
        seen[where] = seen.get(where, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_once(step, opt)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return seen


def host_view(step, opt, trace: str | None) -> dict:
    """Two steps profiled with the host's activity too: how long the host takes to issue a step (if that is
    longer than the GPU's time, the GPU waits) and what the CUDA runtime calls cost it (a cudaMalloc or cudaFree
    from the caching allocator, a stream synchronisation)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            with torch.profiler.record_function("step"):
                run_once(step, opt)
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    steps = [e for e in prof.events() if e.name == "step" and e.device_type.name == "CPU"]
    runtime = {}
    for e in prof.key_averages():
        if re.match(r"cuda|cu[A-Z]", e.key) and e.device_type.name == "CPU":
            runtime[e.key] = dict(count=e.count, ms=e.cpu_time_total / 1e3)
    return dict(
        host_ms_per_step=[(e.time_range.end - e.time_range.start) / 1e3 for e in steps],
        runtime_calls=dict(sorted(runtime.items(), key=lambda kv: -kv[1]["ms"])[:12]),
    )


def memory_phases(student, teacher, step, opt) -> list[dict]:
    """The peak memory within each phase of one step (the student's decoder, the teacher's, the loss, the
    backward, the optimizer) and what stays allocated at its end, in GiB: which phase sets the step's peak."""
    phases = []

    def mark(name: str) -> None:
        torch.cuda.synchronize()
        phases.append(dict(phase=name, peak_GiB=torch.cuda.max_memory_allocated() / 2**30,
                           end_GiB=torch.cuda.memory_allocated() / 2**30))  # fmt: skip
        torch.cuda.reset_peak_memory_stats()

    hooks = [
        student.model.register_forward_hook(lambda *_: mark("student decoder")),
        teacher.model.register_forward_hook(lambda *_: mark("teacher decoder")),
        student.register_forward_hook(lambda *_: mark("loss (the rest of the forward)")),
    ]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    try:
        step()
        mark("backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark("optimizer")
    finally:
        for hook in hooks:
            hook.remove()
    return phases


def run_once(step, opt) -> None:
    step()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="runs/profile_step.json")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--method", default="liger_patch_kd", help="a liger_patch_kd row of bench_train_step")
    parser.add_argument("--teacher-only", action="store_true", help="profile the teacher's decoder forward alone")
    parser.add_argument("--trace", default=None, help="write a Chrome trace of two steps here")
    parser.add_argument("--top", type=int, default=20, help="how many kernels to list")
    args = parser.parse_args()
    if not args.method.startswith("liger_patch_kd"):
        parser.error(f"--method {args.method!r}: only bench_train_step's liger_patch_kd rows are profiled here")
    device, dtype = torch.device("cuda"), torch.bfloat16
    student_cfg, teacher_cfg = SHAPES["llama"]
    if args.method.startswith(FP8_ROW):
        teacher = fp8_copy(teacher_cfg, device, dtype, args.seq, fast_accum="fast accum" in args.method)
    else:
        teacher = build(teacher_cfg, device, dtype, seed=2, max_positions=args.seq).eval().requires_grad_(False)
    teacher.config.use_cache = False
    apply_kd_patch_to_llama(model=teacher)
    student = build(student_cfg, device, dtype, seed=1, max_positions=args.seq)
    prepare_student(args.method, student)
    opt = make_optimizer(student)
    ids = torch.randint(0, student_cfg["vocab_size"], (args.micro_batch, args.seq), device=device)
    step = method_step(args.method, student, teacher, {"input_ids": ids, "labels": ids})
    if args.teacher_only:
        step, opt = torch.no_grad()(lambda: teacher.model(input_ids=ids)), None
    # the first step's phases too: bench_train_step's peak counts it (a first-step allocation is memory a user needs)
    cold = [] if args.teacher_only else memory_phases(student, teacher, step, opt)
    for _ in range(2):
        run_once(step, opt)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    start, reps = time.perf_counter(), 3  # wall time beside GPU time: the difference is the GPU idling
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    for i in range(reps):
        marks[i].record()
        run_once(step, opt)
    marks[-1].record()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / reps * 1e3
    rep_ms = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    after = torch.cuda.memory_stats()  # the caching allocator going back to the driver costs synchronisations
    counts = ("num_device_alloc", "num_device_free", "num_alloc_retries")
    allocator = {k: after.get(k, 0) - before.get(k, 0) for k in counts}
    host = host_view(step, opt, args.trace)
    phases = [] if args.teacher_only else memory_phases(student, teacher, step, opt)
    syncs = synchronizing_calls(step, opt)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_once(step, opt)
        torch.cuda.synchronize()
    idle_ms, gaps = idle_gaps(prof)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0)]
    total = sum(e.self_device_time_total for e in events)
    by_cat: dict[str, float] = {}
    for e in events:
        cat = next((c for c, pattern in CATEGORIES if re.search(pattern, e.key, re.I)), "other elementwise / copies")
        by_cat[cat] = by_cat.get(cat, 0.0) + e.self_device_time_total
    top = sorted(events, key=lambda e: -e.self_device_time_total)[: args.top]
    print(f"GPU time of one step: {total / 1e3:.1f} ms (wall {wall_ms:.1f} ms)")
    for cat, us in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"  {cat:32} {us / 1e3:8.1f} ms  {100 * us / total:5.1f}%")
    print(f"per-step GPU-timeline ms (events): {[round(m, 1) for m in rep_ms]}")
    print(f"allocator over {reps} steps: {allocator}; peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    print(f"host ms to issue a step (profiled): {[round(m, 1) for m in host['host_ms_per_step']]}")
    for name, call in host["runtime_calls"].items():
        print(f"  {call['ms']:8.2f} ms  x{call['count']:<6} {name[:80]}")
    print(f"GPU idle between kernels: {idle_ms:.1f} ms; largest gaps:")
    for g in gaps:
        print(f"  {g['ms']:7.2f} ms  {g['before']} -> {g['after']}")
    for label, steps in (("first step", cold), ("a later step", phases)):
        for phase in steps:
            print(f"  memory, {label}: {phase['phase']:32} peak {phase['peak_GiB']:6.2f} GiB, "
                  f"{phase['end_GiB']:6.2f} at its end")  # fmt: skip
    print(f"synchronising calls in one step: {sum(syncs.values())}")
    for where, count in sorted(syncs.items(), key=lambda kv: -kv[1]):
        print(f"  x{count:<4} {where[:150]}")
    print("top kernels:")
    for e in top:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms  x{e.count:<5} {e.key[:100]}")
    write_json(
        args.out,
        dict(
            environment=environment(),
            method=args.method,
            micro_batch=args.micro_batch,
            seq=args.seq,
            teacher_only=args.teacher_only,
            total_ms=total / 1e3,
            wall_ms=wall_ms,
            rep_ms=rep_ms,
            allocator=allocator,
            memory_phases=dict(first_step=cold, later_step=phases),
            host=host,
            idle_ms=idle_ms,
            largest_gaps=gaps,
            synchronising_calls=syncs,
            categories_ms={k: v / 1e3 for k, v in by_cat.items()},
            top=[dict(kernel=e.key, ms=e.self_device_time_total / 1e3, count=e.count) for e in top],
        ),
    )


if __name__ == "__main__":
    main()
