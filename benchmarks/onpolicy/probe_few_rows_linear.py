"""A decode step's products alone: ops/few_rows_linear.py against F.linear (cuBLAS), by shape, rows and config.

    python -m benchmarks.onpolicy.probe_few_rows_linear --out runs/probe_few_rows_linear.json
    python -m benchmarks.onpolicy.probe_few_rows_linear --sweep   # also every config of a small grid, per cell

The shapes are a Llama-3.2-1B's (q/k/v and gate/up fused as the decode engine runs them, o, down, lm_head), bf16.
Each cell times 20 products captured in one CUDA graph, cycling through enough copies of the weight (at least
256 MB) that none is in L2 when read, as in a decode step where every other layer's weights pass through L2 in
between: ms per product, and the weight's bytes over that time (TB/s). With --sweep, the fastest config of the grid
and its time beside the default's: what few_rows_config should pick.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import torch.nn.functional as F

from ..common import environment, print_table, write_json

SHAPES = {  # name: (N, K) of a Llama-3.2-1B decode step's products
    "qkv": (3072, 2048),
    "o": (2048, 2048),
    "gate_up": (16384, 2048),
    "down": (2048, 8192),
    "lm_head": (128256, 2048),
}
GRID = list(itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4)))  # BLOCK_N, BLOCK_K, warps, stages


def graph_ms(fn, copies: list[torch.Tensor], x: torch.Tensor, calls: int = 20, reps: int = 10) -> float:
    """ms per product: `calls` products, each on the next weight copy, captured as one graph, replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for w in copies[:3]:
            fn(x, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(x, copies[i % len(copies)])
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    from liger_patch_kd.ops.few_rows_linear import few_rows_config, few_rows_linear

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/probe_few_rows_linear.json")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--sweep", action="store_true")
    a = p.parse_args(argv)
    device = torch.device("cuda")
    results = []
    for name in a.shapes:
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
                  for _ in range(max(2, -(-256 * 2**20 // nbytes)))]  # fmt: skip
        for rows in a.rows:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            want = F.linear(x, copies[0])
            got = few_rows_linear(x, copies[0])
            error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            cublas = graph_ms(lambda x, w: F.linear(x, w), copies, x)
            ours = graph_ms(lambda x, w: few_rows_linear(x, w), copies, x)
            row = dict(shape=name, N=n, K=k, rows=rows, cublas_ms=cublas, ours_ms=ours, speedup=cublas / ours,
                       cublas_TBps=nbytes / cublas / 1e9, ours_TBps=nbytes / ours / 1e9, max_rel_diff=error,
                       config=list(few_rows_config(rows, n, k)))  # fmt: skip
            if a.sweep:
                best = (ours, row["config"])
                block_m = few_rows_config(rows, n, k)[0]
                for block_n, block_k, warps, stages in GRID:
                    if block_m * block_k > 64 * 256:  # the x tile in registers: keep it under 32 KB
                        continue
                    cfg = (block_m, block_n, block_k, warps, stages)
                    try:
                        ms = graph_ms(lambda x, w, cfg=cfg: few_rows_linear(x, w, config=cfg), copies, x, reps=5)
                    except Exception as err:  # a config the compiler refuses (registers, shared memory)
                        print(f"  {name} rows {rows} {cfg}: {type(err).__name__}")
                        continue
                    if ms < best[0]:
                        best = (ms, list(cfg))
                row.update(best_ms=best[0], best_config=best[1], best_TBps=nbytes / best[0] / 1e9)
            results.append(row)
            print({key: (round(v, 4) if isinstance(v, float) else v) for key, v in row.items()}, flush=True)
        del copies
        torch.cuda.empty_cache()
    columns = ["shape", "rows", "cublas_ms", "ours_ms", "speedup", "cublas_TBps", "ours_TBps", "max_rel_diff"]
    columns += ["best_ms", "best_config", "best_TBps"] if a.sweep else []
    table = print_table(results, columns)
    out = dict(environment=environment(), args=vars(a), rows=results, table=table)
    write_json(a.out, out)
    return out


if __name__ == "__main__":
    main()
