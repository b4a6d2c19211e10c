"""Teacher signals as data: the store (write, read), precompute, other tools' formats, batching."""

from .collator import TeacherDataCollator
from .formats import import_vllm_logprobs
from .precompute import precompute, teacher_topk, topk_of_logits
from .store import (
    FORMAT_VERSION,
    LOGPROB_DTYPES,
    MANIFEST,
    StoreWriter,
    TeacherLogprobsDataset,
    TeacherStoreError,
    tokenizer_fingerprint,
)

__all__ = [
    "FORMAT_VERSION",
    "LOGPROB_DTYPES",
    "MANIFEST",
    "StoreWriter",
    "TeacherDataCollator",
    "TeacherLogprobsDataset",
    "TeacherStoreError",
    "import_vllm_logprobs",
    "precompute",
    "teacher_topk",
    "tokenizer_fingerprint",
    "topk_of_logits",
]
