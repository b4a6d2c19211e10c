"""What each store encoding costs on disk and what it changes in distillation, on the demo (CPU, ~2-3 min on 1 thread).

    OMP_NUM_THREADS=1 python -m benchmarks.teachers.bench_store_encodings [--quick] [--out FILE.json]

`liger-kd demo`'s teacher, corpus and offline top-k recipe (liger_patch_kd/demo/): the teacher is trained once,
its top-k store is precomputed once per encoding (plain float32 = the reference, plain bf16 = the default, plain
float16, packed6/8/10/12), and the same student (same init, steps and data order) is trained from each store.
Per encoding:

- bytes per token: the store's shard files / its tokens here (K = demo top-k, a ~70-symbol vocabulary), and the
  payload per token at K = 64, V = 151936 (Qwen-sized vocabulary; the input id included, as docs/teachers/stores.md);
- the log-prob error against the float32 store over the kept slots (max and mean absolute); ids must be equal;
- the KD loss change at a fixed student: the top-k KD loss (forward KL, bucket tail: the recipe's loss) of the
  float32-trained student on the stored training windows, with this store's targets minus the float32 targets:
  the objective's own change, free of training noise;
- the student trained from this store: its final training KD loss (mean over the last logging window), held-out
  CE (nats/char) and KL(teacher || student) per token, and their change against the float32 store.

Run-to-run noise: the float32 run repeated with a second student init seed (same data order); a change below
that is not a change.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import environment, print_table, write_json
from liger_patch_kd import reference
from liger_patch_kd.config import KDLossConfig
from liger_patch_kd.demo import (
    BOS,
    PAD,
    CharTokenizer,
    DemoSizes,
    build_model,
    evaluate,
    load_corpus,
    training_args,
    windows,
)
from liger_patch_kd.models import revert_kd_patch
from liger_patch_kd.teacher import TeacherDataCollator, TeacherLogprobsDataset, precompute, tokenizer_fingerprint
from liger_patch_kd.teacher.store.compact import codec_from_spec

# (name, precompute encoding, plain log-prob dtype); the first is the reference every other row is compared with
ENCODINGS = [
    ("plain float32", "plain", "float32"),
    ("plain bf16 (default)", "plain", "bfloat16"),
    ("plain float16", "plain", "float16"),
    ("packed12", "packed12", "float32"),
    ("packed10", "packed10", "float32"),
    ("packed8", "packed8", "float32"),
    ("packed6", "packed6", "float32"),
]
QWEN_VOCAB, QWEN_K = 151936, 64
STUDENT_SEED, NOISE_SEED = 1, 2  # demo/same_tokenizer.py's student init seed, and the second one for the noise row
FIXED_STUDENT_SEQUENCES = 128  # training windows the fixed-student KD loss is measured on


def payload_bytes_per_token(encoding: str, dtype: str, vocab: int, top_k: int) -> int:
    """Bytes a token costs in a store (its input id + its top-k), ignoring per-sequence offsets and checksums."""
    codec = codec_from_spec(encoding, vocab, top_k)
    if codec is not None:
        return 4 + codec.row_bytes
    return 4 + top_k * (4 + torch.empty(0, dtype=getattr(torch, dtype)).element_size())


def store_bytes_per_token(store: Path, data: TeacherLogprobsDataset) -> float:
    tokens = sum(len(data[i]["input_ids"]) for i in range(len(data)))
    return sum(p.stat().st_size for p in store.glob("shard-*.safetensors")) / tokens


def logprob_error(data: TeacherLogprobsDataset, ref: TeacherLogprobsDataset) -> tuple[float, float]:
    """Max and mean |log p - log p_float32| over the kept (finite) slots; the ids must be identical."""
    errors = []
    for i in range(len(ref)):
        a, b = data[i], ref[i]
        if not torch.equal(a["teacher_token_ids"], b["teacher_token_ids"]):
            raise AssertionError(f"sequence {i}: top-k ids differ from the float32 store's")
        kept = torch.isfinite(b["teacher_logprobs"])
        if not torch.equal(kept, torch.isfinite(a["teacher_logprobs"].float())):
            raise AssertionError(f"sequence {i}: the kept slots differ from the float32 store's")
        errors.append((a["teacher_logprobs"].double() - b["teacher_logprobs"].double())[kept].abs())
    err = torch.cat(errors)
    return float(err.max()), float(err.mean())


@torch.no_grad()
def fixed_student_kd(student, data: TeacherLogprobsDataset, n: int) -> float:
    """The recipe's top-k KD loss (beta 0, bucket tail) of `student` on the first n stored sequences, float64."""
    student.eval()
    batch = TeacherDataCollator(pad_token_id=PAD)([data[i] for i in range(n)])
    logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    labels = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)  # row j is scored against token j + 1
    cfg = KDLossConfig(beta=0.0, tail="bucket")
    return float(reference.topk_kd_loss(logits, batch["teacher_token_ids"], batch["teacher_logprobs"].double(),
                                        labels, cfg))  # fmt: skip


def train_student(data, sizes: DemoSizes, vocab: int, seed: int, work: Path, teacher, held_out):
    from transformers.trainer_callback import PrinterCallback

    from liger_patch_kd.trainer import KDTrainer

    device = torch.device("cpu")
    student = build_model(vocab, 64, 2, seed=seed, device=device)
    args = training_args(work / "student", sizes.student_steps, sizes.batch, device, use_kd_patch=True, kd_beta=0.0)
    trainer = KDTrainer(model=student, teacher_model=None, args=args, train_dataset=data,
                        data_collator=TeacherDataCollator(pad_token_id=PAD))  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # the per-log dicts; the table below says what matters
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    revert_kd_patch(model=student)
    ce, kl = evaluate(student, teacher, held_out, device)
    train_kd = [h["loss"] for h in trainer.state.log_history if "loss" in h][-1]
    return student, dict(train_kd=float(train_kd), held_out_ce=ce, kl_to_teacher=kl, train_s=seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the demo's --quick sizes")
    parser.add_argument("--out", default="benchmarks/results/bench_store_encodings.json")
    opts = parser.parse_args()
    from transformers import Trainer
    from transformers.trainer_callback import PrinterCallback
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    started = time.perf_counter()
    device = torch.device("cpu")
    sizes = DemoSizes.quick() if opts.quick else DemoSizes()
    text = load_corpus()
    tok = CharTokenizer(text)
    split = int(len(text) * 0.9)
    train = windows(tok.encode(text[:split]), sizes.seq)
    held_out = windows(tok.encode(text[split:]), sizes.seq)[:64]
    vocab = len(tok)
    assert train[0][0] == BOS
    work = Path(tempfile.mkdtemp(prefix="bench_store_encodings_"))

    teacher = build_model(vocab, 128, 4, seed=0, device=device)
    teacher_args = training_args(work / "teacher", sizes.teacher_steps, sizes.batch, device)
    teacher_trainer = Trainer(model=teacher, args=teacher_args,
                              train_dataset=[{"input_ids": torch.tensor(w)} for w in train],
                              data_collator=TeacherDataCollator(pad_token_id=PAD))  # fmt: skip
    teacher_trainer.remove_callback(PrinterCallback)
    teacher_trainer.train()
    teacher.eval()
    teacher_ce, _ = evaluate(teacher, teacher, held_out, device)
    print(f"teacher held-out CE {teacher_ce:.4f} nats/char; {len(train)} windows of {sizes.seq}, V = {vocab}, "
          f"K = {sizes.top_k}, {sizes.student_steps} student steps of batch {sizes.batch}")  # fmt: skip

    stores = {}
    for name, encoding, dtype in ENCODINGS:
        path = precompute(teacher, train, work / f"{encoding}-{dtype}", top_k=sizes.top_k,
                          batch_size=32, logprob_dtype=dtype, encoding=encoding, progress=False,
                          tokenizer_fp=tokenizer_fingerprint(tok))  # fmt: skip
        stores[name] = (path, TeacherLogprobsDataset(path, vocab_size=vocab, tokenizer=tok))
    ref_name = ENCODINGS[0][0]
    ref = stores[ref_name][1]
    n_fixed = min(FIXED_STUDENT_SEQUENCES, len(ref))

    # kept log-probs' span per row: the packed codes' step is span / (2**bits - 2), the error at most half of it
    spans = []
    for i in range(len(ref)):
        lp = ref[i]["teacher_logprobs"].double()
        finite = torch.isfinite(lp)
        rows = finite.any(-1)
        spans.append((lp.where(finite, -math.inf).amax(-1) - lp.where(finite, math.inf).amin(-1))[rows])
    span = torch.cat(spans)

    rows, ref_student = [], None
    for name, encoding, dtype in ENCODINGS:
        path, data = stores[name]
        max_err, mean_err = logprob_error(data, ref)
        student, trained = train_student(data, sizes, vocab, STUDENT_SEED, work, teacher, held_out)
        if ref_student is None:
            ref_student = student
        row = dict(
            encoding=name, bytes_per_token=store_bytes_per_token(path, data),
            bytes_per_token_k64_qwen=payload_bytes_per_token(encoding, dtype, QWEN_VOCAB, QWEN_K),
            max_abs_logprob_err=max_err, mean_abs_logprob_err=mean_err,
            fixed_student_kd=fixed_student_kd(ref_student, data, n_fixed), **trained,
        )  # fmt: skip
        rows.append(row)
        print(f"  {name}: {row['bytes_per_token']:.1f} B/token, max err {max_err:.2e}, train KD "
              f"{row['train_kd']:.5f}, CE {row['held_out_ce']:.5f} ({row['train_s']:.0f} s)", flush=True)  # fmt: skip
    _, noise = train_student(ref, sizes, vocab, NOISE_SEED, work, teacher, held_out)
    noise_row = dict(encoding=f"plain float32, student seed {NOISE_SEED} (noise)", **noise)
    print(f"  noise run: train KD {noise['train_kd']:.5f}, CE {noise['held_out_ce']:.5f}")

    base = rows[0]
    for row in rows + [noise_row]:
        for key in ("train_kd", "held_out_ce", "kl_to_teacher"):
            row[f"d_{key}"] = row[key] - base[key]
        if "fixed_student_kd" in row:
            row["d_fixed_student_kd"] = row["fixed_student_kd"] - base["fixed_student_kd"]
    noise_level = {key: abs(noise_row[f"d_{key}"]) for key in ("train_kd", "held_out_ce", "kl_to_teacher")}
    for row in rows[1:]:
        row["beyond_noise"] = [k for k, level in noise_level.items() if abs(row[f"d_{k}"]) > level]

    def fmt(v: float | None, spec: str) -> str | None:
        return None if v is None else format(v, spec)

    table = [
        {
            "encoding": r["encoding"],
            "B/token here": fmt(r.get("bytes_per_token"), ".1f"),
            "B/token K=64, V=152k": r.get("bytes_per_token_k64_qwen"),
            "max abs err": fmt(r.get("max_abs_logprob_err"), ".2e"),
            "mean abs err": fmt(r.get("mean_abs_logprob_err"), ".2e"),
            "KD change, fixed student": fmt(r.get("d_fixed_student_kd"), "+.1e"),
            "train KD": fmt(r["train_kd"], ".4f"),
            "Δ train KD": fmt(r["d_train_kd"], "+.4f"),
            "held-out CE": fmt(r["held_out_ce"], ".4f"),
            "Δ CE": fmt(r["d_held_out_ce"], "+.4f"),
            "Δ KL to teacher": fmt(r["d_kl_to_teacher"], "+.4f"),
        }
        for r in rows + [noise_row]
    ]
    print(f"\nkept log-probs span per row: median {span.median():.2f}, max {span.max():.2f} nats; "
          f"fixed-student KD (float32 targets) {base['fixed_student_kd']:.5f} on {n_fixed} sequences")  # fmt: skip
    print_table(table, list(table[0]))
    for row in rows[1:]:
        verdict = ", ".join(row["beyond_noise"]) or "nothing"
        print(f"{row['encoding']}: beyond the seed-to-seed noise: {verdict}")
    seconds = time.perf_counter() - started
    print(f"total {seconds:.0f} s, {torch.get_num_threads()} thread(s)")
    write_json(opts.out, dict(
        environment=environment(), threads=torch.get_num_threads(), seconds=seconds,
        sizes=vars(sizes), vocab=vocab, teacher_held_out_ce=teacher_ce, train_windows=len(train),
        fixed_student_sequences=n_fixed, kept_span_median=float(span.median()), kept_span_max=float(span.max()),
        rows=rows, noise=noise_row, noise_level=noise_level,
    ))  # fmt: skip


if __name__ == "__main__":
    main()
