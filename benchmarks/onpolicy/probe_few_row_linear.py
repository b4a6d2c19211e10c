"""The decode step's products alone, at a 1B Llama's shapes: cuBLAS (F.linear) beside the few-row kernel
(generation/few_row_linear.py) with its own launch configuration and with tile variants, to set launch_config by
measurement.

    python -m benchmarks.onpolicy.probe_few_row_linear --rows 8 64 --out runs/probe_few_row_linear.json

Each cell captures one CUDA graph of `--calls` products, each with its own copy of the weight (so the weights come
from memory, not L2, as in a step where each layer has its own), replays it and reports µs a product and the
weight's bytes over that time. Variants are BLOCK_N,BLOCK_K,warps,stages.

The "gated" shape is the MLP's gate and up (8192 features each) and the SiLU of the one times the other: cuBLAS's
product of the gate/up copy then ops.swiglu's activation kernel, against few_row_gated's one launch.

`--chain` times what a step runs instead: `--layers` layers of q/k/v, o, gate/up with the activation, and down, then
the head, each product reading the one before's output, in one graph: through cuBLAS (and the activation kernel),
through the kernels (the gated one for gate/up), and through the kernels launched as programmatic dependents of the
one before (`pdl`: each launched while that one runs, waiting for it to finish before it reads).

    python -m benchmarks.onpolicy.probe_few_row_linear --chain --rows 8 64 --out runs/chain.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from liger_patch_kd.ops.swiglu import gated_act

from ..common import environment, graph_us_per_call, print_table, write_json

# (name, N, K) of a Llama-3.2-1B layer's products and its head, q/k/v and gate/up fused as the engine runs them
SHAPES = [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
          ("head", 128256, 2048), ("gated", 8192, 2048)]  # fmt: skip
VARIANTS = [f"{n},{k},{w},{s}" for n in (16, 32, 64, 128) for k in (128, 256, 512) for w, s in ((4, 3), (4, 5), (8, 4))]
WEIGHT_BYTES_WANTED = 256 << 20  # copies of a weight per graph: several times any L2


def time_cell(rows: int, shape: tuple[str, int, int], variant: str, a: argparse.Namespace) -> dict:
    from liger_patch_kd.generation.few_row_linear import few_row_gated, few_row_linear, launch_config

    name, n, k = shape
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gated = name == "gated"
    weight_bytes = n * k * 2 * (2 if gated else 1)
    copies = max(2, min(a.calls, -(-WEIGHT_BYTES_WANTED // weight_bytes)))
    weights = [torch.randn(n * (2 if gated else 1), k, device=dev, dtype=dtype) / k**0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device=dev, dtype=dtype)
    config = None
    if variant == "default":
        config = launch_config(rows, n, k, 2, dev, weights=2 if gated else 1)
        variant = "default " + ",".join(str(v) for v in config.values())
    elif variant != "cublas":
        bn, bk, warps, stages = (int(v) for v in variant.split(","))
        config = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}

    def product(x, w):
        if gated and config is None:
            return gated_act(*F.linear(x, w).chunk(2, dim=-1))
        if gated:
            return few_row_gated(x, *w.chunk(2, dim=0), config=config)
        return F.linear(x, w) if config is None else few_row_linear(x, w, config=config)

    expected = gated_act(*F.linear(x, weights[0]).chunk(2, dim=-1)) if gated else F.linear(x, weights[0])
    got = product(x, weights[0]).float()
    if not torch.allclose(got, expected.float(), rtol=2e-2, atol=2e-2):  # bf16 roundings of other sums' orders
        raise AssertionError(f"differs from cuBLAS's by {(got - expected.float()).abs().max().item():.3g}")
    calls = max(a.calls, copies)

    def step():
        for i in range(calls):
            product(x, weights[i % copies])

    us = graph_us_per_call(step, calls, a.reps)
    return dict(rows=rows, shape=name, n=n, k=k, variant=variant, us=round(us, 2),
                tb_per_s=round(weight_bytes / us / 1e6, 2))  # fmt: skip


def time_chain(rows: int, variant: str, a: argparse.Namespace) -> dict:
    """µs a step of `a.layers` layers' four products and the head, each reading the product before's output."""
    from liger_patch_kd.generation.few_row_linear import few_row_gated, few_row_linear

    dev, dtype = torch.device("cuda"), torch.bfloat16
    shapes = {name: (n, k) for name, n, k in SHAPES}
    layers = [{name: torch.randn(*shapes[name], device=dev, dtype=dtype) / shapes[name][1] ** 0.5
               for name in ("qkv", "o", "gate_up", "down")} for _ in range(a.layers)]  # fmt: skip
    head = torch.randn(*shapes["head"], device=dev, dtype=dtype) / shapes["head"][1] ** 0.5
    x = torch.randn(rows, shapes["o"][1], device=dev, dtype=dtype)
    pdl = variant == "kernel, pdl"
    if variant == "cublas":
        product = F.linear

        def mlp_in(x, w):
            return gated_act(*F.linear(x, w).chunk(2, dim=-1))
    else:
        def product(x, w):
            return few_row_linear(x, w, dependent=pdl)

        def mlp_in(x, w):
            return few_row_gated(x, *w.chunk(2, dim=0), dependent=pdl)

    def step():
        h = x
        for weights in layers:
            h = product(h, weights["qkv"])[:, : shapes["o"][1]]
            h = product(h, weights["o"])
            h = mlp_in(h, weights["gate_up"])
            h = product(h, weights["down"])
        return product(h, head)

    want = None if variant == "cublas" else _chain_reference(layers, head, x)
    if want is not None and not torch.allclose(step().float(), want, rtol=5e-2, atol=5e-2):
        raise AssertionError("the chain differs from cuBLAS's")
    us = graph_us_per_call(step, 1, a.reps)
    weight_bytes = sum(w.numel() * 2 for layer in layers for w in layer.values()) + head.numel() * 2
    return dict(rows=rows, variant=variant, us=round(us, 1), us_per_layer=round(us / a.layers, 2),
                tb_per_s=round(weight_bytes / us / 1e6, 2))  # fmt: skip


def _chain_reference(layers, head, x):
    h = x
    for weights in layers:
        h = F.linear(F.linear(h, weights["qkv"])[:, : weights["o"].shape[1]], weights["o"])
        h = F.linear(gated_act(*F.linear(h, weights["gate_up"]).chunk(2, dim=-1)), weights["down"])
    return F.linear(h, head).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], choices=[s[0] for s in SHAPES])
    parser.add_argument("--calls", type=int, default=16, help="products a graph (at least the weight's copies)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, help="BLOCK_N,BLOCK_K,warps,stages")
    parser.add_argument("--chain", action="store_true", help="time a step's chain of products (module docstring)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    results = []
    if a.chain:
        for rows in a.rows:
            for variant in ("cublas", "kernel", "kernel, pdl"):
                try:
                    results.append(time_chain(rows, variant, a))
                except Exception as error:  # named, not fatal
                    results.append(dict(rows=rows, variant=variant, error=f"{type(error).__name__}: {error}"[:300]))
                print(results[-1], flush=True)
        print_table(results, ["rows", "variant", "us", "us_per_layer", "tb_per_s", "error"])
        if a.out:
            write_json(a.out, dict(environment=environment(), args=vars(a), rows=results))
        return
    for rows in a.rows:
        for shape in [s for s in SHAPES if s[0] in a.shapes]:
            cells = []
            for variant in ["cublas", "default", *a.variants]:
                try:
                    cells.append(time_cell(rows, shape, variant, a))
                except Exception as error:  # a variant that does not compile or launch: named, not fatal
                    cells.append(dict(rows=rows, shape=shape[0], variant=variant,
                                      error=f"{type(error).__name__}: {error}"[:160]))  # fmt: skip
            timed = sorted((c for c in cells if "us" in c), key=lambda c: c["us"])
            for rank, cell in enumerate(timed):
                cell["rank"] = rank + 1
            results += cells
            print_table(timed[:6] + [c for c in cells if c["variant"] in ("cublas",) or "default" in c["variant"]],
                        ["rows", "shape", "variant", "us", "tb_per_s", "rank"])  # fmt: skip
    if a.out:
        write_json(a.out, dict(environment=environment(), args=vars(a), rows=results))


if __name__ == "__main__":
    main()
