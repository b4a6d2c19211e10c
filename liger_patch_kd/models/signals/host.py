"""A model's forward as a host: a computation that needs the model's last hidden states and lm_head runs inside the
model's own top-level call, where FSDP has the root's parameters gathered and the wrappers (DDP, PEFT, accelerate's
autocast) do what they do for any forward.

The KD forward takes one explicit request, `kd_head_request=HeadRequest(compute, trainable)`, and returns
`compute(hidden, lm_head weight, bias, softcap)`: a teacher's (not trainable) backbone under no_grad and its head
inputs detached, a student's with gradients. `run_teacher_head` asks a live teacher that way (live.py); the KD
forward and `call_student` (models/kd_forward.py) are the other ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...distributed import release_root_parameters
from ..backbone import PaddingCheck, teacher_vision_inputs
from ..registry import VISION_INPUTS

# What a live teacher gets of the student's inputs: the tokens and how they are laid out (padding, packing).
# Anything else (pixel_values of a VLM student, labels) is the student's own.
TEACHER_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")

HeadCompute = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", "float | None"], Any]


@dataclass(frozen=True)
class HeadRequest:
    """Ask a KD forward for `compute(hidden, lm_head weight, bias, softcap)` on its last hidden states (the model's
    logit scale folded into hidden and bias), computed inside the forward. `trainable`: the student's, with
    gradients; otherwise a teacher's, detached and under no_grad. `grad_enabled`: the grad mode `compute` runs in
    (a teacher's forward runs under no_grad; the student's loss computed in it needs its caller's mode); None: the
    forward's own. `padding`: the student's rows' padding check (models.backbone.PaddingCheck), when the host reads
    the student's rows: its backbone may then drop a mask that only pads the end of rows. The forward also puts
    compute's result in `results`: wrappers may rebuild what a module returns."""

    compute: HeadCompute
    trainable: bool = False
    grad_enabled: bool | None = None
    padding: PaddingCheck | None = None
    results: list = field(default_factory=list)


def teacher_inputs(teacher: nn.Module, model_inputs: dict[str, Any]) -> dict[str, Any]:
    """What a live teacher reads of the student's inputs: the tokens and their layout, and a VLM teacher's vision
    inputs."""
    inputs = {k: model_inputs[k] for k in TEACHER_INPUT_KEYS if model_inputs.get(k) is not None}
    inputs.update(teacher_vision_inputs(teacher, model_inputs))
    return inputs


def run_teacher_head(
    teacher: nn.Module, input_ids, attention_mask, student_kwargs: dict, compute: HeadCompute,
    padding: PaddingCheck | None = None,
):  # fmt: skip
    """Return `compute(teacher hidden, teacher lm_head weight, bias, softcap)` run inside the teacher's own forward
    (the teacher runs the KD forward already: models.kd_forward.install_kd_forward), in this call's grad mode.
    `padding`: the student's rows' check, when `attention_mask` is theirs.

    Going through the teacher's top-level call (FSDP1/FSDP2/PEFT wrappers included) is what gathers its
    sharded parameters; the teacher's decoder runs under no_grad, and FSDP registers no backward hooks for it.
    """
    keys = (*TEACHER_INPUT_KEYS[2:], "use_cache")  # input_ids and attention_mask are passed explicitly
    passthrough = {k: student_kwargs[k] for k in keys if student_kwargs.get(k) is not None}
    if any(student_kwargs.get(k) is not None for k in VISION_INPUTS):  # a text batch has none to pass on
        passthrough.update(teacher_vision_inputs(teacher, student_kwargs))
    # the loss leaves through request.results, not as the teacher's output: wrappers rebuild a module's outputs
    # inside its call, under the teacher's no_grad (DeepSpeed ZeRO-3 does), which would cut the loss from the graph
    request = HeadRequest(compute, trainable=False, grad_enabled=torch.is_grad_enabled(), padding=padding)
    with torch.no_grad():
        teacher(input_ids=input_ids, attention_mask=attention_mask, kd_head_request=request, **passthrough)
    release_root_parameters(teacher)
    return request.results[0]
