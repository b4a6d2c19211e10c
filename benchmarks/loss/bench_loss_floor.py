"""The fused loss, forward + backward, against its floor: the four N x H x V products timed in the same run.

    python -m benchmarks.loss.bench_loss_floor --out benchmarks/results/bench_loss_floor.json
    python -m benchmarks.loss.bench_loss_floor --tiny      # CPU smoke test, tiny shapes, no figures

Rows per N (default 8192 and 2048; H 4096, V 128256, bf16, beta 0.5):
  matmul floor            the two logit products and the two gradient products in bf16, back to back
  fp8 floor               the same with the two logit products in FP8 (e4m3, rowwise, operands pre-quantised)
  liger_patch_kd          the default fused loss
  ... fp8 teacher         teacher_logits_fp8=True (the teacher's logit product in FP8)
  ... fp8 both            teacher_logits_fp8 and student_logits_fp8 (the backward stays bf16)
  liger chunked / triton  Liger-Kernel's LigerFusedLinearJSDLoss (compiled) and LigerFusedLinearJSD, if importable
Columns: ms (median), x_floor, extra_GiB (peak beyond inputs and returned gradients), held_GiB (memory kept between
calls: the frozen teacher head's cached FP8 copy), grad_err (max over d/dinput,
d/dweight of ||g - g_ref|| / ||g_ref||, g_ref from fp32 products), loss_rel_err (against the same fp32 reference),
and for the FP8 rows the teacher distribution's KL(P_bf16 || P_fp8) per row (mean, p99) on the first 1024 rows.
Random weights: the KL figures say what the rounding does to flat-ish random-logit distributions, not to a
trained teacher's peaked ones.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import torch

from liger_patch_kd import KDLossConfig, fused_linear_jsd
from liger_patch_kd import reference as R
from liger_patch_kd.ops.backend import logits_fp32
from liger_patch_kd.ops.fp8 import fp8_available, quantize_rows
from liger_patch_kd.ops.fp8_logits import forget_quantized_head, fp8_logits, quantize_head

from ..common import cuda_time_ms, environment, print_table, write_json
from ..common.losses import LLAMA_V, floor_products, liger_methods, rel_err

OURS = "liger_patch_kd"
VARIANTS = {
    OURS: {},
    f"{OURS} fp8 teacher": dict(teacher_logits_fp8=True),
    f"{OURS} fp8 both": dict(teacher_logits_fp8=True, student_logits_fp8=True),
}


def make_inputs(n: int, hidden: int, vocab: int, device: str, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(torch.bfloat16)

    # hidden ~N(0,1), weights scaled so logits have std ~2 (student) and ~2.5 (teacher)
    return dict(
        h_s=rand(n, hidden).requires_grad_(),
        w_s=rand(vocab, hidden, scale=2 / hidden**0.5).requires_grad_(),
        h_t=rand(n, hidden),
        w_t=rand(vocab, hidden, scale=2.5 / hidden**0.5),
        labels=torch.randint(0, vocab, (n,), device=device, generator=g),
    )


def time_ms(fn: Callable[[], object], device: str, warmup: int = 2, reps: int = 8) -> float:
    """Median time of fn(): CUDA events on the GPU (benchmarks.common), the wall clock on the CPU."""
    if device == "cuda":
        return cuda_time_ms(fn, warmup=warmup, reps=reps)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def floors(x: dict, device: str, with_fp8: bool) -> dict[str, float]:
    """The four products (bf16), and the same with the two logit products in FP8 on pre-quantised operands."""
    logit_products, grad_products = floor_products(x)
    h_s, w_s, h_t, w_t = (x[k].detach() for k in ("h_s", "w_s", "h_t", "w_t"))

    def bf16():
        logit_products()
        grad_products()

    out = {"matmul floor (4 bf16 products)": time_ms(bf16, device)}
    if with_fp8:
        quantized = [(quantize_rows(h), quantize_rows(w)) for h, w in ((h_s, w_s), (h_t, w_t))]

        def fp8():
            for (h8, sh), (w8, sw) in quantized:
                torch._scaled_mm(h8, w8.t(), scale_a=sh[:, None], scale_b=sw[None, :], out_dtype=torch.bfloat16)
            grad_products()

        out["fp8 floor (2 fp8 + 2 bf16 products)"] = time_ms(fp8, device)
    return out


def reference(x: dict, cfg: KDLossConfig, rows: int = 1024) -> tuple[float, list[torch.Tensor]]:
    """Loss and d loss / d(h_s, w_s) from fp32 products and fp32 math, a chunk of rows at a time."""
    h = x["h_s"].detach().float().requires_grad_()
    w = x["w_s"].detach().float().requires_grad_()
    w_t = x["w_t"].float()
    valid = (x["labels"] != cfg.ignore_index).sum()
    total = 0.0
    for start in range(0, h.shape[0], rows):
        sl = slice(start, start + rows)
        loss = R.kd_loss(h[sl] @ w.T, x["h_t"][sl].float() @ w_t.T, x["labels"][sl], cfg.replace(reduction="sum"))
        (loss / valid).backward()
        total += float(loss / valid)
    return total, [h.grad, w.grad]


def teacher_kl(x: dict, rows: int = 1024) -> dict:
    """KL(P_bf16 || P_fp8) of the teacher's distribution per row (fp32-output products either way)."""
    h_t, w_t = x["h_t"][:rows], x["w_t"]
    log_p = torch.log_softmax(logits_fp32(h_t, w_t, None), -1)
    log_q = torch.log_softmax(fp8_logits(h_t, quantize_head(w_t, w_t.shape[0], keep=False), None), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return dict(teacher_kl_mean=float(kl.mean()), teacher_kl_p99=float(kl.quantile(0.99)))


def run_case(n: int, hidden: int, vocab: int, device: str, methods: dict[str, Callable], fp8: bool) -> list[dict]:
    x = make_inputs(n, hidden, vocab, device)
    cfg = KDLossConfig(beta=0.5)
    ref_loss, ref_grads = reference(x, cfg)
    rows = [dict(N=n, method=name, ms=ms) for name, ms in floors(x, device, fp8).items()]
    floor = rows[0]["ms"]
    for row in rows:
        row["x_floor"] = row["ms"] / floor
    kl = teacher_kl(x) if fp8 else {}
    params = [x["h_s"], x["w_s"]]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    for name, fn in methods.items():
        row = dict(N=n, method=name)
        losses = []

        def step():
            for p in params:
                p.grad = None
            loss = fn(x, cfg)
            loss.backward()
            losses.append(loss.detach())

        try:
            if device == "cuda":
                torch.cuda.empty_cache()
                reserved = torch.cuda.memory_reserved()
            step()  # compile / capture / autotune outside the measurement
            row["ms"] = time_ms(step, device)
            row["x_floor"] = row["ms"] / floor
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                step()
                torch.cuda.synchronize()
                row["extra_GiB"] = (torch.cuda.max_memory_allocated() - before - grad_bytes) / 2**30
                row["grad_err"] = max(rel_err(p.grad, r) for p, r in zip(params, ref_grads))
                for p in params:
                    p.grad = None
                torch.cuda.empty_cache()  # what stays between calls: a cached FP8 teacher head
                row["held_GiB"] = (torch.cuda.memory_reserved() - reserved) / 2**30
            else:
                step()
                row["grad_err"] = max(rel_err(p.grad, r) for p, r in zip(params, ref_grads))
            row["loss_rel_err"] = abs(float(losses[-1]) - ref_loss) / abs(ref_loss)
            if "fp8" in name:
                row.update(kl)
        except torch.OutOfMemoryError:
            row["ms"] = "OOM"
        except Exception as e:  # a row that breaks is reported, the others still run
            row["ms"] = f"error: {type(e).__name__}: {str(e)[:100]}"
        for p in params:
            p.grad = None
        for w in (x["w_s"], x["w_t"]):
            forget_quantized_head(w)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        print(row, flush=True)
    return rows


def ours(options: dict) -> Callable:
    def method(x: dict, cfg: KDLossConfig) -> torch.Tensor:
        return fused_linear_jsd(x["h_s"], x["w_s"], x["h_t"], x["w_t"], x["labels"], config=cfg.replace(**options))

    return method


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/ (runs/ with --tiny)")
    parser.add_argument("--ns", type=int, nargs="+", default=[8192, 2048])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=LLAMA_V)
    parser.add_argument("--methods", nargs="+", help="only the rows whose names start with one of these")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with tiny shapes")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    out = args.out or ("runs/bench_loss_floor_tiny.json" if args.tiny else "benchmarks/results/bench_loss_floor.json")
    ns, hidden, vocab = ([64, 48], 64, 512) if args.tiny else (args.ns, args.hidden, args.vocab)
    fp8_ok, fp8_why = fp8_available(torch.device(device))
    notes = [] if fp8_ok else [f"FP8 rows skipped: {fp8_why}"]
    variants = {name: ours(opts) for name, opts in VARIANTS.items() if fp8_ok or "fp8" not in name}
    methods = dict(variants)
    if device == "cuda":
        liger, note = liger_methods(KDLossConfig(beta=0.5))
        methods.update(liger)
        notes += [note] if note else []
    else:
        notes.append("CPU smoke test: Liger rows skipped")
    if args.methods:
        methods = {k: v for k, v in methods.items() if k.startswith(tuple(args.methods))}
    for note in notes:
        print(f"note: {note}", flush=True)
    rows = []
    for n in ns:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        rows += run_case(n, hidden, vocab, device, methods, fp8_ok)
    print(f"\nH={hidden}, V={vocab}, bf16, beta 0.5, forward+backward" + "".join(f"; {n}" for n in notes))
    columns = ["N", "method", "ms", "x_floor", "extra_GiB", "held_GiB", "grad_err", "loss_rel_err", "teacher_kl_mean",
               "teacher_kl_p99"]  # fmt: skip
    table = print_table(rows, columns)
    write_json(out, dict(environment=environment(), hidden=hidden, vocab=vocab, notes=notes, rows=rows,
                              table=table))  # fmt: skip


if __name__ == "__main__":
    main()
