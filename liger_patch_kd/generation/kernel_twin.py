"""The model a decode session runs: a twin of the user's module tree over the very same parameters, with the project's
RMSNorm, gated-MLP and RoPE kernels bound on the twin's modules, whether or not the user's model is patched.

    twin = kernel_twin(model)   # twin(input_ids=..., ...) computes what model(...) computes, through the kernels

Why a twin: a decode step is a few rows, bound by how many kernels it launches; transformers' RMSNorm is about six
element-wise kernels, its RoPE about ten and its gated MLP's activation two, where the project's kernels are one
each (ops/rms_norm.py, ops/rope.py, ops/swiglu.py). An unpatched student's captured step ran transformers' ops, a
patched one's the kernels. Binding the kernels on the user's modules would change its training forward (and, for
RoPE, a module-level function every model of the architecture calls); the twin leaves the user's model as it was.

What the twin shares and what it owns:
  - every module is a shallow copy: parameters, buffers, config and hooks are the user's objects (an optimizer's
    in-place update is what the next step computes with; no weight is copied), the module tree is the twin's own;
  - a forward bound on a user's module (accelerate's autocast wrapper, a kernel of apply_kd_patch) is bound to its
    twin instead; the KD forward of a patched *ForCausalLM gives way to transformers' own forward (the engine asks
    for logits, never a loss); any other instance-level forward stays as it is, on the user's module (exact, slower);
  - the kernels go where the architecture's registry entry (models/registry.py) says its RMSNorm and gated-MLP
    classes are, and RoPE into a copy of each attention forward whose `apply_rotary_pos_emb` is the kernel's
    (the function itself, and transformers' module, unchanged); decoder layers laid out as Llama's add their
    residuals in the kernel of the norm that reads them (residual_fusion.py), and attention laid out as Llama's
    rotates, writes the cache and attends in one kernel at decode steps (attention_fusion.py), and a gated MLP
    runs its gate/up product and activation in one kernel there (mlp_fusion.py). An architecture without an entry
    runs as it is;
  - only where the module computes what the kernel computes: an instance whose class's forward is transformers'
    own (`ArchSpec.is_stock`: not a subclass's forward, not one set on the class), an MLP whose activation module
    is transformers' and has no hook on it (read at every call: `models.patch.activation_name`), a RoPE function
    that is transformers' (`models.patch.is_stock_rope`). Elsewhere the module's own forward runs.

The twin is made with its decode session and kept with it, a snapshot of the tree: what the user changes later (a
module replaced, a forward set on a module or its class, a plain attribute such as an epsilon, a hook, PEFT's adapter
switches, a function of the modeling module) is not in it, as a captured graph would not hold it either. The session's
key reads all of that at every call (utils/module_state.py), so such a change makes, or finds, the session of the
model as it is now; parameters replaced by new tensors make a new session through the key's storage.

The kernels compute the model's maths to rounding (each is tested against transformers' module on its own), so the
twin decodes what the model decodes; tests/test_generation.py checks tokens and log-probs against the model.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable

from torch import nn

from ..models.patch import gated_mlp_kernel_forward, is_stock_rope, rms_norm_kernel_forward, rope_kernel_function
from ..models.registry import REGISTRY, ArchSpec
from ..models.state import transformers_forward
from .attention_fusion import ROPE_NAME, ROTATES_IN_KERNEL, fuse_decode_attention
from .mlp_fusion import fuse_decode_mlp
from .residual_fusion import fold_residual_adds


def kernel_twin(model: nn.Module) -> nn.Module:
    """The twin of `model` (see the module docstring): shallow copies of its modules, the kernels bound on them."""
    pairs: dict[int, tuple[nn.Module, nn.Module]] = {}  # id(user's module) -> (it, its twin)
    twin = _copy_tree(model, pairs)
    for original, copied in pairs.values():
        _rebind(original, copied)
    unpatched = transformers_forward(model)
    if unpatched is not None:  # the KD forward (instance or class level): transformers' own, on the twin
        copied_forward = twin.__dict__.get("forward")
        if copied_forward is None or _is_kernel(copied_forward):
            twin.forward = types.MethodType(unpatched, twin)
    spec = REGISTRY.get(getattr(getattr(model, "config", None), "model_type", None))
    if spec is not None:
        bind_kernels(twin, spec)
        fold_residual_adds(twin, spec)
        fuse_decode_attention(twin, spec)
        fuse_decode_mlp(twin, spec)
    return twin


def bind_kernels(twin: nn.Module, spec: ArchSpec) -> int:
    """Bind the kernels on the modules of `twin` that `spec` names; returns how many modules got one. A module with
    a forward of someone else's on its instance keeps it."""
    norm_forward, mlp_forward = rms_norm_kernel_forward(spec), gated_mlp_kernel_forward(spec)
    module = spec.load()
    current = getattr(module, ROPE_NAME, None)
    rope = None
    # already the kernel where the classes are patched: nothing to swap; a function of the user's: theirs
    if spec.rope and is_stock_rope(current):
        rope = rope_kernel_function(current)
    rope_forwards: dict[type, Callable | None] = {}  # per attention class: its forward with the kernel's RoPE
    bound = 0
    for sub in twin.modules():
        own = sub.__dict__.get("forward")
        if own is not None and not _is_kernel(own):
            continue
        if spec.is_stock(sub, spec.rms_norm):
            sub.forward = types.MethodType(norm_forward, sub)
        elif spec.is_stock(sub, spec.mlp):
            sub.forward = types.MethodType(mlp_forward, sub)
        elif rope is not None:
            cls = type(sub)
            if cls not in rope_forwards:
                rope_forwards[cls] = _with_global(cls.forward, ROPE_NAME, current, rope)
                if rope_forwards[cls] is not None:  # what attention_fusion looks for
                    setattr(rope_forwards[cls], ROTATES_IN_KERNEL, True)
            if rope_forwards[cls] is None:
                continue
            sub.forward = types.MethodType(rope_forwards[cls], sub)
        else:
            continue
        bound += 1
    return bound


def _copy_tree(module: nn.Module, pairs: dict[int, tuple[nn.Module, nn.Module]]) -> nn.Module:
    """A shallow copy of `module` whose children are copies too (a module shared by two parents stays shared)."""
    if id(module) in pairs:
        return pairs[id(module)][1]
    twin = copy.copy(module)  # the instance __dict__ copied: its entries (config, hooks, tensors) shared
    pairs[id(module)] = (module, twin)
    # own dicts: a parameter the user's module is given later (new storage) is no part of the session's twin
    twin._parameters = dict(module._parameters)
    twin._buffers = dict(module._buffers)
    twin._modules = {
        name: None if child is None else _copy_tree(child, pairs) for name, child in module._modules.items()
    }
    return twin


def _rebind(original: nn.Module, twin: nn.Module) -> None:
    """Methods bound on the user's instance (accelerate's forward and `_original_forward`, a cached bound forward),
    bound to its twin instead: none of the twin's attributes calls into the user's module. Others stay as they are."""
    for name, own in list(twin.__dict__.items()):
        if isinstance(own, types.MethodType) and own.__self__ is original:
            twin.__dict__[name] = types.MethodType(own.__func__, twin)
    if _is_kernel(twin.__dict__.get("forward")):  # apply_kd_patch's kernel or KD forward: bound anew below
        del twin.__dict__["forward"]


def _is_kernel(forward) -> bool:
    """Whether an instance-level forward is one of apply_kd_patch's (a kernel, the KD forward)."""
    function = getattr(forward, "__func__", getattr(forward, "func", forward))
    return bool(getattr(function, "__liger_kd__", False))


def _with_global(function: Callable, name: str, old: object, new: object) -> Callable | None:
    """A copy of `function` that sees `new` where its code reads the global `name` (now `old`), through the
    decorators around it (each rebuilt with its closure pointing at the copy below it); None where the function
    reads no such global or a decorator keeps it out of reach."""
    inner = getattr(function, "__wrapped__", None)
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    if inner is None:
        if name not in code.co_names or function.__globals__.get(name) is not old:
            return None
        rebuilt = types.FunctionType(code, {**function.__globals__, name: new}, function.__name__,
                                     function.__defaults__, function.__closure__)  # fmt: skip
    else:
        copied = _with_global(inner, name, old, new)
        if copied is None:
            return None
        cells = list(function.__closure__ or ())
        found = [i for i, cell in enumerate(cells) if _cell_holds(cell, inner)]
        if len(found) != 1:
            return None
        cells[found[0]] = types.CellType(copied)
        rebuilt = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__,
                                     tuple(cells))  # fmt: skip
        rebuilt.__dict__.update(function.__dict__)
        rebuilt.__wrapped__ = copied
    rebuilt.__kwdefaults__ = function.__kwdefaults__
    rebuilt.__qualname__ = function.__qualname__
    rebuilt.__module__ = function.__module__
    rebuilt.__doc__ = function.__doc__
    rebuilt.__annotations__ = getattr(function, "__annotations__", {})
    if inner is None:
        rebuilt.__dict__.update(function.__dict__)
    return rebuilt


def _cell_holds(cell: types.CellType, value: object) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False
