"""`liger-kd demo`: distillation from nothing, on whatever machine this is. The toys (toys.py: a character
tokenizer, the packaged corpus, small Llama models), the same-tokenizer demo (same_tokenizer.py: the loss alone,
then online / offline / on-policy students against CE alone) and the cross-tokenizer one (cross_tokenizer.py;
`python -m liger_patch_kd.demo.cross_tokenizer --quick` runs it alone)."""

from .same_tokenizer import evaluate, evaluate_on_own_samples, loss_memory_demo, run_demo
from .toys import BOS, EOS, PAD, CharTokenizer, DemoSizes, build_model, load_corpus, training_args, windows

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "CharTokenizer",
    "DemoSizes",
    "build_model",
    "evaluate",
    "evaluate_on_own_samples",
    "load_corpus",
    "loss_memory_demo",
    "run_demo",
    "training_args",
    "windows",
]
