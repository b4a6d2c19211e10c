"""TopKTokenClient: a teacher server's top-k of token sequences together with its log-prob of each sequence's own
next token, what scoring a rollout needs (the teacher's log-prob of every sampled token, inside its top-k or not).

vLLM's prompt_logprobs carry the prompt token's own entry at every position, and SGLang's input_token_logprobs
its log-prob; the binary liger top-k reply names each row's token but not its log-prob, so a `liger-kd serve` is
asked in vLLM's JSON, which it answers alike. Requests, retries, timeouts, the protocol's resolution and the checks
of a reply are TeacherClient's.
"""

from __future__ import annotations

import json

import torch

from ...wire import protocols as P
from ...wire.protocols import PROTOCOLS, own_token_logprobs
from .client import TeacherClient


class TopKTokenClient(TeacherClient):
    """Per sequence ((ids (T, K) int32, log-probs (T, K) float32), own (T,) float32): the row-aligned top-k and
    the log-prob of token t + 1 at row t (the last row -inf). Protocols: vllm, sglang, liger (asked as vllm)."""

    def _request(self, sequences: list[list[int]]) -> list[tuple[P.TopK, torch.Tensor]]:
        size = f"{len(sequences)} sequences, {sum(map(len, sequences))} tokens"
        name = f"request {next(self._counter)} ({size}) to {self.url}"
        protocol = self.resolve_protocol()
        protocol = "vllm" if protocol == "liger" else protocol  # its JSON reply: the own token's log-prob too
        wire = PROTOCOLS[protocol]
        raw, _ = self._post(wire.path, wire.request(sequences, self.top_k, self._model_name), "application/json")
        try:
            reply = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise P.TeacherReplyError(f"{name}: the reply is not JSON ({raw[:80]!r}...)") from e
        topks = wire.parse_reply(reply, sequences, top_k=self.top_k, vocab_size=self.vocab_size, request=name)
        return list(zip(topks, own_token_logprobs(protocol, reply, sequences, request=name)))
