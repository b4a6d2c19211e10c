"""One entry per model class: where transformers keeps it and the quirks the kernels and the loss must reproduce.

Adding an architecture is adding an `ArchSpec` here; the KD forward itself is generic (`kd_forward.py`). What a
class's forward does to its logits after lm_head (`logits`, see transforms.py) and whether it adds a router's
auxiliary loss is declared here and checked against the forward's source when a model is patched
(forward_audit.py): a forward that does something its entry does not declare is refused, never mis-scored.
This module holds the declarations only; `spec.spec_for_model` picks a model's entry and audits its forward.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from torch import nn

Names = tuple[str, ...]  # candidate class names, first found wins (transformers renames classes between releases)


@dataclass(frozen=True)
class ArchSpec:
    model_type: str  # config.model_type of the patched class
    module: str  # where transformers keeps the modeling code
    causal_lm: str  # the class whose forward becomes the KD forward (*ForCausalLM, a VLM's *ForConditionalGeneration)
    rms_norm: Names  # RMSNorm classes (every instance, q/k norms included); () where the norm is not an RMSNorm
    mlp: Names  # dense gated-MLP classes; () where there is none
    rms_norm_offset: float = 0.0  # Gemma scales by (1 + weight)
    rms_norm_casting: str = "llama"  # see ops/rms_norm.py
    fused_gate_up: bool = False  # Phi-3 / GLM-4 keep gate and up in one gate_up_proj (gate first)
    rope: bool = True  # False where the module's apply_rotary_pos_emb is not Llama's (interleaved, half-width cos)
    # MoE expert classes the gated-MLP kernel knowingly leaves alone: their weights are 3-D parameters run by
    # transformers' experts implementation (grouped_mm / batched_mm), or their activation is not SwiGLU (GPT-OSS)
    experts: Names = ()
    logits: frozenset[str] = frozenset()  # what the forward does to logits after lm_head (transforms.py)
    router_aux_loss: bool = False  # the forward adds router_aux_loss_coef * load_balancing_loss_func(...)
    vision_inputs: Names = ()  # a VLM's non-text inputs; a VLM teacher is given those its student received
    # decoder-layer classes laid out as Llama's (input norm, attention, add, post-attention norm, MLP, add), whose
    # residual adds a decode step folds into the norms that read them (generation/residual_fusion.py);
    # tests/test_residual_fusion.py checks each against the installed transformers' source
    residual_layers: Names = ()
    # attention classes laid out as Llama's (q/k/v projections, RoPE, the cache's update, the attention function,
    # o_proj), whose decode steps rotate, write the cache and attend in one kernel (generation/attention_fusion.py);
    # `attention_norms`: q and k go through the module's q_norm / k_norm per head before RoPE (Qwen3's layout);
    # tests/test_attention_fusion.py checks each against the installed transformers' source
    attention: Names = ()
    attention_norms: bool = False

    def load(self) -> ModuleType:
        try:
            return importlib.import_module(self.module)
        except ImportError as e:  # pragma: no cover - depends on the installed transformers
            raise ValueError(
                f"transformers has no module {self.module} for model_type {self.model_type!r} "
                f"(transformers too old? this library supports >= 5.17): {e}"
            ) from e

    def model_class(self) -> type[nn.Module]:
        return getattr(self.load(), self.causal_lm)

    def classes(self, names: Names) -> list[type[nn.Module]]:
        """The classes of `names` that the installed transformers has."""
        module = self.load()
        return [getattr(module, n) for n in names if hasattr(module, n)]

    def is_stock(self, module: nn.Module, names: Names) -> bool:
        """Whether `module` is one of the classes `names` names computing with that class's own forward: the one
        transformers defines (or a kernel of this project's, bound on the class by apply_kd_patch), not a
        subclass's forward of its own nor one someone set on the class. A kernel replaces only what it knows the
        module computes; a module that computes something else keeps its forward."""
        forward, owner = None, None
        for owner in type(module).__mro__:
            forward = owner.__dict__.get("forward")
            if forward is not None:
                break
        if owner not in self.classes(names):
            return False
        if getattr(forward, "__liger_kd__", False):
            return True
        return getattr(forward, "__module__", None) == owner.__module__ and \
            getattr(forward, "__qualname__", None) == f"{owner.__qualname__}.forward"  # fmt: skip

    @property
    def is_vlm(self) -> bool:
        return bool(self.vision_inputs)


def _spec(model_type: str, prefix: str, module: str | None = None, **quirks) -> ArchSpec:
    module = module or model_type
    quirks.setdefault("rms_norm", (f"{prefix}RMSNorm",))
    quirks.setdefault("mlp", (f"{prefix}MLP",))
    if quirks.pop("llama_layers", False):
        quirks["residual_layers"] = (f"{prefix}DecoderLayer",)
    if quirks.pop("llama_attention", False):
        quirks["attention"] = (f"{prefix}Attention",)
    return ArchSpec(
        model_type=model_type,
        module=f"transformers.models.{module}.modeling_{module}",
        causal_lm=quirks.pop("causal_lm", f"{prefix}ForCausalLM"),
        **quirks,
    )


_GEMMA = dict(rms_norm_offset=1.0, rms_norm_casting="gemma")
_SOFTCAP = frozenset({"softcap"})
_MOE = dict(router_aux_loss=True)
_QWEN_VL_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "mm_token_type_ids")

REGISTRY: dict[str, ArchSpec] = {
    spec.model_type: spec
    for spec in (
        # dense, Llama-like
        _spec("llama", "Llama", llama_layers=True, llama_attention=True),
        _spec("mistral", "Mistral", llama_layers=True, llama_attention=True),
        _spec("qwen2", "Qwen2", llama_layers=True, llama_attention=True),
        _spec("qwen3", "Qwen3", llama_layers=True, llama_attention=True, attention_norms=True),
        _spec("smollm3", "SmolLM3", llama_layers=True),  # NoPE layers skip RoPE inside attention: nothing to do here
        # OLMo-2 / GPT-OSS normalise in fp32 and multiply by w before casting back: ops/rms_norm.py's "olmo" mode
        _spec("olmo2", "Olmo2", rms_norm_casting="olmo"),
        _spec("glm4", "Glm4", fused_gate_up=True, rope=False),  # interleaved, partial RoPE
        _spec("phi3", "Phi3", fused_gate_up=True),
        _spec("gemma", "Gemma", **_GEMMA, llama_layers=True, llama_attention=True),
        _spec("gemma2", "Gemma2", **_GEMMA, logits=_SOFTCAP),
        _spec("gemma3_text", "Gemma3", "gemma3", **_GEMMA, logits=_SOFTCAP),
        # a logit scale
        _spec("granite", "Granite", logits=frozenset({"logits_scaling"}), llama_attention=True),
        # Cohere: LayerNorm (mean-centred, not an RMSNorm) and interleaved RoPE stay as they are
        _spec("cohere", "Cohere", rms_norm=(), rope=False, logits=frozenset({"logit_scale"})),
        _spec("cohere2", "Cohere2", rms_norm=(), rope=False, logits=frozenset({"logit_scale"})),
        # mixture of experts
        _spec("mixtral", "Mixtral", mlp=(), experts=("MixtralExperts", "MixtralBlockSparseTop2MLP"), **_MOE),
        # Qwen3-MoE's dense layers (mlp_only_layers) use Qwen3MoeMLP; transformers 4.57's experts are that class too
        _spec("qwen3_moe", "Qwen3Moe", experts=("Qwen3MoeExperts",), **_MOE, llama_layers=True, llama_attention=True,
              attention_norms=True),
        # GPT-OSS: GptOssMLP is the router + experts block; experts use a clamped SwiGLU (alpha, limit) and biases;
        # its RoPE takes a half-width cos/sin (the kernel wrapper would fall back anyway)
        _spec("gpt_oss", "GptOss", rms_norm_casting="olmo", mlp=(), rope=False, experts=("GptOssExperts",), **_MOE),
        # vision-language: the KD forward runs the model's own backbone (vision tower + language model)
        _spec(
            "gemma3",
            "Gemma3",
            **_GEMMA,
            causal_lm="Gemma3ForConditionalGeneration",
            vision_inputs=("pixel_values", "token_type_ids"),
        ),
        _spec(
            "qwen2_5_vl",
            "Qwen2_5_VL",
            causal_lm="Qwen2_5_VLForConditionalGeneration",
            rms_norm=("Qwen2_5_VLRMSNorm", "Qwen2RMSNorm"),
            mlp=("Qwen2MLP",),
            vision_inputs=(*_QWEN_VL_INPUTS, "second_per_grid_ts"),
            llama_layers=True,
        ),
        _spec(
            "qwen3_vl",
            "Qwen3VL",
            causal_lm="Qwen3VLForConditionalGeneration",
            rms_norm=("Qwen3VLTextRMSNorm",),
            mlp=("Qwen3VLTextMLP",),
            vision_inputs=_QWEN_VL_INPUTS,
            residual_layers=("Qwen3VLTextDecoderLayer",),
        ),
    )
}
# every input a registered VLM takes beside the text (a batch without any of these has nothing for a VLM teacher)
VISION_INPUTS: frozenset[str] = frozenset(name for spec in REGISTRY.values() for name in spec.vision_inputs)
# apply_kd_patch_to_<family> patches every class of the family; a model_type not listed is its own family
FAMILIES: dict[str, tuple[str, ...]] = {"gemma3": ("gemma3_text", "gemma3")}


def family_names() -> list[str]:
    """Every name there is an `apply_kd_patch_to_<name>` for: each family, and each model_type in none."""
    members = {m for family in FAMILIES.values() for m in family}
    return sorted({*FAMILIES, *(k for k in REGISTRY if k not in members)})


def specs_for(name: str) -> list[ArchSpec]:
    """The entries of a family name or model_type (class-level patching)."""
    keys = FAMILIES.get(name, (name,))
    missing = [k for k in keys if k not in REGISTRY]
    if missing:
        raise ValueError(
            f"model_type {name!r} is not supported by liger_patch_kd; supported: {sorted(REGISTRY)}. "
            f"A new architecture is one ArchSpec in liger_patch_kd/models/registry.py"
        )
    return [REGISTRY[k] for k in keys]


def spec_for(model_type: str) -> ArchSpec:
    """The entry of one model_type; a family name gives its first (text) member."""
    return specs_for(model_type)[0]


def softcap_of(config) -> float | None:
    """The final-logit soft-capping the model applies to its logits (Gemma-2/3), or None."""
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None
