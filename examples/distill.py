"""Distil a teacher into a student with KDTrainer: online, offline (precompute, then train) or on-policy.

Tiny random Llama models on the packaged demo corpus by default (20 steps, `--max-steps` for fewer):

    python examples/distill.py --mode online
    python examples/distill.py --mode offline --store /tmp/kd_store
    python examples/distill.py --mode on-policy

Real models: pass paths (or hub names) and your own JSONL ({"text": ...} per line), e.g.

    accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/distill.py --mode online \\
        --student meta-llama/Llama-3.2-1B --teacher meta-llama/Llama-3.1-8B --data train.jsonl --seq 4096 --bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path


def tiny_pair(vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(hidden, layers, seed):
        torch.manual_seed(seed)
        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=3 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        )

    return make(64, 2, 1), make(128, 4, 0)


def load(args):
    """(student, teacher, tokenized sequences, tokenizer-like object with pad/fingerprint)."""
    import torch

    if args.student is None:
        from liger_patch_kd.demo import CharTokenizer, load_corpus, windows

        text = load_corpus()
        tok = CharTokenizer(text)
        student, teacher = tiny_pair(len(tok))
        # the windows the run trains on, no more: --mode offline precomputes the teacher on each of them
        return student, teacher, windows(tok.encode(text), args.seq)[: args.max_steps * args.batch_size], tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    tok = AutoTokenizer.from_pretrained(args.student)
    student = AutoModelForCausalLM.from_pretrained(args.student, dtype=dtype)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=dtype)
    with open(args.data) as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    return student, teacher, [tok(t)["input_ids"][: args.seq] for t in texts], tok


def check(parser: argparse.ArgumentParser, args) -> None:
    """Every option before any work: a mistake is one line and exit status 2 (argparse's parser.error)."""
    if (args.student is None) != (args.teacher is None):
        parser.error("--student and --teacher go together: pass both (with --data) for real models, or neither "
                     "for the tiny demo pair")  # fmt: skip
    if args.student is not None and args.data is None:
        parser.error("--data is needed with --student / --teacher: a JSONL file with a 'text' field per line")
    for option, name in (("--student", args.student), ("--teacher", args.teacher)):
        # a hub name is org/model (one slash); anything else path-like must exist
        looks_like_path = name is not None and (name.startswith(("/", ".", "~")) or name.count("/") > 1)
        if looks_like_path and not Path(name).expanduser().exists():
            parser.error(f"{option} {name}: no such file or directory (a local model folder, or a hub name)")
    if args.data is not None and not os.path.isfile(args.data):
        parser.error(f"--data {args.data}: no such file")
    for option, value, low in (("--top-k", args.top_k, 1), ("--seq", args.seq, 2), ("--max-steps", args.max_steps, 1),
                               ("--batch-size", args.batch_size, 1)):  # fmt: skip
        if value < low:
            parser.error(f"{option} {value}: must be >= {low}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["online", "offline", "on-policy"], default="online")
    parser.add_argument("--student", default=None, help="model path or hub name (with --teacher and --data); "
                        "default: the tiny random Llama pair")  # fmt: skip
    parser.add_argument("--teacher", default=None, help="model path or hub name (with --student)")
    parser.add_argument("--data", default=None, help="JSONL with a 'text' field (real models)")
    parser.add_argument("--store", default="kd_store", help="offline: where the teacher top-k goes")
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--output-dir", default="kd_out")
    args = parser.parse_args()
    check(parser, args)

    import torch

    from liger_patch_kd import teacher as TD
    from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments

    student, teacher, sequences, tok = load(args)
    dataset = [{"input_ids": torch.tensor(s)} for s in sequences]
    kd = dict(use_kd_patch=True, kd_beta=0.5)
    if args.mode == "offline":
        # precompute skips the shards a previous run finished, so this also resumes an interrupted one
        TD.precompute(
            teacher.to("cuda" if torch.cuda.is_available() else "cpu"),
            sequences,
            args.store,
            top_k=min(args.top_k, teacher.config.vocab_size),
            tokenizer_fp=TD.tokenizer_fingerprint(tok),
        )
        dataset = TD.TeacherLogprobsDataset(args.store, vocab_size=student.config.vocab_size, tokenizer=tok)
        teacher, kd["kd_beta"] = None, 0.0  # no teacher in memory; forward KL against the stored top-k
    elif args.mode == "on-policy":
        kd.update(kd_lmbda=0.5, kd_max_new_tokens=32)
    if args.student is not None:  # real models: recompute activations in the backward (gradient_checkpointing before)
        fields = {f.name for f in dataclasses.fields(KDTrainingArguments)}
        kd["activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"] = True
    training_args = KDTrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=3e-3 if args.student is None else 1e-5, logging_steps=10, report_to="none", save_strategy="no",
        bf16=args.bf16, dataloader_pin_memory=torch.cuda.is_available(), **kd,
    )  # fmt: skip
    trainer = KDTrainer(model=student, teacher_model=teacher, args=training_args, train_dataset=dataset,
                        data_collator=TD.TeacherDataCollator(pad_token_id=tok.pad_token_id or 0))  # fmt: skip
    trainer.train()


if __name__ == "__main__":
    main()
