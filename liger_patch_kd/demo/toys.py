"""The demo's toys: a character tokenizer and its special ids, a byte-level BPE trainer, the packaged corpus, the
demo's sizes, its small Llama models and training arguments. Everything here runs offline (no downloads)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

PAD, BOS, EOS = 0, 1, 2


class CharTokenizer:
    """Characters of the corpus, after three specials; enough for a demo and fingerprintable like HF's."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i + 3 for i, c in enumerate(self.chars)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id = PAD, BOS, EOS

    def __len__(self) -> int:
        return len(self.chars) + 3

    def get_vocab(self) -> dict[str, int]:
        return {"<pad>": PAD, "<s>": BOS, "</s>": EOS, **self.index}

    def encode(self, text: str) -> list[int]:
        return [self.index[c] for c in text if c in self.index]

    def decode(self, ids: list[int]) -> str:
        inverse = {i: c for c, i in self.index.items()}
        return "".join(inverse.get(i, "") for i in ids)


def load_corpus() -> str:
    return resources.files("liger_patch_kd").joinpath("data/corpus.txt").read_text()


def train_bpe_tokenizer(text: str, vocab_size: int = 384):
    """A byte-level BPE (GPT-2 / Llama-3 / Qwen style) trained on `text`, with <pad> <s> </s> as ids 0 1 2."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator([text], vocab_size=vocab_size, min_frequency=2, special_tokens=["<pad>", "<s>", "</s>"],
                            show_progress=False)  # fmt: skip
    return tok._tokenizer


@dataclass
class DemoSizes:
    seq: int = 64
    teacher_steps: int = 300
    student_steps: int = 250
    batch: int = 16
    top_k: int = 8

    @classmethod
    def quick(cls) -> DemoSizes:
        return cls(seq=48, teacher_steps=200, student_steps=150, batch=8)


def windows(ids: list[int], seq: int) -> list[list[int]]:
    """BOS + non-overlapping windows of the token stream."""
    return [[BOS] + ids[i : i + seq - 1] for i in range(0, len(ids) - seq, seq - 1)]


def build_model(vocab: int, hidden: int, layers: int, seed: int, device):
    """A small Llama (tied embeddings, the demo's special ids), seeded: the demo's teachers and students."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).to(device)


def training_args(out: Path, steps: int, batch: int, device, seed: int = 0, **kd):
    """The demo's KDTrainingArguments: cosine schedule from 3e-3, no saving, no reports; `seed` orders the data;
    `kd` adds kd_* options."""
    from ..trainer import KDTrainingArguments

    return KDTrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=batch, learning_rate=3e-3,
        lr_scheduler_type="cosine", warmup_steps=max(1, steps // 20), logging_steps=max(1, steps // 5),
        report_to="none", save_strategy="no", disable_tqdm=True, seed=seed, use_cpu=device.type == "cpu",
        bf16=device.type == "cuda", dataloader_pin_memory=device.type == "cuda", **kd,
    )  # fmt: skip


def quiet(trainer):
    """`trainer` without the Trainer's own printing (its log dicts and progress bars): the demos print one line
    per phase themselves. Its logs still reach trainer.state.log_history."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    return trainer


@contextmanager
def demo_threads(device):
    """On a CPU, one intra-op thread while a demo runs, unless OMP_NUM_THREADS says how many: the demos' models
    are tiny (a second thread buys little) and on a machine other work shares, threads that spin waiting for each
    other cost ten times over (40 steps of the demo's teacher: 3.2 s of CPU on one thread, 47-56 s on two, at
    load 11 on 2 cores)."""
    if torch.device(device).type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
