"""What `liger-kd serve` accepts: a /v1/completions body checked whole before any teacher work. Pure functions.

Every refusal is a RequestError(status, one line naming the field and the fix), answered as HTTP `status` with a
JSON body {"error": message}: 400 for a malformed request (vLLM's status for a prompt past max_model_len too), 413
for one over --max-request-tokens. JSON booleans are refused wherever a number is wanted (Python's True is an int).

Sampling fields are checked for type and range as vLLM's are. A scoring request (with prompt_logprobs) generates
nothing, so there they are otherwise ignored: `temperature` (any number >= 0, as vLLM takes it) would shape only the
completion token, and prompt_logprobs are always reported at temperature 1, as vLLM reports them by default. A
generation request (without prompt_logprobs) is checked further by generation.validated_generation. A scoring
request may ask for sampled teacher tokens instead (samples, sample_seed, sample_temperature; prompt_logprobs 0
allowed then): checked by validated_samples (the fields of wire/sampled_wire.py).

Beside the requests: the server's own options (check_serve_options, is_loopback, listening_socket), and what it
refuses to send: an output of the served model that holds NaN or infinite values is a NonFiniteOutput, a 500 naming
it (never a 200).
"""

from __future__ import annotations

import ipaddress
import json
import math
import socket
from dataclasses import dataclass
from typing import Any

from ..wire.conventions import is_int, is_number
from ..wire.sampled_tokens import MAX_SAMPLES
from ..wire.sampled_wire import SampleAsk


class NonFiniteOutput(RuntimeError):
    """The served model's output holds NaN or infinite values: a fault of the server (its weights, or its forward in
    its dtype), answered 500 naming it. JSON cannot carry them and a client must not train on them, so no route
    sends them as a 200."""


def nonfinite_output(what: str) -> NonFiniteOutput:
    """The one-line fault for `what` (e.g. "the teacher's log-probs") holding NaN or infinite values."""
    return NonFiniteOutput(f"{what} hold NaN or infinite values: the served model's output is not finite (a NaN or "
                           f"infinite weight, or its forward overflowed in its dtype); check the teacher's weights "
                           f"and --dtype")  # fmt: skip


class RequestError(ValueError):
    """A request the server refuses: `status` (400, 413) and a one-line message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Limits:
    """max_top_k: the server's --top-k; vocab_size: the teacher's lm_head rows; max_context: the model's
    max_position_embeddings (None: no limit known); max_request_tokens: the server's --max-request-tokens;
    sample_temperature: the server's --sample-temperature, for sampled tokens asked without one."""

    max_top_k: int
    vocab_size: int
    max_context: int | None
    max_request_tokens: int
    sample_temperature: float = 1.0

    @property
    def max_body_bytes(self) -> int:
        """The largest /v1/completions body read (413 past it, before it is held in memory): room for
        max_request_tokens ids and an allowed_token_ids list of the whole vocabulary, as JSON, generously spaced."""
        return BYTES_PER_ID * (self.max_request_tokens + self.vocab_size) + CONTROL_BODY_BYTES


BYTES_PER_ID = 32  # "151935, " is 8 bytes; pretty-printed JSON puts an id on a line of its own, indented
CONTROL_BODY_BYTES = 2**20 * 16  # the other routes' bodies (adapter paths, weight-update names and shapes)


SEQUENCES_FIX = "send fewer sequences per request (the limit follows --max-request-tokens)"


async def read_body(request: Any, limit: int, fix: str = SEQUENCES_FIX) -> bytes:
    """The request's body, read as it streams in: RequestError(413) once it passes `limit` bytes (or its
    Content-Length says it will), so no client makes the server hold more than that in memory."""
    declared = request.headers.get("content-length", "")
    size = int(declared) if declared.isdigit() else 0
    chunks = []
    if size <= limit:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                break
            chunks.append(chunk)
    if size > limit:
        raise RequestError(413, f"the request body is over {limit} bytes, this server's limit for "
                                f"{request.url.path}: {fix}")  # fmt: skip
    return b"".join(chunks)


def parse_body(raw: bytes) -> Any:
    """The request's bytes as JSON, or RequestError(400)."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise RequestError(400, f"the request body is not valid JSON ({e}); send a JSON object") from None
    except RecursionError:  # arrays or objects nested thousands deep: Python's parser recurses per level
        raise RequestError(400, "the request body nests JSON arrays or objects too deep to parse; send the flat "
                                "JSON object the endpoint takes") from None  # fmt: skip


def validated_completion(body: Any, limits: Limits) -> tuple[list[list[int]], int]:
    """A /v1/completions body -> (prompts as lists of token ids, prompt_logprobs K), or RequestError."""
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body is a JSON {type(body).__name__}, not an object")
    prompts = token_prompts(body.get("prompt"))
    check_prompts(prompts, limits)
    k = body.get("prompt_logprobs")
    low = 0 if body.get("samples") is not None else 1  # with sampled tokens, 0 asks for the draws alone
    if not is_int(k) or not low <= k <= limits.max_top_k:
        raise RequestError(
            400, f"prompt_logprobs must be an int in [{low}, {limits.max_top_k}] (the server's --top-k); got "
                 f"{json.dumps(k)[:40]}"
        )  # fmt: skip
    check_sampling(body)
    return prompts, k


def check_prompts(prompts: list[list[int]], limits: Limits, new_tokens: int = 0, copies: int = 1) -> None:
    """RequestError unless every prompt is ids in [0, vocab) and, with `new_tokens` more, fits the model's context;
    413 when the request (each prompt `copies` times, `new_tokens` generated each) is over --max-request-tokens."""
    total = sum(len(p) + new_tokens for p in prompts) * copies
    if total > limits.max_request_tokens:
        what = "tokens (prompts + max_tokens, times n)" if new_tokens else "prompt tokens"
        raise RequestError(
            413, f"the request holds {total} {what}, over the server's --max-request-tokens "
                 f"{limits.max_request_tokens}; send fewer sequences per request"
        )  # fmt: skip
    for n, p in enumerate(prompts):
        if limits.max_context is not None and len(p) + new_tokens > limits.max_context:
            raise RequestError(400, _past_the_context(n, len(p), new_tokens, limits.max_context))
        bad = next((t for t in p if not (is_int(t) and 0 <= t < limits.vocab_size)), None)
        if bad is not None:
            raise RequestError(
                400, f"prompt {n} holds {json.dumps(bad)[:40]}: token ids must be ints in [0, {limits.vocab_size})"
            )


def _past_the_context(n: int, length: int, new_tokens: int, context: int) -> str:
    """The refusal of prompt `n` (`length` tokens) that does not fit the context with `new_tokens` more; the fix it
    names can always be taken (never a negative count)."""
    where = f"the model's context (max_position_embeddings {context})"
    if not new_tokens:
        return f"prompt {n} has {length} tokens, more than {where}: shorten it to at most {context} tokens"
    if length >= context:
        return (f"prompt {n} has {length} tokens, which leaves no room in {where} for max_tokens {new_tokens}: "
                f"shorten the prompt to at most {context - 1} tokens")  # fmt: skip
    return (f"prompt {n} has {length} tokens + max_tokens {new_tokens} = {length + new_tokens}, more than {where}: "
            f"ask for at most max_tokens={context - length}, or shorten the prompt")  # fmt: skip


def token_prompts(prompt: Any) -> list[list[int]]:
    """The prompt field: a list of token ids, or a non-empty list of them (ints are checked by the caller)."""
    if isinstance(prompt, list) and prompt and not any(isinstance(p, list) for p in prompt):
        prompt = [prompt]
    if not (isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt)):
        raise RequestError(
            400, "prompt must be token ids: a non-empty list of ints, or a list of such lists (text is not accepted: "
                 "tokenize it first)"
        )  # fmt: skip
    return prompt


# field -> (check, what it must be); absent fields are fine, null only where OpenAI's API allows it
_SAMPLING: dict[str, tuple[Any, str]] = {
    "temperature": (lambda v: is_number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: is_int(v) and v >= -1, "an int >= -1 (-1 or 0: all)"),
    "min_p": (lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "max_tokens": (lambda v: v is None or (is_int(v) and v >= 0), "null or an int >= 0"),
    "n": (lambda v: v is None or v == 1 and is_int(v), "1 (one choice per prompt)"),
    "logprobs": (lambda v: v is None or (is_int(v) and v >= 0), "null or an int >= 0"),
    "echo": (lambda v: v is None or isinstance(v, bool), "a boolean"),
    "stream": (lambda v: v is None or v is False, "false (this server does not stream)"),
    "seed": (lambda v: v is None or is_int(v), "null or an int"),
    "model": (lambda v: v is None or isinstance(v, str), "a string"),
    **{f: (lambda v: v is None or is_number(v), "a number") for f in (
        "presence_penalty", "frequency_penalty", "repetition_penalty")},
}  # fmt: skip


def check_sampling(body: dict, skip: tuple[str, ...] = ()) -> None:
    """RequestError naming the first sampling field (but `skip`) of a wrong type or range."""
    for field, (ok, want) in _SAMPLING.items():
        if field in body and field not in skip and not ok(body[field]):
            raise RequestError(400, f"{field} must be {want}; got {json.dumps(body[field])[:40]}")


def check_serve_options(
    top_k: int, vocab: int | None, max_batch_tokens: int, max_request_tokens: int, sample_temperature: float = 1.0
) -> None:
    """ValueError naming the option when `liger-kd serve`'s options cannot work with this teacher."""
    if isinstance(sample_temperature, bool) or not (
        isinstance(sample_temperature, (int, float)) and math.isfinite(sample_temperature) and sample_temperature > 0
    ):
        raise ValueError(f"--sample-temperature must be a finite number > 0; got {sample_temperature!r}")
    if vocab is not None and not 1 <= top_k <= vocab:
        raise ValueError(f"--top-k {top_k} must be in [1, {vocab}] (the teacher's vocabulary size); lower it")
    if max_batch_tokens < 1 or max_request_tokens < 1:
        raise ValueError(
            f"--max-batch-tokens ({max_batch_tokens}) and --max-request-tokens ({max_request_tokens}) must be >= 1"
        )


def is_loopback(host: str) -> bool:
    """Whether `host` (serve's --host) is reachable from this machine only: without an API key, warn otherwise."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listening_socket(host: str, port: int) -> socket.socket:
    """`liger-kd serve`'s socket, bound to (host, port) and listening before the teacher loads: a port in use is a
    one-line ValueError naming --host / --port at once, not uvicorn's OSError after minutes of loading; and a client
    that connects while the weights load waits in the backlog (its timeout) instead of being refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn picks it
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses a port in TIME_WAIT
    try:
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as e:
        sock.close()
        raise ValueError(
            f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); another server may hold the port: "
            f"pass a free --port, or stop what listens on {port} (`ss -ltnp | grep :{port}` names it)"
        ) from None
    return sock


def validated_samples(body: dict, limits: Limits, top_k: int, binary: bool) -> SampleAsk | None:
    """The body's sample fields -> SampleAsk (None when it asks for none), or RequestError(400) naming the field."""
    if body.get("samples") is None:
        extra = [f for f in ("sample_seed", "sample_temperature") if f in body]
        if extra:
            raise RequestError(400, f"{extra[0]} is given without samples; add samples (draws per position)")
        return None
    m, seed = body["samples"], body.get("sample_seed", 0)
    t = body.get("sample_temperature", limits.sample_temperature)
    checks = (
        ("samples", m, is_int(m) and 1 <= m <= MAX_SAMPLES, f"an int in [1, {MAX_SAMPLES}] (draws per position)"),
        ("sample_seed", seed, is_int(seed) and seed >= 0, "an int >= 0"),
        ("sample_temperature", t, is_number(t) and t > 0, "a number > 0 (the temperature the draws come from)"),
    )
    for field, value, ok, want in checks:
        if not ok:
            raise RequestError(400, f"{field} must be {want}; got {json.dumps(value)[:40]}")
    if top_k + m > limits.vocab_size:
        raise RequestError(
            400, f"samples {m} + prompt_logprobs {top_k} exceed the vocabulary ({limits.vocab_size}); ask fewer"
        )
    if not binary:
        raise RequestError(
            400, "samples: sampled teacher tokens come only in the liger binary reply; send `Accept: "
                 "application/octet-stream` (TeacherClient protocol 'liger')"
        )  # fmt: skip
    return SampleAsk(m, top_k, seed, float(t))
