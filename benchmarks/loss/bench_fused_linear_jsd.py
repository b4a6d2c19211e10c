"""Fused linear JSD, forward + backward, on one GPU: this project against plain PyTorch, Liger-Kernel's two
losses, TRL's divergence kernel and the matmul floor, in one run.

    python -m benchmarks.loss.bench_fused_linear_jsd --out runs/bench_fused_linear_jsd.json

Columns: ms (median fwd+bwd, each call timed alone: the host's work before its first kernel included), gpu ms (the
same with the host ahead, as behind a model's forward in a training step: the GPU's kernels and the gaps between
them; benchmarks.common.cuda_time_ms), extra GiB (peak memory beyond the inputs and the gradients every method must
return, so a method's own buffers, fp32 weight-grad copies included), grad err (max over d/dinput and
d/dweight of ||g - g_ref|| / ||g_ref||, g_ref from float32 products and float32 softmax).
"""

from __future__ import annotations

import argparse
import gc

import torch

from liger_patch_kd import KDLossConfig, fused_linear_jsd, fused_linear_topk_kd
from liger_patch_kd import reference as R

from ..common import cuda_time_ms, environment, peak_extra_gib, print_table, write_json
from ..common.losses import GEMMA_V, LLAMA_V, QWEN_V, liger_methods, make_inputs, rel_err, trl_methods

# Qwen2.5: 0.5B-3B heads have 151936 rows, 7B and up 152064; the tokenizer holds 151665 real tokens
QWEN_SMALL_V, QWEN_LARGE_V, QWEN_TOKENS = 151936, 152064, 151665
GROUPS = ("sweep", "vocab", "betas", "topk", "padded")


def reference_grads(x: dict, cfg: KDLossConfig, rows: int = 1024) -> list[torch.Tensor]:
    """d loss / d(h_s, w_s) from float32 products and float32 math, computed a chunk of rows at a time."""
    h = x["h_s"].detach().float().requires_grad_()
    w = x["w_s"].detach().float().requires_grad_()
    w_t = x["w_t"].float()
    valid = (x["labels"] != cfg.ignore_index).sum()
    v = cfg.vocab_size  # padded heads: the reference sees the real tokens' columns only
    for start in range(0, h.shape[0], rows):
        sl = slice(start, start + rows)
        s_logits, t_logits = h[sl] @ w[:v].T, x["h_t"][sl].float() @ w_t[:v].T
        loss = R.kd_loss(s_logits, t_logits, x["labels"][sl], cfg.replace(reduction="sum", vocab_size=None))
        (loss / valid).backward()
    return [h.grad, w.grad]


def method_ours(x: dict, cfg: KDLossConfig) -> torch.Tensor:
    return fused_linear_jsd(x["h_s"], x["w_s"], x["h_t"], x["w_t"], x["labels"], config=cfg)


def method_ours_fp32_weight_grad(x: dict, cfg: KDLossConfig) -> torch.Tensor:
    """The weight gradient accumulated in float32 across chunks; its chunks' gradients gathered in groups."""
    config = cfg.replace(fp32_weight_grad=True)
    return fused_linear_jsd(x["h_s"], x["w_s"], x["h_t"], x["w_t"], x["labels"], config=config)


def method_ours_fp32_weight_grad_ungrouped(x: dict, cfg: KDLossConfig) -> torch.Tensor:
    """The same, each 1024-row chunk running its own gradient products (no gradient groups), in the same 1 GiB."""
    config = cfg.replace(fp32_weight_grad=True, chunk_size=1024, grad_chunk_size=1024)
    return fused_linear_jsd(x["h_s"], x["w_s"], x["h_t"], x["w_t"], x["labels"], config=config)


def method_ours_chunk_2048(x: dict, cfg: KDLossConfig) -> torch.Tensor:
    """The memory / speed trade-off: fewer, larger chunks (2 GiB of logits) re-read the weight gradient less."""
    return fused_linear_jsd(x["h_s"], x["w_s"], x["h_t"], x["w_t"], x["labels"], config=cfg.replace(chunk_size=2048))


def method_torch(x: dict, cfg: KDLossConfig) -> torch.Tensor:
    """What a plain HF user writes: materialise both logits, upcast, reference loss."""
    s = x["h_s"] @ x["w_s"].T
    with torch.no_grad():
        t = x["h_t"] @ x["w_t"].T
    return R.kd_loss(s.float(), t.float(), x["labels"], cfg)


def floor_ms(x: dict, host_ahead: bool = False) -> float:
    """The four N x H x V bf16 products an exact online method cannot avoid, back to back."""
    n, vocab = x["h_s"].shape[0], x["w_s"].shape[0]
    logits = torch.empty(n, vocab, device="cuda", dtype=torch.bfloat16)
    g_in = torch.empty_like(x["h_s"])
    g_w = torch.empty_like(x["w_s"])
    h_s, w_s, h_t, w_t = (x[k].detach() for k in ("h_s", "w_s", "h_t", "w_t"))

    def products():
        torch.mm(h_s, w_s.T, out=logits)
        torch.mm(h_t, w_t.T, out=logits)
        torch.mm(logits, w_s, out=g_in)
        torch.mm(logits.T, h_s, out=g_w)

    return cuda_time_ms(products, host_ahead=host_ahead)  # the buffers go with this frame


def run_padded_case(n: int, hidden: int) -> list[dict]:
    """A Qwen2.5-shaped padded pair (student head 151936 rows, teacher 152064, 151665 real tokens) against the
    same loss on equal heads: slicing the weights as row views should cost nothing beyond the smaller V."""
    rows = []
    for label, teacher_vocab, vocab_size in (
        (f"equal heads V={QWEN_SMALL_V}", None, None),
        (f"padded V_s={QWEN_SMALL_V} V_t={QWEN_LARGE_V} vocab_size={QWEN_TOKENS}", QWEN_LARGE_V, QWEN_TOKENS),
    ):
        gc.collect()
        torch.cuda.empty_cache()
        x = make_inputs(n, hidden, QWEN_SMALL_V, teacher_vocab=teacher_vocab)
        x["labels"] = x["labels"] % QWEN_TOKENS
        cfg = KDLossConfig(beta=0.5, vocab_size=vocab_size)
        ref = reference_grads(x, cfg)
        params = [x["h_s"], x["w_s"]]
        row = dict(N=n, V=QWEN_SMALL_V, beta=cfg.beta, method=f"liger_patch_kd, {label}")

        def step():
            for p in params:
                p.grad = None
            method_ours(x, cfg).backward()

        step()
        row["ms"] = cuda_time_ms(step)
        row["extra_GiB"] = peak_extra_gib(step, exclude_bytes=sum(p.numel() * p.element_size() for p in params))
        row["grad_err"] = max(rel_err(p.grad, r) for p, r in zip(params, ref))
        if vocab_size is not None:
            row["padding_rows_grad_zero"] = bool((x["w_s"].grad[vocab_size:] == 0).all())
        rows.append(row)
        print(row, flush=True)
    return rows


def run_case(n: int, hidden: int, vocab: int, cfg: KDLossConfig, methods: dict, with_error: bool) -> list[dict]:
    x = make_inputs(n, hidden, vocab)
    ref = reference_grads(x, cfg) if with_error else None
    floor, floor_gpu = floor_ms(x), floor_ms(x, host_ahead=True)
    params = [x["h_s"], x["w_s"]]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    rows = [dict(N=n, V=vocab, beta=cfg.beta, method="matmul floor (4 bf16 products)", ms=floor, x_floor=1.0,
                 gpu_ms=floor_gpu, gpu_x_floor=1.0)]  # fmt: skip
    for name, fn in methods.items():
        row = dict(N=n, V=vocab, beta=cfg.beta, method=name)

        def step():
            for p in params:
                p.grad = None
            fn(x, cfg).backward()

        try:
            step()  # compile / autotune outside the measurement
            row["ms"] = cuda_time_ms(step)
            row["x_floor"] = row["ms"] / floor
            row["gpu_ms"] = cuda_time_ms(step, host_ahead=True)
            row["gpu_x_floor"] = row["gpu_ms"] / floor_gpu
            for p in params:
                p.grad = None
            row["extra_GiB"] = peak_extra_gib(step, exclude_bytes=grad_bytes)
            if ref is not None:
                row["grad_err"] = max(rel_err(p.grad, r) for p, r in zip(params, ref))
        except torch.OutOfMemoryError:
            row["ms"] = "OOM"
        for p in params:
            p.grad = None
        gc.collect()
        torch.cuda.empty_cache()
        rows.append(row)
        print(row, flush=True)
    return rows  # x and ref go with this frame; the next case starts with gc


def run_topk_case(n: int, hidden: int, vocab: int, k: int, cfg: KDLossConfig) -> list[dict]:
    """Offline top-k: this project against plain PyTorch on materialised student logits, and the floor of the
    three N x H x V products left when the teacher is data (student logits, grad of input, grad of weight)."""
    x = make_inputs(n, hidden, vocab)
    g = torch.Generator(device="cuda").manual_seed(1)
    teacher_lp, ids = torch.log_softmax(torch.randn(n, vocab, device="cuda", generator=g) * 2, -1).topk(k, -1)
    ids, teacher_lp = ids.int(), teacher_lp.to(torch.bfloat16)
    logits = torch.empty(n, vocab, device="cuda", dtype=torch.bfloat16)
    g_in, g_w = torch.empty_like(x["h_s"]), torch.empty_like(x["w_s"])
    h_s, w_s = x["h_s"].detach(), x["w_s"].detach()

    def products():
        torch.mm(h_s, w_s.T, out=logits)
        torch.mm(logits, w_s, out=g_in)
        torch.mm(logits.T, h_s, out=g_w)

    floor = cuda_time_ms(products)  # its buffers stay allocated: extra_GiB counts from what exists before a step
    floor_gpu = cuda_time_ms(products, host_ahead=True)
    rows = [dict(N=n, V=vocab, beta=cfg.beta, method=f"top-{k} floor (3 bf16 products)", ms=floor, x_floor=1.0,
                 gpu_ms=floor_gpu, gpu_x_floor=1.0)]  # fmt: skip
    methods = {
        f"liger_patch_kd top-{k}": lambda: fused_linear_topk_kd(
            x["h_s"], x["w_s"], ids, teacher_lp, x["labels"], config=cfg, check_inputs=False
        ),
        f"plain pytorch top-{k}": lambda: R.topk_kd_loss(
            (x["h_s"] @ x["w_s"].T).float(), ids, teacher_lp, x["labels"], cfg
        ),
    }
    params = [x["h_s"], x["w_s"]]
    for name, fn in methods.items():

        def step():
            for p in params:
                p.grad = None
            fn().backward()

        row = dict(N=n, V=vocab, beta=cfg.beta, method=name)
        try:
            step()
            row["ms"] = cuda_time_ms(step)
            row["x_floor"] = row["ms"] / floor
            row["gpu_ms"] = cuda_time_ms(step, host_ahead=True)
            row["gpu_x_floor"] = row["gpu_ms"] / floor_gpu
            row["extra_GiB"] = peak_extra_gib(step, exclude_bytes=sum(p.numel() * p.element_size() for p in params))
        except torch.OutOfMemoryError:
            row["ms"] = "OOM"
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_fused_linear_jsd.json")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ns", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--quick", action="store_true", help="two sizes only, for a smoke test")
    parser.add_argument("--only", nargs="+", choices=GROUPS, default=list(GROUPS), help="case groups to run")
    parser.add_argument("--methods", nargs="+", help="run only the methods whose names start with one of these")
    args = parser.parse_args()
    ns = [1024, 2048] if args.quick else args.ns
    groups = set(args.only)

    cfg = KDLossConfig(beta=0.5)
    liger, liger_note = liger_methods(cfg)
    trl, trl_note = trl_methods(cfg)
    note = "; ".join(n for n in (liger_note, trl_note) if n) or None
    methods = {"liger_patch_kd": method_ours, "liger_patch_kd chunk 2048": method_ours_chunk_2048,
               "liger_patch_kd fp32 weight grad": method_ours_fp32_weight_grad,
               "liger_patch_kd fp32 weight grad, no groups": method_ours_fp32_weight_grad_ungrouped,
               "plain pytorch": method_torch, **liger, **trl}  # fmt: skip
    cases = [(n, LLAMA_V, cfg, n <= 8192) for n in ns] if "sweep" in groups else []
    if not args.quick and "vocab" in groups:
        cases += [(8192, QWEN_V, cfg, False), (8192, GEMMA_V, cfg, False)]
    if not args.quick and "betas" in groups:
        cases += [(8192, LLAMA_V, KDLossConfig(beta=0.0), True), (8192, LLAMA_V, KDLossConfig(beta=1.0), False)]
    rows = []
    for n, vocab, case_cfg, with_error in cases:
        gc.collect()
        torch.cuda.empty_cache()
        if case_cfg is not cfg:  # other betas: ours and the Liger losses (same convention), not plain torch again
            case_methods = {"liger_patch_kd": method_ours, **liger_methods(case_cfg)[0], **trl_methods(case_cfg)[0]}
        else:
            case_methods = methods
        if args.methods:
            case_methods = {k: v for k, v in case_methods.items() if k.startswith(tuple(args.methods))}
        rows += run_case(n, args.hidden, vocab, case_cfg, case_methods, with_error)
    if not args.quick and "topk" in groups:  # the offline loss: teacher log-probs as data, K = 64
        rows += run_topk_case(8192, args.hidden, LLAMA_V, 64, KDLossConfig(beta=0.0))
    if not args.quick and "padded" in groups:
        rows += run_padded_case(8192, args.hidden)
    print(f"\nH={args.hidden}, bf16, forward+backward" + (f"; note: {note}" if note else ""))
    columns = ["N", "V", "beta", "method", "ms", "x_floor", "gpu_ms", "gpu_x_floor", "extra_GiB", "grad_err",
               "padding_rows_grad_zero"]  # fmt: skip
    table = print_table(rows, columns)
    write_json(args.out, dict(environment=environment(), hidden=args.hidden, note=note, rows=rows, table=table))


if __name__ == "__main__":
    main()
