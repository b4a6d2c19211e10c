"""TeacherClient: ask a teacher server (vLLM, SGLang, `trl vllm-serve` or `liger-kd serve`) for row-aligned top-k
log-probs of token sequences, many requests in flight, with retries. Standard library only (urllib, threads).

Faults are never silent: a connection error or a 5xx is retried with exponential backoff (each wait at most
transport.MAX_BACKOFF_S) up to `retries` times, then TeacherServerError names the URL and the last error; a server
that sends nothing for `timeout` seconds raises TeacherTimeoutError naming the URL and the timeout (not retried: a
slow server stays slow); a 4xx (the request is wrong: retrying cannot help) raises TeacherServerError at once with
the server's message; a reply that does not fit the request, or cannot be a distribution, raises
protocols.TeacherReplyError naming the request.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import threading
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ...wire import protocols as P
from ...wire.conventions import API_KEY_ENV
from ...wire.protocols import PROTOCOLS
from ...wire.sampled_wire import checked_ask, decode_sampled
from .transport import HttpEndpoint, TeacherServerError, TeacherTimeoutError, open_url

__all__ = ["PendingTopK", "TeacherClient", "TeacherServerError", "TeacherTimeoutError"]

_HINTS = {
    401: " (set kd_teacher_api_key, or LIGER_KD_API_KEY, to the server's --api-key)",
    413: " (lower sequences_per_request, or raise the server's --max-request-tokens)",
}


class PendingTopK:
    """The replies to one `submit`: `result()` waits for every request and returns one TopK per sequence."""

    def __init__(self, futures: list[Future]) -> None:
        self._futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self) -> list[P.TopK]:
        return [topk for f in self._futures for topk in f.result()]


class TeacherClient:
    """Row-aligned (T, top_k) teacher ids / log-probs for token sequences from a server.

    protocol: "vllm" (vLLM's /v1/completions with prompt_logprobs; also `trl vllm-serve`, which runs vLLM's server;
    start vLLM with --max-logprobs >= top_k), "sglang" (/generate with input_top_logprobs) or "liger"
    (`liger-kd serve`, binary replies). `sequences_per_request` sequences go in one request and up to
    `max_in_flight` requests run at once. `vocab_size` (the student's) bounds the ids the server may return.
    `api_key` (default: the LIGER_KD_API_KEY environment variable) is sent as `Authorization: Bearer <api_key>`.

    `samples` = m asks `liger-kd serve` (protocol "liger") for m sampled teacher tokens per position at
    `sample_temperature`, seeded by `sample_seed` (wire/sampled_wire.py); `top_k` is then the hybrid's exact top-k (0:
    draws alone), and each sequence's reply is a sampling.SampledTokens (T rows) instead of a TopK.
    """

    def __init__(
        self, url: str, protocol: str = "vllm", *, top_k: int, vocab_size: int, timeout: float = 120.0,
        retries: int = 5, model: str | None = None, max_in_flight: int = 8, sequences_per_request: int = 4,
        backoff: float = 0.5, api_key: str | None = None, samples: int | None = None, sample_seed: int = 0,
        sample_temperature: float = 1.0,
    ) -> None:  # fmt: skip
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {tuple(PROTOCOLS)}; got {protocol!r}")
        if samples is not None and protocol != "liger":
            raise ValueError(f"samples (sampled teacher tokens) are served by `liger-kd serve` only: use protocol "
                             f"'liger', not {protocol!r}")  # fmt: skip
        if top_k < (0 if samples is not None else 1) or vocab_size < 1:
            raise ValueError(f"top_k and vocab_size must be >= 1 (top_k >= 0 with samples); got top_k={top_k}, "
                             f"vocab_size={vocab_size}")  # fmt: skip
        if timeout <= 0 or retries < 0 or max_in_flight < 1 or sequences_per_request < 1:
            raise ValueError(
                f"need timeout > 0, retries >= 0, max_in_flight >= 1, sequences_per_request >= 1; got {timeout}, "
                f"{retries}, {max_in_flight}, {sequences_per_request}"
            )
        self.url = url.rstrip("/")
        self.protocol, self.top_k, self.vocab_size = protocol, top_k, vocab_size
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.sequences_per_request = sequences_per_request
        self._model = model
        self.ask = None if samples is None else checked_ask(samples, top_k, sample_seed, sample_temperature)
        self._http = HttpEndpoint(
            self.url, timeout=timeout, retries=retries, backoff=backoff,
            api_key=api_key or os.environ.get(API_KEY_ENV) or None, hints=_HINTS,
        )  # fmt: skip
        self._model_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix="teacher-client")
        self._counter = itertools.count(1)

    @property
    def retried(self) -> int:
        """Requests sent again after a connection error or a 5xx, for logs and tests."""
        return self._http.retried

    # ------------------------------------------------------------------------------------------------ public
    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Poll GET /health until the server answers 200, or raise TeacherServerError after `timeout` seconds
        (default: the client's timeout) naming the URL: a server that is down at start fails fast and clearly."""
        limit = self.timeout if timeout is None else timeout
        deadline, last = time.monotonic() + limit, None
        while True:
            try:
                health = urllib.request.Request(self.url + "/health", headers=self._http.headers("application/json"))
                with open_url(health, timeout=max(0.1, min(5.0, limit))) as reply:
                    if reply.status == 200:
                        return
            except (OSError, http.client.HTTPException) as e:
                last = e
            if time.monotonic() >= deadline:
                raise TeacherServerError(
                    f"no teacher server answers at {self.url}/health within {limit:g} s (last error: {last}); start "
                    f"it (e.g. `liger-kd serve --teacher PATH --top-k {self.top_k} --port PORT`) or fix "
                    f"kd_teacher_url"
                )
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def submit(self, sequences: Sequence[Sequence[int]]) -> PendingTopK:
        """Send the requests for `sequences` now (background threads); `.result()` gives one TopK each."""
        seqs = [list(map(int, s)) for s in sequences]
        for n, s in enumerate(seqs):
            if len(s) < 1:
                raise ValueError(f"sequence {n} is empty: nothing to score")
        chunks = [seqs[i : i + self.sequences_per_request] for i in range(0, len(seqs), self.sequences_per_request)]
        return PendingTopK([self._pool.submit(self._request, chunk) for chunk in chunks])

    def fetch(self, sequences: Sequence[Sequence[int]]) -> list[P.TopK]:
        """Row-aligned (ids (T, K) int32, log-probs (T, K) float32) per sequence; waits for the replies."""
        return self.submit(sequences).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------------------ private
    def _request(self, sequences: list[list[int]]) -> list[P.TopK]:
        size = f"{len(sequences)} sequences, {sum(map(len, sequences))} tokens"
        name = f"request {next(self._counter)} ({size}) to {self.url}"
        wire = PROTOCOLS[self.protocol]
        body = wire.request(sequences, self.top_k, self._model_name)
        raw, content_type = self._post(wire.path, body | (self.ask.fields() if self.ask else {}), wire.accept)
        if self.ask is not None:
            return decode_sampled(raw, sequences, self.ask, vocab_size=self.vocab_size, request=name)
        common = dict(top_k=self.top_k, vocab_size=self.vocab_size, request=name)
        if content_type.startswith(P.BINARY_MEDIA_TYPE):
            return P.decode_binary(raw, sequences, **common)
        try:
            reply = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise P.TeacherReplyError(f"{name}: the reply is not JSON ({raw[:80]!r}...)") from e
        return wire.parse_reply(reply, sequences, **common)

    def served_model(self) -> dict:
        """The first model GET /v1/models lists: {"id": its name, ...}; `liger-kd serve` adds "max_logprobs" (its
        --top-k) and "vocab_size" (its lm_head's rows), vLLM and SGLang "max_model_len"."""
        raw, _ = self._send("GET", "/v1/models", None, "application/json")
        try:
            model = json.loads(raw)["data"][0]
            if not isinstance(model, dict) or not isinstance(model["id"], str):
                raise TypeError("the model is not {'id': str, ...}")
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise TeacherServerError(f"{self.url}/v1/models lists no model ({raw[:200]!r})") from e
        return model

    def _model_name(self) -> str:
        """vLLM wants the served model's name: asked once from /v1/models unless given."""
        with self._model_lock:
            if self._model is None:
                self._model = self.served_model()["id"]
            return self._model

    def _post(self, path: str, body: dict, accept: str) -> tuple[bytes, str]:
        return self._send("POST", path, json.dumps(body).encode(), accept)

    def _send(self, method: str, path: str, data: bytes | None, accept: str) -> tuple[bytes, str]:
        return self._http.send(method, path, data, accept)
