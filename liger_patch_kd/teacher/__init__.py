"""Teacher signals as data: the store (write, read), precompute, other tools' formats, batching, and a teacher
behind a server (protocols, client, prefetch; the server itself is teacher.server, FastAPI imported lazily)."""

from .axolotl import axolotl_to_store, store_to_axolotl
from .client import TeacherClient, TeacherServerError, TeacherTimeoutError
from .collator import TeacherDataCollator
from .compact import PackedCodec
from .distillkit import distillkit_to_store, store_to_distillkit
from .formats import import_sglang_logprobs, import_vllm_logprobs
from .hf_datasets import dataset_to_store, load_table, store_to_dataset
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
    iter_store,
    read_manifest,
    tokenizer_fingerprint,
    verify_store,
)

__all__ = [
    "FORMAT_VERSION",
    "PackedCodec",
    "axolotl_to_store",
    "dataset_to_store",
    "distillkit_to_store",
    "iter_store",
    "load_table",
    "read_manifest",
    "store_to_axolotl",
    "store_to_dataset",
    "store_to_distillkit",
    "verify_store",
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
