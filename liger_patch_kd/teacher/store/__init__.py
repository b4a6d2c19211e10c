"""The teacher store: its on-disk format (manifest.py), writer, reader, shard files (shard.py), the packed
encoding (compact.py), and the collator that batches its items."""

from .collator import TeacherDataCollator
from .compact import PackedCodec, codec_from_manifest, codec_from_spec
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
from .writer import StoreWriter, check_store_folder

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
