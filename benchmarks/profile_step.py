"""Where one online distillation step spends its GPU time: a PyTorch profiler summary of the patched step.

    python -m benchmarks.profile_step --out runs/profile_step.json

Same setup as bench_train_step (Llama-1B-shaped student with gradient checkpointing, Llama-8B-shaped teacher,
bf16, sequence 4096, micro-batch 4, every kernel on). Prints the top CUDA kernels and the time per category.
"""

from __future__ import annotations

import argparse
import re

import torch
from torch.profiler import ProfilerActivity, profile

from liger_patch_kd.models import apply_kd_patch_to_llama

from .bench_train_step import SHAPES, build, method_step, prepare_student
from .common import environment, write_json

CATEGORIES = [  # first match wins
    ("fused KD loss kernel", r"_jsd_chunk|_topk_chunk"),
    ("matmul", r"gemm|nvjet|cutlass|sm90_xmma|cublas|matmul"),
    ("attention", r"flash|fmha|attention|sdpa|efficient"),
    ("our RMSNorm/RoPE/MLP kernels", r"_rms_norm|_gated|_rope"),
    ("optimizer", r"adam|foreach|multi_tensor"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="runs/profile_step.json")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    student_cfg, teacher_cfg = SHAPES["llama"]
    teacher = build(teacher_cfg, device, dtype, seed=2).eval().requires_grad_(False)
    apply_kd_patch_to_llama(model=teacher)
    student = build(student_cfg, device, dtype, seed=1)
    prepare_student("liger_patch_kd", student)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-5)
    ids = torch.randint(0, student_cfg["vocab_size"], (args.micro_batch, args.seq), device=device)
    step = method_step("liger_patch_kd", student, teacher, {"input_ids": ids, "labels": ids})
    for _ in range(2):
        step(), opt.step(), opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(), opt.step(), opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0)]
    total = sum(e.self_device_time_total for e in events)
    by_cat: dict[str, float] = {}
    for e in events:
        cat = next((c for c, pattern in CATEGORIES if re.search(pattern, e.key, re.I)), "other elementwise / copies")
        by_cat[cat] = by_cat.get(cat, 0.0) + e.self_device_time_total
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:20]
    print(f"GPU time of one step: {total / 1e3:.1f} ms")
    for cat, us in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"  {cat:32} {us / 1e3:8.1f} ms  {100 * us / total:5.1f}%")
    print("top kernels:")
    for e in top:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms  x{e.count:<5} {e.key[:100]}")
    write_json(
        args.out,
        dict(
            environment=environment(),
            total_ms=total / 1e3,
            categories_ms={k: v / 1e3 for k, v in by_cat.items()},
            top=[dict(kernel=e.key, ms=e.self_device_time_total / 1e3, count=e.count) for e in top],
        ),
    )


if __name__ == "__main__":
    main()
