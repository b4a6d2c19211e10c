"""How faithful and how fast an FP8 teacher is (quantize_teacher_fp8), in one run on one GPU.

    python -m benchmarks.teachers.bench_fp8_teacher --out $OUT/bench_fp8_teacher.json
    python -m benchmarks.teachers.bench_fp8_teacher --tokenizer bpe --parts fidelity \
        --out $OUT/bench_fp8_teacher_bpe.json

Fidelity needs a teacher whose distributions are peaked like a trained model's (a random one's are nearly flat
and hide rounding), so one is trained here: a Llama-shaped model of ~190M parameters on the packaged corpus
(90 % for training, 10 % held out), for --train-seconds; `--tokenizer char` (default, V = 48) or `bpe` (a
byte-level BPE trained on the corpus here, benchmarks.common.corpus_token_ids: V = 464, the most this corpus's
100 words give). On the held-out text:
  KL(P_bf16 ‖ P_fp8) per token (mean, median, p99, max) and top-1 agreement, beside the same figures for
  KL(P_fp32 ‖ P_bf16) (what bf16 rounding alone does, the scale to read them against);
  a small student distilled for --student-steps from the bf16 teacher and, from the same start and data, from the
  FP8 teacher, for --student-seeds seeds: its held-out KD loss (against the bf16 teacher, for both) and CE.
The FP8 logit product inside the loss (KDLossConfig.teacher_logits_fp8), on the same held-out text: KL of the
teacher distribution from fp32-output bf16 logits to FP8 logits (the bf16 decoder, and the FP8 decoder too), and
the fused loss's relative gradient error (d/d student hidden states, d/d lm_head weight) with teacher_logits_fp8 and
with both FP8 options, against the bf16 loss, for an untrained student.
Each FP8 figure is given for the default accumulation and for fast accumulation (`fast_accum=True`,
kd_teacher_precision="fp8_fast_accum"). Speed: the 8B-shaped teacher's forward (random weights, patched kernels,
4 x 4096 tokens) in bf16, in FP8 and in FP8 with fast accumulation, and its weight memory. `--parts` picks the
sections (fidelity always runs: it trains the teacher the others use).
`--tiny` runs everything on CPU with tiny shapes (a smoke test, no figures).
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch

from liger_patch_kd import KDLossConfig, fused_linear_jsd
from liger_patch_kd.models import apply_kd_patch_to_llama, quantize_teacher_fp8, revert_kd_patch
from liger_patch_kd.ops.backend import logits_fp32
from liger_patch_kd.ops.fp8_logits import fp8_logits, quantize_head

from ..common import TOKENIZERS, corpus_token_ids, environment, print_table, write_json
from ..common.fp8_teacher import TEACHER, TINY, Windows, llama, train_teacher
from ..common.train_step import SHAPES, build

STUDENT = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=4)  # fmt: skip


@torch.no_grad()
def logprobs(model, windows: torch.Tensor) -> torch.Tensor:
    return torch.cat([model(input_ids=w[None]).logits[0].float().log_softmax(-1) for w in windows])


def divergence(p_log: torch.Tensor, q_log: torch.Tensor) -> dict:
    """KL(P ‖ Q) per token and top-1 agreement, over all held-out positions."""
    kl = (p_log.exp() * (p_log - q_log)).sum(-1).clamp_min(0).double()
    return dict(kl_mean=kl.mean().item(), kl_median=kl.median().item(), kl_p99=kl.quantile(0.99).item(),
                kl_max=kl.max().item(), top1_agreement=(p_log.argmax(-1) == q_log.argmax(-1)).double().mean().item(),
                positions=kl.numel())  # fmt: skip


def distil_student(teacher, data: Windows, held_out: torch.Tensor, reference, steps, batch, vocab, device, seed):
    """The student from a start and data order fixed by `seed`, distilled from `teacher`; held-out figures are
    against `reference` (the bf16 teacher) so the runs are read on one scale."""
    student = llama(STUDENT if device.type == "cuda" else TINY, vocab, device, torch.bfloat16, seed=7 + seed)
    apply_kd_patch_to_llama(model=student, beta=0.5)
    apply_kd_patch_to_llama(model=teacher)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    data.gen.manual_seed(1 + seed)
    losses = []
    for _ in range(steps):
        ids = data.batch(batch)
        loss = student(input_ids=ids, labels=ids, teacher_model=teacher).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    student.eval()
    kd, ce = [], []
    with torch.no_grad():
        for w in held_out:
            kd.append(float(student(input_ids=w[None], labels=w[None], teacher_model=reference).loss))
    revert_kd_patch(model=student)
    with torch.no_grad():
        for w in held_out:
            ce.append(float(student(input_ids=w[None], labels=w[None]).loss))
    revert_kd_patch(model=teacher)
    return dict(seed=seed, train_kd_loss_last10=sum(losses[-10:]) / len(losses[-10:]),
                held_out_kd_loss=sum(kd) / len(kd), held_out_ce=sum(ce) / len(ce))  # fmt: skip


def fp8_logits_fidelity(teacher_bf16, teacher_fp8, held: torch.Tensor, vocab: int, device) -> tuple[list, list]:
    """(fidelity rows, gradient rows) of the FP8 logit product in the loss; see the module docstring."""
    w_t = teacher_bf16.lm_head.weight
    head = quantize_head(w_t, vocab, keep=False)
    with torch.no_grad():
        h_bf16 = torch.cat([teacher_bf16.model(input_ids=w[None]).last_hidden_state[0] for w in held])
        h_fp8 = torch.cat([teacher_fp8.model(input_ids=w[None]).last_hidden_state[0] for w in held])
        base = logits_fp32(h_bf16, w_t, None).log_softmax(-1)
        fidelity = [
            dict(pair="P_bf16 (fp32-output logits) vs FP8 logits (teacher_logits_fp8)",
                 **divergence(base, fp8_logits(h_bf16, head, None).log_softmax(-1))),
            dict(pair="P_bf16 (fp32-output logits) vs FP8 decoder + FP8 logits",
                 **divergence(base, fp8_logits(h_fp8, head, None).log_softmax(-1))),
        ]  # fmt: skip
    student = llama(STUDENT if device.type == "cuda" else TINY, vocab, device, torch.bfloat16, seed=7)
    with torch.no_grad():
        h_s = torch.cat([student.model(input_ids=w[None]).last_hidden_state[0] for w in held])
    labels = held.reshape(-1)
    w_s = student.lm_head.weight.detach()
    grads = {}
    for name, opts in (
        ("bf16", {}),
        ("fp8 teacher logits", dict(teacher_logits_fp8=True)),
        ("fp8 teacher + student logits", dict(teacher_logits_fp8=True, student_logits_fp8=True)),
    ):
        h, w = h_s.clone().requires_grad_(), w_s.clone().requires_grad_()
        loss = fused_linear_jsd(h, w, h_bf16, w_t, labels, config=KDLossConfig(beta=0.5, **opts))
        grads[name] = (float(loss.detach()), *torch.autograd.grad(loss, [h, w]))
    ref = grads.pop("bf16")
    gradient = [
        dict(option=name, loss_rel_err=abs(g[0] - ref[0]) / abs(ref[0]),
             grad_input_rel_err=float((g[1].float() - ref[1].float()).norm() / ref[1].float().norm()),
             grad_weight_rel_err=float((g[2].float() - ref[2].float()).norm() / ref[2].float().norm()))
        for name, g in grads.items()
    ]  # fmt: skip
    return fidelity, gradient


@torch.no_grad()
def teacher_speed(shape: dict, device, micro_batch: int, seq: int, reps: int) -> list[dict]:
    """The 8B-shaped teacher's forward to its last hidden states (what the fused loss consumes), bf16 then FP8,
    then FP8 with fast accumulation (a fresh copy: a quantised teacher is not quantised again)."""

    def patched_teacher():
        model = build(shape, device, torch.bfloat16, seed=2).eval().requires_grad_(False)
        model.config.use_cache = False
        apply_kd_patch_to_llama(model=model)
        return model

    teacher = patched_teacher()
    ids = torch.randint(0, shape["vocab_size"], (micro_batch, seq), device=device)

    def seconds_per_forward() -> float:
        for i in range(reps + 2):
            if i == 2:
                _sync(device)
                start = time.perf_counter()
            teacher.model(input_ids=ids)
        _sync(device)
        return (time.perf_counter() - start) / reps

    bf16_s = seconds_per_forward()
    summary = quantize_teacher_fp8(teacher)  # its byte counts: the weights before and after
    fp8_s = seconds_per_forward()
    revert_kd_patch(model=teacher)
    del teacher
    teacher = patched_teacher()
    quantize_teacher_fp8(teacher, fast_accum=True)
    fast_s = seconds_per_forward()
    revert_kd_patch(model=teacher)
    rows = [
        dict(precision=name, forward_ms=1e3 * sec, tokens_per_s=micro_batch * seq / sec, weights_GiB=size / 2**30)
        for name, sec, size in (("bf16", bf16_s, summary.bytes_before), ("fp8", fp8_s, summary.bytes_after),
                                ("fp8_fast_accum", fast_s, summary.bytes_after))
    ]  # fmt: skip
    for row in rows[1:]:
        row["speedup"] = bf16_s / (row["forward_ms"] / 1e3)
    return rows


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_fp8_teacher.json")
    parser.add_argument("--train-seconds", type=float, default=75.0)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--student-steps", type=int, default=150)
    parser.add_argument("--student-seeds", type=int, default=2)
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="char", help="the corpus's tokenizer")
    parser.add_argument("--vocab", type=int, default=2048, help="BPE: the most tokens (the corpus gives 464)")
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=["fidelity", "student", "speed"],
        default=["fidelity", "student", "speed"],
        help="sections to run (fidelity always runs)",
    )
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with tiny shapes")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        args.train_seconds, args.seq, args.batch, args.student_steps, args.student_seeds = 3.0, 32, 4, 5, 1
    token_ids, vocab, chars_per_token = corpus_token_ids(args.tokenizer, args.vocab)
    ids = torch.tensor(token_ids)
    cut = int(0.9 * len(ids))
    train, held = Windows(ids[:cut], args.seq, device), Windows(ids[cut:], args.seq, device).consecutive()
    print(f"{args.tokenizer} tokenizer: vocabulary {vocab}, {chars_per_token:.2f} characters per token, "
          f"{len(held)} held-out windows of {args.seq}")  # fmt: skip

    teacher = llama(TINY if args.tiny else TEACHER, vocab, device, torch.float32, seed=0)
    params = sum(p.numel() for p in teacher.parameters())
    training = train_teacher(teacher, train, args.train_seconds, args.batch, device)
    teacher.eval().requires_grad_(False)
    fp32 = logprobs(teacher, held)
    teacher_bf16 = teacher.to(torch.bfloat16)
    bf16 = logprobs(teacher_bf16, held)
    teacher_fp8 = copy.deepcopy(teacher_bf16)
    summary = quantize_teacher_fp8(teacher_fp8)
    fp8 = logprobs(teacher_fp8, held)
    teacher_fast = copy.deepcopy(teacher_bf16)
    quantize_teacher_fp8(teacher_fast, fast_accum=True)
    fast = logprobs(teacher_fast, held)
    targets = held[:, 1:].reshape(-1)
    rows_fidelity = [
        dict(pair="P_fp32 vs P_bf16 (bf16 rounding alone)", **divergence(fp32, bf16)),
        dict(pair="P_bf16 vs P_fp8 (the FP8 teacher)", **divergence(bf16, fp8)),
        dict(pair="P_bf16 vs P_fp8 fast accumulation", **divergence(bf16, fast)),
    ]
    per_window = bf16.reshape(len(held), args.seq, -1)[:, :-1].reshape(-1, vocab)
    teacher_ce = -per_window.gather(-1, targets[:, None].long()).mean().item()
    print(f"\ntrained teacher: {params / 1e6:.0f}M parameters, {training['steps']} steps in "
          f"{training['seconds']:.0f} s, held-out CE {teacher_ce:.3f} nats/token, {teacher_ce / chars_per_token:.3f} "
          f"nats/char ({math.exp(teacher_ce):.2f} ppl)")  # fmt: skip
    logit_rows, rows_gradient = fp8_logits_fidelity(teacher_bf16, teacher_fp8, held, vocab, device)
    rows_fidelity += logit_rows
    table_fidelity = print_table(rows_fidelity, ["pair", "kl_mean", "kl_median", "kl_p99", "kl_max", "top1_agreement"])
    table_gradient = print_table(rows_gradient, ["option", "loss_rel_err", "grad_input_rel_err", "grad_weight_rel_err"])

    rows_student = []  # seed by seed: a short run's spread between seeds is the scale to read the gap against
    for seed in range(args.student_seeds if "student" in args.parts else 0):
        for name, t in (("bf16 teacher", teacher_bf16), ("fp8 teacher", teacher_fp8),
                        ("fp8 fast-accum teacher", teacher_fast)):  # fmt: skip
            rows_student.append(dict(teacher=name, **distil_student(t, train, held, teacher_bf16, args.student_steps,
                                                                    args.batch, vocab, device, seed)))  # fmt: skip
    for row in rows_student:  # the loss's CE is per token; per character too, to compare tokenizers
        row["held_out_ce_nats_per_token"] = row.pop("held_out_ce")
        row["held_out_ce_nats_per_char"] = row["held_out_ce_nats_per_token"] / chars_per_token
    columns = ["teacher", "seed", "train_kd_loss_last10", "held_out_kd_loss", "held_out_ce_nats_per_char"]
    table_student = print_table(rows_student, columns) if rows_student else ""
    del teacher, teacher_bf16, teacher_fp8, teacher_fast
    rows_speed, table_speed = [], ""
    if "speed" in args.parts:
        shape = SHAPES["tiny" if args.tiny else "llama"][1]
        rows_speed = teacher_speed(shape, device, 1 if args.tiny else 4, 32 if args.tiny else 4096,
                                   3 if args.tiny else 10)  # fmt: skip
        table_speed = print_table(rows_speed, ["precision", "forward_ms", "tokens_per_s", "weights_GiB", "speedup"])
    write_json(args.out, dict(
        environment=environment(), args=vars(args), tokenizer=args.tokenizer, vocab=vocab,
        chars_per_token=chars_per_token, teacher_parameters=params, teacher_training=training,
        teacher_held_out_ce=teacher_ce, teacher_held_out_ce_per_char=teacher_ce / chars_per_token,
        quantised=len(summary.quantized), kept=summary.kept,
        fidelity=rows_fidelity, student=rows_student, speed=rows_speed, fp8_logits_gradient=rows_gradient,
        tables=dict(fidelity=table_fidelity, student=table_student, speed=table_speed,
                    fp8_logits_gradient=table_gradient),
    ))  # fmt: skip


if __name__ == "__main__":
    main()
