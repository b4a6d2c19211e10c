"""A seeded stretch of sampling that leaves the caller's random state as it was.

    with seeded(seed, devices):   # the CPU's and these CUDA devices' generators seeded, put back after
        ...

What torch.manual_seed(seed) inside torch.random.fork_rng(devices) does for the generators that sampling reads,
without seeding every other backend torch knows (each CUDA device, MPS, XPU): XPU's seeding, queued while XPU is
not initialised, formats a stack trace at each call, which an on-policy step paid at every generation call. It
also leaves the other CUDA devices' generators alone, which manual_seed reseeded for good
(fork_rng puts back only the devices it is given).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


@contextlib.contextmanager
def seeded(seed: int, devices: Sequence[torch.device] = ()) -> Iterator[None]:
    """The CPU's generator and each CUDA device's in `devices` seeded with `seed` inside, their states restored on
    exit (an exception included). `seed`: anything int() takes, as torch.manual_seed (a numpy integer too)."""
    seed = int(seed)
    with torch.random.fork_rng(devices=list(devices)):
        torch.default_generator.manual_seed(seed)
        for device in devices:
            index = device.index if device.index is not None else torch.cuda.current_device()
            torch.cuda.default_generators[index].manual_seed(seed)
        yield
