"""Where the fused loss's time goes, on one GPU: each stage of one chunk timed alone against its own floor, and
a profile of whole forward + backward calls grouped by kernel.

    python -m benchmarks.loss.bench_loss_breakdown --out runs/bench_loss_breakdown.json

Stages of a chunk of R rows (V = 128256, H = 4096, bf16): the student's logits product with an fp32 and a bf16
output (cuBLAS), the per-chunk JSD kernel, a device-to-device copy for the memory bandwidth the kernel is
measured against, the backward's scaling of the V x H weight gradient by grad_output, and the two gradient
products (the weight gradient's first chunk written, later chunks accumulated). The profile sums CUDA kernel
time by kernel name for whole fused_linear_jsd calls at N rows, beside the time between the first kernel's start
and the last one's end and the time CUDA events measure around the call.

A Triton product that reduced each row's log-sum-exp in its epilogue (so the JSD kernel could skip its first
pass) was measured with this script at commit 1591d19 and removed: 582 TFLOP/s against cuBLAS's 679 at
R = 896, costing 0.46 ms per chunk for the two products against the 0.27 ms the skipped pass saved
(bench_loss_breakdown_lse_trial.json, in git at commit f966e27).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from liger_patch_kd import KDLossConfig, fused_linear_jsd
from liger_patch_kd.ops.backend import logits_fp32
from liger_patch_kd.ops.fused_linear_jsd import jsd_chunk_triton
from liger_patch_kd.ops.scale import scale_

from ..common import cuda_time_ms, environment, print_table, write_json
from ..common.losses import LLAMA_V, make_inputs


def stage_rows(rows: int, hidden: int, vocab: int) -> list[dict]:
    x = make_inputs(rows, hidden, vocab)
    h, w, h_t, w_t = (x[k].detach() for k in ("h_s", "w_s", "h_t", "w_t"))
    labels, ones = x["labels"], torch.full((rows,), 1.0 / rows, device="cuda")
    flops = 2 * rows * vocab * hidden
    logit_bytes = rows * vocab * 4
    out = []

    def add(stage, ms, *, flop=None, nbytes=None):
        row = dict(R=rows, stage=stage, ms=ms)
        if flop:
            row["TFLOP/s"] = flop / ms / 1e9
        if nbytes:
            row["TB/s"] = nbytes / ms / 1e9
        out.append(row)
        print(row, flush=True)

    add("product fp32 out (cuBLAS)", cuda_time_ms(lambda: logits_fp32(h, w, None), reps=20), flop=flops)
    add("product bf16 out (cuBLAS)", cuda_time_ms(lambda: h @ w.T, reps=20), flop=flops)
    src = torch.randn(rows, vocab, device="cuda")
    add("copy R x V fp32 (bandwidth)", cuda_time_ms(lambda: src.clone(), reps=20), nbytes=2 * logit_bytes)
    s = logits_fp32(h, w, None)
    t = logits_fp32(h_t, w_t, None)
    for beta in (0.5, 0.0):
        cfg = KDLossConfig(beta=beta)

        def kernel():  # the kernel overwrites the teacher's logits with the gradient: a fresh copy per call
            return jsd_chunk_triton(s, t.clone(), labels, ones, ones * 0, torch.bfloat16, cfg)

        reads = (3 if beta not in (0.0, 1.0) else 2) * 2 * logit_bytes
        ms = cuda_time_ms(kernel, reps=20) - cuda_time_ms(lambda: t.clone(), reps=20)
        add(f"JSD kernel beta={beta}", ms, nbytes=reads + rows * vocab * 2)
    g = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
    g_in, g_w = torch.empty_like(h), torch.empty_like(w)
    head_bytes = 2 * w.numel() * w.element_size()
    for factor in (1.0, 0.5):  # the backward's scaling of the V x H weight gradient by grad_output
        f = torch.tensor(factor, device="cuda")
        mul_ms = cuda_time_ms(lambda: g_w.mul_(f.to(g_w.dtype)), reps=20)
        add(f"scale V x H grad by {factor}, t.mul_", mul_ms, nbytes=head_bytes)
        add(f"scale V x H grad by {factor}, scale_", cuda_time_ms(lambda: scale_(g_w, f), reps=20), nbytes=head_bytes)
    add("grad input product", cuda_time_ms(lambda: torch.mm(g, w, out=g_in), reps=20), flop=flops)
    add("grad weight product, first chunk", cuda_time_ms(lambda: torch.mm(g.t(), h, out=g_w), reps=20), flop=flops)
    add("grad weight product, accumulated", cuda_time_ms(lambda: g_w.addmm_(g.t(), h), reps=20), flop=flops)
    return out


def loss_step(x: dict, cfg: KDLossConfig):
    """One fused_linear_jsd forward + backward on make_inputs' tensors, as a callable for the timers."""

    def step():
        x["h_s"].grad = x["w_s"].grad = None
        fused_linear_jsd(x["h_s"], x["w_s"], x["h_t"], x["w_t"], x["labels"], config=cfg).backward()

    return step


def kernel_profile(n: int, hidden: int, vocab: int) -> dict:
    step = loss_step(make_inputs(n, hidden, vocab), KDLossConfig(beta=0.5))
    step()
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_kernel = defaultdict(float)
    starts, ends = [], []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_kernel[event.name[:90]] += event.device_time_total / 1e3
            starts.append(event.time_range.start)
            ends.append(event.time_range.end)
    total = sum(by_kernel.values())
    span = (max(ends) - min(starts)) / 1e3  # first kernel's start to last kernel's end: busy plus idle gaps
    timed = cuda_time_ms(step)
    top = dict(sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12])
    print(f"\nN={n}: {total:.2f} ms of kernels over a {span:.2f} ms span; "
          f"{timed:.2f} ms timed with events", flush=True)  # fmt: skip
    for name, ms in top.items():
        print(f"  {ms:8.3f} ms  {name}")
    return dict(N=n, kernel_ms=total, span_ms=span, timed_ms=timed, top=top)


def host_overhead(n: int, hidden: int, vocab: int) -> dict:
    """What the call spends outside its kernels: torch.cuda.mem_get_info (the automatic chunk size asks it once
    per call) timed alone, and the fused call with the automatic chunk size against the same size given."""
    import time

    from liger_patch_kd.ops.chunked import plan_chunk_rows

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(100):
        torch.cuda.mem_get_info()
    info_ms = (time.perf_counter() - start) * 10
    x = make_inputs(n, hidden, vocab)
    rows, group = plan_chunk_rows(n, vocab, torch.device("cuda"), 8, 8, 2)  # fused_linear_jsd's plan, bf16 rows
    out = dict(N=n, mem_get_info_ms=info_ms, chunk_rows=rows, grad_rows=group)
    given = KDLossConfig(beta=0.5, chunk_size=rows, grad_chunk_size=group)
    for label, cfg in (("automatic", KDLossConfig(beta=0.5)), ("given", given)):
        out[f"{label}_ms"] = cuda_time_ms(loss_step(x, cfg), reps=10)
    print(out, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_loss_breakdown.json")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", type=int, nargs="+", default=[896, 2048])
    parser.add_argument("--profile-ns", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--host-only", action="store_true", help="only the host-overhead probe")
    args = parser.parse_args()
    if args.host_only:
        overhead = [host_overhead(n, args.hidden, LLAMA_V) for n in args.profile_ns]
        write_json(args.out, dict(environment=environment(), host_overhead=overhead))
        return
    rows = [r for n in args.rows for r in stage_rows(n, args.hidden, LLAMA_V)]
    profiles = [kernel_profile(n, args.hidden, LLAMA_V) for n in args.profile_ns]
    overhead = [host_overhead(n, args.hidden, LLAMA_V) for n in args.profile_ns]
    print(f"\nV={LLAMA_V}, H={args.hidden}, bf16")
    table = print_table(rows, ["R", "stage", "ms", "TFLOP/s", "TB/s"])
    payload = dict(environment=environment(), stages=rows, profiles=profiles, host_overhead=overhead, table=table)
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
