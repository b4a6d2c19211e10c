"""Teacher signals as data: the store (write, read), precompute, other tools' formats, batching."""

from .axolotl import axolotl_to_store, store_to_axolotl
from .collator import TeacherDataCollator
from .compact import PackedCodec
from .formats import import_vllm_logprobs
from .hf_datasets import dataset_to_store, load_table, store_to_dataset
from .precompute import precompute, teacher_topk, topk_of_logits
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
    "iter_store",
    "load_table",
    "read_manifest",
    "store_to_axolotl",
    "store_to_dataset",
    "verify_store",
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
