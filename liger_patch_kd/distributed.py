"""Getting the full lm_head weight to the fused loss under FSDP2, FSDP1 and DeepSpeed ZeRO-3.

The fused loss reads `lm_head.weight` directly (it never calls lm_head), so it must run where the weight is
whole. The patched forward arranges that:

* FSDP2 (`fully_shard`) and FSDP1 (`FullyShardedDataParallel`, `use_orig_params` True or False): parameters
  of a unit are gathered for the duration of that unit's forward. The KD forward *is* the root unit's
  forward (and the teacher's hidden states and weight are handed over inside the teacher's own forward,
  see `models.kd_forward.call_teacher`), so `lm_head.weight` is whole there and its gradient flows back to
  the sharded parameter through FSDP's own hooks. This holds as long as lm_head stays in the root unit —
  the default when you wrap the decoder layers and then the model. A separately wrapped lm_head is caught
  by `check_full_weight` with an explanation instead of a size mismatch or a silently wrong loss.
* DeepSpeed ZeRO-3 partitions every parameter and gathers it only inside its own module's forward;
  `gathered_weights` gathers lm_head's for the loss (deepspeed is an optional extra, imported lazily).

Nothing here imports transformers or the models: the patched forward and the trainer use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def check_full_weight(weight: torch.Tensor, expected_shape: tuple[int, int] | None, role: str) -> None:
    """Raise a clear ValueError when `weight` is a shard rather than the whole lm_head weight."""
    if is_dtensor(weight):
        raise ValueError(
            f"the {role}'s lm_head.weight is a sharded DTensor (placements {weight.placements}) at loss time: "
            f"lm_head was given its own fully_shard unit. Keep it in the root unit (fully_shard the decoder "
            f"layers, then the whole model), so it is gathered during the model's forward"
        )
    if expected_shape is not None and tuple(weight.shape) != tuple(expected_shape):
        raise ValueError(
            f"the {role}'s lm_head.weight has shape {tuple(weight.shape)} at loss time, expected {expected_shape}: "
            f"it is sharded or flattened (FSDP1 with lm_head in its own unit?). Keep lm_head in the root FSDP unit, "
            f"e.g. an auto-wrap policy on the decoder layer class only"
        )


@contextlib.contextmanager
def gathered_weights(module: nn.Module) -> Iterator[None]:
    """Gather a ZeRO-3 partitioned module's own parameters for the duration of the block (no-op otherwise)."""
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]  # an adapter's too
    if not params:
        yield
        return
    import deepspeed  # optional extra: only reached when the parameters are ZeRO-3 partitioned

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield
