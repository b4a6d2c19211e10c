"""Programmatic dependent launch (PDL) for the kernels of a captured decode step.

At a decode step's few rows every kernel is short, and between two of them the GPU drains the first, then launches
and schedules the second. Launched as a programmatic dependent (Hopper and later), a kernel is launched and its
programs placed while the one before it still runs; each program waits (ops.triton_utils.await_prior_grids) for the
kernels before it to finish before it reads or writes anything, then lets the next kernel launch.

    dependent_launch(x.device)   # whether the project's decode-step kernels launch so here

Only while a decode step is being captured (the engine's "graph" cache), where the step's launches are what the
graph replays. Off unless ENABLED: timed side by side by `bench_rollouts --launch plain dependent`.
"""

from __future__ import annotations

import torch

from ..ops.backend import triton_available

ENABLED = False

if triton_available():
    from ..ops.triton_utils import dependent_launch_supported


def dependent_launch(device: torch.device) -> bool:
    """Whether the decode step's kernels on `device` launch as programmatic dependents now: ENABLED, a step being
    captured on this thread's stream, a GPU that supports it."""
    if not (ENABLED and triton_available() and device.type == "cuda"):
        return False
    return torch.cuda.is_current_stream_capturing() and dependent_launch_supported(device)
