"""What a teacher server and its clients agree on besides a format's bytes: the environment variable both read the
API key from, the key the server sets in the trainer's store once it joins a weight broadcast, and which JSON
values count as ints and numbers (never a boolean, though Python's True is an int) when either end checks a field."""

from __future__ import annotations

import math
from typing import Any

API_KEY_ENV = "LIGER_KD_API_KEY"  # the server's --api-key, read by both ends when not given
JOINED_KEY = "joined"  # set by the server once it reached the trainer's store: the trainer then makes its group


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return isinstance(x, int) or math.isfinite(x)  # an int of any size is finite (and may not fit a float)
