"""Sampled teacher tokens against top-k: gradient bias and variance against the full-vocabulary
forward-KL gradient, and bytes per token, at (near) equal bytes.

    python -m benchmarks.loss.bench_sampled_kd --out runs/bench_sampled_kd.json                 # CPU, the demo teacher
    python -m benchmarks.loss.bench_sampled_kd --teacher fp8bench --speed --out $OUT/bench_sampled_kd.json  # GPU
    python -m benchmarks.loss.bench_sampled_kd --tiny --out runs/bench_sampled_kd_tiny.json     # CPU smoke test

The teacher is trained here on the packaged corpus: the demo's (Llama 4 x 128, liger_patch_kd.demo) or
bench_fp8_teacher's ~190M Llama (--teacher fp8bench, for --train-seconds, on a GPU; --tiny: a tiny one on CPU).
`--tokenizer`: "char" (V = 48, the demo's default) or "bpe" (fp8bench's default: a byte-level BPE trained on the
corpus here, benchmarks.common.corpus_token_ids, V = 464), where every row of METHODS fits. A fresh demo-sized student
(Llama 2 x 64) is scored on held-out windows: g* is the gradient of the full-vocabulary forward KL(P_T || S_T)
(batchmean) with respect to the student's last hidden states and lm_head weight, in float64. Each method's
gradient g comes from the same fused losses a training run uses: top-k (fused_linear_topk_kd, tail "bucket"),
sampled tokens (fused_linear_sampled_kd; --repeats independent draws) and the hybrid (exact top-k + draws from
the rest). Reported, relative to |g*|:
  bias  = |mean g - g*|   (for draws: with its Monte-Carlo floor `bias_floor` = sqrt(tr Cov / repeats))
  sd    = sqrt(E |g - mean g|^2)   (one batch's noise; 0 for top-k; E and Cov over the draws, divisor repeats)
  rmse  = sqrt(E |g - g*|^2)   (what one training step sees: bias and noise together)
and the bytes per position the store spends (plain: int32 id + bf16 log-prob per slot, + a uint8 count per
sampled slot; packed12: the store's compact encoding, store/compact.py). `--demo-students` adds the demo row:
students distilled offline from top-8 and from sampled data of about its size, three seeds, held-out CE and KL.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from liger_patch_kd import KDLossConfig, fused_linear_sampled_kd, fused_linear_topk_kd
from liger_patch_kd import reference as R
from liger_patch_kd.teacher.sampling import sample_teacher_tokens
from liger_patch_kd.teacher.store.compact import PackedCodec

from ..common import TOKENIZERS, corpus_token_ids, cuda_time_ms, environment, peak_extra_gib, print_table, write_json

# (name, top_k, samples): top-k K = 8, 16, 32, 64; draws at m = 8, 16, 32 and at top-k's plain bytes (m = 7 ~ top-8,
# 14 ~ top-16, 27 ~ top-32, 55 ~ top-64); the hybrid (K exact + m drawn) at those bytes. Rows that do not fit the
# vocabulary (K + m > V: top-64 and m = 55 with the character tokenizer's V = 48) are left out.
METHODS = [
    ("top-8", 8, 0), ("top-16", 16, 0), ("top-32", 32, 0), ("top-64", 64, 0),
    ("sampled m=7", 0, 7), ("sampled m=8", 0, 8), ("sampled m=14", 0, 14), ("sampled m=16", 0, 16),
    ("sampled m=27", 0, 27), ("sampled m=32", 0, 32), ("sampled m=55", 0, 55),
    ("hybrid 4+3", 4, 3), ("hybrid 8+7", 8, 7), ("hybrid 16+13", 16, 13), ("hybrid 32+23", 32, 23),
]  # fmt: skip


def bytes_per_position(vocab: int, top_k: int, samples: int) -> tuple[int, int]:
    """(plain, packed12) bytes a store spends per position on `top_k` exact slots plus `samples` drawn slots."""
    plain = 6 * top_k + 7 * samples
    packed = (PackedCodec(vocab, top_k, 12).row_bytes if top_k else 0) + (
        PackedCodec(vocab, samples, 12).row_bytes + samples if samples else 0
    )
    return plain, packed


def demo_teacher(device, steps: int, work: Path, tokenizer: str, vocab: int):
    """The demo's teacher (liger_patch_kd.demo): (teacher, vocab, train windows, held-out windows, collator)."""
    from transformers import Trainer

    from liger_patch_kd import teacher as TD
    from liger_patch_kd.demo.toys import PAD, DemoSizes, build_model, training_args
    from liger_patch_kd.demo.toys import windows as cut_windows

    sizes = DemoSizes.quick()
    ids, vocab, _ = corpus_token_ids(tokenizer, vocab)
    split = int(len(ids) * 0.9)
    train = cut_windows(ids[:split], sizes.seq)
    held = cut_windows(ids[split:], sizes.seq)[:32]
    collator = TD.TeacherDataCollator(pad_token_id=PAD)
    teacher = build_model(vocab, 128, 4, seed=0, device=device)
    data = [{"input_ids": torch.tensor(w)} for w in train]
    Trainer(model=teacher, args=training_args(work / "teacher", steps, sizes.batch, device),
            train_dataset=data, data_collator=collator).train()  # fmt: skip
    return teacher.eval(), vocab, train, held, collator


def fp8bench_teacher(device, seconds: float, tokenizer: str, vocab: int, tiny: bool = False):
    """bench_fp8_teacher's ~190M teacher, trained for `seconds` on the GPU (`tiny`: its tiny shape, on CPU)."""
    from ..common.fp8_teacher import TEACHER, TINY, Windows, llama, train_teacher

    token_ids, vocab, _ = corpus_token_ids(tokenizer, vocab)
    ids = torch.tensor(token_ids)
    cut = int(0.9 * len(ids))
    teacher = llama(TINY if tiny else TEACHER, vocab, device, torch.float32, seed=0)
    train_teacher(teacher, Windows(ids[:cut], 32 if tiny else 256, device), seconds, 4 if tiny else 32, device)
    held = Windows(ids[cut:], 64, device).consecutive()[:32].tolist()
    return teacher.eval(), vocab, None, held, None


@torch.no_grad()
def head_inputs(student, teacher, held, device, dtype):
    """(student last hidden states (N, H), lm_head weight (V, H), teacher log-probs at T = 1 (N, V)) in `dtype`,
    for every position of the held-out windows but each window's last."""
    ids = torch.tensor(held, device=device)
    out = student(input_ids=ids, output_hidden_states=True)
    hidden = out.hidden_states[-1][:, :-1].reshape(-1, out.hidden_states[-1].shape[-1])
    lp = F.log_softmax(teacher(input_ids=ids).logits[:, :-1].float(), -1).reshape(hidden.shape[0], -1)
    return hidden.to(dtype), student.get_output_embeddings().weight.detach().to(dtype), lp.to(dtype)


def gradient(loss_fn, hidden, weight) -> torch.Tensor:
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    gh, gw = torch.autograd.grad(loss_fn(h, w), (h, w))
    return torch.cat([gh.reshape(-1), gw.reshape(-1)])


def measure(hidden, weight, lp1, temperature: float, repeats: int, seed: int) -> list[dict]:
    vocab = weight.shape[0]
    exact = gradient(lambda h, w: R.kd_loss(h @ w.T, lp1, beta=0.0, temperature=temperature), hidden, weight)
    norm = exact.norm()
    lp_t = F.log_softmax(lp1 / temperature, -1)  # the draws' distribution P_T
    gen = torch.Generator(lp1.device).manual_seed(seed)
    rows = []
    for name, k, m in METHODS:
        if k >= vocab or k + m > vocab:
            continue
        if m == 0:  # top-k: log-probs at T = 1, tempered by the loss (the top-k convention)
            top_lp, top_ids = lp1.topk(k, -1)
            draws = [
                gradient(
                    lambda h, w: fused_linear_topk_kd(
                        h, w, top_ids, top_lp, config=KDLossConfig(beta=0.0, temperature=temperature)
                    ),
                    hidden,
                    weight,
                )
            ]  # fmt: skip
            tail = float((1 - lp_t.topk(k, -1).values.exp().sum(-1)).mean())
        else:
            draws = []
            for _ in range(repeats):
                d = sample_teacher_tokens(lp_t, m, top_k=k, generator=gen)

                def loss(h, w, d=d):
                    return fused_linear_sampled_kd(
                        h, w, d.ids, d.counts, d.logprobs, teacher_token_ids=d.topk_ids,
                        teacher_logprobs=d.topk_logprobs, config=KDLossConfig(beta=0.0, temperature=temperature),
                    )  # fmt: skip

                draws.append(gradient(loss, hidden, weight))
            tail = float((1 - lp_t.topk(k, -1).values.exp().sum(-1)).mean()) if k else 1.0
        g = torch.stack(draws)
        mean = g.mean(0)
        spread = ((g - mean) ** 2).sum(-1).mean()
        plain, packed = bytes_per_position(vocab, k, m)
        rows.append(dict(
            method=name, top_k=k, samples=m, bytes_plain=plain, bytes_packed12=packed,
            mass_left_to_draws=round(tail, 4), bias=float((mean - exact).norm() / norm),
            bias_floor=float((spread / len(draws)).sqrt() / norm) if m else 0.0,
            sd=float(spread.sqrt() / norm), rmse=float(((g - exact) ** 2).sum(-1).mean().sqrt() / norm),
            repeats=len(draws),
        ))  # fmt: skip
    return rows


def demo_students(teacher, vocab, train, held, collator, device, work: Path, steps: int, seeds) -> list[dict]:
    """Offline students from a top-8 store and from sampled stores of about its bytes (held-out CE and KL)."""
    from liger_patch_kd import teacher as TD
    from liger_patch_kd.demo.same_tokenizer import evaluate
    from liger_patch_kd.demo.toys import DemoSizes, build_model, training_args
    from liger_patch_kd.models import revert_kd_patch
    from liger_patch_kd.trainer import KDTrainer

    sizes = DemoSizes.quick()
    stores = {
        "top-8": dict(top_k=8),
        "sampled m=7": dict(top_k=0, samples=7),
        "hybrid 4+3": dict(top_k=4, samples=3),
    }
    rows = []
    for name, options in stores.items():
        store = TD.precompute(teacher, train, work / name.replace(" ", "_"), batch_size=32, progress=False, **options)
        data = TD.TeacherLogprobsDataset(store, vocab_size=vocab)
        plain, packed = bytes_per_position(vocab, options["top_k"], options.get("samples", 0))
        ces, kls = [], []
        for seed in seeds:
            student = build_model(vocab, 64, 2, seed=seed, device=device)
            args = training_args(work / "student", steps, sizes.batch, device, seed=seed - 1, use_kd_patch=True,
                                 kd_beta=0.0)  # fmt: skip
            KDTrainer(model=student, args=args, train_dataset=data, data_collator=collator).train()
            revert_kd_patch(model=student)
            ce, kl = evaluate(student, teacher, held, device)
            ces.append(ce)
            kls.append(kl)
            print(f"  {name}, seed {seed}: CE {ce:.4f}, KL {kl:.4f}", flush=True)

        def mean_sd(v):
            mean = sum(v) / len(v)
            return mean, math.sqrt(sum((x - mean) ** 2 for x in v) / max(1, len(v) - 1))

        (ce, ce_sd), (kl, kl_sd) = mean_sd(ces), mean_sd(kls)
        rows.append(dict(data=name, bytes_plain=plain, bytes_packed12=packed, held_out_ce=ce, ce_sd=ce_sd,
                         held_out_kl=kl, kl_sd=kl_sd, ce_by_seed=ces, kl_by_seed=kls))  # fmt: skip
    return rows


def loss_speed(n: int = 8192, hidden: int = 4096, vocab: int = 128256) -> list[dict]:
    """GPU forward + backward of the fused losses alone (bf16, Llama-8B-sized head): top-64 against 64 draws and the
    hybrid 32 + 32, the sampled ones through their Triton kernel and their PyTorch chunk; median ms and the peak
    memory beyond the gradients."""
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    h = torch.randn(n, hidden, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=gen) / hidden**0.5).to(torch.bfloat16).requires_grad_()
    with torch.no_grad():
        lp = torch.cat([F.log_softmax((h[i : i + 1024] @ w.T).float() * 2, -1) for i in range(0, n, 1024)])
    top_lp, top_ids = lp.topk(64, -1)
    drawn = sample_teacher_tokens(lp, 64, generator=gen)
    hybrid = sample_teacher_tokens(lp, 32, top_k=32, generator=gen)
    del lp
    calls = {"top-64 (triton)": lambda: fused_linear_topk_kd(h, w, top_ids, top_lp, config=KDLossConfig(beta=0.0))}
    for backend in ("triton", "torch"):
        calls[f"sampled m=64 ({backend})"] = lambda b=backend: fused_linear_sampled_kd(
            h, w, drawn.ids, drawn.counts, drawn.logprobs, backend=b
        )
        calls[f"hybrid 32+32 ({backend})"] = lambda b=backend: fused_linear_sampled_kd(
            h, w, hybrid.ids, hybrid.counts, hybrid.logprobs, teacher_token_ids=hybrid.topk_ids,
            teacher_logprobs=hybrid.topk_logprobs, backend=b,
        )  # fmt: skip
    grads = (h.numel() + w.numel()) * 2
    rows = []
    for name, call in calls.items():

        def step(call=call):
            call().backward()
            h.grad = w.grad = None

        rows.append(dict(loss=name, ms=cuda_time_ms(step), peak_extra_GiB=peak_extra_gib(step, grads)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_sampled_kd.json")
    parser.add_argument("--teacher", choices=["demo", "fp8bench"], default="demo")
    parser.add_argument("--teacher-steps", type=int, default=200, help="demo teacher's training steps")
    parser.add_argument("--train-seconds", type=float, default=75.0, help="fp8bench teacher's training time")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 2.0])
    parser.add_argument("--repeats", type=int, default=64, help="independent draws per sampled method")
    parser.add_argument("--demo-students", action="store_true", help="also train the offline students (demo only)")
    parser.add_argument("--student-steps", type=int, default=150)
    parser.add_argument("--speed", action="store_true", help="also time the fused losses alone (GPU)")
    parser.add_argument(
        "--tokenizer",
        choices=TOKENIZERS,
        default=None,
        help="the corpus's tokenizer; default bpe with --teacher fp8bench, char with the demo's",
    )
    parser.add_argument("--vocab", type=int, default=2048, help="BPE: the most tokens (the corpus gives 464)")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="CPU smoke test: fp8bench's tiny shape for 3 s, 3 repeats, T = 1 (no figures)",
    )
    args = parser.parse_args()
    if args.tiny:
        args.teacher, args.train_seconds, args.repeats, args.temperatures = "fp8bench", 3.0, 3, [1.0]
    args.tokenizer = args.tokenizer or ("bpe" if args.teacher == "fp8bench" else "char")
    device = torch.device("cuda" if args.teacher == "fp8bench" and not args.tiny else "cpu")
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    from liger_patch_kd.demo.toys import build_model

    with tempfile.TemporaryDirectory(prefix="bench_sampled_kd_") as work:
        work = Path(work)
        if args.teacher == "demo":
            teacher, vocab, train, held, collator = demo_teacher(device, args.teacher_steps, work, args.tokenizer,
                                                                 args.vocab)  # fmt: skip
        else:
            teacher, vocab, train, held, collator = fp8bench_teacher(device, args.train_seconds, args.tokenizer,
                                                                     args.vocab, args.tiny)  # fmt: skip
        student = build_model(vocab, 64, 2, seed=1, device=device).eval()
        hidden, weight, lp1 = head_inputs(student, teacher, held, device, dtype)
        print(f"\n{hidden.shape[0]} held-out positions, {args.tokenizer} vocabulary {vocab}, "
              f"student H={hidden.shape[1]}")  # fmt: skip
        rows, tables = [], {}
        for t in args.temperatures:
            part = [dict(temperature=t, **r) for r in measure(hidden, weight, lp1, t, args.repeats, seed=0)]
            print(f"\ntemperature {t}: gradient error relative to |g*| (full-vocabulary forward KL)")
            tables[f"T={t}"] = print_table(part, ["method", "bytes_plain", "bytes_packed12", "mass_left_to_draws",
                                                  "bias", "bias_floor", "sd", "rmse"])  # fmt: skip
            rows += part
        students = []
        if args.demo_students and train is not None:
            print(f"\noffline students ({args.student_steps} steps, seeds 1 2 3), T = 1, forward KL")
            students = demo_students(teacher, vocab, train, held, collator, device, work, args.student_steps,
                                     (1, 2, 3))  # fmt: skip
            tables["students"] = print_table(students, ["data", "bytes_plain", "held_out_ce", "ce_sd", "held_out_kl",
                                                        "kl_sd"])  # fmt: skip
    speed = []
    if args.speed and device.type == "cuda":
        print("\nthe fused losses alone: N = 8192, H = 4096, V = 128256, bf16, forward + backward")
        speed = loss_speed()
        tables["speed"] = print_table(speed, ["loss", "ms", "peak_extra_GiB"])
    write_json(args.out, dict(environment=environment(), args=vars(args), tokenizer=args.tokenizer, vocab=vocab,
                              positions=hidden.shape[0],
                              gradients=rows, students=students, speed=speed, tables=tables))  # fmt: skip


if __name__ == "__main__":
    main()
