"""Tiny local stand-ins for the hub models and dataset the docs' recipe names, so that its commands run as
written in CI: Hugging Face resolves a name like `Qwen/Qwen2.5-0.5B-Instruct` to the folder of that relative path
when one exists in the working directory, before asking the hub. `make_hub_standins(root)` writes

- root/Qwen/Qwen2.5-0.5B-Instruct and root/Qwen/Qwen2.5-1.5B-Instruct: a 2-layer Qwen2 student and a wider
  teacher, float32, random weights, sharing one byte-level BPE tokenizer (trained with `tokenizers` on the
  packaged corpus) with a ChatML chat template, as the real pair shares Qwen2.5's (`liger-kd demo
  --write-tiny-pair`'s pair);
- root/trl-lib/Capybara/{train,test}.jsonl: conversational rows ({"messages": [user, assistant]}), as the real
  dataset's.
"""

from __future__ import annotations

from pathlib import Path

from liger_patch_kd.demo.tiny_pair import CHATML, conversations, tiny_qwen, tiny_tokenizer, write_pair

__all__ = ["CHATML", "DATASET_ID", "STUDENT_ID", "TEACHER_ID", "conversations", "make_hub_standins", "tiny_qwen",
           "tiny_tokenizer"]  # fmt: skip

STUDENT_ID = "Qwen/Qwen2.5-0.5B-Instruct"
TEACHER_ID = "Qwen/Qwen2.5-1.5B-Instruct"
DATASET_ID = "trl-lib/Capybara"


def make_hub_standins(root: str | Path, train_rows: int = 16, test_rows: int = 4) -> dict[str, Path]:
    """Write the stand-ins under `root` (a run's working directory); returns {hub id: folder}. The pair is
    `liger-kd demo --write-tiny-pair`'s (liger_patch_kd/demo/tiny_pair.py), at the hub ids' relative paths."""
    root = Path(root)
    paths = {STUDENT_ID: root / STUDENT_ID, TEACHER_ID: root / TEACHER_ID, DATASET_ID: root / DATASET_ID}
    write_pair(paths[STUDENT_ID], paths[TEACHER_ID], paths[DATASET_ID], train_rows, test_rows)
    return paths
