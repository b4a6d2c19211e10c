"""Programmatic dependent launch (PDL) for the kernels of the decode engine's steps.

At a decode step's few rows every kernel is short, and between two of them the GPU drains the first, then launches
and schedules the second. Launched as a programmatic dependent (Hopper and later), a kernel is launched and its
programs placed while the one before it still runs; each program waits (ops.triton_utils.await_prior_grids) for the
kernels before it to finish before it reads or writes anything, then lets the next kernel launch.

    dependent_launch(x.device)   # whether the project's decode-step kernels launch so here

The kernels that consult it run in the decode engine's twin (generation/kernel_twin.py), captured or not: a captured
step replays them as launched, with or without the attribute. Off unless ENABLED: timed side by side by
`bench_rollouts --launch plain dependent`.
"""

from __future__ import annotations

import torch

from ..ops.backend import triton_available

ENABLED = False

if triton_available():
    from ..ops.triton_utils import dependent_launch_supported


def dependent_launch(device: torch.device) -> bool:
    """Whether the decode step's kernels on `device` launch as programmatic dependents: ENABLED, on a GPU that
    supports it (the same answer for a captured step's warm-up and its capture, so both compile one variant)."""
    return ENABLED and triton_available() and device.type == "cuda" and dependent_launch_supported(device)
