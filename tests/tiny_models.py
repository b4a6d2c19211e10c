"""Tiny random models of every supported architecture, built from configs (no downloads)."""

from __future__ import annotations

import torch
import transformers

VOCAB = 257

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "final_logit_softcapping": 5.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "final_logit_softcapping": 5.0}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
}


def tiny_config(arch: str, hidden: int = 64, layers: int = 2, vocab: int = VOCAB, **overrides):
    config_name, _, extra = ARCHS[arch]
    cfg = getattr(transformers, config_name)(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=128,
        **{**extra, **overrides},
    )
    cfg._attn_implementation = "eager"  # deterministic and identical math on every machine
    return cfg


def tiny_model(arch: str, dtype: torch.dtype = torch.float64, seed: int = 0, **cfg_overrides):
    torch.manual_seed(seed)
    _, model_name, _ = ARCHS[arch]
    model = getattr(transformers, model_name)(tiny_config(arch, **cfg_overrides)).to(dtype)
    # random norm weights so an RMSNorm offset bug (Gemma's 1 + w) cannot hide behind w = 1 or w = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    return model.eval()
