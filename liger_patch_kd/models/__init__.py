"""Patching Hugging Face causal LMs: one generic KD forward, a registry of architectures.

Modules, lowest first (imports point down only):
  state          the patch registries (PatchState, CLASS_STATE, INSTANCE_ATTR, PATCHED_INSTANCES) and unwrap_model
  registry       ArchSpec declarations (REGISTRY, FAMILIES), softcap_of; no logic that needs a model
  forward_audit  what a forward does to its logits and loss, checked against an entry
  spec           spec_for_model: picks an instance's entry and audits its forward (above registry and audit)
  transforms     logit scales folded into the head inputs (scaled_head_inputs)
  facts          what the KD forward knows of its model (entry, options with its soft-cap, logit scales), found once
  captured_backbone  a frozen teacher's decoder replayed from CUDA graphs, one per batch shape
  moe, backbone  the router loss; running the backbone (text and VLM)
  heads, kd_io   lm_head weights (PEFT-aware) and gathered_head (the head inputs, ZeRO-3 gathered); label shifting,
                 the output type
  privileged     a teacher's own prompt, its completion tokens paired with the student's
  teachers       several teachers in one KD forward (the set, routing, mixtures, per-teacher figures)
  host           a forward as a host: HeadRequest, a live teacher's head inputs taken inside its forward
  signals        the typed teacher signal of one call (live, hidden states + head, top-k, sampled, a set), each with
                 its fused and materialised loss; parsed once
  materialised   the objective on materialised logits (reference/), through the signal's term
  kd_forward     the one KD forward: its model's facts, parse the signal, run the backbone, gather the head, call
                 the signal's loss
  cross_tokenizer  the cross-tokenizer loss on two models, each one's head inputs taken inside its own forward
  patch          apply_kd_patch / apply_kd_patch_to_<family> / revert_kd_patch
  fp8_teacher, recompute
"""

from .backbone import run_backbone
from .captured_backbone import (
    CapturedBackbone,
    captured_backbone_of,
    disable_captured_backbone,
    enable_captured_backbone,
)
from .fp8_teacher import (
    TEACHER_PRECISIONS,
    Fp8Linear,
    apply_teacher_precision,
    check_teacher_precision,
    quantize_teacher_fp8,
)
from .heads import output_head
from .kd_forward import kd_causal_lm_forward
from .kd_io import KDCausalLMOutput, targets_of
from .materialised import materialised_kd
from .patch import (
    apply_kd_patch,
    apply_kd_patch_to_cohere,
    apply_kd_patch_to_cohere2,
    apply_kd_patch_to_gemma,
    apply_kd_patch_to_gemma2,
    apply_kd_patch_to_gemma3,
    apply_kd_patch_to_glm4,
    apply_kd_patch_to_gpt_oss,
    apply_kd_patch_to_granite,
    apply_kd_patch_to_llama,
    apply_kd_patch_to_mistral,
    apply_kd_patch_to_mixtral,
    apply_kd_patch_to_olmo2,
    apply_kd_patch_to_phi3,
    apply_kd_patch_to_qwen2,
    apply_kd_patch_to_qwen2_5_vl,
    apply_kd_patch_to_qwen3,
    apply_kd_patch_to_qwen3_moe,
    apply_kd_patch_to_qwen3_vl,
    apply_kd_patch_to_smollm3,
    patch_teacher_kernels,
    revert_kd_patch,
    transformers_code,
)
from .recompute import limit_recompute
from .registry import FAMILIES, REGISTRY, ArchSpec, softcap_of
from .signals import (
    HeadRequest,
    HiddenTeacher,
    LiveTeacher,
    SampledTeacher,
    TeacherMix,
    TeacherSignal,
    TopKTeacher,
    parse_signal,
)
from .spec import spec_for_model
from .state import original_forward, unwrap_model
from .teachers import TeacherSet
from .transforms import scaled_head_inputs

__all__ = [
    "CapturedBackbone",
    "captured_backbone_of",
    "disable_captured_backbone",
    "enable_captured_backbone",
    "Fp8Linear",
    "quantize_teacher_fp8",
    "apply_teacher_precision",
    "check_teacher_precision",
    "TEACHER_PRECISIONS",
    "patch_teacher_kernels",
    "KDCausalLMOutput",
    "FAMILIES",
    "REGISTRY",
    "ArchSpec",
    "apply_kd_patch",
    "apply_kd_patch_to_cohere",
    "apply_kd_patch_to_cohere2",
    "apply_kd_patch_to_gemma",
    "apply_kd_patch_to_gemma2",
    "apply_kd_patch_to_gemma3",
    "apply_kd_patch_to_glm4",
    "apply_kd_patch_to_gpt_oss",
    "apply_kd_patch_to_granite",
    "apply_kd_patch_to_llama",
    "apply_kd_patch_to_mistral",
    "apply_kd_patch_to_mixtral",
    "apply_kd_patch_to_olmo2",
    "apply_kd_patch_to_phi3",
    "apply_kd_patch_to_qwen2",
    "apply_kd_patch_to_qwen2_5_vl",
    "apply_kd_patch_to_qwen3",
    "apply_kd_patch_to_qwen3_moe",
    "apply_kd_patch_to_qwen3_vl",
    "apply_kd_patch_to_smollm3",
    "kd_causal_lm_forward",
    "revert_kd_patch",
    "unwrap_model",
    "original_forward",
    "transformers_code",
    "output_head",
    "materialised_kd",
    "TeacherSet",
    "TeacherSignal",
    "LiveTeacher",
    "HiddenTeacher",
    "TopKTeacher",
    "SampledTeacher",
    "TeacherMix",
    "parse_signal",
    "HeadRequest",
    "targets_of",
    "limit_recompute",
    "run_backbone",
    "softcap_of",
    "scaled_head_inputs",
    "spec_for_model",
]
