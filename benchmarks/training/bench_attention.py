"""Causal attention at long context, by SDPA backend: where the long-context step's time goes, measured.

    python -m benchmarks.training.bench_attention --out runs/bench_attention.json
    python -m benchmarks.training.bench_attention --tiny                       # CPU smoke test, no figures

The attention of one decoder layer at the shapes of the step benchmark (`bench_train_step`): the 8B-shaped
teacher's (32 query heads, 8 key/value heads, head dim 128; forward only, it is frozen) and the 1B-shaped
student's (32 / 8 heads, head dim 64; forward + backward), bf16, batch 1, causal, for each sequence length and
each SDPA backend this stack offers (flash, cuDNN, memory-efficient). Reports ms per layer, TFLOP/s (causal:
half the square) and the per-step total over the models' layers (teacher 32 layers forward; student 16 layers
forward, recomputed forward and backward under gradient checkpointing), to set against the step time.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from ..common import cuda_time_ms, environment, print_table, write_json

BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
MODELS = {  # name: (query heads, key/value heads, head dim, layers, passes timed)
    "teacher 8B": (32, 8, 128, 32, "forward"),
    "student 1B": (32, 8, 64, 16, "forward+backward"),
}


def timed(fn, reps: int, device) -> float:
    """Median milliseconds of `fn`: CUDA events on a GPU (benchmarks.common), the wall clock on a CPU."""
    if device.type == "cuda":
        return cuda_time_ms(fn, warmup=2, reps=reps)
    began = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - began) * 1e3 / reps


def run(model: str, seq: int, backend: str, reps: int, device, dtype) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv_heads, dim, layers, passes = MODELS[model]
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, seq, dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, kv_heads, seq, dim, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, kv_heads, seq, dim, device=device, dtype=dtype, generator=g)
    # transformers repeats the key/value heads before SDPA (repeat_kv) unless it can pass enable_gqa
    k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
    backward = passes != "forward"
    if backward:
        q.requires_grad_(True)
        k.requires_grad_(True)
        v.requires_grad_(True)
    grad = torch.randn_like(q) if backward else None

    def step():
        with sdpa_kernel(getattr(SDPBackend, backend)):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if backward:
                out.backward(grad)

    try:
        ms = timed(step, reps, device)
    except RuntimeError as error:  # this backend does not take these shapes / this GPU
        return {"model": model, "seq": seq, "backend": backend, "error": str(error).splitlines()[0][:120]}
    flops = 4 * seq * seq * heads * dim / 2 * (3.5 if backward else 1.0)  # causal; backward ~2.5x the forward
    # per step: teacher forward once per layer; student forward twice (checkpointing recomputes it) + backward
    per_step = ms * layers * (1.0 if not backward else (1.0 + 3.5) / 3.5)
    return {
        "model": model,
        "seq": seq,
        "backend": backend,
        "passes": passes,
        "ms_per_layer": ms,
        "tflops": flops / ms / 1e9,
        "ms_per_step_all_layers": per_step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_attention.json")
    parser.add_argument("--seq", type=int, nargs="*", default=[4096, 16384, 32768])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tiny", action="store_true")
    a = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if a.tiny:
        a.seq, a.reps = [64], 2
    rows = [run(m, s, b, a.reps, device, dtype) for m in MODELS for s in a.seq for b in BACKENDS]
    print_table(
        rows, ["model", "seq", "backend", "passes", "ms_per_layer", "tflops", "ms_per_step_all_layers", "error"]
    )
    write_json(a.out, {"environment": environment(), "args": vars(a), "rows": rows})


if __name__ == "__main__":
    main()
