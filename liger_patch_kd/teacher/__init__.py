"""Teacher signals as data, in three rooms: the store (store/: format, writer, reader, packed encoding,
collator), other tools' formats and the converter table (formats/), a teacher behind a server from the trainer's
side (client/: the clients and the prefetcher; the formats they read are liger_patch_kd/wire/, the server itself is
liger_patch_kd/server/); and precompute.py, which fills a store from a teacher model. `__all__` is what users
call."""

from ..wire import TeacherReplyError
from ..wire.sampled_tokens import SampledTokens
from .client import TeacherClient, TeacherPrefetcher, TeacherServerError, TeacherTimeoutError
from .formats import (
    CONVERTERS,
    axolotl_to_store,
    dataset_to_store,
    distillkit_to_store,
    import_sglang_logprobs,
    import_vllm_logprobs,
    load_table,
    store_to_axolotl,
    store_to_dataset,
    store_to_distillkit,
)
from .joined import JoinedTeacherData
from .precompute import precompute, teacher_topk
from .routed import RoutedTeacherData
from .sampling import sample_teacher_tokens
from .store import (
    MANIFEST,
    StoreWriter,
    TeacherDataCollator,
    TeacherLogprobsDataset,
    TeacherStoreError,
    iter_store,
    read_manifest,
    tokenizer_fingerprint,
    verify_store,
)

__all__ = [
    # the store
    "MANIFEST",
    "StoreWriter",
    "TeacherDataCollator",
    "TeacherLogprobsDataset",
    "RoutedTeacherData",
    "JoinedTeacherData",
    "iter_store",
    "read_manifest",
    "tokenizer_fingerprint",
    "verify_store",
    # converters
    "CONVERTERS",
    "axolotl_to_store",
    "dataset_to_store",
    "distillkit_to_store",
    "import_sglang_logprobs",
    "import_vllm_logprobs",
    "load_table",
    "store_to_axolotl",
    "store_to_dataset",
    "store_to_distillkit",
    # precompute
    "precompute",
    "teacher_topk",
    "SampledTokens",
    "sample_teacher_tokens",
    # a served teacher
    "TeacherClient",
    "TeacherPrefetcher",
    # errors
    "TeacherReplyError",
    "TeacherServerError",
    "TeacherStoreError",
    "TeacherTimeoutError",
]
