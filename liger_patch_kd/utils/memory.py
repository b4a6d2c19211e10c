"""Peak memory of a block of code, on CUDA (allocator statistics) and on CPU (live tensor storages)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _LiveStorages(TorchDispatchMode):
    """Counts the bytes of every storage created inside the block while it is alive; keeps the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._seen:
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._release, key, storage.nbytes())
        return out


class PeakMemory:
    """`with PeakMemory(device) as m: ...` then `m.peak_bytes`: the most memory the block held at once beyond
    what existed when it started (CUDA: allocator peak minus start; CPU: tensors created inside the block)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.peak_bytes = 0
        self._mode: _LiveStorages | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = _LiveStorages()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        else:
            self._mode.__exit__(*exc)
            self.peak_bytes = self._mode.peak

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20


def peak_memory_meaning(device: torch.device | str) -> str:
    """What PeakMemory's figure is on `device`, for a table's legend."""
    if torch.device(device).type == "cuda":
        return "peak MiB: the CUDA allocator's peak during the run, beyond what was allocated when it started"
    return (
        "peak MiB: the most bytes the tensors created during the run held at once (on a CPU, counted tensor by "
        "tensor; not the process's resident memory)"
    )
