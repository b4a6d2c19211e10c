"""What a module tree computes by beyond its tensors, as one hashable value, for the captured forwards to key on.

A captured forward holds a snapshot: the decode engine's kernel twin (generation/kernel_twin.py) copies each
module's instance attributes and its own tree of children, and binds its kernels by what each class's forward was;
a CUDA graph (the decode step, a teacher's backbone: models/captured_backbone.py) bakes in every plain number the
forward read and every hook it ran. A change the user makes after the snapshot (an activation replaced, a
subclass or a forward set on a module or its class, an epsilon or scaling changed, a hook added, PEFT's
set_adapter / disable_adapter() / set_scale, a function of the model's module replaced) is then not what the next
call computes. `module_state` reads all of that per call, so a change makes, or finds, the capture of the state in
force; tensors are left to the callers' own key (where parameters and buffers live).
"""

from __future__ import annotations

import sys
import types
from collections import OrderedDict

from torch import nn

_PLAIN = frozenset({bool, int, float, str, bytes, type(None)})
_SKIPPED = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_pre_hooks", "_backward_hooks",
    "_is_full_backward_hook", "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
})  # fmt: skip


def _shallow(value):
    """A value as the key holds it: plain data as it is, a function or class by identity, a bound method by its
    function and its instance's id, anything else by its type. Dispatched on type(value), never isinstance: a
    config's own __getattribute__ (which isinstance may call for __class__) costs more than the rest together."""
    kind = type(value)
    if kind in _PLAIN or kind is types.FunctionType or kind is types.BuiltinFunctionType or issubclass(kind, type):
        return value
    if kind is types.MethodType:
        return value.__func__, id(value.__self__)
    return kind


_OPAQUE = object()  # an attribute holding any other object: left out of the key (see _value)


def _value(value):
    """`_shallow`, one level into lists, tuples, sets and dicts (PEFT's per-adapter scaling, a module's hooks)."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if issubclass(kind, dict):
        return tuple((k, _shallow(v)) for k, v in value.items()) if value else ()
    if issubclass(kind, (list, tuple)):
        return tuple(map(_shallow, value))
    if issubclass(kind, (set, frozenset)):
        return frozenset(map(_shallow, value))
    shallow = _shallow(value)
    if shallow is not kind or issubclass(kind, type):
        return shallow
    if callable(value):  # a forward set as a functools.partial (accelerate's hooks) or a callable object: by identity
        return id(value)
    # another object (a cache the project or transformers keeps on the model, a config): by its type alone it would
    # only tell that it appeared, which a cache does after the first call, not what the forward computes
    return _OPAQUE


def module_state(model: nn.Module) -> tuple:
    """Per module (in tree order, by name): its id and class, the class's forward, and its instance attributes
    (plain values, functions and bound methods, hooks); the config's plain values; and the functions and classes of
    each modeling module the tree's classes come from (a captured forward's copies read those as they were)."""
    entries, modules = [], set()
    for name, module in model.named_modules():
        cls = type(module)
        attributes = []
        for k, v in module.__dict__.items():  # a loop, not nested generators: it runs at every call of a replay
            if k in _SKIPPED:
                continue
            kind = type(v)
            if kind in _PLAIN:
                attributes.append((k, v))
            elif kind is OrderedDict and not v:  # nn.Module's hook dicts, nearly always empty
                continue
            elif (held := _value(v)) is not _OPAQUE:
                attributes.append((k, held))
        attributes = tuple(attributes)
        entries.append((name, id(module), cls, getattr(cls, "forward", None), attributes))
        modules.add(cls.__module__)
    config = getattr(model, "config", None)
    if config is not None:
        entries.append(tuple((k, held) for k, v in vars(config).items() if (held := _value(v)) is not _OPAQUE))
    for name in sorted(modules):
        module = sys.modules.get(name)
        if name.startswith("transformers.models.") and module is not None:
            entries.append((name, tuple((k, v) for k, v in vars(module).items()
                                        if isinstance(v, (types.FunctionType, type)))))  # fmt: skip
    return tuple(entries)
