"""Several teachers: the fused mixture loss (forward + backward) with 1, 2 and 4 teachers on one GPU, against the
matmul floor of that many products, with its peak extra memory.

    python -m benchmarks.training.bench_multi_teacher --out runs/bench_multi_teacher.json  # H200: N = 8192, H = 4096
    python -m benchmarks.training.bench_multi_teacher --tiny --out /tmp/bench_multi_teacher.json   # CPU smoke test

Columns: J (teachers), mixture ("distribution": the student against sum_j w_j P_j; "loss": sum_j w_j D(S, P_j)),
ms (median fwd+bwd), floor_ms (the 3 + J bf16 N x H x V products: student logits, J teachers' logits, grad of the
input, grad of the weight), x_floor, extra_GiB (peak memory beyond the inputs and the two gradients any method
returns: the loss's own buffers; the chunk budget is 1 GiB), grad_err (max over d/dinput, d/dweight of
||g - g_ref|| / ||g_ref||, g_ref from fp32 products and fp32 math, reference.multi_teacher_kd_loss). The single-
teacher fused_linear_jsd is timed beside J = 1. Per-row weights are a random mixture over the J teachers.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from liger_patch_kd import KDLossConfig, fused_linear_jsd, fused_linear_multi_teacher_jsd
from liger_patch_kd import reference as R

from ..common import cuda_time_ms, environment, peak_extra_gib, print_table, write_json


def make_inputs(n: int, hidden: int, vocab: int, n_teachers: int, device, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(torch.bfloat16)

    weights = torch.rand(n, n_teachers, device=device, generator=g) + 0.1
    return dict(
        h_s=rand(n, hidden).requires_grad_(),
        w_s=rand(vocab, hidden, scale=2 / hidden**0.5).requires_grad_(),
        h_t=[rand(n, hidden) for _ in range(n_teachers)],
        w_t=[rand(vocab, hidden, scale=2.5 / hidden**0.5) for _ in range(n_teachers)],
        mix=weights / weights.sum(-1, keepdim=True),
        labels=torch.randint(0, vocab, (n,), device=device, generator=g),
    )


def reference_grads(x: dict, cfg: KDLossConfig, mixture: str, rows: int = 512) -> list[torch.Tensor]:
    """d loss / d(h_s, w_s) from fp32 products and fp32 math, a chunk of rows at a time."""
    h = x["h_s"].detach().float().requires_grad_()
    w = x["w_s"].detach().float().requires_grad_()
    valid = (x["labels"] != cfg.ignore_index).sum()
    w_t32 = [w_t.float() for w_t in x["w_t"]]
    for start in range(0, h.shape[0], rows):
        sl = slice(start, start + rows)
        teachers = [h_t[sl].float() @ w_t.T for h_t, w_t in zip(x["h_t"], w_t32)]
        loss = R.multi_teacher_kd_loss(
            h[sl] @ w.T, teachers, x["mix"][sl], x["labels"][sl], cfg.replace(reduction="sum"), mixture=mixture
        )
        (loss / valid).backward()
    return [h.grad, w.grad]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def floor_ms(x: dict, timer) -> float:
    """The 3 + J products every exact method needs, in bf16 with cuBLAS."""
    h_s, w_s = x["h_s"].detach(), x["w_s"].detach()
    logits = torch.empty(h_s.shape[0], w_s.shape[0], device=h_s.device, dtype=torch.bfloat16)
    g_in, g_w = torch.empty_like(h_s), torch.empty_like(w_s)

    def products():
        torch.mm(h_s, w_s.T, out=logits)
        for h_t, w_t in zip(x["h_t"], x["w_t"]):
            torch.mm(h_t, w_t.T, out=logits)
        torch.mm(logits, w_s, out=g_in)
        torch.mm(logits.T, h_s, out=g_w)

    return timer(products)


def cpu_time_ms(fn, reps: int = 3) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def run_case(n: int, hidden: int, vocab: int, n_teachers: int, cfg: KDLossConfig, device, with_error: bool):
    x = make_inputs(n, hidden, vocab, n_teachers, device)
    on_gpu = device.type == "cuda"
    timer = cuda_time_ms if on_gpu else cpu_time_ms
    floor = floor_ms(x, timer)
    params = [x["h_s"], x["w_s"]]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    methods = {
        f"multi-teacher {mixture}": (
            mixture,
            lambda mixture=mixture: fused_linear_multi_teacher_jsd(
                x["h_s"],
                x["w_s"],
                x["h_t"],
                x["w_t"],
                x["mix"],
                x["labels"],
                config=cfg,
                mixture=mixture,
                check_inputs=False,
            ),
        )  # fmt: skip
        for mixture in ("distribution", "loss")
    }
    if n_teachers == 1:
        methods["fused_linear_jsd (one teacher)"] = (
            "distribution",
            lambda: fused_linear_jsd(x["h_s"], x["w_s"], x["h_t"][0], x["w_t"][0], x["labels"], config=cfg),
        )
    rows = []
    for name, (mixture, fn) in methods.items():
        row = dict(N=n, H=hidden, V=vocab, J=n_teachers, method=name, floor_ms=floor)

        def step():
            for p in params:
                p.grad = None
            fn().backward()

        try:
            step()
            row["ms"] = timer(step)
            row["x_floor"] = row["ms"] / floor
            if on_gpu:
                row["extra_GiB"] = peak_extra_gib(step, exclude_bytes=grad_bytes)
            if with_error:
                step()
                got = [p.grad.clone() for p in params]
                row["grad_err"] = max(rel_err(a, b) for a, b in zip(got, reference_grads(x, cfg, mixture)))
        except torch.OutOfMemoryError:
            row["ms"] = "OOM"
        for p in params:
            p.grad = None
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_multi_teacher.json")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--ns", type=int, nargs="+", default=[8192], help="rows (add 4096 16384 to see flatness)")
    parser.add_argument("--teachers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--error-max-n", type=int, default=8192, help="largest N whose grad error is measured")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: N 64 / 96, H 32, V 1000")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.tiny:
        args.ns, args.hidden, args.vocab = [64, 96], 32, 1000
    cfg = KDLossConfig(beta=args.beta)
    rows = []
    for n in args.ns:
        for n_teachers in args.teachers:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows += run_case(n, args.hidden, args.vocab, n_teachers, cfg, device, n <= args.error_max_n)
    print(f"\nbf16, beta={args.beta}, forward+backward, {device}")
    columns = ["N", "J", "method", "ms", "floor_ms", "x_floor", "extra_GiB", "grad_err"]
    table = print_table(rows, columns)
    write_json(args.out, dict(environment=environment(), args=vars(args), rows=rows, table=table))


if __name__ == "__main__":
    main()
