"""A rollout store's completions from an inference engine (`liger-kd precompute --rollouts-from http://host:port`):
vLLM, SGLang's OpenAI server or `liger-kd serve` holding the student, asked as the on-policy trainer's engine path
asks it (rollouts/engine.py: completion_request, rollouts_from_reply), without pushing weights: the engine's
weights are the student's.

Call c of a store sends its prompts with `n` = num_generations, the store's sampling settings, `logprobs: 0` and
the seed rollouts.call_seed(seed, c, 0), and keeps the engine's log-prob of each sampled token as its behaviour
log-prob (raw: temperature 1, the engine's full distribution, before top-k / top-p; vLLM's default
--logprobs-mode). An engine that samples the same request with the same seed and weights alike (`liger-kd serve`
does, each request from its own generator) makes a resumed store the uninterrupted one. The engine is asked what it
serves (GET /v1/models) when this is made, so an unreachable URL is a one-line ValueError naming it before any
model loads. The API key comes from LIGER_KD_API_KEY (or `api_key=`), never from the URL, and is never written.
"""

from __future__ import annotations

import json
import os

from ...teacher.client import TeacherClient
from ...teacher.client.transport import HttpEndpoint
from ...wire.conventions import API_KEY_ENV, is_int
from ...wire.protocols import TeacherReplyError
from ..rollouts.engine import completion_request, rollouts_from_reply
from ..rollouts.generate import Rollout, RolloutSettings, call_seed
from .served_teacher import checked_url, served_model

_HINTS = {401: f" (set {API_KEY_ENV} to the engine's --api-key)"}


class EngineStudent:
    """The student served at `url`: its name, vocabulary and context as GET /v1/models lists them (vocabulary and
    context: `liger-kd serve` lists both, vLLM the context), and its completions of a call's prompts."""

    def __init__(self, url: str, *, timeout: float = 600.0, retries: int = 3, api_key: str | None = None,
                 flag: str = "--rollouts-from") -> None:  # fmt: skip
        self.url, self.flag = checked_url(url, flag), flag
        api_key = api_key or os.environ.get(API_KEY_ENV) or None
        probe = TeacherClient(self.url, "vllm", top_k=1, vocab_size=1, timeout=timeout, retries=retries,
                              api_key=api_key)  # fmt: skip
        try:
            model = served_model(probe, flag)
        finally:
            probe.close()
        self.name: str = model["id"]
        served, context = model.get("vocab_size"), model.get("max_model_len")
        self.vocab_size: int | None = served if is_int(served) else None
        self.context: int | None = context if is_int(context) else None
        self.http = HttpEndpoint(self.url, timeout=timeout, retries=retries, api_key=api_key,
                                 what="the rollout engine", timeout_option="--url-timeout", needed="rollouts",
                                 hints=_HINTS)  # fmt: skip

    def section(self) -> dict:
        """The manifest's name of the generator: where it is served and its model (never a key)."""
        return {"url": self.url, "model": self.name}

    def generate(self, prompts: list[list[int]], settings: RolloutSettings, *, eos_ids: set[int], start_id: int,
                 call: int, vocab_size: int) -> list[Rollout]:  # fmt: skip
        """Call `call`'s rollouts of `prompts`, prompt-major, each with the engine's log-prob of every token; only
        ids below `vocab_size` are sampled when the engine's head has more rows (allowed_token_ids)."""
        rows = [p if p else [start_id] for p in prompts]
        allowed = vocab_size if self.vocab_size is not None and vocab_size < self.vocab_size else None
        body = completion_request(rows, settings, self.name, call_seed(settings.seed, call, 0), eos_ids, allowed)
        name = f"call {call} to {self.url}/v1/completions"
        raw, _ = self.http.post_json("/v1/completions", body)
        try:
            reply = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise TeacherReplyError(f"{name}: the reply is not JSON ({raw[:80]!r}...)") from e
        return rollouts_from_reply(reply, rows, settings, eos_ids, vocab_size, name, need_logprobs=True)
