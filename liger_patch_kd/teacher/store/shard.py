"""One shard file, read a sequence at a time with positioned reads, each read checked against its own checksum.

A shard is a safetensors file (any safetensors tool can open it). Format 2 adds `checksums`: one crc32 per
sequence over the bytes of that sequence in every other array, in `ARRAY_ORDER`. Why per sequence and not per
shard: a shuffled reader touches one sequence of a shard at a time, so hashing a whole (hundreds of MB) shard on
first touch costs more than the epoch's useful reading, and on a TB store every process (each DataLoader worker,
each rank) would pay it again. A per-sequence crc32 checks exactly the bytes being read (2.5 GB/s on one core,
a few % of the read), needs no shared state between workers, and costs nothing at open. The small parts that
locate sequences (safetensors header, offsets, checksums) are checked once per process against the manifest's
`index_crc32` when the shard is first opened. Format 1 shards (no per-sequence checksums) get their whole-file
sha256 verified once per process instead.

Reads use os.preadv on a descriptor opened lazily in each process: nothing is mapped or cached, so resident
memory stays flat in the store's size, and forked DataLoader workers share no file position.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np

ARRAY_ORDER = ("input_ids", "topk_ids", "topk_logprobs", "topk_packed")
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
    present = [arrays[name] for name in ARRAY_ORDER if name in arrays]
    out = np.empty(len(offsets) - 1, dtype=np.int64)
    for j in range(len(out)):
        crc = 0
        for a in present:
            crc = zlib.crc32(a[offsets[j] : offsets[j + 1]].tobytes(), crc)
        out[j] = crc
    return out


def index_checksum(header: bytes, offsets: np.ndarray, checksums: np.ndarray | None) -> int:
    crc = zlib.crc32(offsets.tobytes(), zlib.crc32(header))
    return zlib.crc32(checksums.tobytes(), crc) if checksums is not None else crc


def read_header(fd: int) -> tuple[bytes, dict]:
    (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    raw = os.pread(fd, length, 8)
    if len(raw) != length:
        raise ShardDamaged("its safetensors header is cut short")
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ShardDamaged(f"its safetensors header is not JSON ({e})") from None
    header.pop("__metadata__", None)
    return raw, header


class ShardReader:
    """Positioned reads of one shard's sequences; verified as described in the module docstring."""

    def __init__(self, path: Path, entry: dict) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self._open(entry)
        except BaseException:
            os.close(self.fd)
            raise

    def _open(self, entry: dict) -> None:
        if "index_crc32" not in entry:  # format 1: only a whole-file hash exists
            if sha256_file(self.path) != entry["sha256"]:
                raise ShardDamaged("it fails its checksum")
        size = os.fstat(self.fd).st_size
        if size < 8:
            raise ShardDamaged("it is cut short")
        raw, header = read_header(self.fd)
        base = 8 + len(raw)
        self.arrays = {}
        for name, info in header.items():
            start, end = info["data_offsets"]
            self.arrays[name] = (_NUMPY[info["dtype"]], info["dtype"], tuple(info["shape"]), base + start)
            if base + end > size:
                raise ShardDamaged("it is cut short")
        self.offsets = self._whole("offsets")
        self.checksums = self._whole("checksums") if "checksums" in self.arrays else None
        if "index_crc32" in entry and index_checksum(raw, self.offsets, self.checksums) != entry["index_crc32"]:
            raise ShardDamaged("its index (header, offsets, checksums) fails its checksum")
        if len(self.offsets) != entry["num_sequences"] + 1:
            raise ShardDamaged("it holds another number of sequences than the manifest lists")

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
        for name in ARRAY_ORDER:
            if name not in self.arrays:
                continue
            _, _, shape, start = self.arrays[name]
            width = self.row_bytes(name)
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
