"""Which adapters a PEFT model computes with, as a value: for the captured forwards (the decode engine's sessions, a
teacher's captured backbone) to key on."""

from __future__ import annotations

import sys

from torch import nn


def adapter_switches(model: nn.Module) -> tuple:
    """What PEFT's adapter layers compute by, per layer: (active adapters, disabled, merged). PEFT keeps them in plain
    attributes that set_adapter, disable_adapter() and merge_adapter() reassign, which neither a captured graph nor
    the decode engine's twin (generation/kernel_twin.py: shallow copies) would see: in their key, a switch makes (or
    finds) the capture of that state instead of replaying the adapters of another. Empty for a model without any (and
    where peft was never imported, so none can be in it)."""
    if "peft" not in sys.modules:
        return ()
    from peft.tuners.tuners_utils import BaseTunerLayer

    return tuple((tuple(m.active_adapters), bool(m.disable_adapters), bool(m.merged))
                 for m in model.modules() if isinstance(m, BaseTunerLayer))  # fmt: skip
