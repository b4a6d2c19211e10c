"""LoRA adapters on the served model (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter), all or nothing.

PEFT injects an adapter's layers into the model before it loads the adapter's weights, and nothing undoes that when
the weights then fail to load: the served model's modules (and its tensor names) stay changed for every later
request. Here an adapter is read and checked whole first (its config, its weights file, every tensor finite), then
injected and loaded; a load that still fails, or that leaves any of the adapter's tensors without a value (PEFT
only warns of missing keys) or any given tensor unused, is undone: the injected layers are taken out again (or the
adapter deleted from the PeftModel already there), the attributes PEFT added removed, and the model is the same
modules with the same tensors as before, so its scores are unchanged bit for bit and full-weight updates still name
its own tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..utils.errors import reason_of
from .validation import RequestError


def read_adapter(path: str) -> dict[str, torch.Tensor]:
    """The adapter's saved tensors, read whole and checked (a 400 naming the problem) before anything is injected."""
    try:
        from peft import PeftConfig
        from peft.utils import load_peft_weights
    except ImportError as e:
        raise RequestError(400, f"loading a LoRA adapter needs peft on the server: pip install peft ({e})") from None
    try:
        PeftConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any failure to read the config is the adapter's fault: one line
        raise RequestError(400, f"lora_path {path!r}: adapter_config.json does not read as a PEFT config: "
                                f"{reason_of(e, 300)}; save the adapter with PEFT's save_pretrained")  # fmt: skip
    names = ("adapter_model.safetensors", "adapter_model.bin")
    if not any((Path(path) / n).is_file() for n in names):
        raise RequestError(400, f"lora_path {path!r} holds no {' or '.join(names)}: save the adapter with PEFT's "
                                f"save_pretrained (weights and config)")  # fmt: skip
    try:
        state = load_peft_weights(path, device="cpu")
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt file raises whatever its reader raises
        raise RequestError(400, f"lora_path {path!r}: the adapter's weights do not read ({reason_of(e, 300)}); is the "
                                f"file truncated? save the adapter again")  # fmt: skip
    if not state:
        raise RequestError(400, f"lora_path {path!r}: the adapter's weights file holds no tensors")
    for name, tensor in state.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise RequestError(400, f"lora_path {path!r}: the adapter's tensor {name!r} holds NaN or infinite "
                                    f"values; it would turn every reply of this adapter into NaN")  # fmt: skip
    return state


def attach_adapter(model: torch.nn.Module, peft: Any, name: str, path: str, state: dict) -> Any:
    """Load the adapter at `path` (its tensors `state`, from read_adapter) as `name` into `model`, whose PeftModel
    is `peft` (None: no adapter yet); the PeftModel after. On any failure the model is left as it was (see the
    module's docstring) and a RequestError(400) names the adapter and the cause."""
    from peft import PeftModel, get_peft_model_state_dict

    before, first = _snapshot(model), peft is None
    try:
        if peft is None:
            peft = PeftModel.from_pretrained(model, path, adapter_name=name, is_trainable=False)
        else:
            peft.load_adapter(path, adapter_name=name, is_trainable=False)
        wanted = set(get_peft_model_state_dict(peft, adapter_name=name))
        missing, unused = sorted(wanted - set(state)), sorted(set(state) - wanted)
        if missing or unused:
            raise ValueError(f"the adapter's file lacks {len(missing)} of the tensors its config makes "
                             f"({missing[:2]}) and gives {len(unused)} this model has no place for "
                             f"({unused[:2]})")  # fmt: skip
    except Exception as e:  # noqa: BLE001 - whatever PEFT raised, the model goes back to what it was first
        restored = _undo(model, before, first=first, peft=peft, name=name)
        status = 400 if restored else 500
        raise RequestError(status, f"the LoRA adapter at {path!r} does not load on this model ({reason_of(e, 300)}); "
                                   f"nothing changed{'' if restored else ' - NOT undone: restart the server'}"
                           ) from None  # fmt: skip
    return peft


def _snapshot(model: torch.nn.Module) -> dict:
    return {
        "keys": list(model.state_dict()),
        "attrs": set(vars(model)),
        "grad": {n: p.requires_grad for n, p in model.named_parameters()},
    }


def _undo(model: torch.nn.Module, before: dict, *, first: bool, peft: Any, name: str) -> bool:
    """Take the half-loaded adapter out; whether the model's tensor names are its own again."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if first:  # every tuner layer in the model is this adapter's: each goes back to the module it wraps
        for path, module in list(model.named_modules()):
            if isinstance(module, BaseTunerLayer) and path:
                parent_path, _, child = path.rpartition(".")
                parent = model.get_submodule(parent_path) if parent_path else model
                if getattr(parent, child, None) is module:
                    setattr(parent, child, module.get_base_layer())
        for attr in set(vars(model)) - before["attrs"]:  # e.g. the peft_config PEFT set on the model
            delattr(model, attr)
    elif peft is not None and name in getattr(peft, "peft_config", {}):
        peft.delete_adapter(name)
    params = dict(model.named_parameters())
    for n, flag in before["grad"].items():  # PEFT freezes the base model's parameters
        if n in params:
            params[n].requires_grad_(flag)
    return list(model.state_dict()) == before["keys"]
