"""Teacher signals as data, in three rooms: the store (store/: format, writer, reader, packed encoding,
collator), other tools' formats and the converter table (formats/), a teacher behind a server (serve/: wire
formats, client, prefetcher; the server itself is teacher.serve.server, FastAPI imported lazily); and
precompute.py, which fills a store from a teacher model. `__all__` is what users call."""

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
from .sampling import SampledTokens, sample_teacher_tokens
from .serve import (
    TeacherClient,
    TeacherPrefetcher,
    TeacherReplyError,
    TeacherServerError,
    TeacherTimeoutError,
)
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
