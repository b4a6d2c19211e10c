"""What a one-line refusal quotes of the error that caused it."""

from __future__ import annotations


def reason_of(error: BaseException, limit: int | None = 500) -> str:
    """`error` as one line (its whitespace collapsed) of at most `limit` characters (None: all of it, for a message
    of our own), or its type's name where it says nothing. The limit keeps a stack of chained messages out of the
    line, not the hint that ends a library's message: a hub that cannot be reached says how to run offline in its
    last 80 of about 260 characters."""
    text = " ".join(str(error).split())
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    return text or type(error).__name__
