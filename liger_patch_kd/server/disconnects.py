"""A request's work raced against its client hanging up, so that no departed client holds the model.

uvicorn does not cancel an endpoint when its client closes the connection: without this, a generation of a client
that has gone runs to its last token under the model's lock while everyone else waits. `unless_hung_up(request,
work, cancel)` awaits `work` while listening for the connection's `http.disconnect` (the ASGI message a server
sends once the body has been read and the client is gone: no polling); when the client goes first it sets `cancel`
(the worker thread's decode loop reads it at its next step: generation/cancellation.py), cancels the awaiting task
(a scoring request's futures, which the batcher then skips) and raises ClientGone. Nothing is sent back: there is
no one to read it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from typing import Any


class ClientGone(Exception):
    """The request's client closed its connection before the reply was ready."""


async def hung_up(request: Any) -> None:
    """Return once the client of `request` (a Starlette Request whose body has been read) has disconnected."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_hung_up(request: Any, work: Awaitable, cancel: threading.Event | None = None) -> Any:
    """`work`'s result, or ClientGone once the client disconnects first (then `cancel` is set and `work` cancelled).
    Call it after the body has been read: until then receive() hands out the body, not the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(hung_up(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and watcher.exception() is not None:  # the connection cannot be watched: work as before
            await asyncio.wait({task})
    except BaseException:  # the endpoint itself cancelled (shutdown): the work is nobody's any more
        task.cancel()
        if cancel is not None:
            cancel.set()
        raise
    finally:
        watcher.cancel()
    if task.done():  # finished (or failed) first, or in the same turn as the disconnect: its outcome stands
        return task.result()
    if cancel is not None:
        cancel.set()
    task.cancel()  # a thread's work goes on until it reads `cancel`; asyncio's awaiting of it ends now
    raise ClientGone
