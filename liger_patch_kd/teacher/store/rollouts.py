"""A store of the student's own rollouts (offline on-policy distillation: sampled from the student once, scored by
the teacher once, trained on many times). Besides a store's teacher top-k and / or sampled tokens, each shard of
such a store holds, per position, label-aligned like a training row's labels:
    labels                  (int32)   the token itself on a completion, ignore_index (-100) on the prompt, so the
                                      loss scores completions only
    behaviour_logprobs      (float32) the log-prob of the token under the student that sampled it (temperature 1,
                                      its full distribution), 0 on the prompt: the importance ratio's denominator
    teacher_token_logprobs  (float32) the scoring teacher's log-prob of the token (temperature 1), 0 on the prompt:
                                      what the sampled-token estimators (k1, pg) read instead of a live teacher
The manifest's `rollouts` section names the model that generated (a weights fingerprint), the one that scored and
the sampling settings. Such stores are format 4: a reader that knows only format 3 refuses them instead of training
on their prompts as if they were completions.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ...batch.columns import BEHAVIOUR_LOGPROBS, TEACHER_TOKEN_LOGPROBS

ROLLOUT_FORMAT_VERSION = 4
IGNORE_INDEX = -100
# name -> (safetensors dtype, torch dtype, what a prompt position holds)
ROLLOUT_ARRAYS = {
    "labels": ("I32", torch.int32, IGNORE_INDEX),
    BEHAVIOUR_LOGPROBS: ("F32", torch.float32, 0.0),
    TEACHER_TOKEN_LOGPROBS: ("F32", torch.float32, 0.0),
}


def rollouts_of(meta: dict) -> dict | None:
    """The manifest's rollouts section (None: a store of given sequences)."""
    section = meta.get("rollouts")
    return section if isinstance(section, dict) else None


def rollout_tensors(meta: dict, rollouts: Any, positions: int, where: str) -> dict:
    """The shard arrays of `rollouts` ({name: (positions,) tensor} for every ROLLOUT_ARRAYS name); ValueError naming
    the problem."""
    if rollouts is None:
        raise ValueError(f"{where}: this store holds rollouts: pass rollouts={{{', '.join(ROLLOUT_ARRAYS)}}}")
    missing = sorted(set(ROLLOUT_ARRAYS) - set(rollouts))
    if missing:
        raise ValueError(f"{where}: rollouts lack {missing}")
    out = {}
    for name, (_, dtype, _) in ROLLOUT_ARRAYS.items():
        t = torch.as_tensor(rollouts[name])
        if tuple(t.shape) != (positions,):
            raise ValueError(f"{where}: rollouts[{name!r}] {tuple(t.shape)} != (positions {positions},)")
        if dtype.is_floating_point:
            t = t.float()
            if torch.isnan(t).any() or (t > 0).any():
                raise ValueError(f"{where}: rollouts[{name!r}] holds NaN or a log-prob > 0")
            scored = torch.as_tensor(rollouts["labels"]) != IGNORE_INDEX
            if torch.isneginf(t[scored]).any():
                raise ValueError(f"{where}: rollouts[{name!r}] holds -inf on a completion token, which the policy "
                                 f"that sampled it cannot have sampled")  # fmt: skip
        out[name] = t.to(dtype).contiguous()
    return out


def rollout_layout(meta: dict, positions: int) -> dict:
    """{array: (allowed safetensors dtypes, shape)} the rollout arrays of a shard must have (empty without)."""
    if rollouts_of(meta) is None:
        return {}
    return {name: ((spec[0],), (positions,)) for name, spec in ROLLOUT_ARRAYS.items()}


def rollout_item(meta: dict, raw: dict, n: int) -> dict:
    """A store item's rollout columns from a sequence's raw rows: labels (int64), behaviour_logprobs and
    teacher_token_logprobs (float32), each (n,)."""
    if rollouts_of(meta) is None:
        return {}
    labels = torch.from_numpy(raw["labels"].view(np.int32).reshape(n).astype(np.int64))
    return {
        "labels": labels,
        BEHAVIOUR_LOGPROBS: torch.from_numpy(raw[BEHAVIOUR_LOGPROBS].view(np.float32).reshape(n).copy()),
        TEACHER_TOKEN_LOGPROBS: torch.from_numpy(raw[TEACHER_TOKEN_LOGPROBS].view(np.float32).reshape(n).copy()),
    }


def sampling_is_the_policy(section: dict) -> bool:
    """Whether the stored tokens were drawn from the generator's own distribution (temperature 1, no top-p / top-k
    truncation): what the sampled-token estimators assume of their samples."""
    sampling = section.get("sampling", {})
    return (
        math.isclose(sampling.get("temperature", 1.0), 1.0)
        and sampling.get("top_p", 1.0) >= 1.0
        and not sampling.get("top_k", 0)
    )
