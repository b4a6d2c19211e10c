"""What patching remembers, and where: the registries every other module of `models` reads.

A patched class keeps its `PatchState` in `CLASS_STATE`; a patched instance keeps its own in its `__dict__`
under `INSTANCE_ATTR`; every instance given the KD forward is in `PATCHED_INSTANCES`, so that revert_kd_patch()
with no arguments can undo them all. Nothing here imports another module of `models`.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from torch import nn

from ..config import KDLossConfig

__all__ = [
    "CLASS_STATE", "FP8_OUTPUT_ATTR", "INSTANCE_ATTR", "ORIGINAL_BOUND_ATTR", "PATCHED_INSTANCES", "PatchState",
    "original_forward", "patch_state", "transformers_forward", "unwrap_model",
]  # fmt: skip


@dataclass
class PatchState:
    """What a patched class or instance remembers: its original forward and its loss options."""

    original_forward: Callable
    config: KDLossConfig = field(default_factory=KDLossConfig)
    fused: bool = True


CLASS_STATE: dict[type, PatchState] = {}
INSTANCE_ATTR = "_liger_kd_state"
ORIGINAL_BOUND_ATTR = "_liger_kd_original_bound"  # original_forward's cached bound method
# on an FP8 teacher's norm whose output only FP8 products read (models/fp8_teacher.py): the patched norm forward
# quantises its output in the same pass and leaves it for them (ops/fp8.QUANTIZED_INPUTS)
FP8_OUTPUT_ATTR = "_liger_kd_fp8_output"
# every instance given the KD forward (apply_kd_patch(model=...), or a teacher or a cross-tokenizer student via
# install_kd_forward)
PATCHED_INSTANCES: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def class_state(cls: type) -> PatchState | None:
    """The state of the patched class `cls` or of its nearest patched base (FSDP2 swaps in a subclass)."""
    for owner in cls.__mro__:
        if owner in CLASS_STATE:
            return CLASS_STATE[owner]
    return None


def patch_state(model: nn.Module) -> PatchState:
    """The state of a model running the KD forward: its instance's own, else its class's."""
    state = model.__dict__.get(INSTANCE_ATTR) or class_state(type(model))
    if state is None:
        raise RuntimeError(f"{type(model).__name__} runs the KD forward but was never patched; call apply_kd_patch")
    return state


def unwrap_model(model: nn.Module) -> nn.Module:
    """The Hugging Face *ForCausalLM inside DDP / FSDP1 / PEFT / torch.compile wrappers."""
    seen = 0
    while seen < 8:
        seen += 1
        for attr in ("module", "_fsdp_wrapped_module", "_orig_mod"):
            inner = getattr(model, attr, None)
            if isinstance(inner, nn.Module):
                model = inner
                break
        else:
            base = getattr(model, "base_model", None)  # PEFT: PeftModel.base_model (LoraModel).model
            if base is not None and base is not model and isinstance(getattr(base, "model", None), nn.Module):
                model = base.model
                continue
            return model
    return model


def transformers_forward(model: nn.Module) -> Callable | None:
    """The function of a patched *ForCausalLM's own, unpatched forward (transformers' code, to bind to `model` or
    to a module standing in for it), or None when the model does not run the KD forward (not patched, or its
    instance forward is a wrapper such as accelerate's autocast)."""
    state = model.__dict__.get(INSTANCE_ATTR) or class_state(type(model))
    own = model.__dict__.get("forward")  # apply_kd_patch(model=...) installs the KD forward on the instance
    # a bound method's function, a partial's (functools.partial(kd_causal_lm_forward, model)), or the class's
    current = type(model).forward if own is None else getattr(own, "__func__", getattr(own, "func", own))
    if state is None or not getattr(current, "__liger_kd__", False):
        return None
    return state.original_forward


@contextlib.contextmanager
def original_forward(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, a patched *ForCausalLM runs its own, unpatched forward; any other model (not patched, or
    whose instance forward is a wrapper such as accelerate's autocast) is left as it is. For generate(): the static
    cache then compiles the model's own code, not the KD forward's dispatch (the KD forward also names
    `logits_to_keep`, so generate() asks for the last position's logits at prefill either way)."""
    own = model.__dict__.get("forward")  # apply_kd_patch(model=...) installs the KD forward on the instance
    unpatched = transformers_forward(model)
    if unpatched is None:
        yield model
        return
    # The same bound method every time: torch.compile (the static cache's compiled decode step) guards on the
    # identity of `model.forward`, and a fresh MethodType per call would recompile every generation call.
    bound = model.__dict__.get(ORIGINAL_BOUND_ATTR)
    if bound is None or bound.__func__ is not unpatched:
        bound = types.MethodType(unpatched, model)
        model.__dict__[ORIGINAL_BOUND_ATTR] = bound
    model.forward = bound
    try:
        yield model
    finally:
        if own is None:
            del model.__dict__["forward"]
        else:
            model.forward = own
