"""Probe (not the product): how much of the fused loss's time is host work the GPU waits for?

The fused loss timed alone (each call synchronised) is slower than with the host ahead of the GPU (as behind a
model's forward): at N = 8192 by more than the host's prelude before the first product explains. This probe times
the call, and the four-product floor beside it, three ways (`benchmarks.common.cuda_time_ms`): alone, with the host
ahead, and after a spin (the GPU busy on a sleep kernel just before, the host not ahead: what the sleep alone
changes); the call with the automatic and a given chunk size and its forward alone; the host's own wall time until
the call returns; and, from a profile that starts with a marker kernel, where the call's first kernel starts after
the marker, its kernel time, where its last kernel ends, every gap over 20 us between kernels with the host ops
running during it, and the host ops over 0.1 ms.

    python -m benchmarks.loss.probe_host_prelude --out $OUT/probe_host_prelude.json

Measured 2026-12-05 on one H100 (benchmarks/results/probe_host_prelude.json, the profile then counted from the
profiler's start): at N = 8192 the automatic and the given chunk size time alike (63.1 and 63.4 ms), the backward
adds nothing (the gradients come from the forward), and the host returns after 5.7 ms while the GPU works for 63.
2026-12-08, one H100, the marker profile and two timings (benchmarks/results/probe_loss_timeline_h100.json, a script
of this probe's profile and timings before the spin and floor timings were added): at N = 2048 alone 15.0 ms, host
ahead 13.5, the profiled call ending 15.1 ms after the marker with 13.4 ms of kernels and 1.7 ms of gaps, all in
the first 1.5 ms (the row weights and masks before the first product, each op a launch the GPU waits for): the
whole difference is the host's prelude. At N = 8192 alone 60.1, host ahead 55.2, the profiled call ending at 56.5
with 1.4 ms of gaps: 3.5 ms of the alone time are in neither, which the spin timing is here to place.
"""

from __future__ import annotations

import argparse
import time

import torch

from liger_patch_kd import KDLossConfig, fused_linear_jsd

from ..common import cuda_time_ms, environment, write_json
from ..common.losses import LLAMA_V, floor_products, make_inputs


def probe(n: int, hidden: int) -> dict:
    x = make_inputs(n, hidden, LLAMA_V)

    def step(cfg: KDLossConfig, backward: bool = True):
        def run():
            x["h_s"].grad = x["w_s"].grad = None
            loss = fused_linear_jsd(x["h_s"], x["w_s"], x["h_t"], x["w_t"], x["labels"], config=cfg)
            if backward:
                loss.backward()

        return run

    logit_products, grad_products = floor_products(x)

    def floor():
        logit_products()
        grad_products()

    call = step(KDLossConfig(beta=0.5))
    out = dict(N=n)
    for name, fn in (("", call), ("floor_", floor)):
        out[f"{name}alone_ms"] = cuda_time_ms(fn, reps=10)
        out[f"{name}host_ahead_ms"] = cuda_time_ms(fn, reps=10, host_ahead=True)
        out[f"{name}after_spin_ms"] = cuda_time_ms(fn, reps=10, after_spin=True)
    out["given_chunk_1024_ms"] = cuda_time_ms(step(KDLossConfig(beta=0.5, chunk_size=1024)), reps=10)
    out["forward_only_ms"] = cuda_time_ms(step(KDLossConfig(beta=0.5), backward=False), reps=10)
    torch.cuda.synchronize()
    began = time.perf_counter()
    call()
    out["host_returns_after_ms"] = (time.perf_counter() - began) * 1e3
    torch.cuda.synchronize()
    out["call_ends_after_ms"] = (time.perf_counter() - began) * 1e3
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        torch.cuda._sleep(1000)  # the marker: offsets count from its end, on the GPU's clock
        call()
        torch.cuda.synchronize()
    events = list(prof.events())
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)  # fmt: skip
    host = sorted((e for e in events if e.device_type != torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)  # fmt: skip
    marker, kernels = kernels[0], kernels[1:]
    origin = marker.time_range.end
    out["first_kernel_after_marker_us"] = kernels[0].time_range.start - origin
    out["kernel_ms"] = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    out["last_kernel_ends_ms"] = (kernels[-1].time_range.end - origin) / 1e3
    gaps = []
    for a, b in zip([marker, *kernels], kernels):
        if b.time_range.start - a.time_range.end > 20:
            during = [h.name[:50] for h in host if h.time_range.elapsed_us() > 50
                      and h.time_range.start < b.time_range.start and h.time_range.end > a.time_range.end]  # fmt: skip
            gaps.append(dict(after=a.name[:60], before=b.name[:60], gap_us=b.time_range.start - a.time_range.end,
                             at_ms=(a.time_range.end - origin) / 1e3, host_ops=during[:6]))  # fmt: skip
    out["gaps_over_20us"] = gaps
    out["gap_total_ms"] = sum(g["gap_us"] for g in gaps) / 1e3
    out["host_ops_over_100us"] = [
        dict(op=e.name[:60], us=e.time_range.elapsed_us(), at_ms=(e.time_range.start - origin) / 1e3)
        for e in host if e.time_range.elapsed_us() > 100
    ][:40]  # fmt: skip
    print({k: v for k, v in out.items() if not isinstance(v, list)}, flush=True)
    for gap in gaps:
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
