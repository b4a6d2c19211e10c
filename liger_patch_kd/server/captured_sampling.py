"""`liger-kd serve`'s sampler through the decode engine (generation/engine.py): the one-token step captured as a CUDA
graph, the KV cache kept per (rows, length) bucket across requests, as the in-process rollouts decode.

It takes a request when the engine draws what the plain loop (generation.py's _sample) would: the base model (no
LoRA layers loaded: their on / off switch is Python state a graph would freeze), sampled log-probs of the chosen
token only (`logprobs` null or 0: no top-K lists), and a model the engine can run (SDPA attention, full attention).
With the engine's `fuse_projections` (on unless `liger-kd serve --no-fused-projections`) q/k/v and gate/up run as
one product each over a copy of their weights, as the in-process rollouts do. The draw is Gumbel-max from the same
filtered distribution (other random numbers than torch.multinomial: the same seed gives the same completions as
another call with that seed, not the plain loop's). Anything else: None, and the plain loop runs.
"""

from __future__ import annotations

import torch

from ..generation import Sampling, decode, decode_applies, left_padded


def captured_sample(engine, rows: list[list[int]], req) -> tuple[list, list, list] | None:
    """(tokens, log-probs, top entries) per row as GenerationEngine._sample returns them, or None (not taken)."""
    if not getattr(engine, "captured", engine.device.type == "cuda"):
        return None
    if engine.peft is not None or req.logprobs not in (None, 0) or decode_applies(engine.model) is not None:
        return None
    ids, mask = left_padded(rows, engine.pad_id)
    stop = sorted(engine.eos_ids | set(req.stop_ids))
    sampling = Sampling(req.temperature, req.top_k, req.top_p, vocab_limit=req.allowed)
    devices = [engine.device] if engine.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=req.seed is not None):
        if req.seed is not None:
            torch.manual_seed(req.seed)
        tokens, logprobs = decode(engine.model, ids.to(engine.device), mask.to(engine.device), logprobs=True,
                                  max_new_tokens=req.max_tokens, sampling=sampling, pad_id=engine.pad_id,
                                  eos_ids=stop, fuse_projections=engine.fuse_projections)  # fmt: skip
    tokens, logprobs = tokens.tolist(), logprobs.tolist()
    stops = set(stop)
    out_tokens, out_logprobs, out_tops = [], [], []
    for toks, lps in zip(tokens, logprobs):
        end = next((i + 1 for i, t in enumerate(toks) if t in stops), len(toks))  # up to and with the first stop
        out_tokens.append(toks[:end])
        out_logprobs.append(lps[:end])
        out_tops.append([{f"token_id:{t}": lp} for t, lp in zip(toks[:end], lps[:end])] if req.logprobs == 0 else [])
    return out_tokens, out_logprobs, out_tops
