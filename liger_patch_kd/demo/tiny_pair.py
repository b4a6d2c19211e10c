"""A tiny student / teacher pair and a chat dataset on disk, for trying `liger-kd train` with no hub access.

    liger-kd demo --write-tiny-pair tiny     # tiny/student, tiny/teacher, tiny/data/{train,test}.jsonl

Two Qwen2-shaped models (random weights, float32) sharing one byte-level BPE tokenizer trained on the packaged
corpus with a ChatML chat template, as a real pair shares its family's; and conversational rows ({"messages":
[user, assistant]}) cut from that corpus. Random weights: a run shows the plumbing (the command line, the logged
terms, the saved student), not what distillation teaches; `liger-kd demo` shows that on trained models.
"""

from __future__ import annotations

import json
from pathlib import Path

from .toys import load_corpus

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(text: str, vocab_size: int = 300):
    """A byte-level BPE with Qwen's special tokens and a ChatML template, as a transformers tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator([text], vocab_size=vocab_size, min_frequency=2, show_progress=False,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])  # fmt: skip
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<|endoftext|>",
                                        eos_token="<|im_end|>")  # fmt: skip
    tokenizer.chat_template = CHATML
    return tokenizer


def tiny_qwen(vocab: int, hidden: int, layers: int, seed: int, tokenizer):
    """A Qwen2 causal LM of this size, random weights from `seed`, its special tokens the tokenizer's."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def conversations(text: str, rows: int) -> list[dict]:
    """`rows` two-turn conversations, each a sentence of `text` and the one after it."""
    sentences = [s.strip() + "." for s in text.split(".") if len(s.strip()) > 20]
    return [{"messages": [{"role": "user", "content": sentences[i]},
                          {"role": "assistant", "content": sentences[i + 1]}]} for i in range(rows)]  # fmt: skip


def write_pair(student: Path, teacher: Path, data: Path, train_rows: int, test_rows: int) -> None:
    """The student (32 wide), the teacher (64 wide), both 2 layers, and data/{train,test}.jsonl, at these folders."""
    text = load_corpus()
    tokenizer = tiny_tokenizer(text)
    for folder, hidden, seed in ((student, 32, 0), (teacher, 64, 1)):
        tiny_qwen(len(tokenizer), hidden, 2, seed, tokenizer).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    rows = conversations(text, train_rows + test_rows)
    data.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", rows[:train_rows]), ("test", rows[train_rows:])):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


def write_tiny_pair(folder: str | Path, train_rows: int = 64, test_rows: int = 8) -> dict[str, Path]:
    """folder/student, folder/teacher and folder/data (see the module docstring); returns those three paths. The
    folder must be new or empty: nothing here overwrites a file it did not write."""
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"--write-tiny-pair {folder}: it exists and is not an empty folder; name a new folder (it "
                         f"writes student/, teacher/ and data/ there)")  # fmt: skip
    paths = {"student": folder / "student", "teacher": folder / "teacher", "data": folder / "data"}
    write_pair(paths["student"], paths["teacher"], paths["data"], train_rows, test_rows)
    return paths


def train_command(paths: dict[str, Path]) -> str:
    """The `liger-kd train` command line that distils the written pair on its data, on a CPU, in seconds."""
    return (f"liger-kd train --model_name_or_path {paths['student']} --teacher_model_name_or_path "
            f"{paths['teacher']} --dataset_name {paths['data']} --output_dir {paths['student'].parent / 'out'} "
            f"--use_kd_patch --kd_beta 0.5 --max_steps 20 --per_device_train_batch_size 4 --logging_steps 5 "
            f"--save_strategy no --use_cpu --bf16 false")  # fmt: skip
