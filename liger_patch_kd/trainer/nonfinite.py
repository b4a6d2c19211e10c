"""A NaN or inf loss or gradient stops training with one clear error instead of being trained on.

HF's Trainer does not stop: with `logging_nan_inf_filter` (the default) it reads every micro-batch's loss on the
host, and when it is NaN / inf only hides it from the logged loss, while the optimizer applies the NaN gradient
to every weight. Checking costs no extra host sync where the Trainer already reads the value:

- per micro-batch, when `logging_nan_inf_filter` is on: the Trainer syncs on that loss right after training_step,
  so the check there raises before the optimizer step, with the weights still those the step started with;
- at each logging step, always: the logged loss, grad_norm and KD terms are host floats by then (with the filter
  off, this is where a non-finite loss is first seen: the weights have then taken up to logging_steps bad steps).
"""

from __future__ import annotations

import math
from typing import Any

import torch

LOGGED = ("loss", "grad_norm", "kd_soft_loss", "kd_hard_loss")
CAUSES = ("look for NaN / inf in the batch's teacher data (log-probs, an engine's behaviour log-probs) or its "
          "inputs, a learning rate too high, or fp16 overflow (bf16 has fp32's range)")  # fmt: skip


def check_step_loss(loss: torch.Tensor, args: Any, step: int) -> None:
    """After a micro-batch's backward: FloatingPointError if its loss is NaN / inf, where the Trainer reads it anyway
    (logging_nan_inf_filter); elsewhere the logging step's check_logged sees it, without a host sync here."""
    if args.logging_nan_inf_filter and not bool(torch.isfinite(loss).all()):
        raise FloatingPointError(
            f"the training loss of optimizer step {step} is {loss.float().mean().item()}: training stops before the "
            f"optimizer applies its non-finite gradient (the weights are those step {step} started with); {CAUSES}"
        )


def check_logged(logs: dict[str, Any], step: int) -> None:
    """At a logging step: FloatingPointError naming the first of LOGGED that is NaN / inf in `logs`."""
    for key in LOGGED:
        value = logs.get(key)
        if isinstance(value, (int, float)) and not math.isfinite(value):
            raise FloatingPointError(
                f"the {key} logged at optimizer step {step} is {value}: a non-finite loss or gradient was applied to "
                f"the weights since the last log (logging_nan_inf_filter=True, the default, stops at the "
                f"step instead); {CAUSES}"
            )
