"""The teacher store: its on-disk format (manifest.py), writer, reader, shard files (shard.py), the packed
encoding (compact.py), which files of a folder a writer may replace (folder.py); the collator that batches its
items is batch/teacher_data.py's TeacherDataCollator, re-exported here."""

from ...batch.teacher_data import TeacherDataCollator
from .compact import PackedCodec, codec_from_manifest, codec_from_spec
from .folder import check_store_folder
from .manifest import (
    FORMAT_VERSION,
    LOGPROB_DTYPES,
    MANIFEST,
    TeacherStoreError,
    read_manifest,
    tokenizer_fingerprint,
    write_manifest,
)
from .reader import TeacherLogprobsDataset, VerifiedStore, iter_store, refuse_samples, store_meta, verify_store
from .writer import StoreWriter

__all__ = [
    "FORMAT_VERSION",
    "LOGPROB_DTYPES",
    "MANIFEST",
    "PackedCodec",
    "StoreWriter",
    "TeacherDataCollator",
    "TeacherLogprobsDataset",
    "TeacherStoreError",
    "VerifiedStore",
    "check_store_folder",
    "codec_from_manifest",
    "codec_from_spec",
    "iter_store",
    "store_meta",
    "refuse_samples",
    "read_manifest",
    "tokenizer_fingerprint",
    "verify_store",
    "write_manifest",
]
