"""Read a model class's forward and say what it does to the logits and the loss besides decoder -> lm_head -> CE.

The KD forward replaces everything after the backbone call, so the registry must know every step there that
changes the logits (a scale, a soft-cap) or the loss (a router's auxiliary loss). This module parses the
forward's source once per function and classifies each statement that touches `logits`, `hidden_states`,
`loss` or `aux_loss`, or runs before the backbone call: a known step names a feature; an unknown one refuses the
model. It is deliberately strict: a statement it has not seen is treated as a change it cannot reproduce.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from collections.abc import Callable

from torch import nn

from .registry import ArchSpec, softcap_of
from .state import CLASS_STATE

_BACKBONE_CALL = re.compile(r"^(outputs(: \w+)?|\w+_outputs) = self\.model\(")
_TRACKED = ("logits", "lm_logits", "hidden_states", "loss", "aux_loss")

# (pattern of one normalised statement, the feature it is, or None for a step that does not change the objective)
_KNOWN: list[tuple[str, str | None]] = [
    # before the backbone call: the standard defaults from the config
    (
        r"(output_attentions|output_hidden_states|return_dict|output_router_logits|use_cache) = \1 if \1 is not None "
        r"else self\.config\.(output_attentions|output_hidden_states|use_return_dict|output_router_logits|use_cache)",
        None,
    ),  # fmt: skip
    # the last hidden states and the head
    (r"hidden_states = (outputs|\w+_outputs)(\.last_hidden_state|\[0\])", None),
    (r"slice_indices = slice\(-logits_to_keep, None\) if isinstance\(logits_to_keep, int\) else logits_to_keep", None),
    (r"hidden_states = slice_logits_to_keep\(hidden_states, logits_to_keep\)", None),
    (r"logits = self\.lm_head\(hidden_states(\[:, slice_indices, :\])?\)", None),
    (r"logits = logits\.float\(\)", None),  # an upcast for the CE: the fused loss computes in fp32 anyway
    # the CE the KD loss replaces
    (r"(aux_)?loss = None", None),
    (r"loss = (self\.loss_function|loss_fct)\(.*\)", None),
    # logit transforms (transforms.py)
    (r"logits = logits / self\.config\.final_logit_softcapping", "softcap"),
    (r"logits = torch\.tanh\(logits\)", "softcap"),
    (r"logits = logits \* self\.config\.final_logit_softcapping", "softcap"),
    (r"logits = logits / self\.config\.logits_scaling", "logits_scaling"),
    (r"logits = logits \* self\.logit_scale", "logit_scale"),
    # the router's load-balancing loss (backbone.py)
    (
        r"aux_loss = load_balancing_loss_func\(outputs\.router_logits, self\.num_experts, self\.num_experts_per_tok, "
        r"attention_mask\)",
        "router_aux_loss",
    ),  # fmt: skip
    (r"loss \+= self\.router_aux_loss_coef \* aux_loss\.to\(loss\.device\)", "router_aux_loss"),
]
_KNOWN_RE = [(re.compile(p + r"$"), feature) for p, feature in _KNOWN]


def unpatched_forward(cls: type[nn.Module]) -> Callable:
    """The forward `cls` runs without this library (a class patched before loading keeps its original)."""
    for owner in cls.__mro__:
        forward = owner.__dict__.get("forward")
        if forward is None:
            continue
        if getattr(forward, "__liger_kd__", False) and owner in CLASS_STATE:
            return CLASS_STATE[owner].original_forward
        return forward
    raise ValueError(f"{cls.__name__} has no forward")


@functools.cache
def forward_features(forward: Callable) -> frozenset[str]:
    """The features (transforms.py names, "router_aux_loss") a forward's source shows; ValueError on an unknown step."""
    function = inspect.unwrap(forward)
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    calls = [i for i, s in enumerate(body) if _BACKBONE_CALL.match(_text(s))]
    if len(calls) != 1:
        raise _unknown(function, "it does not call its backbone as `outputs = self.model(...)` exactly once")
    features = set()
    for statement in body[: calls[0]]:
        features |= _classify(function, statement, before_backbone=True)
    for statement in body[calls[0] + 1 :]:
        for simple in _simple_statements(statement):
            features |= _classify(function, simple, before_backbone=False)
    return frozenset(features)


def check_forward(spec: ArchSpec, cls: type[nn.Module] | None = None) -> None:
    """ValueError unless the forward of `cls` (default: the entry's class) does exactly what the entry declares."""
    cls = cls or spec.model_class()
    declared = set(spec.logits) | ({"router_aux_loss"} if spec.router_aux_loss else set())
    found = forward_features(unpatched_forward(cls))
    if found != declared:
        raise ValueError(
            f"{cls.__name__}.forward (transformers as installed) does {sorted(found) or 'nothing'} to its "
            f"logits and loss after lm_head, but the registry entry for {spec.model_type!r} declares "
            f"{sorted(declared) or 'nothing'}. The fused loss would score other logits than the model's; refusing. "
            f"Update the entry in liger_patch_kd/models/registry.py (and transforms.py) for this forward"
        )


def check_model(model: nn.Module, spec: ArchSpec) -> None:
    """ValueError unless the model's forward and config do exactly what the registry entry declares."""
    check_forward(spec, type(model))
    if "softcap" not in spec.logits and softcap_of(model.config) is not None:
        raise ValueError(
            f"{type(model).__name__}'s config sets final_logit_softcapping={softcap_of(model.config)}, which its "
            f"forward does not apply; the fused loss would. Remove it from the config (it has no effect on the model)"
        )


def _text(statement: ast.stmt) -> str:
    return re.sub(r"\s+", " ", ast.unparse(statement)).strip()


def _simple_statements(statement: ast.stmt):
    """The statements inside ifs / loops / withs, each on its own (conditions do not change what a step does)."""
    if isinstance(statement, (ast.If, ast.For, ast.While, ast.With)):
        for child in (*statement.body, *getattr(statement, "orelse", ())):
            yield from _simple_statements(child)
    else:
        yield statement


def _touches(statement: ast.stmt) -> bool:
    if isinstance(statement, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        return any(isinstance(n, ast.Name) and n.id in _TRACKED for t in targets for n in ast.walk(t))
    if isinstance(statement, ast.Expr):  # a call such as logits.mul_(...) changes a tensor in place
        return any(isinstance(n, ast.Name) and n.id in _TRACKED for n in ast.walk(statement))
    return False


def _classify(function: Callable, statement: ast.stmt, before_backbone: bool) -> set[str]:
    if isinstance(statement, ast.Return):
        for call in ast.walk(statement):
            for kw in getattr(call, "keywords", ()):
                if kw.arg == "logits" and _text(kw.value) not in ("logits", "lm_logits"):
                    raise _unknown(function, f"it returns logits={_text(kw.value)}")
        return set()
    if isinstance(statement, (ast.Pass, ast.Raise)):
        return set()
    text = _text(statement)
    for pattern, feature in _KNOWN_RE:
        if pattern.match(text):
            return {feature} if feature else set()
    if before_backbone or _touches(statement):
        raise _unknown(function, f"of the step `{text}`")
    return set()  # a statement on other names: the CE's own bookkeeping (shift_logits, loss_fct, ...)


def _unknown(function: Callable, why: str) -> ValueError:
    return ValueError(
        f"{function.__qualname__} cannot be distilled with the fused loss: liger_patch_kd does not know what it "
        f"does to the logits or the loss, because {why}. It refuses rather than score other logits than the "
        f"model's; a supported architecture is one entry in liger_patch_kd/models/registry.py"
    )


def survey() -> dict[str, str]:
    """Every *ForCausalLM / *ForConditionalGeneration class of the installed transformers -> what the audit finds
    ("nothing", its features, or why it is refused). Slow (imports every modeling module); for the docs table:
    `python -c "from liger_patch_kd.models.forward_audit import survey; [print(k, v) for k, v in survey().items()]"`
    """
    import importlib
    import pkgutil

    import transformers.models as models

    found = {}
    for info in pkgutil.iter_modules(models.__path__):
        try:
            module = importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
        except Exception:  # noqa: BLE001 - no modeling module, or one needing an optional dependency
            continue
        for name, cls in vars(module).items():
            own = getattr(cls, "__module__", None) == module.__name__
            if own and name.endswith(("ForCausalLM", "ForConditionalGeneration")) and hasattr(cls, "forward"):
                try:
                    features = forward_features(cls.forward)
                    found[f"{info.name}.{name}"] = ", ".join(sorted(features)) or "nothing"
                except ValueError as e:
                    found[f"{info.name}.{name}"] = "refused: " + str(e).split("because ")[-1].split(". It refuses")[0]
    return found
