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
import logging
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
from .transport import (
    MAX_BACKOFF_S,
    HttpEndpoint,
    TeacherServerError,
    TeacherTimeoutError,
    nobody_listens,
    open_url,
    retry_delay,
    why,
)

__all__ = [
    "AUTO_PROTOCOL",
    "PendingTopK",
    "TeacherClient",
    "TeacherServerError",
    "TeacherTimeoutError",
    "protocol_for",
]

log = logging.getLogger(__name__)
AUTO_PROTOCOL = "auto"  # the protocol the server offers that is best: asked of GET /v1/models (protocol_for)
# /v1/models' owned_by -> the protocol of that server; any other speaks vLLM's /v1/completions (JSON)
_OWNERS = {"liger-kd": "liger", "sglang": "sglang"}
_HINTS = {
    401: " (set kd_teacher_api_key, or LIGER_KD_API_KEY, to the server's --api-key)",
    413: " (lower tokens_per_request or sequences_per_request, or raise the server's --max-request-tokens)",
}


def protocol_for(owner: object) -> str:
    """The top-k protocol to speak to a server whose /v1/models entry says `owned_by: owner`."""
    return _OWNERS.get(owner, "vllm") if isinstance(owner, str) else "vllm"


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
    start vLLM with --max-logprobs >= top_k), "sglang" (/generate with input_top_logprobs), "liger"
    (`liger-kd serve`, binary replies), or "auto": the server is asked before the first request (resolve_protocol:
    "liger" for `liger-kd serve`, "sglang" for SGLang, "vllm" for any other). A call's sequences go out in requests of
    up to `tokens_per_request` padded tokens (the longest sequence times their number; at least one sequence
    each), the size of one of `liger-kd serve`'s forwards (its --max-batch-tokens default), so a step's rows fill
    the server's batches instead of trickling in a few at a time; `sequences_per_request` fixes the count instead.
    Up to `max_in_flight` requests run at once. `vocab_size` (the student's) bounds the ids the
    server may return. `api_key` (default: the LIGER_KD_API_KEY environment variable) is sent as `Authorization:
    Bearer <api_key>`.

    `samples` = m asks `liger-kd serve` (protocol "liger") for m sampled teacher tokens per position at
    `sample_temperature`, seeded by `sample_seed` (wire/sampled_wire.py); `top_k` is then the hybrid's exact top-k (0:
    draws alone), and each sequence's reply is a sampling.SampledTokens (T rows) instead of a TopK.
    """

    def __init__(
        self, url: str, protocol: str = AUTO_PROTOCOL, *, top_k: int, vocab_size: int, timeout: float = 120.0,
        retries: int = 5, model: str | None = None, max_in_flight: int = 8, sequences_per_request: int | None = None,
        tokens_per_request: int = 16384,
        backoff: float = 0.5, api_key: str | None = None, samples: int | None = None, sample_seed: int = 0,
        sample_temperature: float = 1.0,
    ) -> None:  # fmt: skip
        if protocol not in PROTOCOLS and protocol != AUTO_PROTOCOL:
            raise ValueError(f"protocol must be one of {(AUTO_PROTOCOL, *PROTOCOLS)}; got {protocol!r}")
        if samples is not None and protocol not in ("liger", AUTO_PROTOCOL):
            raise ValueError(f"samples (sampled teacher tokens) are served by `liger-kd serve` only: use protocol "
                             f"'liger' (or 'auto'), not {protocol!r}")  # fmt: skip
        if top_k < (0 if samples is not None else 1) or vocab_size < 1:
            raise ValueError(f"top_k and vocab_size must be >= 1 (top_k >= 0 with samples); got top_k={top_k}, "
                             f"vocab_size={vocab_size}")  # fmt: skip
        if (
            timeout <= 0
            or retries < 0
            or max_in_flight < 1
            or tokens_per_request < 1
            or (sequences_per_request is not None and sequences_per_request < 1)
        ):
            raise ValueError(
                f"need timeout > 0, retries >= 0, max_in_flight >= 1, sequences_per_request >= 1 (or None), "
                f"tokens_per_request >= 1; got {timeout}, {retries}, {max_in_flight}, {sequences_per_request}, "
                f"{tokens_per_request}"
            )
        self.url = url.rstrip("/")
        self.protocol, self.top_k, self.vocab_size = protocol, top_k, vocab_size
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.sequences_per_request, self.tokens_per_request = sequences_per_request, tokens_per_request
        self._model = model
        self.ask = None if samples is None else checked_ask(samples, top_k, sample_seed, sample_temperature)
        self._http = HttpEndpoint(
            self.url, timeout=timeout, retries=retries, backoff=backoff,
            api_key=api_key or os.environ.get(API_KEY_ENV) or None, hints=_HINTS,
        )  # fmt: skip
        self._model_lock, self._protocol_lock = threading.Lock(), threading.Lock()
        self._pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix="teacher-client")
        self._counter = itertools.count(1)

    @property
    def retried(self) -> int:
        """Requests sent again after a connection error or a 5xx, for logs and tests."""
        return self._http.retried

    # ------------------------------------------------------------------------------------------------ public
    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Poll GET /health until the server answers 200, or raise TeacherServerError naming the URL: a server that
        does not answer at once is logged at once (the URL, how long it is waited for); one that accepts connections
        but is not ready is waited for up to `timeout` seconds (default: the client's timeout), while an address
        where nothing listens (connection refused, or a host name that does not resolve) is tried `retries` more
        times with the backoff between requests (0.5 ... 8 s by default), so a server still starting is waited for
        a little (more retries: longer) and a wrong URL fails in seconds rather than after the whole timeout."""
        limit = self.timeout if timeout is None else timeout
        start = time.monotonic()
        deadline, last, refused, announced = start + limit, None, 0, False
        while True:
            try:
                health = urllib.request.Request(self.url + "/health", headers=self._http.headers("application/json"))
                with open_url(health, timeout=max(0.1, min(5.0, limit))) as reply:
                    if reply.status == 200:
                        return
                    last = http.client.HTTPException(f"HTTP {reply.status}")
            except (OSError, http.client.HTTPException) as e:
                last = e
            nobody = nobody_listens(last)
            refused += nobody
            if not announced:  # the first miss: say at once what is waited for, where, and how long
                announced = True
                log.warning(
                    "the teacher server at %s/health does not answer yet (%s): waiting up to %g s for it (the "
                    "timeout, kd_teacher_timeout); while nothing listens there, %d retries %g s apart, doubling up "
                    "to %g s (kd_teacher_retries)", self.url, why(last), limit, self.retries, self.backoff,
                    MAX_BACKOFF_S,
                )  # fmt: skip
            if nobody and refused > self.retries:
                raise TeacherServerError(
                    f"nothing listens at {self.url} ({why(last)}; tried {refused} times over "
                    f"{time.monotonic() - start:.0f} s): start the teacher server (e.g. `liger-kd serve --teacher PATH "
                    f"--top-k {self.top_k} --port PORT`) or fix the URL (kd_teacher_url); for a server that takes "
                    f"longer to start listening, raise the retries (kd_teacher_retries, each wait at most "
                    f"{MAX_BACKOFF_S:g} s)"
                )
            if time.monotonic() >= deadline:
                raise TeacherServerError(
                    f"no teacher server answers at {self.url}/health within {limit:g} s (last error: {last}); start "
                    f"it (e.g. `liger-kd serve --teacher PATH --top-k {self.top_k} --port PORT`) or fix "
                    f"kd_teacher_url"
                )
            pause = retry_delay(refused, self.backoff) if nobody else 0.2
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))

    def submit(self, sequences: Sequence[Sequence[int]]) -> PendingTopK:
        """Send the requests for `sequences` now (background threads); `.result()` gives one TopK each."""
        seqs = [list(map(int, s)) for s in sequences]
        for n, s in enumerate(seqs):
            if len(s) < 1:
                raise ValueError(f"sequence {n} is empty: nothing to score")
        return PendingTopK([self._pool.submit(self._request, chunk) for chunk in self.requests_of(seqs)])

    def requests_of(self, seqs: list[list[int]]) -> list[list[list[int]]]:
        """`seqs` in order, cut into the requests that carry them (see the class docstring)."""
        if self.sequences_per_request is not None:
            step = self.sequences_per_request
            return [seqs[i : i + step] for i in range(0, len(seqs), step)]
        chunks: list[list[list[int]]] = []
        longest = 0
        for s in seqs:
            if chunks and max(longest, len(s)) * (len(chunks[-1]) + 1) <= self.tokens_per_request:
                chunks[-1].append(s)
                longest = max(longest, len(s))
            else:
                chunks.append([s])
                longest = len(s)
        return chunks

    def fetch(self, sequences: Sequence[Sequence[int]]) -> list[P.TopK]:
        """Row-aligned (ids (T, K) int32, log-probs (T, K) float32) per sequence; waits for the replies."""
        return self.submit(sequences).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------------------ private
    def _request(self, sequences: list[list[int]]) -> list[P.TopK]:
        size = f"{len(sequences)} sequences, {sum(map(len, sequences))} tokens"
        name = f"request {next(self._counter)} ({size}) to {self.url}"
        wire = PROTOCOLS[self.resolve_protocol()]
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

    def resolve_protocol(self, model: dict | None = None) -> str:
        """The protocol requests use: the one given, or for "auto" the best the server offers, from its GET /v1/models
        entry (`model` when the caller has it) once: `liger-kd serve` (owned_by "liger-kd") the binary "liger",
        SGLang "sglang", any other server vLLM's JSON. Logged once. Sampled tokens need `liger-kd serve`."""
        with self._protocol_lock:
            if self.protocol == AUTO_PROTOCOL:
                owner = (model or self.served_model()).get("owned_by")
                chosen = protocol_for(owner)
                if self.ask is not None and chosen != "liger":
                    raise TeacherServerError(
                        f"sampled teacher tokens are served by `liger-kd serve` only, and {self.url}/v1/models says "
                        f"owned_by {owner!r}: point the client (kd_teacher_url) at a `liger-kd serve`"
                    )
                log.info("protocol 'auto': %s/v1/models says owned_by %r, so requests use the %r protocol",
                         self.url, owner, chosen)  # fmt: skip
                self.protocol = chosen
            return self.protocol

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
