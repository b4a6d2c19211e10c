"""Whether a user's forward hook can run where a kernel computes on a module's behalf.

A kernel that computes a module's output without calling the module (the gated-MLP kernel never calls `act_fn`;
a fused add hands a norm its output computed ahead) must step aside wherever a hook of the user's would have run
there: activation steering and ablation hooks change what the model computes.
"""

from __future__ import annotations

from torch import nn


def no_hooks(after: tuple[nn.Module, ...] = (), before: tuple[nn.Module, ...] = ()) -> bool:
    """Whether no forward hook runs after the modules of `after` and no forward pre-hook before those of `before`,
    their own or the global ones (torch.nn.modules.module.register_module_forward_hook and _pre_hook)."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False
    return not any(m._forward_hooks for m in after) and not any(m._forward_pre_hooks for m in before)
