"""The decode step's fused attention (decode_kernel.rope_write_attend) alone, at a 1B Llama's shapes, over tile
variants (cache columns a step, warps, pipeline stages), to set decode_kernel's tile constants by measurement.

    python -m benchmarks.onpolicy.probe_decode_attention --rows 8 64 --out runs/probe_decode_attention.json

Each cell captures one CUDA graph of `--layers` calls (each layer its own cache, so the keys and values come from
memory, not L2, as in a step), replays it and reports µs a call, and the keys' and values' bytes over that time.
The first `--written` columns and the slot are attended (a prompt and a completion so far); the cache has
`--length` columns. Variants set decode_kernel's BLOCK_N (and DIRECT_BLOCK_N), NUM_WARPS and NUM_STAGES before their
calls.
"""

from __future__ import annotations

import argparse

import torch

from ..common import environment, graph_us_per_call, print_table, write_json

VARIANTS = ["128,4,2", "128,4,3", "128,8,2", "64,4,2", "64,4,3", "64,2,3", "64,8,3", "32,4,4"]


def time_cell(rows: int, variant: str, a: argparse.Namespace) -> dict:
    import liger_patch_kd.generation.decode_kernel as kernel

    block, warps, stages = (int(x) for x in variant.split(","))
    kernel.BLOCK_N = kernel.DIRECT_BLOCK_N = block  # with or without splits
    kernel.NUM_WARPS, kernel.NUM_STAGES = warps, stages
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    heads, kv_heads, dim = 32, 8, 64
    shape = (rows, kv_heads, a.length, dim)
    caches = [(torch.randn(shape, device=dev, dtype=bf16), torch.randn(shape, device=dev, dtype=bf16))
              for _ in range(a.layers)]  # fmt: skip
    fused = torch.randn(rows, (heads + 2 * kv_heads) * dim, device=dev, dtype=bf16)
    q, k, v = (t.view(rows, -1, dim) for t in fused.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    angle = torch.rand(rows, dim // 2, device=dev) * 6
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(bf16) for f in (torch.cos, torch.sin))
    mask = torch.zeros(rows, a.length, dtype=torch.bool, device=dev)
    mask[:, : a.written + 1] = True
    slot = torch.tensor([a.written], device=dev)

    def step():
        for keys, values in caches:
            kernel.rope_write_attend(q, k, v, keys, values, slot, cos, sin, mask, dim**-0.5)

    us = graph_us_per_call(step, a.layers, a.reps)
    read = rows * kv_heads * (a.written + 1) * dim * 2 * 2  # keys and values attended, bf16
    return dict(rows=rows, variant=variant, us_per_call=round(us, 2), gb_per_s=round(read / us / 1e3, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--length", type=int, default=512, help="cache columns")
    parser.add_argument("--written", type=int, default=384, help="columns attended before the slot")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, help="block,warps,stages")
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    results = []
    for rows in a.rows:
        for variant in a.variants:
            try:
                results.append(time_cell(rows, variant, a))
            except Exception as error:  # a variant that does not compile or launch: named, not fatal
                results.append(dict(rows=rows, variant=variant, error=f"{type(error).__name__}: {error}"[:200]))
            print(results[-1], flush=True)
    print_table(results, ["rows", "variant", "us_per_call", "gb_per_s", "error"])
    if a.out:
        write_json(a.out, dict(environment=environment(), args=vars(a), rows=results))


if __name__ == "__main__":
    main()
