"""Probe (not the product): how much of the fused loss's time is host work the GPU waits for?

The breakdown's profile (bench_loss_breakdown.py) put ~4 ms between the call's kernel time and its timed length
at N = 8192, read as host prelude and gaps between kernels. This probe times the call with CUDA events four
ways (the automatic chunk size, which asks torch.cuda.mem_get_info once per call; the same size given; the
forward alone; the host's own wall time until the call returns) and lists, from a profile with CPU activity, the
gaps over 50 us between consecutive kernels and the host ops over 0.1 ms.

    python -m benchmarks.loss.probe_host_prelude --out $OUT/probe_host_prelude.json

Measured 2026-12-05 on one H100 (benchmarks/results/probe_host_prelude.json): at N = 8192 the automatic and the
given chunk size time alike (63.1 and 63.4 ms), the backward adds nothing (the gradients come from the forward),
the host returns after 5.7 ms while the GPU works for 63, and the only gaps over 50 us are five in the first
0.7 ms (the row weights and masks before the first product); none between the products and the divergence
kernels. What separates the loss from its floor is the divergence kernel's passes, not the host.
"""

from __future__ import annotations

import argparse
import time

import torch

from liger_patch_kd import KDLossConfig, fused_linear_jsd

from ..common import cuda_time_ms, environment, write_json
from ..common.losses import LLAMA_V, make_inputs


def probe(n: int, hidden: int) -> dict:
    x = make_inputs(n, hidden, LLAMA_V)

    def step(cfg: KDLossConfig, backward: bool = True):
        def run():
            x["h_s"].grad = x["w_s"].grad = None
            loss = fused_linear_jsd(x["h_s"], x["w_s"], x["h_t"], x["w_t"], x["labels"], config=cfg)
            if backward:
                loss.backward()

        return run

    out = dict(N=n)
    out["automatic_chunk_ms"] = cuda_time_ms(step(KDLossConfig(beta=0.5)), reps=10)
    out["given_chunk_1024_ms"] = cuda_time_ms(step(KDLossConfig(beta=0.5, chunk_size=1024)), reps=10)
    out["forward_only_ms"] = cuda_time_ms(step(KDLossConfig(beta=0.5), backward=False), reps=10)
    call = step(KDLossConfig(beta=0.5))
    torch.cuda.synchronize()
    began = time.perf_counter()
    call()
    out["host_returns_after_ms"] = (time.perf_counter() - began) * 1e3
    torch.cuda.synchronize()
    out["call_ends_after_ms"] = (time.perf_counter() - began) * 1e3
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        call()
        torch.cuda.synchronize()
    events = list(prof.events())
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)  # fmt: skip
    host = sorted((e for e in events if e.device_type != torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)  # fmt: skip
    origin = kernels[0].time_range.start
    out["kernel_ms"] = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    out["span_ms"] = (kernels[-1].time_range.end - origin) / 1e3
    out["gaps_over_50us"] = [
        dict(after=a.name[:60], before=b.name[:60], gap_us=b.time_range.start - a.time_range.end,
             at_ms=(a.time_range.end - origin) / 1e3)
        for a, b in zip(kernels, kernels[1:]) if b.time_range.start - a.time_range.end > 50
    ]  # fmt: skip
    out["host_ops_over_100us"] = [
        dict(op=e.name[:60], us=e.time_range.elapsed_us(), at_ms=(e.time_range.start - origin) / 1e3)
        for e in host if e.time_range.elapsed_us() > 100
    ][:40]  # fmt: skip
    print({k: v for k, v in out.items() if not isinstance(v, list)}, flush=True)
    for gap in out["gaps_over_50us"]:
        print("  gap", gap)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/probe_host_prelude.json")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ns", type=int, nargs="+", default=[2048, 8192])
    args = parser.parse_args()
    write_json(args.out, dict(environment=environment(), rows=[probe(n, args.hidden) for n in args.ns]))


if __name__ == "__main__":
    main()
