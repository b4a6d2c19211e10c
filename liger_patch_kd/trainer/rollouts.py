"""On-policy and sequence-level distillation's rollouts: completions sampled from the student (kd_lmbda, GKD) or
the teacher (kd_seq_kd), which the step then trains on in place of the dataset's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..models import unwrap_model


@torch.no_grad()
def generate_completions(
    generator: nn.Module, inputs: dict, *, max_new_tokens: int, temperature: float, pad_id: int | None = None
) -> dict:
    """Replace each row's completion (labelled tokens) by one sampled from `generator` given its prompt
    (the tokens before the first label). Prompts of length 0 start from BOS; completions end at EOS or
    max_new_tokens (kd_max_new_tokens); the prompt is masked out of the labels. `inputs` are on the
    generator's device; `pad_id` (the tokenizer's) pads when the generation config names none."""
    input_ids, labels = inputs["input_ids"], inputs["labels"]
    mask = inputs.get("attention_mask", torch.ones_like(input_ids))
    gen_cfg = unwrap_model(generator).generation_config
    eos = gen_cfg.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    pad = _first(gen_cfg.pad_token_id, pad_id, eos, 0)
    start = _first(gen_cfg.bos_token_id, eos, pad)
    prompts = []
    for row in range(input_ids.shape[0]):
        keep = mask[row].bool()
        ids, lab = input_ids[row][keep], labels[row][keep]
        scored = (lab != -100).nonzero()
        cut = int(scored[0]) if len(scored) else len(ids)
        prompts.append(ids[:cut] if cut > 0 else torch.tensor([start], device=ids.device))
    width = max(len(p) for p in prompts)
    prompt_ids = torch.full((len(prompts), width), pad, dtype=input_ids.dtype, device=input_ids.device)
    prompt_mask = torch.zeros_like(prompt_ids)
    for row, p in enumerate(prompts):  # left padding for batched generation
        prompt_ids[row, width - len(p) :] = p
        prompt_mask[row, width - len(p) :] = 1
    was_training = generator.training
    generator.eval()
    out = unwrap_model(generator).generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        pad_token_id=pad,
    )
    generator.train(was_training)
    rows = []
    for row, p in enumerate(prompts):
        completion = out[row, width:].tolist()
        ends = [i for i, t in enumerate(completion) if t in eos_ids]
        completion = completion[: ends[0] + 1] if ends else completion  # up to and including EOS
        rows.append((p.tolist(), completion))
    length = max(len(p) + len(c) for p, c in rows)
    new_ids = torch.full((len(rows), length), pad, dtype=input_ids.dtype, device=input_ids.device)
    new_labels = torch.full_like(new_ids, -100)
    new_mask = torch.zeros_like(new_ids)
    for row, (p, c) in enumerate(rows):
        new_ids[row, : len(p) + len(c)] = torch.tensor(p + c, device=new_ids.device)
        new_labels[row, len(p) : len(p) + len(c)] = torch.tensor(c, dtype=torch.long, device=new_ids.device)
        new_mask[row, : len(p) + len(c)] = 1
    return {"input_ids": new_ids, "attention_mask": new_mask, "labels": new_labels, "_kd_generated": True}


def _first(*values: Any) -> Any:
    for v in values:
        if v is not None:
            return v[0] if isinstance(v, list) and v else v
    return None
