"""A CUDA graph capture that leaves the process as it found it when the capture fails.

A capture fails when the code inside it does what a capture refuses (a host sync: `.item()`, a hook that
synchronises). torch.cuda.graph's exit then raises from `capture_end` before three things it would do after it:
  - put the caller's current stream back: every later op of the thread would run on the capture stream, out of
    order with the other threads' work on the default stream;
  - tell the caching allocator the pool stopped recording: a later capture into that pool is refused ("already
    recording to mempool_id"), and every allocation is tested against the dead capture;
  - tell torch's CUDA generator the capture ended: every random op on the device fails ("Offset increment outside
    graph capture").
`graph_capture` does all three on the way out. The pinned host allocator also keeps the pool marked as recording
and has no call to end it, so a caller that captures again after a failure takes a new pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, device: torch.device, pool, **options) -> Iterator[None]:
    """`torch.cuda.graph(graph, pool=pool, **options)`, repaired when the capture fails (the module docstring);
    `pool`: a handle from torch.cuda.graph_pool_handle() (given, so a failure can end its recording)."""
    stream = torch.cuda.current_stream(device)
    try:
        with torch.cuda.graph(graph, pool=pool, **options):
            yield
    except BaseException:
        torch.cuda.set_stream(stream)
        _end_recording(device, pool)
        _end_generator_capture(device)
        raise


def _end_recording(device: torch.device, pool) -> None:
    end_allocating = getattr(torch._C, "_cuda_endAllocateToPool", None)  # what capture_end calls after its check
    if end_allocating is not None:
        with contextlib.suppress(RuntimeError):  # "not currently recording": capture_end got that far itself
            end_allocating(device.index if device.index is not None else torch.cuda.current_device(), pool)


def _end_generator_capture(device: torch.device) -> None:
    """A capture that succeeds, on a side stream, tells torch's CUDA generator the capture ended."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            torch.zeros(1, device=device)
    torch.cuda.current_stream(device).wait_stream(side)
