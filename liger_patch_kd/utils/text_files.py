"""Reading a user's text data file as UTF-8, where a byte that is not UTF-8 is a one-line error naming the option,
the file, the byte and where it sits, and the fix (Python's own message names neither the file nor the option)."""

from __future__ import annotations

import io
from pathlib import Path


def read_utf8(path: str | Path, option: str) -> str:
    """The file's text, newlines as open() gives them (\\r\\n and \\r read as \\n); a ValueError if not UTF-8."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{option} {path}: not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} (line "
                         f"{line}) ({e.reason}); re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE > "
                         "NEW)") from None  # fmt: skip
    return io.StringIO(text, newline=None).read()
