"""Tiny random models of every registry entry, built from configs (no downloads), keyed like REGISTRY."""

from __future__ import annotations

import inspect

import torch
import transformers

VOCAB = 257
IMAGE_TOKEN, VISION_START, VISION_END = VOCAB - 1, VOCAB - 2, VOCAB - 3  # a VLM's special ids; text ids stay below
TEXT_VOCAB = VOCAB - 3

_MOE = {"num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.3, "pad_token_id": 0}

ARCHS = {  # registry key -> (config class, model class, config overrides)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"pad_token_id": 0, "no_rope_layers": [1, 0, 1]}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"pad_token_id": 0}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16, "pad_token_id": 0}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "final_logit_softcapping": 5.0}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "final_logit_softcapping": 5.0}),
    # scales that are not powers of two, so a scale applied twice or not at all cannot pass
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 3.0, "embedding_multiplier": 2.0}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.3, "head_dim": 16}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {"logit_scale": 0.3, "head_dim": 16, "sliding_window": 8}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, **_MOE}),
    # layer 1 is dense (Qwen3MoeMLP, which the gated-MLP kernel covers), layer 0 sparse
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 4,
            "num_local_experts": 4,
            "moe_intermediate_size": 32,
            "head_dim": 16,
            "mlp_only_layers": [1],
            **_MOE,
        },
    ),  # fmt: skip
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {"num_local_experts": 4, "head_dim": 16, "sliding_window": 8, "layer_types": None, **_MOE},
    ),  # fmt: skip
}

# vision-language models: registry key -> (config class, model class, vision config, top-level overrides)
VLMS = {
    "gemma3": (
        "Gemma3Config", "Gemma3ForConditionalGeneration",
        {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "image_size": 28, "patch_size": 14},
        {"mm_tokens_per_image": 4, "image_token_index": IMAGE_TOKEN, "boi_token_index": VISION_START,
         "eoi_token_index": VISION_END},
    ),
    "qwen2_5_vl": (
        "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
        {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 14,
         "spatial_merge_size": 2, "temporal_patch_size": 2, "fullatt_block_indexes": [0], "window_size": 28},
        {"image_token_id": IMAGE_TOKEN, "vision_start_token_id": VISION_START, "vision_end_token_id": VISION_END},
    ),
    "qwen3_vl": (
        "Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
        {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 14,
         "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16,
         "deepstack_visual_indexes": [0]},
        {"image_token_id": IMAGE_TOKEN, "vision_start_token_id": VISION_START, "vision_end_token_id": VISION_END},
    ),
}  # fmt: skip
ALL_ARCHS = [*ARCHS, *VLMS]
_MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}


def _text_fields(hidden: int, layers: int, vocab: int) -> dict:
    return dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=128,
    )


def tiny_config(arch: str, hidden: int = 64, layers: int = 2, vocab: int = VOCAB, **overrides):
    if arch in VLMS:
        config_name, _, vision, top = VLMS[arch]
        # head_dim 16 whatever the width: Qwen2.5-VL derives it from hidden / heads, and M-RoPE's sections fill it
        text = {**_text_fields(hidden, layers, vocab), "num_attention_heads": hidden // 16, "head_dim": 16}
        text.update(pad_token_id=0, **overrides)
        if arch != "gemma3":
            text["rope_parameters"] = {**_MROPE, "mrope_interleaved": True} if arch == "qwen3_vl" else _MROPE
            text["rope_scaling"] = text["rope_parameters"]  # transformers 4.57 reads rope_scaling
            vision = {**vision, "out_hidden_size": hidden}
        cfg = getattr(transformers, config_name)(text_config=text, vision_config=vision, **top)
    else:
        config_name, _, extra = ARCHS[arch]
        cfg = getattr(transformers, config_name)(**_text_fields(hidden, layers, vocab), **{**extra, **overrides})
    cfg._attn_implementation = "eager"  # deterministic and identical math on every machine
    cfg._experts_implementation = "eager"  # MoE: the per-expert loop runs in float64 (grouped_mm does not)
    for sub in ("text_config", "vision_config"):
        if hasattr(cfg, sub):
            getattr(cfg, sub)._attn_implementation = "eager"
    return cfg


def tiny_model(arch: str, dtype: torch.dtype = torch.float64, seed: int = 0, **cfg_overrides):
    torch.manual_seed(seed)
    model_name = VLMS[arch][1] if arch in VLMS else ARCHS[arch][1]
    model = getattr(transformers, model_name)(tiny_config(arch, **cfg_overrides)).to(dtype)
    # random norm weights so an RMSNorm offset bug (Gemma's 1 + w) cannot hide behind w = 1 or w = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    return model.eval()


def vision_inputs(arch: str, ids: torch.Tensor, dtype: torch.dtype = torch.float64) -> dict:
    """One small random image per row for a VLM, its placeholder tokens written into `ids` (in place) at
    positions 1..n; {} for a text model."""
    if arch not in VLMS:
        return {}
    batch = ids.shape[0]
    g = torch.Generator().manual_seed(7)
    if arch == "gemma3":  # 28x28 pixels, 4 tokens per image, bracketed by begin / end of image
        ids[:, 1], ids[:, 2:6], ids[:, 6] = VISION_START, IMAGE_TOKEN, VISION_END
        return {
            "pixel_values": torch.randn(batch, 3, 28, 28, generator=g, dtype=dtype),
            "token_type_ids": (ids == IMAGE_TOKEN).long(),
        }
    # Qwen-VL: a 28x28 image is a 2x2 grid of 14-pixel patches (x2 frames), merged 2x2 into one token
    ids[:, 1], ids[:, 2], ids[:, 3] = VISION_START, IMAGE_TOKEN, VISION_END
    inputs = {
        "pixel_values": torch.randn(4 * batch, 3 * 2 * 14 * 14, generator=g, dtype=dtype),
        "image_grid_thw": torch.tensor([[1, 2, 2]] * batch),
    }
    if "mm_token_type_ids" in inspect.signature(getattr(transformers, VLMS[arch][1]).forward).parameters:
        inputs["mm_token_type_ids"] = (ids == IMAGE_TOKEN).int()  # transformers 5 needs it for M-RoPE; 4.57 has none
    return inputs
