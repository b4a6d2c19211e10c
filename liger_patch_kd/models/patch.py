"""apply_kd_patch_to_<arch>, apply_kd_patch and revert_kd_patch.

Before loading (model=None) the architecture's classes are patched, so every model built afterwards gets the
kernels and the KD forward. With model=..., only that instance and its submodules are patched (RoPE is a
module-level function in transformers, so it is always patched module-wide: the same math, to rounding).
Every replaced attribute is recorded once, so patching twice is harmless and revert restores the originals.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..config import KDLossConfig
from ..ops.fp8 import QUANTIZED_INPUTS, rms_norm_quantized
from ..ops.rms_norm import rms_norm as rms_norm_kernel
from ..ops.rope import rope as rope_kernel
from ..ops.swiglu import ACTIVATIONS, gated_act, recomputed_gated_outputs
from ..utils.hooks import no_hooks
from .facts import FACTS_ATTR
from .forward_audit import check_forward
from .kd_forward import kd_causal_lm_forward
from .recompute import RECOMPUTE_ACT_ATTR
from .registry import REGISTRY, ArchSpec, specs_for
from .spec import spec_for_model
from .state import (
    CLASS_STATE,
    FP8_OUTPUT_ATTR,
    INSTANCE_ATTR,
    ORIGINAL_BOUND_ATTR,
    PATCHED_INSTANCES,
    PatchState,
    original_forward,
    unwrap_model,
)

# (owner, attribute) -> original value, for everything patched at class / module level
_ORIGINALS: dict[tuple[Any, str], Any] = {}
_MISSING = object()


def _set(owner: Any, name: str, value: Any) -> None:
    """setattr that remembers the first original (a class's own attribute, not an inherited one)."""
    original = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
    _ORIGINALS.setdefault((owner, name), original)
    setattr(owner, name, value)


# ------------------------------------------------------------------------------------------ patched methods
def norm_eps(norm: nn.Module) -> float:
    """An RMSNorm module's epsilon, under the name its architecture keeps it."""
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))


def rms_norm_kernel_forward(spec: ArchSpec):
    """The RMSNorm forward through the kernel, as `spec`'s norm computes it (to bind on a norm module)."""

    def forward(self, hidden_states):
        eps = norm_eps(self)
        if self.__dict__.get(FP8_OUTPUT_ATTR) and not torch.is_grad_enabled():  # an FP8 teacher's: see state.py
            out, quantized = rms_norm_quantized(
                hidden_states, self.weight, eps, spec.rms_norm_offset, spec.rms_norm_casting
            )
            QUANTIZED_INPUTS.remember(out, quantized)
            return out
        return rms_norm_kernel(hidden_states, self.weight, eps, spec.rms_norm_offset, spec.rms_norm_casting)

    forward.__liger_kd__ = True
    return forward


ACTIVATION_ATTRS = ("act_fn", "activation_fn")  # where transformers' gated MLPs keep their activation module


def activation_name(mlp: nn.Module) -> str | None:
    """The gated MLP's activation when the kernels know it (ops.swiglu.ACTIVATIONS) and the MLP's activation module
    computes just that, else None. The kernel reads the activation from the config and never calls the module:
    one replaced, or with a hook of the user's on it (activation steering, ablation), keeps the MLP's own forward."""
    config = getattr(mlp, "config", None)
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if name not in ACTIVATIONS:
        return None
    act = next((getattr(mlp, attr) for attr in ACTIVATION_ATTRS if isinstance(getattr(mlp, attr, None), nn.Module)),
               None)  # fmt: skip
    if act is not None and (type(act) is not _stock_activation_type(name) or not no_hooks(after=(act,), before=(act,))):
        return None
    return name


@functools.cache
def _stock_activation_type(name: str) -> type:
    """The class transformers builds for activation `name` (ACT2FN)."""
    from transformers.activations import ACT2FN

    return type(ACT2FN[name])


def _act_scope(mlp: nn.Module):
    """Where selective recompute keeps this MLP's layer (models/recompute.py), its activation output is recomputed
    in the backward rather than kept."""
    return recomputed_gated_outputs() if getattr(mlp, RECOMPUTE_ACT_ATTR, False) else contextlib.nullcontext()


def _gated_mlp_forward(self, x):
    activation = activation_name(self)
    if activation is None:  # an activation the kernel does not know: the original computation
        return type(self).__liger_kd_original_forward__(self, x)
    with _act_scope(self):
        return self.down_proj(gated_act(self.gate_proj(x), self.up_proj(x), activation))


def _fused_gate_up_mlp_forward(self, x):
    activation = activation_name(self)
    if activation is None:
        return type(self).__liger_kd_original_forward__(self, x)
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    with _act_scope(self):
        return self.down_proj(gated_act(gate, up, activation))


_gated_mlp_forward.__liger_kd__ = _fused_gate_up_mlp_forward.__liger_kd__ = True


# the functions rope_kernel_function made: by identity, not by an attribute (functools.wraps copies attributes, so a
# user's wrapper of the kernel would carry them)
_ROPE_KERNELS: weakref.WeakSet = weakref.WeakSet()


def is_rope_kernel(function) -> bool:
    """Whether `function` is one rope_kernel_function made (not a wrapper of one, which may compute otherwise)."""
    try:
        return function in _ROPE_KERNELS
    except TypeError:  # not weakly referenceable: no function of ours
        return False


def rope_kernel_function(original):
    """apply_rotary_pos_emb through the kernel; `original` (the module's own function) takes partial rotary."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        # (q, k, cos, sin, unsqueeze_dim=1) in transformers 5, (..., position_ids=None, unsqueeze_dim=1) before
        positional_dims = [a for a in args if isinstance(a, int)]
        unsqueeze_dim = kwargs.get("unsqueeze_dim", positional_dims[-1] if positional_dims else 1)
        if cos.shape[-1] != q.shape[-1]:  # partial rotary (Phi-4-mini): the model's own function knows how
            return original(q, k, cos, sin, *args, **kwargs)
        return rope_kernel(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    apply_rotary_pos_emb.__liger_kd__ = True
    _ROPE_KERNELS.add(apply_rotary_pos_emb)
    return apply_rotary_pos_emb


# ------------------------------------------------------------------------------------------------- apply
def apply_kd_patch(
    model: nn.Module | None = None,
    model_type: str | None = None,
    *,
    rope: bool = True,
    swiglu: bool = True,
    rms_norm: bool = True,
    fused_linear_jsd: bool = True,
    kd_config: KDLossConfig | None = None,
    **kd: Any,
) -> nn.Module | None:
    """Patch a model instance (model=...) or an architecture's classes (model_type=...).

    The KD forward is always installed; a patched forward given labels and a teacher returns the distillation
    loss (see kd_forward.kd_causal_lm_forward), otherwise it is the original forward.

    Args:
        model (nn.Module | None): the instance to patch (DDP / FSDP / PEFT wrappers are unwrapped); None patches
            the classes of `model_type`, so every model built afterwards is patched.
        model_type (str | None): a registry family or model_type ("llama", "gemma3", ...); with `model`, a
            check that the instance is of that family.
        rope (bool): swap in the RoPE kernel (Triton on CUDA, PyTorch elsewhere).
        swiglu (bool): swap in the gated-MLP kernel.
        rms_norm (bool): swap in the RMSNorm kernel.
        fused_linear_jsd (bool): compute the loss from hidden states and the lm_head weight (True) or on
            materialised logits (False).
        kd_config (KDLossConfig | None): the default loss options of the patched forward.
        **kd: KDLossConfig fields as keywords, merged with `kd_config` by `KDLossConfig.build` (a keyword that
            conflicts with `kd_config` is a ValueError).

    Returns:
        nn.Module | None: `model` (patched in place) when one was given, else None.
    """
    if model is None and model_type is None:
        raise ValueError("apply_kd_patch needs model= (patch that instance) or model_type= (patch the classes)")
    config = KDLossConfig.build(kd_config, **kd)
    if model is None:
        for spec in specs_for(model_type):
            check_forward(spec)  # refuse before changing anything
        for spec in specs_for(model_type):
            _patch_classes(spec, config, rope=rope, swiglu=swiglu, rms_norm=rms_norm, fused=fused_linear_jsd)
        return None
    inner = unwrap_model(model)
    spec = spec_for_model(inner)  # the instance's own entry; its forward and config are checked against it
    if model_type is not None and spec not in specs_for(model_type):
        raise ValueError(
            f"model is a {type(inner).__name__}; apply_kd_patch for {model_type!r} patches "
            f"{[s.causal_lm for s in specs_for(model_type)]}. Pass such a model, or call apply_kd_patch(model=...)"
        )
    _patch_rope(spec, rope)
    norm_forward, mlp_forward = rms_norm_kernel_forward(spec), gated_mlp_kernel_forward(spec)
    for sub in inner.modules():
        if rms_norm and spec.is_stock(sub, spec.rms_norm):
            _bind(sub, norm_forward)
        elif swiglu and spec.is_stock(sub, spec.mlp):
            _bind(sub, mlp_forward)
    lm_cls = spec.model_class()
    original = CLASS_STATE[lm_cls].original_forward if lm_cls in CLASS_STATE else type(inner).forward
    inner.__dict__[INSTANCE_ATTR] = PatchState(original, config, fused_linear_jsd)
    _bind_kd_forward(inner, original)
    PATCHED_INSTANCES.add(inner)
    return model


def _bind_kd_forward(model: nn.Module, original) -> None:
    """model.forward = the KD forward, showing the original's parameters as well as its own: generate() and the
    Trainer read the signature to decide which inputs reach the model (a VLM's pixel_values among them)."""
    bound = functools.partial(kd_causal_lm_forward, model)
    bound.__func__, bound.__self__ = kd_causal_lm_forward, model  # what a bound method offers; revert reads these
    bound.__signature__ = _merged_signature(original, kd_causal_lm_forward)
    model.forward = bound


def _merged_signature(original, kd_forward) -> inspect.Signature:
    params = list(inspect.signature(original).parameters.values())[1:]  # without self
    names = {p.name for p in params}
    extra = [p for p in inspect.signature(kd_forward).parameters.values() if p.kind is p.KEYWORD_ONLY]
    extra = [p for p in extra if p.name not in names]
    ordered = sorted(params + extra, key=lambda p: p.kind)  # stable: positional first, **kwargs last
    if not any(p.kind is p.VAR_KEYWORD for p in ordered):
        ordered.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(ordered)


def _patch_rope(spec: ArchSpec, rope: bool) -> None:
    """RoPE is a module-level function in transformers: always patched module-wide (same math, to rounding)."""
    module = spec.load()
    if rope and spec.rope and hasattr(module, "apply_rotary_pos_emb"):
        current = module.apply_rotary_pos_emb
        if is_stock_rope(current):
            _set(module, "apply_rotary_pos_emb", rope_kernel_function(current))


def is_stock_rope(function) -> bool:
    """Whether a modeling module's apply_rotary_pos_emb is transformers' own, which the kernel computes; one of the
    user's set in its place is theirs to keep (the kernel would compute something else). Already the kernel:
    nothing to swap."""
    return not getattr(function, "__liger_kd__", False) and \
        getattr(function, "__module__", "").startswith("transformers.")  # fmt: skip


def gated_mlp_kernel_forward(spec: ArchSpec):
    """The gated-MLP forward through the kernel for `spec`'s MLP classes (to bind on an MLP module); an
    activation the kernel does not know runs the class's own forward."""
    for mlp_cls in spec.classes(spec.mlp):
        if not hasattr(mlp_cls, "__liger_kd_original_forward__"):
            mlp_cls.__liger_kd_original_forward__ = mlp_cls.forward
    return _fused_gate_up_mlp_forward if spec.fused_gate_up else _gated_mlp_forward


def _patch_classes(spec: ArchSpec, config: KDLossConfig, *, rope: bool, swiglu: bool, rms_norm: bool, fused: bool):
    _patch_rope(spec, rope)
    mlp_forward = gated_mlp_kernel_forward(spec)
    if rms_norm:
        for norm_cls in spec.classes(spec.rms_norm):
            _set(norm_cls, "forward", rms_norm_kernel_forward(spec))
    if swiglu:
        for mlp_cls in spec.classes(spec.mlp):
            _set(mlp_cls, "forward", mlp_forward)
    lm_cls = spec.model_class()
    _ORIGINALS.setdefault((lm_cls, "forward"), lm_cls.__dict__["forward"])
    CLASS_STATE[lm_cls] = PatchState(_ORIGINALS[(lm_cls, "forward")], config, fused)
    lm_cls.forward = kd_causal_lm_forward


def _bind(module: nn.Module, function) -> None:
    module.forward = types.MethodType(function, module)


def revert_kd_patch(model: nn.Module | None = None, model_type: str | None = None) -> None:
    """Undo apply_kd_patch.

    model=...: that instance's patched forwards (the KD forward and its kernels' bound forwards).
    model_type=...: that architecture's classes and module functions (RoPE).
    Neither: everything this process patched — every architecture's classes, every patched instance, and the
    KD forward given to teachers (KDTrainer patches instances, so this is what undoes a KDTrainer's patches).
    """
    if model is not None:
        inner = unwrap_model(model)
        for sub in inner.modules():
            # accelerate's mixed-precision wrapper replaces `forward` and keeps ours as `_original_forward`: a
            # wrapper around the KD forward goes too, or it would call the KD forward after its state is gone
            wrapped = sub.__dict__.get("_original_forward")
            if _is_ours(sub.__dict__.get("forward")) or _is_ours(wrapped):
                del sub.__dict__["forward"]
                if _is_ours(wrapped):
                    del sub.__dict__["_original_forward"]
            sub.__dict__.pop(INSTANCE_ATTR, None)
            sub.__dict__.pop(ORIGINAL_BOUND_ATTR, None)
            sub.__dict__.pop(FACTS_ATTR, None)
        PATCHED_INSTANCES.discard(inner)
        return
    if model_type is None:
        for instance in list(PATCHED_INSTANCES):
            revert_kd_patch(model=instance)
    specs = specs_for(model_type) if model_type else list(REGISTRY.values())
    for spec in specs:
        try:
            module = spec.load()
        except ValueError:
            continue
        owners = {module, spec.model_class(), *spec.classes(spec.rms_norm), *spec.classes(spec.mlp)}
        for (owner, name), original in list(_ORIGINALS.items()):
            if owner in owners:
                if original is _MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)
                del _ORIGINALS[(owner, name)]
        CLASS_STATE.pop(spec.model_class(), None)


def _is_ours(forward) -> bool:
    return getattr(getattr(forward, "__func__", None), "__liger_kd__", False)


@contextlib.contextmanager
def transformers_code(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block the model runs transformers' own code end to end, for generate(): its own forward
    (original_forward) and its own RMSNorm / RoPE / MLP, at class, module and instance level alike.

    Why: the kernels are built for the training step's long rows, while a decode step is a few rows and bound by
    launches, and torch.compile (the static cache's compiled decode step) traces transformers' code in one graph;
    the patched RoPE broke every attention layer's graph, so dynamo recompiled per layer up to its
    limit (benchmarks/onpolicy/bench_rollouts.py). Not thread-safe: nothing else may run a patched model of the same
    architecture inside the block (the trainer generates between steps, alone).
    """
    inner = unwrap_model(model)
    # the kernels bound on submodules; the model's own KD forward is original_forward's to swap (its cached bound
    # method keeps a compiled decode step valid)
    subs = [m for m in inner.modules() if m is not inner]
    own = [(m, m.__dict__["forward"]) for m in subs if _is_ours(m.__dict__.get("forward"))]
    shared = []  # (owner, name, patched value): module-level RoPE and class-level kernels, not the LM classes'
    for (owner, name), original in _ORIGINALS.items():
        current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if getattr(current, "__liger_kd__", False) and owner not in CLASS_STATE:
            shared.append((owner, name, current, original))
    try:
        for sub, _ in own:
            del sub.__dict__["forward"]
        for owner, name, _, original in shared:
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        with original_forward(inner):
            yield model
    finally:
        for sub, forward in own:
            sub.forward = forward
        for owner, name, current, _ in shared:
            setattr(owner, name, current)


def _make_apply(model_type: str):
    def apply(
        rope: bool = True,
        swiglu: bool = True,
        rms_norm: bool = True,
        fused_linear_jsd: bool = True,
        model: nn.Module | None = None,
        **kd: Any,
    ) -> nn.Module | None:
        return apply_kd_patch(
            model, model_type=model_type, rope=rope, swiglu=swiglu, rms_norm=rms_norm,
            fused_linear_jsd=fused_linear_jsd, **kd,
        )  # fmt: skip

    specs = specs_for(model_type)
    apply.__name__ = f"apply_kd_patch_to_{model_type}"
    apply.__doc__ = (
        f"Patch {' and '.join(s.causal_lm for s in specs)} (model=None: the classes, before loading; model=...: that "
        f"instance) with the "
        f"Triton RMSNorm / RoPE / gated-MLP kernels and the KD forward. See apply_kd_patch."
    )
    return apply


apply_kd_patch_to_llama = _make_apply("llama")
apply_kd_patch_to_mistral = _make_apply("mistral")
apply_kd_patch_to_qwen2 = _make_apply("qwen2")
apply_kd_patch_to_qwen3 = _make_apply("qwen3")
apply_kd_patch_to_gemma = _make_apply("gemma")
apply_kd_patch_to_gemma2 = _make_apply("gemma2")
apply_kd_patch_to_gemma3 = _make_apply("gemma3")
apply_kd_patch_to_phi3 = _make_apply("phi3")
apply_kd_patch_to_smollm3 = _make_apply("smollm3")
apply_kd_patch_to_olmo2 = _make_apply("olmo2")
apply_kd_patch_to_glm4 = _make_apply("glm4")
apply_kd_patch_to_granite = _make_apply("granite")
apply_kd_patch_to_cohere = _make_apply("cohere")
apply_kd_patch_to_cohere2 = _make_apply("cohere2")
apply_kd_patch_to_mixtral = _make_apply("mixtral")
apply_kd_patch_to_qwen3_moe = _make_apply("qwen3_moe")
apply_kd_patch_to_gpt_oss = _make_apply("gpt_oss")
apply_kd_patch_to_qwen2_5_vl = _make_apply("qwen2_5_vl")
apply_kd_patch_to_qwen3_vl = _make_apply("qwen3_vl")


def patch_teacher_kernels(teacher: nn.Module, patch_config: dict | None) -> None:
    """The teacher's forward is a third of the step or more: give it the same RMSNorm / RoPE / MLP kernels
    (its results are unchanged to rounding). A teacher of an architecture without a registry entry runs as is."""
    inner = unwrap_model(teacher)
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    if model_type in REGISTRY:
        toggles = {k: v for k, v in (patch_config or {}).items() if k in ("rope", "swiglu", "rms_norm")}
        apply_kd_patch(model=inner, **toggles)
