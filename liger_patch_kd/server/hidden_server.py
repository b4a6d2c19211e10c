"""`liger-kd serve`'s exact-teacher routes (the wire format: wire/hidden_wire.py):

    POST /v1/hidden_states  {"prompt": [[ids], ...], "dtype": "auto" | "bf16" | "fp32" | "fp8"}: the teacher's final
                            hidden states, binary, each reply naming the weights it was computed with
    GET  /v1/head           the lm_head (weight, bias, soft-cap, vocab_size) of the current weights

The "version" both carry is the engine's weights_id (generation.py): this server start's random id and its weight
version, so a client's cached head is fetched again after a weight update and after a restart (which starts at
version 0 again, possibly with other weights).

The hidden states are what the in-process fused loss takes from a teacher: the teacher's KD forward gives them to
a request (models.kd_forward.call_teacher's path: after the final norm, the logit scale folded in), so a student
trained on them trains on the in-process objective. Requests are batched like the top-k ones (TeacherBatcher: up to
--max-batch-tokens padded tokens a forward, --batch-invariant runs each alone), checked whole first (400 naming the
field, 413 over --max-request-tokens), behind the app's --api-key; the forward holds the model's lock, so a weight
update (generation.py) never lands inside one, and the version in its reply is the one it ran with.

SGLang's `return_hidden_states` is not spoken: SGLang answers meta_info.hidden_states as JSON floats (about 10
bytes a value, and their parse dominates at H = 4096), per prompt and then per generated token, and serves no head;
a student would need the teacher's checkpoint beside it to get W. The liger route sends H x 2 bytes a token and the
head it was computed with.
"""

# no `from __future__ import annotations`: FastAPI resolves the endpoint annotations

import asyncio
import json
import logging
import threading

import torch

from ..models import HeadRequest, scaled_head_inputs
from ..models.kd_forward import install_kd_forward
from ..wire.hidden_wire import HEAD_PATH, HIDDEN_PATH, WIRE_DTYPES, TeacherHead, encode_head, encode_hidden, wire_dtype
from ..wire.protocols import BINARY_MEDIA_TYPE
from .validation import Limits, RequestError, check_prompts, nonfinite_output, parse_body, read_body, token_prompts

log = logging.getLogger("liger_patch_kd.serve")
_FIELDS = ("prompt", "dtype", "model")


def hidden_batcher(base: type, model, engine, max_batch_tokens: int, batch_invariant: bool):
    """A `base` (app.TeacherBatcher, passed in: app.py registers these routes, so importing it here would be
    a cycle) whose forward returns, per sequence, (its final hidden states (T, H) on the CPU in the teacher's dtype,
    the weight version they were computed with)."""

    class HiddenBatcher(base):
        task: asyncio.Task | None = None

        async def hidden(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, int]]:
            if self.task is None:  # started on first use: the app's lifespan belongs to app.py
                self.task = asyncio.create_task(self.run())
            return await self._wait(sequences, None)

        def _forward(self, batch) -> list:
            with self.guard(), torch.no_grad():
                version = engine.weights_id  # under the model's lock: no update lands until the forward ends
                groups = [[p] for p in batch] if self.batch_invariant else [batch]
                out = []
                for items in groups:
                    ids, mask, lengths = self._padded(items)
                    hidden = _final_hidden(self.model, ids, mask).cpu()
                    if not all(torch.isfinite(hidden[row, :n]).all() for row, n in enumerate(lengths)):
                        raise nonfinite_output("the teacher's final hidden states")  # a 500, never sent as data
                    out += [(hidden[row, :n].clone(), version) for row, n in enumerate(lengths)]
            return out

    return HiddenBatcher(model, 1, max_batch_tokens, batch_invariant, guard=engine.using)


def _final_hidden(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The (B, T, H) hidden states the teacher's KD forward hands the fused loss (kd_forward.call_teacher)."""
    kept = {}
    request = HeadRequest(lambda h, w, b, c: kept.update(h=h))
    model(input_ids=ids, attention_mask=mask, use_cache=False, kd_head_request=request)
    return kept["h"]


class HeadCache:
    """The head at the current weight version, read once per version (under the model's lock) and kept encoded."""

    def __init__(self, model, engine, vocab_size: int | None) -> None:
        self.model, self.engine, self.vocab_size = model, engine, vocab_size
        self.lock = threading.Lock()
        self.encoded: tuple[int, bytes] | None = None

    def current(self) -> bytes:
        with self.lock:
            if self.encoded is None or self.encoded[0] != self.engine.weights_id:
                head = self.read()
                self.encoded = (head.version, encode_head(head))
            return self.encoded[1]

    def read(self) -> TeacherHead:
        kept = {}
        with self.engine.using(), torch.no_grad():
            version = self.engine.weights_id
            ids = torch.zeros((1, 1), dtype=torch.long, device=self.engine.device)
            self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                       kd_head_request=HeadRequest(lambda h, w, b, c: kept.update(w=w, b=b, c=c)))  # fmt: skip
            scale = float(scaled_head_inputs(self.model, torch.ones(()), None)[0])
            weight = kept["w"].detach().cpu().clone()
            bias = None if kept["b"] is None else kept["b"].detach().cpu().clone()
        if not (torch.isfinite(weight).all() and (bias is None or torch.isfinite(bias).all())):
            raise nonfinite_output("the teacher's lm_head weights")  # every log-prob made with it would be NaN
        return TeacherHead(version, weight, bias, kept["c"], self.vocab_size, scale)


def validated_hidden(body, limits: Limits, engine) -> tuple[list[list[int]], str]:
    """A /v1/hidden_states body -> (prompts, dtype name), or RequestError naming the field. `model` names the base
    model or nothing: an adapter is a 400 (the head served is the base model's, so an adapter's hidden states
    would not make its log-probs), another name a 404 (engine.adapter_of), as the other routes answer."""
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body is a JSON {type(body).__name__}, not an object")
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise RequestError(400, f"{unknown[0]} is not a field of {HIDDEN_PATH}; it takes {list(_FIELDS)}")
    prompts = token_prompts(body.get("prompt"))
    check_prompts(prompts, limits)
    dtype = body.get("dtype", "auto")
    if dtype not in WIRE_DTYPES:
        raise RequestError(400, f"dtype must be one of {list(WIRE_DTYPES)}; got {json.dumps(dtype)[:40]}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(400, f"model must be a string; got {json.dumps(model)[:40]}")
    if engine.adapter_of(model) is not None:
        raise RequestError(400, f"model {model!r} is a LoRA adapter: {HIDDEN_PATH} serves the base model's hidden "
                                f"states only (its head is the base's); leave model out, or score with "
                                f"/v1/completions")  # fmt: skip
    return prompts, dtype


def add_hidden_routes(
    app, model, engine, limits: Limits, error, *, batcher_type: type, max_batch_tokens: int, batch_invariant: bool
):
    """The two routes on the FastAPI `app` (`error(status, message)` builds a refusal; `batcher_type`: the top-k
    routes' batcher, app.TeacherBatcher, whose queue and padding these share). A teacher whose architecture
    the KD forward does not know answers them 400, naming why; its other routes are unaffected."""
    from fastapi import Request
    from fastapi.responses import Response

    try:
        install_kd_forward(model)
        refused = None
    except ValueError as e:
        refused = f"this teacher cannot serve its hidden states: {e}"
    batcher = hidden_batcher(batcher_type, model, engine, max_batch_tokens, batch_invariant)
    config = model.config.get_text_config()
    heads = HeadCache(model, engine, getattr(config, "vocab_size", None))
    app.state.hidden_batcher = batcher
    teacher_dtype = next(model.parameters()).dtype

    @app.post(HIDDEN_PATH)
    async def hidden_states(request: Request) -> Response:
        try:
            if refused:
                raise RequestError(400, refused)
            raw = await read_body(request, limits.max_body_bytes)  # bounded as /v1/completions: no client OOMs us
            prompts, dtype = validated_hidden(parse_body(raw), limits, engine)
        except RequestError as e:
            return error(e.status, e.message)
        try:
            results = await batcher.hidden(prompts)
            versions = {v for _, v in results}
            if len(versions) > 1:  # split across forwards around a weight update: one version per reply
                results = await batcher.hidden(prompts)  # both after the update now (updates are rare)
                versions = {v for _, v in results}
            if len(versions) > 1:
                raise RuntimeError(f"the weights changed twice during one request (versions {sorted(versions)})")
            blob = encode_hidden([h for h, _ in results], prompts, wire_dtype(dtype, teacher_dtype), versions.pop())
        except Exception as e:  # a fault of the server: 500, which clients retry
            log.exception("the teacher forward failed")
            return error(500, f"the teacher forward failed: {type(e).__name__}: {e}")
        return Response(blob, media_type=BINARY_MEDIA_TYPE)

    @app.get(HEAD_PATH)
    async def head() -> Response:
        if refused:
            return error(400, refused)
        try:
            blob = await asyncio.to_thread(heads.current)
        except Exception as e:
            log.exception("reading the head failed")
            return error(500, f"reading the head failed: {type(e).__name__}: {e}")
        return Response(blob, media_type=BINARY_MEDIA_TYPE)
