"""Which input an output was computed ahead for: a kernel that computes a later module's output early (the fused
projections' tails, a fused add's norm) hands it over only when that module is called on the very same tensor, not
changed in place since (the same identity and version counter), and only where no hook of the user's can run in
between: a hook may change the tensor in place where the counter does not see it (under inference mode, which keeps
none, or through `.data`), as activation steering does.

    mark = input_mark(x)                 # when computing ahead
    y is x and input_mark(y) == mark     # when asked: the very input, unchanged
    no_hooks(after=(layer,), before=(next_layer, norm))   # nothing of the user's runs between the two (utils/hooks.py)
"""

from __future__ import annotations

import torch


def input_mark(x: torch.Tensor) -> int | None:
    """x's in-place version counter; None for an inference-mode tensor, which has none (identity alone then: such a
    tensor is changed in place only inside inference mode, by code the decode step does not run between the two)."""
    return None if x.is_inference() else x._version
