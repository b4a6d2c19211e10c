"""`liger-kd serve`: any Hugging Face causal LM as a teacher server speaking vLLM's prompt-log-prob protocol.

    GET  /health                   200 once the model is loaded
    GET  /v1/models                the one model, OpenAI style
    POST /v1/completions           {"prompt": [ids] or [[ids], ...], "prompt_logprobs": K, "max_tokens": 1, ...}

Replies as vLLM does: choices[i].prompt_logprobs is a list over prompt positions, the first null, each position
{"<id>": {"logprob", "rank", "decoded_token"}} with the top K and, when it is outside them, the prompt token itself.
With `Accept: application/octet-stream` the reply is protocols.encode_binary's arrays instead (already row-aligned
top K), far cheaper to decode. Prompts must be token ids; the server scores them and generates nothing.

Concurrent requests are batched: a batcher takes the waiting prompts (up to --max-batch-tokens padded tokens),
runs the teacher once over them (teacher_topk_and_next: chunked, the logits never held whole) in a worker thread,
and answers each request. FastAPI and uvicorn are the optional extra `serve`.
"""

import asyncio  # no `from __future__ import annotations`: FastAPI resolves the endpoint annotations
import json
import math
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..precompute import teacher_topk_and_next
from .protocols import BINARY_MEDIA_TYPE, TopK, encode_binary

JSON_NEG_INF = -9999.0  # JSON has no -inf; vLLM writes this (protocols maps it back)


@dataclass
class _Pending:
    sequences: list[list[int]]
    top_k: int
    future: asyncio.Future


class TeacherBatcher:
    """Collects concurrent requests and runs the teacher on them together, one batch at a time: while a batch
    runs (in a worker thread), new requests wait and then go together into the next."""

    def __init__(self, model: torch.nn.Module, max_top_k: int, max_batch_tokens: int = 16384) -> None:
        self.model, self.max_top_k, self.max_batch_tokens = model, max_top_k, max_batch_tokens
        self.device = next(model.parameters()).device
        self.waiting: deque[_Pending] = deque()
        self.wakeup = asyncio.Event()
        self.batches_run = 0

    async def score(self, sequences: list[list[int]], top_k: int) -> list[tuple[TopK, torch.Tensor, torch.Tensor]]:
        """Per sequence: (ids, log-probs) (T, top_k) row-aligned, next-token log-probs (T,) and their ranks (T,)."""
        pending = _Pending(sequences, top_k, asyncio.get_running_loop().create_future())
        self.waiting.append(pending)
        self.wakeup.set()
        return await pending.future

    async def run(self) -> None:
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            while self.waiting:
                batch = [self.waiting.popleft()]  # at least one request, however long
                while (
                    self.waiting
                    and _padded_tokens([s for p in (*batch, self.waiting[0]) for s in p.sequences])
                    <= self.max_batch_tokens
                ):
                    batch.append(self.waiting.popleft())
                await self._run_batch(batch)

    async def _run_batch(self, batch: list[_Pending]) -> None:
        try:
            results = await asyncio.to_thread(self._forward, [s for p in batch for s in p.sequences])
        except Exception as e:  # these requests get a 500 naming the error; the server keeps serving
            for p in batch:
                p.future.set_exception(e)
            return
        self.batches_run += 1
        start = 0
        for p in batch:
            mine = results[start : start + len(p.sequences)]
            start += len(p.sequences)
            if not p.future.done():  # a client that hung up has a cancelled future
                p.future.set_result([((i[:, : p.top_k], v[:, : p.top_k]), lp, r) for (i, v), lp, r in mine])

    def _forward(self, sequences: list[list[int]]):
        lengths = [len(s) for s in sequences]
        width = max(lengths)
        ids = torch.zeros((len(sequences), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        top_ids, top_lp, next_lp, ranks = teacher_topk_and_next(
            self.model, ids.to(self.device), mask.to(self.device), self.max_top_k
        )
        top_ids, top_lp, next_lp, ranks = (t.cpu() for t in (top_ids, top_lp, next_lp, ranks))
        out = []
        for row, n in enumerate(lengths):
            i, v = top_ids[row, :n].to(torch.int32), top_lp[row, :n].clone()
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


def build_app(model: torch.nn.Module, *, top_k: int, model_name: str, max_batch_tokens: int = 16384):
    """The FastAPI app serving `model` (eval mode, on its device)."""
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import Response

    batcher = TeacherBatcher(model, top_k, max_batch_tokens)
    vocab = model.get_output_embeddings().weight.shape[0]

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()

    app = FastAPI(title="liger-kd teacher server", lifespan=lifespan)
    app.state.batcher = batcher

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "batches_run": batcher.batches_run}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "liger-kd", "max_logprobs": top_k,
             "vocab_size": vocab}
        ]}  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        sequences, k = _validated(body, top_k, vocab, HTTPException)
        scored = await batcher.score(sequences, k)
        if BINARY_MEDIA_TYPE in request.headers.get("accept", ""):
            return Response(encode_binary([topk for topk, _, _ in scored]), media_type=BINARY_MEDIA_TYPE)
        choices = [
            {"index": n, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None,
             "prompt_logprobs": vllm_prompt_logprobs(seq, topk, lp, r)}
            for n, (seq, (topk, lp, r)) in enumerate(zip(sequences, scored))
        ]  # fmt: skip
        reply = {
            "id": f"cmpl-{time.monotonic_ns()}", "object": "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices,
            "usage": {"prompt_tokens": sum(map(len, sequences)), "completion_tokens": 0,
                      "total_tokens": sum(map(len, sequences))},
        }  # fmt: skip
        return Response(json.dumps(reply), media_type="application/json")

    return app


def _validated(body: Any, max_top_k: int, vocab: int, http_error) -> tuple[list[list[int]], int]:
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    if not (isinstance(prompt, list) and prompt and all(isinstance(s, list) and s for s in prompt)):
        raise http_error(400, "prompt must be token ids: a non-empty list of ints, or a list of them (no text)")
    if not all(isinstance(t, int) and 0 <= t < vocab for s in prompt for t in s):
        raise http_error(400, f"prompt token ids must be ints in [0, {vocab})")
    k = body.get("prompt_logprobs")
    if not isinstance(k, int) or not 1 <= k <= max_top_k:
        raise http_error(400, f"prompt_logprobs must be an int in [1, {max_top_k}] (the server's --top-k); got {k!r}")
    if float(body.get("temperature", 1.0)) != 1.0:
        raise http_error(400, "this server reports log-probs at temperature 1 only (temper them in the loss)")
    return prompt, k


def serve(
    teacher: str, *, top_k: int, host: str = "127.0.0.1", port: int = 8000, device: str | None = None,
    dtype: str = "auto", max_batch_tokens: int = 16384, log_level: str = "warning",
    attn_implementation: str | None = None, random_weights: bool = False, precision: str = "bf16",
) -> None:  # fmt: skip
    """Load `teacher` (a path or hub name), patch its kernels on GPU, and serve it until interrupted.
    `random_weights` builds the model from its config alone with random weights (seed 0): for benchmarks only.
    `precision="fp8"` runs its decoder products in FP8 (models/fp8_teacher.py)."""
    try:
        import uvicorn
    except ImportError as e:
        raise ImportError("`liger-kd serve` needs FastAPI and uvicorn: pip install 'liger_patch_kd[serve]'") from e
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if random_weights:
        from transformers import AutoConfig

        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(teacher, **extra)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=None if dtype == "auto" else getattr(torch, dtype))
        print("liger-kd serve: RANDOM WEIGHTS (--random-weights), for benchmarks only", flush=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(teacher, dtype=dtype, **extra)
    model = model.to(device).eval().requires_grad_(False)
    if torch.device(device).type == "cuda":
        from ...models import patch_teacher_kernels

        patch_teacher_kernels(model, None)
    if precision == "fp8":
        from ...models import quantize_teacher_fp8

        summary = quantize_teacher_fp8(model)
        print(f"liger-kd serve: FP8 teacher, {len(summary.quantized)} products quantised, lm_head in bf16", flush=True)
    app = build_app(model, top_k=top_k, model_name=teacher, max_batch_tokens=max_batch_tokens)
    print(f"liger-kd serve: {teacher} on {device}, top-{top_k}, http://{host}:{port}", flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
