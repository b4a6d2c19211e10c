"""Which input an output was computed ahead for: a kernel that computes a later module's output early (the fused
projections' tails, a fused add's norm) hands it over only when that module is called on the very same tensor, not
changed in place since (the same identity and version counter).

    mark = input_mark(x)            # when computing ahead
    input_mark(y) == mark and y is x   # when asked: the very input, unchanged
"""

from __future__ import annotations

import torch


def input_mark(x: torch.Tensor) -> int | None:
    """x's in-place version counter; None for an inference-mode tensor, which has none (identity alone then: such a
    tensor is changed in place only inside inference mode, by code the decode step does not run between the two)."""
    return None if x.is_inference() else x._version
