"""Tiny local stand-ins for the hub models and dataset the docs' recipe names, so that its commands run as
written in CI: Hugging Face resolves a name like `Qwen/Qwen2.5-0.5B-Instruct` to the folder of that relative path
when one exists in the working directory, before asking the hub. `make_hub_standins(root)` writes

- root/Qwen/Qwen2.5-0.5B-Instruct and root/Qwen/Qwen2.5-1.5B-Instruct: a 2-layer Qwen2 student and a wider
  teacher, float32, random weights, sharing one byte-level BPE tokenizer (trained here with `tokenizers` on the
  packaged corpus) with a ChatML chat template, as the real pair shares Qwen2.5's;
- root/trl-lib/Capybara/{train,test}.jsonl: conversational rows ({"messages": [user, assistant]}), as the real
  dataset's.
"""

from __future__ import annotations

import json
from pathlib import Path

STUDENT_ID = "Qwen/Qwen2.5-0.5B-Instruct"
TEACHER_ID = "Qwen/Qwen2.5-1.5B-Instruct"
DATASET_ID = "trl-lib/Capybara"
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
    sentences = [s.strip() + "." for s in text.split(".") if len(s.strip()) > 20]
    return [{"messages": [{"role": "user", "content": sentences[i]},
                          {"role": "assistant", "content": sentences[i + 1]}]} for i in range(rows)]  # fmt: skip


def make_hub_standins(root: str | Path, train_rows: int = 16, test_rows: int = 4) -> dict[str, Path]:
    """Write the stand-ins under `root` (a run's working directory); returns {hub id: folder}."""
    from liger_patch_kd.demo import load_corpus

    root, text = Path(root), load_corpus()
    tokenizer = tiny_tokenizer(text)
    paths = {STUDENT_ID: root / STUDENT_ID, TEACHER_ID: root / TEACHER_ID, DATASET_ID: root / DATASET_ID}
    for hub_id, hidden, layers, seed in ((STUDENT_ID, 32, 2, 0), (TEACHER_ID, 64, 2, 1)):
        tiny_qwen(len(tokenizer), hidden, layers, seed, tokenizer).save_pretrained(paths[hub_id])
        tokenizer.save_pretrained(paths[hub_id])
    rows = conversations(text, train_rows + test_rows)
    paths[DATASET_ID].mkdir(parents=True, exist_ok=True)
    for split, part in (("train", rows[:train_rows]), ("test", rows[train_rows:])):
        (paths[DATASET_ID] / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths
