"""`liger-kd serve`: any Hugging Face causal LM as a teacher server speaking vLLM's prompt-log-prob protocol.

    GET  /health                   200 once the model is loaded
    GET  /v1/models                the one model, OpenAI style
    POST /v1/completions           {"prompt": [ids] or [[ids], ...], "prompt_logprobs": K, "max_tokens": 1, ...}
    POST /v1/hidden_states, GET /v1/head   the exact teacher: final hidden states and lm_head (hidden_server.py)

Replies as vLLM does: choices[i].prompt_logprobs is a list over prompt positions, the first null, each position
{"<id>": {"logprob", "rank", "decoded_token"}} with the top K and, when it is outside them, the prompt token itself.
With `Accept: application/octet-stream` the reply is protocols.encode_binary's arrays instead (already row-aligned
top K), far cheaper to decode; a binary request with `samples` gets sampled teacher tokens instead (m draws per
position at sample_temperature, seeded by sample_seed and each prompt's ids, optionally after the exact top-K: the
hybrid; wire/sampled_wire.py). Prompts must be token ids. A /v1/completions body without prompt_logprobs asks
for sampled completions instead, and the server also takes vLLM's LoRA adapter and a full-weight update routes: the
model as a rollout engine (generation.py).

Concurrent requests are batched: a batcher takes the waiting prompts (up to --max-batch-tokens padded tokens; a
large request is split across batches), runs the teacher once over them (teacher_topk_and_next: chunked, the logits
never held whole) in a worker thread, and answers each request. Which prompts share a forward depends on timing,
so a reply equals the prompt's reply alone only to float32 rounding (~1e-6 for log-probs of magnitude < ~50);
--batch-invariant runs every prompt alone (no padding) and its reply is then bit-identical whatever else was asked.

A request is checked whole before any teacher work (validation.py): a bad one gets a 400 (413 over
--max-request-tokens) with {"error": "..."} naming the field. With --api-key (or LIGER_KD_API_KEY) every endpoint
but /health wants `Authorization: Bearer <key>` (401 otherwise), as vLLM's --api-key. FastAPI and uvicorn are the
optional extra `serve`.

A request whose client hangs up is dropped: a generation stops at its next decode step (or never starts, if it was
waiting for the model), a scoring request leaves the batches it has not reached yet (disconnects.py), so no
departed client keeps the model from the others.
"""

import asyncio  # no `from __future__ import annotations`: FastAPI resolves the endpoint annotations
import hmac
import json
import logging
import math
import os
import sys
import threading
import time
from collections import deque
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass

import torch

from ..generation import Cancelled
from ..teacher.precompute import teacher_samples, teacher_topk_and_next
from ..teacher.sampling import sequence_generator
from ..wire.conventions import API_KEY_ENV
from ..wire.protocols import BINARY_MEDIA_TYPE, TopK, encode_binary
from ..wire.sampled_tokens import SampledTokens
from ..wire.sampled_wire import SampleAsk, encode_sampled
from .disconnects import ClientGone, unless_hung_up
from .generation import GenerationEngine, add_generation_routes, validated_generation, wants_generation
from .hidden_server import add_hidden_routes
from .request_fields import check_fields
from .validation import (
    Limits,
    RequestError,
    check_serve_options,
    is_loopback,
    listening_socket,
    nonfinite_output,
    parse_body,
    read_body,
    validated_completion,
    validated_samples,
)

JSON_NEG_INF = -9999.0  # JSON has no -inf; vLLM writes this (protocols maps it back)
GRACEFUL_SHUTDOWN_S = 5  # after SIGTERM, how long requests in flight may still finish
DEFAULT_MAX_REQUEST_TOKENS = 262144  # prompt tokens in one request (413 above): 64 sequences of 4096
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client left: what the (unread) reply carries
log = logging.getLogger("liger_patch_kd.serve")


@dataclass
class _Pending:
    sequence: list[int]
    future: asyncio.Future
    ask: SampleAsk | None = None  # sampled teacher tokens instead of the top-k (wire/sampled_wire.py)
    adapter: str | None = None  # the LoRA adapter its request's `model` names (None: the base model)


class TeacherBatcher:
    """Collects the sequences of concurrent requests and runs the teacher on them together, one batch at a time:
    while a batch runs (in a worker thread), new sequences wait and then go together into the next. A batch holds
    up to max_batch_tokens padded tokens (a longer sequence runs alone), so a large request is split across
    batches. `batch_invariant`: every sequence runs in a forward of its own (no padding, batch size 1), so its
    reply is bit-identical whatever else was asked at the same time; slower."""

    def __init__(
        self, model: torch.nn.Module, max_top_k: int, max_batch_tokens: int = 16384, batch_invariant: bool = False,
        guard=nullcontext,
    ) -> None:  # fmt: skip
        self.model, self.max_top_k, self.max_batch_tokens = model, max_top_k, max_batch_tokens
        self.batch_invariant = batch_invariant
        self.guard = guard  # guard(adapter) held around each forward: the model is shared with the generation engine
        self.device = next(model.parameters()).device
        self.waiting: deque[_Pending] = deque()
        self.wakeup = asyncio.Event()
        self.batches_run = 0
        self.forwards_run = 0

    async def score(
        self, sequences: list[list[int]], top_k: int, adapter: str | None = None
    ) -> list[tuple[TopK, torch.Tensor, torch.Tensor]]:
        """Per sequence: (ids, log-probs) (T, top_k) row-aligned, next-token log-probs (T,) and their ranks (T,)."""
        results = await self._wait(sequences, None, adapter)
        return [((i[:, :top_k], v[:, :top_k]), lp, r) for (i, v), lp, r in results]

    async def draw(self, sequences: list[list[int]], ask: SampleAsk, adapter: str | None = None) -> list[SampledTokens]:
        """Per sequence: its sampled teacher tokens (T rows, the last padding), drawn with its own generator."""
        return await self._wait(sequences, ask, adapter)

    async def _wait(self, sequences: list[list[int]], ask: SampleAsk | None, adapter: str | None = None) -> list:
        loop = asyncio.get_running_loop()
        pending = [_Pending(s, loop.create_future(), ask, adapter) for s in sequences]
        self.waiting.extend(pending)
        self.wakeup.set()
        return await asyncio.gather(*(p.future for p in pending))

    async def run(self) -> None:
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            while self.waiting:
                batch = [self.waiting.popleft()]  # at least one sequence, however long
                while self.waiting and _padded_tokens([p.sequence for p in (*batch, self.waiting[0])]) <= (
                    self.max_batch_tokens
                ):
                    batch.append(self.waiting.popleft())
                batch = [p for p in batch if not p.future.done()]  # a client that hung up cancelled its futures
                if batch:
                    await self._run_batch(batch)

    async def _run_batch(self, batch: list[_Pending]) -> None:
        try:
            results = await asyncio.to_thread(self._forward, batch)
        except Exception as e:  # these requests get a 500 naming the error; the server keeps serving
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(e)
            return
        self.batches_run += 1
        for p, result in zip(batch, results):
            if not p.future.done():
                p.future.set_result(result)

    def _forward(self, batch: list[_Pending]) -> list:
        """One result per pending sequence; a forward per kind of request (top-k, or one draw setting) in it."""
        groups: dict = {}
        for n, p in enumerate(batch):  # sequences alike share a forward; a draw's seed is its sequence's own
            key = (p.adapter, None if p.ask is None else (p.ask.samples, p.ask.top_k, p.ask.temperature))
            groups.setdefault(n if self.batch_invariant else key, []).append(n)
        out: list = [None] * len(batch)
        for members in groups.values():
            items = [batch[n] for n in members]
            run = self._forward_padded if items[0].ask is None else self._draw_padded
            with self.guard(items[0].adapter):  # a forward sees one adapter (or none) throughout
                for n, result in zip(members, run(items)):
                    out[n] = result
        return out

    def _padded(self, items: list[_Pending]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        self.forwards_run += 1
        lengths = [len(p.sequence) for p in items]
        ids = torch.zeros((len(items), max(lengths)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(items):
            ids[row, : lengths[row]] = torch.tensor(p.sequence)
            mask[row, : lengths[row]] = 1
        return ids.to(self.device), mask.to(self.device), lengths

    def _draw_padded(self, items: list[_Pending]) -> list[SampledTokens]:
        ask = items[0].ask
        ids, mask, lengths = self._padded(items)
        generators = [sequence_generator(p.ask.seed, p.sequence, self.device) for p in items]
        drawn = teacher_samples(self.model, ids, mask, ask.samples, ask.top_k, ask.temperature, generators)
        out = []
        for row, n in enumerate(lengths):
            s_ids, counts, s_lp, t_ids, t_lp = (d[row, :n].cpu().clone() for d in drawn)
            if torch.isnan(s_lp[:-1]).any() or torch.isnan(t_lp[:-1]).any():  # -inf is a log-prob (of 0), NaN not
                raise nonfinite_output("the teacher's log-probs of its sampled tokens")
            s_ids[-1], counts[-1], s_lp[-1], t_ids[-1], t_lp[-1] = -1, 0, -math.inf, -1, -math.inf  # predicts nothing
            out.append(SampledTokens(s_ids, counts, s_lp, t_ids.to(torch.int32), t_lp))
        return out

    def _forward_padded(self, items: list[_Pending]):
        ids, mask, lengths = self._padded(items)
        top_ids, top_lp, next_lp, ranks = teacher_topk_and_next(self.model, ids, mask, self.max_top_k)
        top_ids, top_lp, next_lp, ranks = (t.cpu() for t in (top_ids, top_lp, next_lp, ranks))
        out = []
        for row, n in enumerate(lengths):
            i, v = top_ids[row, :n].to(torch.int32), top_lp[row, :n].clone()
            if torch.isnan(v[:-1]).any() or torch.isnan(next_lp[row, : n - 1]).any():  # -inf is a log-prob (of 0)
                raise nonfinite_output("the teacher's log-probs")
            i[-1], v[-1] = -1, -math.inf  # the last position predicts nothing in this sequence
            out.append(((i, v), next_lp[row, :n], ranks[row, :n]))
        return out


def _padded_tokens(sequences: list[list[int]]) -> int:
    return len(sequences) * max((len(s) for s in sequences), default=0)


def vllm_prompt_logprobs(sequence: list[int], topk: TopK, next_lp: torch.Tensor, ranks: torch.Tensor) -> list:
    """vLLM's prompt_logprobs of one prompt: [None, {id: {logprob, rank, decoded_token}}, ...]; position t scores
    token t (row t - 1 here), its top K plus token t itself when outside them."""
    ids, values = topk[0].tolist(), topk[1].tolist()
    next_lp, ranks = next_lp.tolist(), ranks.tolist()
    out: list[dict | None] = [None]
    for t in range(1, len(sequence)):
        row = t - 1
        entry = {
            str(tok): {"logprob": max(lp, JSON_NEG_INF), "rank": r, "decoded_token": None}
            for r, (tok, lp) in enumerate(zip(ids[row], values[row]), 1)
        }
        own = str(sequence[t])
        if own not in entry:
            entry[own] = {"logprob": max(next_lp[row], JSON_NEG_INF), "rank": ranks[row], "decoded_token": None}
        out.append(entry)
    return out


def build_app(
    model: torch.nn.Module, *, top_k: int, model_name: str, max_batch_tokens: int = 16384,
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS, api_key: str | None = None, batch_invariant: bool = False,
    max_context: int | None = None, sample_temperature: float = 1.0, fuse_projections: bool = True,
):  # fmt: skip
    """The FastAPI app serving `model` (eval mode, on its device). `max_context` defaults to the model config's
    max_position_embeddings; `api_key`: every endpoint but /health wants `Authorization: Bearer <api_key>`;
    `sample_temperature`: the draws' temperature of a request for sampled tokens that names none;
    `fuse_projections`: the sampler's q/k/v and gate/up as one product each, over a copy of those weights
    (captured_sampling.py: faster decode steps for those weights' bytes once more in GPU memory)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    vocab = model.get_output_embeddings().weight.shape[0]
    check_serve_options(top_k, vocab, max_batch_tokens, max_request_tokens, sample_temperature)
    if max_context is None:
        max_context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    limits = Limits(max_top_k=top_k, vocab_size=vocab, max_context=max_context, max_request_tokens=max_request_tokens,
                    sample_temperature=float(sample_temperature))  # fmt: skip
    engine = GenerationEngine(model, model_name, fuse_projections=fuse_projections)
    batcher = TeacherBatcher(model, top_k, max_batch_tokens, batch_invariant, guard=engine.using)
    expected = f"Bearer {api_key}".encode() if api_key else None

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()

    app = FastAPI(title="liger-kd teacher server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.batcher, app.state.engine = batcher, engine

    def error(status: int, message: str) -> Response:
        return JSONResponse({"error": message}, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:  # 404, 405: {"error": ...} too
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if expected is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return error(401, "missing or wrong API key: send the header `Authorization: Bearer <the server's "
                                  "--api-key>` (the client's kd_teacher_api_key or LIGER_KD_API_KEY)")  # fmt: skip
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "batches_run": batcher.batches_run, "forwards_run": batcher.forwards_run,
                **engine.health_fields()}  # fmt: skip

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "liger-kd", "max_logprobs": top_k,
             "vocab_size": vocab, "max_model_len": max_context, "sample_temperature": limits.sample_temperature}
        ]}  # fmt: skip

    async def generate(req, request: Request) -> Response:
        cancel = threading.Event()  # set when the client hangs up: the decode loop stops at its next step
        try:
            reply = await unless_hung_up(request, asyncio.to_thread(engine.complete, req, cancel), cancel)
        except (ClientGone, Cancelled):  # nobody is left to read a reply
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except RequestError as e:  # checked under the engine's lock: a model (adapter) that is not loaded
            return error(e.status, e.message)
        except Exception as e:  # a fault of the server: 500, which clients retry
            log.exception("generation failed")
            return error(500, f"generation failed: {type(e).__name__}: {e}")
        return Response(json.dumps(reply), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:  # the whole request is checked before any teacher work
            body = parse_body(await read_body(request, limits.max_body_bytes))  # bounded: no client OOMs us
            if wants_generation(body):  # no prompt_logprobs: sample completions (generation.py)
                return await generate(validated_generation(body, limits), request)
            sequences, k = validated_completion(body, limits)
            check_fields(body, scoring=True)  # request_fields.py: an allow-list
            adapter = engine.adapter_of(body.get("model"))  # 404 for a model not served, as generation answers
            binary = BINARY_MEDIA_TYPE in request.headers.get("accept", "")
            ask = validated_samples(body, limits, k, binary)
        except RequestError as e:
            return error(e.status, e.message)
        try:
            if ask is not None:  # sampled teacher tokens (wire/sampled_wire.py), binary only
                drawn = await unless_hung_up(request, batcher.draw(sequences, ask, adapter))
                return Response(encode_sampled(drawn, sequences, ask), media_type=BINARY_MEDIA_TYPE)
            scored = await unless_hung_up(request, batcher.score(sequences, k, adapter))
        except ClientGone:  # its sequences still waiting are skipped by the batcher (their futures are cancelled)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except RequestError as e:  # its adapter was unloaded while it waited: 404 (never the base model instead)
            return error(e.status, e.message)
        except Exception as e:  # a fault of the server (out of memory, ...): 500, which clients retry
            log.exception("the teacher forward failed")
            return error(500, f"the teacher forward failed: {type(e).__name__}: {e}")
        if binary:
            return Response(encode_binary([topk for topk, _, _ in scored], sequences), media_type=BINARY_MEDIA_TYPE)
        choices = [
            {"index": n, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None,
             "prompt_logprobs": vllm_prompt_logprobs(seq, topk, lp, r)}
            for n, (seq, (topk, lp, r)) in enumerate(zip(sequences, scored))
        ]  # fmt: skip
        reply = {
            "id": f"cmpl-{time.monotonic_ns()}", "object": "text_completion", "created": int(time.time()),
            "model": adapter or model_name, "choices": choices,
            "usage": {"prompt_tokens": sum(map(len, sequences)), "completion_tokens": 0,
                      "total_tokens": sum(map(len, sequences))},
        }  # fmt: skip
        return Response(json.dumps(reply), media_type="application/json")

    add_generation_routes(app, engine, error)
    add_hidden_routes(app, model, engine, limits, error, batcher_type=TeacherBatcher,  # the exact teacher
                      max_batch_tokens=max_batch_tokens, batch_invariant=batch_invariant)  # fmt: skip
    return app


def serve(
    teacher: str, *, top_k: int, host: str = "127.0.0.1", port: int = 8000, device: str | None = None,
    dtype: str = "auto", max_batch_tokens: int = 16384, log_level: str = "warning",
    attn_implementation: str | None = None, random_weights: bool = False, precision: str = "bf16",
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS, api_key: str | None = None, batch_invariant: bool = False,
    sample_temperature: float = 1.0, fuse_projections: bool = True,
) -> None:  # fmt: skip
    """Load `teacher` (a path or hub name), patch its kernels on GPU, and serve it until interrupted.
    `random_weights` builds the model from its config alone with random weights (seed 0): for benchmarks only.
    `precision="fp8"` (or "fp8_fast_accum") runs its decoder products in FP8 (models/fp8_teacher.py). `api_key`
    defaults to the LIGER_KD_API_KEY environment variable. Options that cannot work raise ValueError before the
    weights load."""
    try:
        import uvicorn
    except ImportError as e:
        raise ImportError("`liger-kd serve` needs FastAPI and uvicorn: pip install 'liger_patch_kd[serve]' (from a "
                          "clone: pip install -e '.[serve]')") from e  # fmt: skip
    listener = listening_socket(host, port)  # a port in use fails now, before transformers or the weights load
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        from ..models import check_teacher_precision

        check_teacher_precision(precision, "serve: precision")
        api_key = api_key or os.environ.get(API_KEY_ENV) or None
        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        config = AutoConfig.from_pretrained(teacher, **extra)
        check_serve_options(top_k, getattr(config.get_text_config(), "vocab_size", None), max_batch_tokens,
                            max_request_tokens, sample_temperature)  # fmt: skip
        if not api_key and not is_loopback(host):
            print(f"liger-kd serve: WARNING: listening on {host} without --api-key ({API_KEY_ENV}): anyone who "
                  f"reaches port {port} may use the teacher", file=sys.stderr, flush=True)  # fmt: skip
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if random_weights:
            torch.manual_seed(0)
            with torch.device(device):
                random_dtype = None if dtype == "auto" else getattr(torch, dtype)
                model = AutoModelForCausalLM.from_config(config, dtype=random_dtype)
            print("liger-kd serve: RANDOM WEIGHTS (--random-weights), for benchmarks only", flush=True)
        else:
            model = AutoModelForCausalLM.from_pretrained(teacher, dtype=dtype, **extra)
        model = model.to(device).eval().requires_grad_(False)
        if torch.device(device).type == "cuda":
            from ..models import patch_teacher_kernels

            patch_teacher_kernels(model, None)
        if precision != "bf16":
            from ..models import apply_teacher_precision

            summary = apply_teacher_precision(model, precision)
            print(f"liger-kd serve: FP8 teacher ({precision}), {len(summary.quantized)} products quantised, lm_head "
                  f"in bf16", flush=True)  # fmt: skip
        app = build_app(
            model, top_k=top_k, model_name=teacher, max_batch_tokens=max_batch_tokens,
            max_request_tokens=max_request_tokens, api_key=api_key, batch_invariant=batch_invariant,
            sample_temperature=sample_temperature, fuse_projections=fuse_projections,
        )  # fmt: skip
        print(f"liger-kd serve: {teacher} on {device}, top-{top_k}, http://{host}:{port}"
              f"{', batch-invariant' if batch_invariant else ''}{', API key required' if api_key else ''}",
              flush=True)  # fmt: skip
    except BaseException:
        listener.close()
        raise
    # SIGTERM / SIGINT: requests still running after GRACEFUL_SHUTDOWN_S are dropped (a pending weight-transfer
    # call would otherwise hold the process for its whole timeout)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    uvicorn.Server(config).run(sockets=[listener])
