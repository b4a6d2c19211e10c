"""One shard file, read a sequence at a time with positioned reads, each read checked against its own checksum.

A shard is a safetensors file (any safetensors tool can open it). Format 2 adds `checksums`: one crc32 per
sequence over the bytes of that sequence in every other array, in `ARRAY_ORDER`. Why per sequence and not per
shard: a shuffled reader touches one sequence of a shard at a time, so hashing a whole (hundreds of MB) shard on
first touch costs more than the epoch's useful reading, and on a TB store every process (each DataLoader worker,
each rank) would pay it again. A per-sequence crc32 checks exactly the bytes being read (a few % of the read on
one core), needs no shared state between workers, and costs nothing at open. The small parts that
locate sequences (safetensors header, offsets, checksums) are checked once per process against the manifest's
`index_crc32` when the shard is first opened. Format 1 shards (no per-sequence checksums) get their whole-file
sha256 verified once per process instead.

Reads use os.preadv on a descriptor opened lazily in each process: nothing is mapped or cached, so resident
memory stays flat in the store's size, and forked DataLoader workers share no file position.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from ...batch.columns import BEHAVIOUR_LOGPROBS, TEACHER_TOKEN_LOGPROBS

# sampled teacher tokens (samples.py), then a rollout store's columns (rollouts.py) come last, so the checksums of
# stores without them are unchanged
ARRAY_ORDER = ("input_ids", "topk_ids", "topk_logprobs", "topk_packed", "sample_ids", "sample_logprobs",
               "sample_packed", "sample_counts", "labels", BEHAVIOUR_LOGPROBS, TEACHER_TOKEN_LOGPROBS)  # fmt: skip
_NUMPY = {"I32": np.int32, "I64": np.int64, "U8": np.uint8, "BF16": np.uint16, "F16": np.float16, "F32": np.float32}


class ShardDamaged(Exception):
    """Raised inside the reader; the dataset turns it into a TeacherStoreError that names the shard."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sequence_checksums(offsets: np.ndarray, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """crc32 of each sequence's rows of every array (in ARRAY_ORDER), as int64 (S,)."""
    present = [np.ascontiguousarray(arrays[name]) for name in ARRAY_ORDER if name in arrays]
    bounds = np.asarray(offsets).tolist()
    out = np.empty(len(bounds) - 1, dtype=np.int64)
    for j in range(len(out)):
        crc = 0
        for a in present:  # a contiguous run of rows: crc32 reads it in place, no copy
            crc = zlib.crc32(a[bounds[j] : bounds[j + 1]], crc)
        out[j] = crc
    return out


def index_checksum(header: bytes, offsets: np.ndarray, checksums: np.ndarray | None) -> int:
    crc = zlib.crc32(offsets.tobytes(), zlib.crc32(header))
    return zlib.crc32(checksums.tobytes(), crc) if checksums is not None else crc


def read_header(fd: int) -> tuple[bytes, dict]:
    """The safetensors header (raw bytes, parsed), every field checked: ShardDamaged on anything else. The length
    prefix is compared with the file's size before anything is read or allocated."""
    size = os.fstat(fd).st_size
    prefix = os.pread(fd, 8, 0)
    if len(prefix) != 8:
        raise ShardDamaged(f"it is cut short ({size} bytes, less than the 8-byte header length)")
    (length,) = struct.unpack("<Q", prefix)
    if length > size - 8:
        raise ShardDamaged(f"its header length {length} exceeds the file ({size} bytes): the length prefix is damaged "
                           f"or the file cut short")  # fmt: skip
    raw = os.pread(fd, length, 8)
    if len(raw) != length:
        raise ShardDamaged("its safetensors header is cut short")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ShardDamaged(f"its safetensors header is not JSON ({str(e)[:80]})") from None
    if not isinstance(header, dict):
        raise ShardDamaged(f"its safetensors header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    body = size - 8 - length
    for name, info in header.items():
        _check_entry(name, info, body)
    return raw, header


def _check_entry(name: str, info: object, body: int) -> None:
    """One tensor entry of a header: dtype, shape and data_offsets that agree with each other and the file."""
    what = f"its header entry {name[:40]!r}"
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise ShardDamaged(f"{what} is not {{dtype, shape, data_offsets}}")
    dtype, shape, span = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _NUMPY:
        raise ShardDamaged(f"{what} has dtype {str(dtype)[:20]!r}; a shard holds {sorted(_NUMPY)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise ShardDamaged(f"{what} has shape {str(shape)[:40]}, not a list of sizes")
    if not isinstance(span, list) or len(span) != 2 or not all(_is_count(x) for x in span) or span[0] > span[1]:
        raise ShardDamaged(f"{what} has data_offsets {str(span)[:40]}, not [start, end]")
    nbytes = math.prod(shape) * np.dtype(_NUMPY[dtype]).itemsize
    if span[1] - span[0] != nbytes:
        raise ShardDamaged(f"{what}: shape {shape} of {dtype} is {nbytes} bytes but data_offsets span "
                           f"{span[1] - span[0]}")  # fmt: skip
    if span[1] > body:
        raise ShardDamaged(f"it is cut short ({what} ends at byte {span[1]} of a {body}-byte body)")


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class ShardReader:
    """Positioned reads of one shard's sequences; verified as described in the module docstring.

    layout: what the manifest says the shard holds, {"top_k": k, "row_bytes": packed row bytes or None}; the
    arrays' presence, dtypes and shapes are checked against it when the shard is opened."""

    def __init__(self, path: Path, entry: dict, layout: dict | None = None) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self._open(entry)
            if layout is not None:
                self._check_layout(layout)
        except BaseException:
            os.close(self.fd)
            raise

    def _open(self, entry: dict) -> None:
        if "index_crc32" not in entry:  # format 1: only a whole-file hash exists
            if sha256_file(self.path) != entry["sha256"]:
                raise ShardDamaged("it fails its checksum")
        raw, header = read_header(self.fd)
        base = 8 + len(raw)
        self.arrays = {}
        for name, info in header.items():
            start = base + info["data_offsets"][0]
            self.arrays[name] = (_NUMPY[info["dtype"]], info["dtype"], tuple(info["shape"]), start)
        for name, dtype, ndim in (("offsets", "I64", 1), ("input_ids", "I32", 1)):
            if name not in self.arrays or self.arrays[name][1] != dtype or len(self.arrays[name][2]) != ndim:
                raise ShardDamaged(f"it has no {ndim}-d {dtype} array {name!r}: not a teacher store shard")
        self.offsets = self._whole("offsets")
        self.checksums = self._whole("checksums") if "checksums" in self.arrays else None
        # per array of a sequence, in checksum order: (name, first byte, bytes a position), worked out once (a
        # training step reads hundreds of sequences, each of every array)
        self._rows = [(name, self.arrays[name][3], self.row_bytes(name)) for name in ARRAY_ORDER if name in self.arrays]
        if "index_crc32" in entry and index_checksum(raw, self.offsets, self.checksums) != entry["index_crc32"]:
            raise ShardDamaged("its index (header, offsets, checksums) fails its checksum")
        if len(self.offsets) != entry["num_sequences"] + 1:
            raise ShardDamaged("it holds another number of sequences than the manifest lists")
        positions = self.arrays["input_ids"][2][0]
        if self.offsets[0] != 0 or self.offsets[-1] != positions or (np.diff(self.offsets) < 0).any():
            raise ShardDamaged(f"its offsets do not split its {positions} tokens into sequences")
        if self.checksums is not None and self.arrays["checksums"][2] != (len(self.offsets) - 1,):
            raise ShardDamaged("it holds another number of checksums than sequences")

    def _check_layout(self, layout: dict) -> None:
        """The arrays the manifest's encoding and top_k imply, with their dtypes and shapes."""
        n, k, row_bytes = self.arrays["input_ids"][2][0], layout["top_k"], layout.get("row_bytes")
        if row_bytes is None:
            want = {"topk_ids": (("I32",), (n, k)), "topk_logprobs": (("BF16", "F16", "F32"), (n, k))}
            other = "topk_packed"
        else:
            want, other = {"topk_packed": (("U8",), (n, row_bytes))}, "topk_ids"
        want = want if k else {}  # sampled tokens alone (samples.py): no top-k arrays
        want.update(layout.get("samples", lambda n: {})(n))
        want.update(layout.get("rollouts", lambda n: {})(n))
        if other in self.arrays:
            kind = "packed" if other == "topk_packed" else "plain"
            raise ShardDamaged(f"it is a {kind} shard but the manifest's encoding is "
                               f"{'plain' if row_bytes is None else 'packed'}: it belongs to another store")
        for name, (dtypes, shape) in want.items():
            if name not in self.arrays:
                raise ShardDamaged(f"it has no {name!r} array (the manifest's encoding needs one)")
            _, dtype, got, _ = self.arrays[name]
            if dtype not in dtypes or got != shape:
                raise ShardDamaged(f"its {name} is {dtype} {list(got)}; the manifest (top_k {k}, encoding) implies "
                                   f"{'/'.join(dtypes)} {list(shape)}: the manifest was edited or belongs to another "
                                   f"store")  # fmt: skip

    def _whole(self, name: str) -> np.ndarray:
        dtype, _, shape, start = self.arrays[name]
        return self._pread(start, int(np.prod(shape)) * np.dtype(dtype).itemsize).view(dtype).reshape(shape)

    def _pread(self, offset: int, nbytes: int) -> np.ndarray:
        buf = np.empty(nbytes, dtype=np.uint8)
        if nbytes and os.preadv(self.fd, [buf], offset) != nbytes:
            raise ShardDamaged("it is cut short")
        return buf

    def row_bytes(self, name: str) -> int:
        dtype, _, shape, _ = self.arrays[name]
        return int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize

    def sequence(self, j: int) -> dict[str, np.ndarray]:
        """Raw bytes of sequence j in every array (uint8, rows x row_bytes), checksum verified."""
        lo, hi = int(self.offsets[j]), int(self.offsets[j + 1])
        out, crc = {}, 0
        for name, start, width in self._rows:
            out[name] = self._pread(start + lo * width, (hi - lo) * width).reshape(hi - lo, width)
            if self.checksums is not None:
                crc = zlib.crc32(out[name], crc)
        if self.checksums is not None and crc != int(self.checksums[j]):
            raise ShardDamaged(f"sequence {j} fails its checksum")
        return out

    def dtype_name(self, name: str) -> str:
        return self.arrays[name][1]

    def close(self) -> None:
        os.close(self.fd)
