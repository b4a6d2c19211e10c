"""Probe (not the product): do gradient groups pay? The fused JSD loss (H 4096, V 128256, bf16, beta 0.5, forward
and backward) with 512-row logit chunks whose gradients are gathered in groups of up to 2048 rows, against 1024-row
chunks that each run their own gradient products, both within the 1 GiB budget; with the weight's own (bf16)
gradient and with fp32_weight_grad. Each is timed alone (each call synchronised: the host's work before its first
kernel counted) and with the host ahead (the GPU's own time; benchmarks.common.cuda_time_ms), beside the four-product
floor timed both ways; and the host's time to queue one call.

    python -m benchmarks.loss.probe_gradient_groups --out $OUT/probe_gradient_groups.json
"""

from __future__ import annotations

import argparse
import time

import torch

from liger_patch_kd import KDLossConfig, fused_linear_jsd

from ..common import cuda_time_ms, environment, print_table, write_json
from ..common.losses import LLAMA_V, floor_products, make_inputs

PLANS = {"groups 512/2048": (512, 2048), "chunks 1024, no groups": (1024, 1024)}


def host_ms(fn) -> float:
    """Wall time for the host to queue one call (the GPU synchronised before and after)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    elapsed = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    return elapsed


def rows_for(n: int, hidden: int) -> list[dict]:
    x = make_inputs(n, hidden, LLAMA_V)
    logit_products, grad_products = floor_products(x)

    def floor():
        logit_products()
        grad_products()

    out = [dict(N=n, plan="matmul floor", weight_grad="-", alone_ms=cuda_time_ms(floor, reps=10),
                gpu_ms=cuda_time_ms(floor, reps=10, host_ahead=True))]  # fmt: skip
    for fp32 in (False, True):
        for name, (rows, group) in PLANS.items():
            cfg = KDLossConfig(beta=0.5, chunk_size=rows, grad_chunk_size=group, fp32_weight_grad=fp32)

            def step(cfg=cfg):
                x["h_s"].grad = x["w_s"].grad = None
                fused_linear_jsd(x["h_s"], x["w_s"], x["h_t"], x["w_t"], x["labels"], config=cfg).backward()

            row = dict(N=n, plan=name, weight_grad="fp32" if fp32 else "bf16")
            row["alone_ms"] = cuda_time_ms(step, reps=10)
            row["gpu_ms"] = cuda_time_ms(step, reps=10, host_ahead=True)
            row["host_ms"] = host_ms(step)
            out.append(row)
            print(row, flush=True)
    x.clear()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--out", default="runs/probe_gradient_groups.json")
    args = parser.parse_args()
    rows = [r for n in args.ns for r in rows_for(n, args.hidden)]
    table = print_table(rows, ["N", "plan", "weight_grad", "alone_ms", "gpu_ms", "host_ms"])
    write_json(args.out, dict(environment=environment(), rows=rows, table=table))


if __name__ == "__main__":
    main()
