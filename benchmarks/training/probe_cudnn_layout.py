"""Why kd_teacher_attention="cudnn" did not speed up the step: SDPA by backend and memory layout, at the teacher's
shapes (32 query heads, 8 key/value heads, head dim 128, causal, forward), the layouts transformers hands over.

    python -m benchmarks.training.probe_cudnn_layout --out runs/probe_cudnn_layout.json

Rows: flash with enable_gqa on (batch, seq, heads, dim) views transposed to (batch, heads, seq, dim), as
transformers calls it without a mask; cuDNN on the same query view with the key/value heads repeated (what
an earlier teacher-attention patch did); cuDNN with every operand contiguous (batch, heads, seq, dim); cuDNN with
every operand a transposed (batch, seq, heads, dim) view; and SDPA's own choice (no backend forced) on
transformers' call, which is what the step runs. ms per layer, median of CUDA events. With the profiler, the
default-dispatch row also names the kernel SDPA picked.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..common import cuda_time_ms, environment, print_table, write_json


def views(batch, seq, heads, kv_heads, dim):
    """Projections as transformers makes them: (batch, seq, heads * dim) viewed and transposed."""

    def proj(h):
        return torch.randn(batch, seq, h, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    return proj(heads), proj(kv_heads), proj(kv_heads)


def repeat(t, groups):
    return t[:, :, None].expand(-1, -1, groups, -1, -1).flatten(1, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/probe_cudnn_layout.json")
    a = parser.parse_args()
    rows = []
    for batch, seq in ((4, 4096), (1, 32768)):
        q, k, v = views(batch, seq, 32, 8, 128)
        cases = {
            "flash, enable_gqa, transformers' views": (SDPBackend.FLASH_ATTENTION, lambda: (q, k, v), True),
            "default dispatch, enable_gqa, transformers' views (the step)": (None, lambda: (q, k, v), True),
            "cudnn, enable_gqa, transformers' views": (SDPBackend.CUDNN_ATTENTION, lambda: (q, k, v), True),
            "cudnn, query view, repeated kv (contiguous)": (
                SDPBackend.CUDNN_ATTENTION, lambda: (q, repeat(k, 4), repeat(v, 4)), False),
            "cudnn, all contiguous (b, h, s, d)": (
                SDPBackend.CUDNN_ATTENTION, lambda: (q.contiguous(), repeat(k, 4), repeat(v, 4)), False),
            "cudnn, all (b, s, h, d) views": (
                SDPBackend.CUDNN_ATTENTION,
                lambda: (q, repeat(k, 4).transpose(1, 2).contiguous().transpose(1, 2),
                         repeat(v, 4).transpose(1, 2).contiguous().transpose(1, 2)), False),
            "flash, repeated kv (contiguous)": (
                SDPBackend.FLASH_ATTENTION, lambda: (q, repeat(k, 4), repeat(v, 4)), False),
        }  # fmt: skip
        for name, (backend, operands, gqa) in cases.items():

            def run():
                with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                    F.scaled_dot_product_attention(*operands(), is_causal=True, enable_gqa=gqa)

            try:
                ms = cuda_time_ms(run, warmup=3, reps=10)
            except RuntimeError as e:
                ms = f"error: {str(e)[:80]}"
            rows.append(dict(batch=batch, seq=seq, case=name, ms_per_layer=ms))
            print(rows[-1], flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.cuda.synchronize()
        picked = [e.key[:80] for e in prof.key_averages() if e.device_type.name == "CUDA"]
        rows.append(dict(batch=batch, seq=seq, case="kernels of the default dispatch", ms_per_layer=" | ".join(picked)))
        print(rows[-1], flush=True)
    table = print_table(rows, ["batch", "seq", "case", "ms_per_layer"])
    write_json(a.out, dict(environment=environment(), rows=rows, table=table))


if __name__ == "__main__":
    main()
