"""Stopping a decode loop part-way: the caller hands the loop a `threading.Event` (set from any thread, e.g. by a
server whose client hung up) and the loop looks at it once per step, a Python flag read with no device sync. A set
event ends the loop with `Cancelled`: nothing is returned, and every piece of state the next call reads is reset by
that call's prefill (the engine's session) or was local to the call (the plain loop's cache)."""

from __future__ import annotations

import threading


class Cancelled(Exception):
    """The decode was stopped because its cancellation event was set; it returns nothing."""


def stop_if_cancelled(cancel: threading.Event | None) -> None:
    """Raise Cancelled if `cancel` is set (None: never)."""
    if cancel is not None and cancel.is_set():
        raise Cancelled("the decode was cancelled (its cancellation event is set)")
