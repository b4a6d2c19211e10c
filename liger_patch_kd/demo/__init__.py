"""`liger-kd demo`: distillation from nothing, on whatever machine this is. The toys (toys.py: a character
tokenizer, the packaged corpus, small Llama models), the same-tokenizer demo (same_tokenizer.py: the loss alone,
then online / offline / on-policy students against CE alone, scored on held-out and on sampled text: samples.py;
then students scored by exact match on held-out arithmetic problems: arithmetic_students.py, on arithmetic.py's task)
and the cross-tokenizer one (cross_tokenizer.py; `python -m liger_patch_kd.demo.cross_tokenizer --quick` runs it
alone)."""

from .same_tokenizer import evaluate, loss_memory_demo, run_demo
from .samples import kl_on_samples, sample_continuations, score_on_samples, teacher_nll
from .toys import (
    BOS,
    EOS,
    PAD,
    CharTokenizer,
    DemoSizes,
    build_model,
    demo_threads,
    load_corpus,
    quiet,
    training_args,
    windows,
)

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "CharTokenizer",
    "DemoSizes",
    "build_model",
    "demo_threads",
    "evaluate",
    "kl_on_samples",
    "load_corpus",
    "loss_memory_demo",
    "quiet",
    "run_demo",
    "sample_continuations",
    "score_on_samples",
    "teacher_nll",
    "training_args",
    "windows",
]
