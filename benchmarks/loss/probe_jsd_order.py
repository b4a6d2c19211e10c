"""Probe (not the product): how should the JSD chunk kernel walk a row, for the L2 cache's sake?

The kernel (ops/fused_linear_jsd.py) streams each row of both fp32 logit arrays three times (beta strictly
between 0 and 1) and is bound by that traffic. Its `JSDLaunch` can walk pass 2 right to left (so pass 2 starts
on the tiles pass 1 read last, and pass 3 on those pass 2 read last), ask L2 to keep passes 1-2's loads and drop
pass 3's, and change the tile width and warps; or split each row over programs that hold a segment of it in
registers and meet at per-row barriers (`segment`: each logit read once). This probe times each variant twice over:

- the kernel alone on one chunk (--rows x V, fp32 logits; the timed call includes a clone of the teacher logits
  the gradient overwrites, also timed alone, so "kernel ms" is the difference), with its largest difference
  from the default launch (loss, bf16 gradient);
- the whole fused loss, forward and backward, at N = 2048 and 8192 (H 4096, V 128256, bf16, beta 0.5), beside
  the four-product floor (`floor_products` of benchmarks/common/losses.py), with the variant set as
  ops.fused_linear_jsd.JSD_LAUNCH.

    python -m benchmarks.loss.probe_jsd_order --out $OUT/probe_jsd_order.json
    python -m benchmarks.loss.probe_jsd_order --rows 1024 --ns 8192 2048 --betas 0.5 --variants streaming \
        --loss-variants default streaming     # the default (the segment walk) against the streaming walk
    python -m benchmarks.loss.probe_jsd_order --rows 512 --betas 0.5 --variants "segments 8192, 2/SM" \
        --loss-variants default --plans auto 1024/1024 640/1280     # gradient groups against plain chunks
    bash benchmarks/run_gpu_suite.sh probe-jsd-order     # the same, then the kernel's float64 tests compiled
"""

from __future__ import annotations

import argparse

import torch

from liger_patch_kd import KDLossConfig, fused_linear_jsd
from liger_patch_kd.ops import fused_linear_jsd as jsd_op

from ..common import cuda_time_ms, environment, print_table, write_json
from ..common.losses import LLAMA_V, floor_products, make_inputs

VARIANTS = {
    "default": jsd_op.JSD_LAUNCH,
    "streaming": jsd_op.JSDLaunch(),
    "reverse pass 2": jsd_op.JSDLaunch(reverse_middle=True),
    "L2 hints": jsd_op.JSDLaunch(l2_hints=True),
    "reverse + hints": jsd_op.JSDLaunch(reverse_middle=True, l2_hints=True),
    "reverse + hints, 16 warps": jsd_op.JSDLaunch(reverse_middle=True, l2_hints=True, num_warps=16),
    "reverse + hints, tile 2048": jsd_op.JSDLaunch(reverse_middle=True, l2_hints=True, block=2048),
    "default, 16 warps": jsd_op.JSDLaunch(num_warps=16),
    # rows split over programs holding a segment each in registers (one read of each logit), met at barriers
    "segments 8192": jsd_op.JSDLaunch(segment=8192),
    "segments 8192, 16 warps": jsd_op.JSDLaunch(segment=8192, num_warps=16),
    "segments 8192, 16 warps, 2/SM": jsd_op.JSDLaunch(segment=8192, num_warps=16, programs_per_sm=2),
    "segments 8192, 2/SM": jsd_op.JSDLaunch(segment=8192, programs_per_sm=2),
    "segments 4096": jsd_op.JSDLaunch(segment=4096),
    "segments 4096, 2/SM": jsd_op.JSDLaunch(segment=4096, programs_per_sm=2),
    "segments 4096, 4 warps, 4/SM": jsd_op.JSDLaunch(segment=4096, num_warps=4, programs_per_sm=4),
    "segments 16384, 16 warps": jsd_op.JSDLaunch(segment=16384, num_warps=16),
    "segments 16384, 32 warps": jsd_op.JSDLaunch(segment=16384, num_warps=32),
    "segments 32768, 32 warps": jsd_op.JSDLaunch(segment=32768, num_warps=32),
    "segments 32768, 16 warps": jsd_op.JSDLaunch(segment=32768, num_warps=16),
    "segments 8192, phased": jsd_op.JSDLaunch(segment=8192, phased=True),
}


def kernel_rows(rows: int, vocab: int, betas: list[float], variants: dict) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    zs = torch.randn(rows, vocab, device="cuda", generator=g) * 4
    zt = torch.randn(rows, vocab, device="cuda", generator=g) * 4
    labels = torch.zeros(rows, dtype=torch.long, device="cuda")
    ones = torch.ones(rows, device="cuda")
    clone_ms = cuda_time_ms(lambda: zt.clone())
    out = []
    for beta in betas:
        cfg = KDLossConfig(beta=beta)

        def call(launch):
            return jsd_op.jsd_chunk_triton(zs, zt.clone(), labels, ones, ones * 0, torch.bfloat16, cfg, launch=launch)

        ref_soft, _, ref_grad = call(VARIANTS["default"])
        for name, launch in variants.items():
            row = dict(stage="kernel", beta=beta, variant=name)
            try:
                soft, _, grad = call(launch)
                row["ms"] = cuda_time_ms(lambda launch=launch: call(launch), warmup=3, reps=20) - clone_ms
                row["loss_diff"] = float((soft - ref_soft).abs().max())
                row["grad_diff"] = float((grad.float() - ref_grad.float()).abs().max())
            except Exception as e:  # a probe: report the variant that breaks and go on
                row["ms"] = f"error: {type(e).__name__}: {str(e)[:120]}"
            out.append(row)
            print(row, flush=True)
    return out


def parse_plan(text: str) -> tuple[int | None, int | None]:
    """A chunk plan for the loss rows: "auto" (the op's own), or "ROWS/GROUP" (chunk_size / grad_chunk_size)."""
    if text == "auto":
        return None, None
    rows, group = (int(v) for v in text.split("/"))
    return rows, group


def loss_rows(ns: list[int], hidden: int, variants: dict, plans: list[str] | None = None) -> list[dict]:
    out = []
    plans = plans or ["auto"]
    for n in ns:
        x = make_inputs(n, hidden, LLAMA_V)
        logit_products, grad_products = floor_products(x)
        floor = cuda_time_ms(lambda: (logit_products(), grad_products()))
        out.append(dict(stage="loss", N=n, variant="matmul floor", ms=floor, x_floor=1.0))
        for (name, launch), plan in ((v, p) for v in variants.items() for p in plans):
            rows, group = parse_plan(plan)
            cfg = KDLossConfig(beta=0.5, chunk_size=rows, grad_chunk_size=group)

            def step(cfg=cfg):
                x["h_s"].grad = x["w_s"].grad = None
                fused_linear_jsd(x["h_s"], x["w_s"], x["h_t"], x["w_t"], x["labels"], config=cfg).backward()

            jsd_op.JSD_LAUNCH = launch
            label = name if plan == "auto" else f"{name}, chunks {plan}"
            try:
                step()
                ms = cuda_time_ms(step, warmup=2, reps=10)
                out.append(dict(stage="loss", N=n, variant=label, ms=ms, x_floor=ms / floor))
            except Exception as e:
                out.append(dict(stage="loss", N=n, variant=label, ms=f"error: {type(e).__name__}: {str(e)[:120]}"))
            finally:
                jsd_op.JSD_LAUNCH = VARIANTS["default"]
            print(out[-1], flush=True)
        x.clear()  # this N's inputs go before the next N's
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--ns", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--out", default="runs/probe_jsd_order.json")
    parser.add_argument(
        "--loss-variants", nargs="+", default=None,
        help="the variants timed in the whole loss (default: all; 'fastest': the default and the two fastest "
             "others in the kernel rows at beta 0.5); the kernel rows time all",
    )  # fmt: skip
    parser.add_argument("--variants", nargs="+", default=None, help="the variants timed (default: all)")
    parser.add_argument("--betas", type=float, nargs="+", default=[0.5, 1.0, 0.0])
    parser.add_argument(
        "--plans", nargs="+", default=["auto"],
        help="chunk plans the loss rows run each variant with: 'auto' (the op's choice) or ROWS/GROUP (chunk_size / "
             "grad_chunk_size, e.g. 1024/1024 for chunks without gradient groups)",
    )  # fmt: skip
    args = parser.parse_args()
    chosen = {name: VARIANTS[name] for name in (args.variants or VARIANTS)}
    kernels = kernel_rows(args.rows, LLAMA_V, args.betas, {"default": VARIANTS["default"], **chosen})
    names = args.loss_variants or list(VARIANTS)
    if names == ["fastest"]:
        timed = [r for r in kernels if r["beta"] == 0.5 and isinstance(r["ms"], float) and r["variant"] != "default"]
        names = ["default"] + [r["variant"] for r in sorted(timed, key=lambda r: r["ms"])[:2]]
    losses = loss_rows(args.ns, args.hidden, {name: VARIANTS[name] for name in names}, args.plans)
    print_table(kernels, ["beta", "variant", "ms", "loss_diff", "grad_diff"])
    print_table(losses, ["N", "variant", "ms", "x_floor"])
    write_json(args.out, {"environment": environment(), "kernel": kernels, "loss": losses})


if __name__ == "__main__":
    main()
