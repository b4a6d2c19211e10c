"""`liger-kd serve`'s sampler through the decode engine (generation/engine.py): the one-token step captured as a CUDA
graph, the KV cache kept per (rows, length) bucket across requests, as the in-process rollouts decode.

It takes a request when the engine draws what the plain loop (generation.py's _sample) would: the base model (no
LoRA layers loaded: their on / off switch is Python state a graph would freeze) and a model the engine can run (SDPA
attention, full attention). `logprobs` K > 0 (the top-K lists) come from the engine's step too: the K most likely
ids under the model's own distribution at each step, as the plain loop lists them.
With the engine's `fuse_projections` (on unless `liger-kd serve --no-fused-projections`) q/k/v and gate/up run as
one product each over a copy of their weights, as the in-process rollouts do. The draw is Gumbel-max from the same
filtered distribution (other random numbers than torch.multinomial: the same seed gives the same completions as
another call with that seed, not the plain loop's). Anything else: None, and the plain loop runs.
"""

from __future__ import annotations

import contextlib

from ..generation import Sampling, decode, decode_applies, left_padded
from ..utils.seeding import seeded


def captured_sample(engine, rows: list[list[int]], req, cancel=None) -> tuple[list, list, list] | None:
    """(tokens, log-probs, top entries) per row as GenerationEngine._sample returns them, or None (not taken);
    `cancel` (a threading.Event) set: the engine's decode stops between two steps with generation.Cancelled."""
    if not getattr(engine, "captured", engine.device.type == "cuda"):
        return None
    if engine.peft is not None or decode_applies(engine.model) is not None:
        return None
    ids, mask = left_padded(rows, engine.pad_id)
    stop = sorted(engine.eos_ids | set(req.stop_ids))
    sampling = Sampling(req.temperature, req.top_k, req.top_p, vocab_limit=req.allowed)
    devices = [engine.device] if engine.device.type == "cuda" else []
    with seeded(req.seed, devices) if req.seed is not None else contextlib.nullcontext():
        decoded = decode(engine.model, ids.to(engine.device), mask.to(engine.device), logprobs=True,
                         top_logprobs=req.logprobs or 0, max_new_tokens=req.max_tokens, sampling=sampling,
                         pad_id=engine.pad_id, eos_ids=stop, fuse_projections=engine.fuse_projections,
                         cancel=cancel)  # fmt: skip
    tokens, logprobs = decoded[0].tolist(), decoded[1].tolist()
    top_ids, top_values = (t.tolist() for t in decoded[2]) if req.logprobs else ([[]] * len(tokens),) * 2
    stops = set(stop)
    out_tokens, out_logprobs, out_tops = [], [], []
    for toks, lps, ids_k, values_k in zip(tokens, logprobs, top_ids, top_values):
        end = next((i + 1 for i, t in enumerate(toks) if t in stops), len(toks))  # up to and with the first stop
        out_tokens.append(toks[:end])
        out_logprobs.append(lps[:end])
        tops = []
        if req.logprobs is not None:  # the chosen token's entry first, then the top K (the plain loop's layout)
            for step, (t, lp) in enumerate(zip(toks[:end], lps[:end])):
                entry = {f"token_id:{t}": lp}
                if req.logprobs:
                    entry.update({f"token_id:{i}": v for i, v in zip(ids_k[step], values_k[step])})
                tops.append(entry)
        out_tops.append(tops)
    return out_tokens, out_logprobs, out_tops
