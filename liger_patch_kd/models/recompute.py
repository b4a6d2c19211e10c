"""Selective recompute: gradient checkpointing on the first layers of the student's language decoder only.

HF's gradient checkpointing is all or nothing: every decoder layer drops its activations and recomputes them in
the backward. A step that has memory to spare (an FP8 teacher frees about half of the teacher's weights) can keep
some layers' activations and skip their recompute. Each layer decides at call time through its own
`gradient_checkpointing` flag (transformers' GradientCheckpointingLayer), so narrowing the set is a flag per layer.

A layer that keeps its activations still drops its gated MLP's activation output, the largest of them with the
gate and up outputs (tokens x intermediate), and recomputes it from those two in the backward: one elementwise
pass (ops/swiglu.py, `recomputed_gated_outputs`), for 256 MiB per layer at 16,384 tokens of a 1B Llama, which
lets more layers keep the rest. The patched gated MLP forward reads the flag (RECOMPUTE_ACT_ATTR) set here.
"""

from __future__ import annotations

from torch import nn

from .state import unwrap_model

RECOMPUTE_ACT_ATTR = "__liger_kd_recompute_act__"  # on a kept layer's gated MLP: its activation output is recomputed


def limit_recompute(model: nn.Module, n_layers: int) -> tuple[int, int]:
    """Leave checkpointing on for the first `n_layers` decoder layers of `model` (DDP / FSDP / PEFT wrappers
    unwrapped) and turn it off for the rest. Returns (layers recomputing, layers keeping their activations).
    Call it after `gradient_checkpointing_enable()` (KDTrainer does, at each train()): enabling checkpointing
    again turns it on for every layer, and a kept layer's MLP flag then only costs memory (its saved tensors
    bypass the checkpoint's hooks) until limit_recompute runs again."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    hf = unwrap_model(model)
    decoder = hf.get_decoder() if hasattr(hf, "get_decoder") else hf
    layers = [m for m in decoder.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(
            f"kd_recompute_layers: {type(hf).__name__}'s decoder has no layers that checkpoint themselves "
            f"(transformers' GradientCheckpointingLayer); leave kd_recompute_layers=None"
        )
    if not any(layer.gradient_checkpointing for layer in layers):
        raise ValueError(
            "kd_recompute_layers: gradient checkpointing is not on for the student's layers (under FSDP, "
            "activation_checkpointing in the FSDP config wraps the layers instead); use gradient_checkpointing=True "
            "without FSDP's activation_checkpointing, or leave kd_recompute_layers=None"
        )
    if n_layers > len(layers):
        raise ValueError(
            f"kd_recompute_layers={n_layers} but the student's decoder has {len(layers)} layers; "
            f"pass at most {len(layers)} (or None: every layer recomputes)"
        )
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index < n_layers
        for module in layer.modules():  # the gated MLPs (the patched forward reads the flag; others ignore it)
            if hasattr(module, "down_proj"):
                setattr(module, RECOMPUTE_ACT_ATTR, index >= n_layers)
    return n_layers, len(layers) - n_layers
