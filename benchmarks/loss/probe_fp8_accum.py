"""Probe (not the product): what `torch._scaled_mm(use_fast_accum=True)` buys and costs at the 8B teacher's shapes.

Hopper's FP8 tensor cores accumulate a product's partial sums with fewer bits than fp32; by default cuBLASLt
promotes them to fp32 registers every few K-steps ("slow" accumulation, what ops/fp8.py uses). Fast accumulation
skips the promotion. This probe times both, per GEMM of one teacher layer at M = 16384 tokens (and the teacher's
head at a 1024-row loss chunk), with q, k and v as three products and as one, and measures the accumulation
error alone: both outputs against the exact fp32 product of the same (dequantised) e4m3 operands, as the relative
Frobenius error and the largest element error over the output's rms.

    python -m benchmarks.loss.probe_fp8_accum --out $OUT/probe_fp8_accum.json
"""

from __future__ import annotations

import argparse

import torch

from liger_patch_kd.ops.fp8 import quantize_rows, quantize_weight

from ..common import cuda_time_ms, environment, print_table, write_json

SHAPES = {  # name: (M, K, N)
    "q": (16384, 4096, 4096),
    "k (or v)": (16384, 4096, 1024),
    "qkv as one": (16384, 4096, 6144),
    "o": (16384, 4096, 4096),
    "gate_up": (16384, 4096, 28672),
    "down": (16384, 14336, 4096),
    "lm_head, 1024-row chunk": (1024, 4096, 128256),
}


def product(x8, xs, w8, ws, fast: bool) -> torch.Tensor:
    return torch._scaled_mm(
        x8, w8.t(), scale_a=xs[:, None], scale_b=ws[None, :], out_dtype=torch.bfloat16, use_fast_accum=fast
    )


def accumulation_error(y: torch.Tensor, exact: torch.Tensor) -> dict:
    diff = (y.double() - exact).flatten()
    rms = exact.pow(2).mean().sqrt()
    return dict(rel_fro=float(diff.norm() / exact.norm()), max_over_rms=float(diff.abs().max() / rms))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="runs/probe_fp8_accum.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, (m, k, n) in SHAPES.items():
        x8, xs = quantize_rows(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        w8, ws = quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5)
        row = dict(gemm=name, M=m, K=k, N=n)
        for fast in (False, True):
            ms = cuda_time_ms(lambda: product(x8, xs, w8, ws, fast), warmup=3, reps=20)
            row[f"{'fast' if fast else 'slow'}_ms"] = ms
            row[f"{'fast' if fast else 'slow'}_TFLOPs"] = 2 * m * k * n / ms / 1e9
        # the error check on the first 2048 rows (an fp64 product of the full gate_up would not fit in time)
        part = slice(0, 2048)
        exact = (x8[part].double() * xs[part, None].double()) @ (w8.double() * ws[:, None].double()).t()
        for fast in (False, True):
            err = accumulation_error(product(x8[part], xs[part], w8, ws, fast), exact)
            row.update({f"{'fast' if fast else 'slow'}_{k}": v for k, v in err.items()})
        row["speedup"] = row["slow_ms"] / row["fast_ms"]
        rows.append(row)
        print(row, flush=True)
    print(print_table(rows, ["gemm", "slow_ms", "fast_ms", "speedup", "slow_rel_fro", "fast_rel_fro",
                             "slow_max_over_rms", "fast_max_over_rms"]))  # fmt: skip
    write_json(args.out, dict(environment=environment(), rows=rows))


if __name__ == "__main__":
    main()
