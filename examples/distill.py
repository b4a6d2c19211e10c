"""Distil a teacher into a student with KDTrainer: online, offline (precompute, then train) or on-policy.

Tiny random Llama models on the packaged demo corpus by default (runs on a CPU in seconds):

    python examples/distill.py --mode online
    python examples/distill.py --mode offline --store /tmp/kd_store
    python examples/distill.py --mode on-policy

Real models: pass paths (or hub names) and your own JSONL ({"text": ...} per line), e.g.

    accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/distill.py --mode online \\
        --student meta-llama/Llama-3.2-1B --teacher meta-llama/Llama-3.1-8B --data train.jsonl --seq 4096 --bf16
"""

from __future__ import annotations

import argparse
import json

import torch

from liger_patch_kd import teacher as TD
from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments


def tiny_pair(vocab: int):
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
    if args.student is None:
        from liger_patch_kd.demo import CharTokenizer, load_corpus, windows

        text = load_corpus()
        tok = CharTokenizer(text)
        student, teacher = tiny_pair(len(tok))
        return student, teacher, windows(tok.encode(text), args.seq), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    tok = AutoTokenizer.from_pretrained(args.student)
    student = AutoModelForCausalLM.from_pretrained(args.student, dtype=dtype)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=dtype)
    with open(args.data) as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    return student, teacher, [tok(t)["input_ids"][: args.seq] for t in texts], tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["online", "offline", "on-policy"], default="online")
    parser.add_argument("--student", default=None, help="model path; default: tiny random Llama")
    parser.add_argument("--teacher", default=None)
    parser.add_argument("--data", default=None, help="JSONL with a 'text' field (real models)")
    parser.add_argument("--store", default="kd_store", help="offline: where the teacher top-k goes")
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--output-dir", default="kd_out")
    args = parser.parse_args()

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
    training_args = KDTrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=3e-3 if args.student is None else 1e-5, logging_steps=10, report_to="none", save_strategy="no",
        bf16=args.bf16, gradient_checkpointing=args.student is not None, **kd,
    )  # fmt: skip
    trainer = KDTrainer(model=student, teacher_model=teacher, args=training_args, train_dataset=dataset,
                        data_collator=TD.TeacherDataCollator(pad_token_id=tok.pad_token_id or 0))  # fmt: skip
    trainer.train()


if __name__ == "__main__":
    main()
