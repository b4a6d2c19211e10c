"""Teacher signals as data: the store (write, read), precompute, other tools' formats, batching, and a teacher
behind a server (protocols, client, prefetch; the server itself is teacher.server, FastAPI imported lazily)."""

from .client import TeacherClient, TeacherServerError, TeacherTimeoutError
from .collator import TeacherDataCollator
from .formats import import_sglang_logprobs, import_vllm_logprobs
from .precompute import precompute, teacher_topk, teacher_topk_and_next, topk_of_logits
from .prefetch import TeacherPrefetcher
from .protocols import TeacherReplyError
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
    "TeacherClient",
    "TeacherDataCollator",
    "TeacherLogprobsDataset",
    "TeacherPrefetcher",
    "TeacherReplyError",
    "TeacherServerError",
    "TeacherStoreError",
    "TeacherTimeoutError",
    "import_sglang_logprobs",
    "import_vllm_logprobs",
    "precompute",
    "teacher_topk",
    "teacher_topk_and_next",
    "tokenizer_fingerprint",
    "topk_of_logits",
]
