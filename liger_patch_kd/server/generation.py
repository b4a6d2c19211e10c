"""`liger-kd serve` as a rollout engine: vLLM's generation and weight-update endpoints answered with the HF model,
so the on-policy trainer's engine path (trainer/rollouts/engine.py) runs, and is tested, without vLLM.

    POST /v1/completions (no prompt_logprobs)  sample completions of token-id prompts, vLLM / OpenAI's reply
    POST /v1/load_lora_adapter                  vLLM's runtime LoRA loading: {"lora_name", "lora_path"}
    POST /v1/unload_lora_adapter                {"lora_name"}
    POST /update_weights_from_disk              full weights from safetensors files: {"model_path"} (SGLang's route)
    POST /init_weight_transfer_engine ...       full weights broadcast by the trainer: vLLM's weight-transfer routes
                                                (weight_receiver.py)

Sampling: `n` completions per prompt (choice index = prompt * n + j, as vLLM numbers them), `temperature` (0:
greedy), `top_p`, `top_k` (-1 or 0: off), `max_tokens` (default 16, as OpenAI's), `seed` (the same request with the
same seed and weights gives the same completions: one request samples alone, from a generator seeded with it),
`stop_token_ids`, `allowed_token_ids` (only 0 .. k-1: what a padded head's trainer sends); a completion ends at the
model's EOS (generation_config / config eos_token_id) or a stop id, which
it keeps (finish_reason "stop"), or after max_tokens ("length"). `logprobs` (an int K >= 0, at most --top-k) returns,
per sampled token, its log-prob and the top K, in OpenAI's completion layout; tokens are named "token_id:<id>" (vLLM's
--return-tokens-as-token-ids convention: the server has no tokenizer, and `text` is ""). The log-probs are those of
the model's own distribution (float32 log_softmax of its logits: temperature 1, before top-k / top-p), which is what
vLLM returns by default (--logprobs-mode raw_logprobs), and what an importance ratio against the trainer's student
at temperature 1 needs; with `allowed_token_ids` they are normalised over those ids (the distribution sampled, as
the student's log q over kd_vocab_size is), where vLLM's raw log-probs span the whole head. `return_token_ids:
true` adds each choice's `prompt_token_ids` and `token_ids`, as vLLM does. Any other field is refused with a 400
naming it unless it is taken at its "off" value or has no bearing on the reply (request_fields.py: an allow-list).

Weights: full weights arrive from safetensors files in a directory the server can read (SGLang's route), or broadcast
by the trainer over vLLM's weight-transfer routes (weight_receiver.py: the same control plane as vLLM's, a
torch.distributed group as the data plane). Every tensor must name a parameter or buffer of the model with its shape
and a dtype of its kind, with finite values (400 otherwise, before any weight changes: weight_updates.py); each
update bumps `weight_version` (in /health and the reply). `weights_id` (in /health, the update replies, each
completion reply and, as its version, each hidden-states reply and head) names the weights across restarts: a
random id drawn at each server start (high 32 bits) and weight_version (low 32), so a restarted server at version
0 again is told from the one before it. A LoRA adapter that fails to load leaves the model as it
was (adapters.py). An adapter is used by a request whose `model` is its lora_name, the base model by one with the
served model's name or none; another name is a 404, as in vLLM, on every route (GenerationEngine.adapter_of). The
model is used by one request at a time (a lock shared with the teacher scoring, which runs with the adapter its
`model` names on, or with adapters off: GenerationEngine.using). A reply never carries a NaN or infinite log-prob:
the model's output that holds one is a 500 naming it (validation.nonfinite_output), not tokens drawn from NaN.

A generation whose client has hung up stops: the endpoint sets the request's cancellation event (disconnects.py)
and the decode loop, plain or captured, ends at its next step with generation.Cancelled, releasing the lock; a
request still waiting for the lock when its client leaves never runs. /health counts them (generations_cancelled).
"""

# no `from __future__ import annotations`: FastAPI resolves the endpoint annotations

import json
import math
import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..generation import (
    Cancelled,
    Sampling,
    decode_forward_options,
    filtered_scores,
    left_padded,
    packed_decode_attention,
    prefill_mask,
    stop_if_cancelled,
)
from ..wire.conventions import is_int
from .adapters import attach_adapter, read_adapter
from .captured_sampling import captured_sample
from .request_fields import check_fields
from .validation import Limits, RequestError, check_prompts, check_sampling, nonfinite_output, token_prompts
from .weight_updates import check_finite, check_update, read_safetensors

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
LOCK_POLL_S = 0.05  # how often a request waiting for the model looks whether its client is still there


@dataclass(frozen=True)
class GenerationRequest:
    prompts: list[list[int]]
    n: int
    temperature: float
    top_p: float
    top_k: int  # 0: off
    max_tokens: int
    seed: int | None
    logprobs: int | None
    stop_ids: tuple[int, ...]
    return_token_ids: bool
    model: str | None
    allowed: int | None = None  # allowed_token_ids as range(allowed) (a padded head's real ids); None: every id


def wants_generation(body: Any) -> bool:
    """A /v1/completions body without prompt_logprobs asks for completions (with them: the teacher's scores)."""
    return isinstance(body, dict) and body.get("prompt_logprobs") is None


def validated_generation(body: dict, limits: Limits) -> GenerationRequest:
    """A generation body -> GenerationRequest, or RequestError(400 / 413) naming the field."""
    prompts = token_prompts(body.get("prompt"))
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not is_int(n) or n < 1:
        raise RequestError(400, f"n must be an int >= 1 (completions per prompt); got {json.dumps(n)[:40]}")
    max_tokens = body.get("max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if not is_int(max_tokens) or max_tokens < 1:
        raise RequestError(400, f"max_tokens must be an int >= 1 to generate; got {json.dumps(max_tokens)[:40]}")
    check_sampling(body, skip=("n", "max_tokens", "logprobs"))
    check_fields(body, scoring=False)  # an allow-list: a field vLLM honours and this server does not is a 400
    logprobs = body.get("logprobs")
    if logprobs is not None and not (is_int(logprobs) and 0 <= logprobs <= limits.max_top_k):
        raise RequestError(
            400, f"logprobs must be null or an int in [0, {limits.max_top_k}] (the server's --top-k); got "
                 f"{json.dumps(logprobs)[:40]}"
        )  # fmt: skip
    stop_ids = body.get("stop_token_ids") or []
    if not (isinstance(stop_ids, list) and all(is_int(t) and 0 <= t < limits.vocab_size for t in stop_ids)):
        raise RequestError(400, f"stop_token_ids must be a list of token ids in [0, {limits.vocab_size})")
    return_ids = body.get("return_token_ids", False)
    if not isinstance(return_ids, bool) and return_ids is not None:
        raise RequestError(400, f"return_token_ids must be a boolean; got {json.dumps(return_ids)[:40]}")
    seed = body.get("seed")
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise RequestError(400, f"seed must fit in 64 bits (|seed| < 2**63); got {seed}")
    check_prompts(prompts, limits, new_tokens=max_tokens, copies=n)
    allowed = body.get("allowed_token_ids")
    prefix = isinstance(allowed, list) and allowed and allowed == list(range(len(allowed)))
    if allowed is not None and not (prefix and len(allowed) <= limits.vocab_size):
        raise RequestError(400, f"allowed_token_ids: liger-kd serve takes only the ids 0 .. k-1 (a padded head's real "
                                f"vocabulary), k <= {limits.vocab_size}; got {json.dumps(allowed)[:60]}")  # fmt: skip
    if allowed is not None and logprobs is not None and logprobs > len(allowed):  # a top-K over fewer ids than K
        raise RequestError(400, f"logprobs {logprobs} is more than the {len(allowed)} allowed_token_ids it ranks: ask "
                                f"for logprobs at most {len(allowed)} (the number of allowed ids)")  # fmt: skip
    top_k = body.get("top_k", -1)
    return GenerationRequest(
        prompts=prompts, n=n, temperature=float(body.get("temperature", 1.0)), top_p=float(body.get("top_p", 1.0)),
        top_k=max(top_k, 0), max_tokens=max_tokens, seed=seed, logprobs=logprobs,
        stop_ids=tuple(stop_ids), return_token_ids=bool(return_ids), model=body.get("model"),
        allowed=None if allowed is None else len(allowed),
    )  # fmt: skip


def sample_next(logits: torch.Tensor, req: GenerationRequest, generator: torch.Generator | None) -> torch.Tensor:
    """(rows,) next tokens from (rows, V) float32 logits: greedy, or tempered, top-k and top-p filtered, sampled."""
    # vLLM's allowed_token_ids is a mask before sampling (ids 0 .. allowed - 1; the log-probs stay raw); the filters
    # are the decode engine's (generation.filtered_scores), the draw torch.multinomial on the request's generator
    sampling = Sampling(req.temperature, req.top_k, req.top_p, vocab_limit=req.allowed)
    scores = filtered_scores(logits, sampling)
    if sampling.greedy:
        return scores.argmax(-1)
    return torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(-1)


class GenerationEngine:
    """The served model as a sampler, plus its adapters and weight updates (see the module docstring)."""

    def __init__(
        self, model: torch.nn.Module, model_name: str, lock: "threading.Lock | None" = None,
        fuse_projections: bool = True,
    ) -> None:  # fmt: skip
        self.model, self.model_name = model, model_name
        # the captured sampler's q/k/v and gate/up as one product each (generation/fused_projections.py), as the
        # in-process rollouts run: a copy of those weights kept with the decode session, refreshed every request
        self.fuse_projections = fuse_projections
        self.lock = lock or threading.Lock()
        self.generations_cancelled = 0  # generations stopped or never run because their client hung up
        self.counter_lock = threading.Lock()  # the count is bumped from worker threads, some outside `lock`
        self.device = next(model.parameters()).device
        self.adapters: dict[str, str] = {}  # lora_name -> lora_path
        self.peft = None  # the PeftModel around `model` while adapters are loaded (its layers sit in `model`)
        self.weight_version = 0
        self.instance = secrets.randbits(32)  # this start's: a restart (version 0 again) gets another weights_id
        gen = getattr(model, "generation_config", None)
        eos = [getattr(gen, "eos_token_id", None), getattr(model.config.get_text_config(), "eos_token_id", None)]
        self.eos_ids = {t for e in eos for t in (e if isinstance(e, list) else [e]) if t is not None}
        pad = getattr(gen, "pad_token_id", None)
        self.pad_id = pad if pad is not None else min(self.eos_ids, default=0)

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` field names (None: the base model), or RequestError(404) for a name
        this server does not serve: vLLM's answer too, never another model silently, on every route."""
        if model not in (None, self.model_name, *self.adapters):
            served = [self.model_name, *self.adapters]
            raise RequestError(404, f"model: the model {model!r} does not exist here; this server serves {served}: "
                                    f"name one of them, or leave model out")  # fmt: skip
        return model if model in self.adapters else None

    @property
    def weights_id(self) -> int:
        """The weights served, across restarts (see the module docstring): read under `lock` to pair it with a
        forward; 2**32 updates would wrap the version, which no run makes."""
        return self.instance << 32 | self.weight_version & 0xFFFFFFFF

    def health_fields(self) -> dict[str, int]:
        """What /health reports of the engine: the weights served and the generations cancelled."""
        return {**self.weights_fields(), "generations_cancelled": self.generations_cancelled}

    def weights_fields(self, weights_id: int | None = None) -> dict[str, int]:
        """`weight_version` and `weights_id` as the replies name them: those of `weights_id` (an update's, read under
        the lock with it), else of the current weights, read once so that both fields name the same weights."""
        weights_id = self.weights_id if weights_id is None else weights_id
        return {"weight_version": weights_id & 0xFFFFFFFF, "weights_id": weights_id}

    @contextmanager
    def using(self, adapter: str | None = None, cancel: threading.Event | None = None):
        """The model to itself, with `adapter` on (None: adapters off): the teacher scoring path's guard. An
        adapter unloaded since the request was checked is a 404 here, under the lock (never the base instead).
        `cancel` set while waiting for the lock (the client hung up): Cancelled, and the model is not taken."""
        if cancel is None:
            self.lock.acquire()
        else:
            while not self.lock.acquire(timeout=LOCK_POLL_S):
                stop_if_cancelled(cancel)
        try:
            stop_if_cancelled(cancel)  # set while this request waited: nothing of it runs
            self.adapter_of(adapter)
            self._select(adapter)
            yield
        finally:
            self.lock.release()

    def _select(self, adapter: str | None) -> None:
        """Turn the LoRA layers PEFT injected into the model on (with `adapter` active) or off."""
        if self.peft is None:
            return
        if adapter is None:
            self.peft.base_model.disable_adapter_layers()
        else:
            self.peft.base_model.enable_adapter_layers()
            self.peft.set_adapter(adapter)

    # ------------------------------------------------------------------------------------------- sampling
    def complete(self, req: GenerationRequest, cancel: threading.Event | None = None) -> dict[str, Any]:
        """The /v1/completions reply for `req` (runs in a worker thread); Cancelled, the lock released, once
        `cancel` is set (the client hung up): before the model is taken, or at the next decode step."""
        adapter = self.adapter_of(req.model)
        try:
            with self.using(adapter, cancel), torch.no_grad(), packed_decode_attention():  # no grouped-query copy
                rows = [p for p in req.prompts for _ in range(req.n)]
                generator = None
                if req.seed is not None:
                    generator = torch.Generator(self.device).manual_seed(req.seed)
                tokens, logprobs, tops = self._sample(rows, req, generator, cancel)
                weights_id = self.weights_id  # the weights that sampled: the trainer checks them against its push
        except Cancelled:
            with self.counter_lock:
                self.generations_cancelled += 1
            raise
        values = [v for row in logprobs for v in row] + [v for row in tops for entry in row for v in entry.values()]
        if not all(map(math.isfinite, values)):  # NaN logits: greedy picks id 0 from them, and JSON cannot carry NaN
            raise nonfinite_output("the model's log-probs of the sampled tokens")
        choices = []
        for index, (prompt, toks, lps, top) in enumerate(zip(rows, tokens, logprobs, tops)):
            stopped = bool(toks) and (toks[-1] in self.eos_ids or toks[-1] in req.stop_ids)
            choice = {
                "index": index, "text": "", "logprobs": None, "finish_reason": "stop" if stopped else "length",
                "stop_reason": toks[-1] if stopped and toks[-1] not in self.eos_ids else None,
            }  # fmt: skip
            if req.logprobs is not None:
                choice["logprobs"] = {
                    "text_offset": [0] * len(toks), "token_logprobs": lps, "tokens": [f"token_id:{t}" for t in toks],
                    "top_logprobs": top,
                }  # fmt: skip
            if req.return_token_ids:
                choice["prompt_token_ids"], choice["token_ids"] = prompt, toks
            choices.append(choice)
        prompt_tokens, completion_tokens = sum(map(len, rows)), sum(map(len, tokens))
        return {
            "id": f"cmpl-{time.monotonic_ns()}", "object": "text_completion", "created": int(time.time()),
            "model": adapter or self.model_name, "choices": choices, "weights_id": weights_id,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }  # fmt: skip

    def _sample(
        self, rows: list[list[int]], req: GenerationRequest, generator: torch.Generator | None,
        cancel: threading.Event | None = None,
    ):  # fmt: skip
        """Left-padded rows decoded together with the model's KV cache; per row the sampled tokens (up to and with
        the first stop id), their raw log-probs and, when asked, the top-`req.logprobs` of each position.
        Cancelled at the first step that finds `cancel` set (the cache is this call's own: nothing to undo)."""
        if (captured := captured_sample(self, rows, req, cancel)) is not None:  # the captured decode step (on CUDA)
            return captured
        ids, mask = left_padded(rows, self.pad_id, device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        stop = torch.tensor(sorted(self.eos_ids | set(req.stop_ids)), dtype=torch.long, device=self.device)
        done = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        tokens, logprobs, tops = [[] for _ in rows], [[] for _ in rows], [[] for _ in rows]
        past, step_ids = None, ids
        for _ in range(req.max_tokens):
            stop_if_cancelled(cancel)
            # the prefill's mask leaves no padding row fully masked (eager float64: NaN otherwise; generation/padding)
            step_mask = prefill_mask(self.model, mask) if past is None else mask
            out = self.model(input_ids=step_ids, attention_mask=step_mask, position_ids=positions, use_cache=True,
                             logits_to_keep=1, **({} if past is None else {past[0]: past[1]}),
                             **decode_forward_options(self.model))  # fmt: skip
            # transformers 5.2x renames past_key_values to cache (the old name warns, then goes): the output says
            # which this version speaks (a patched model's forward signature would not)
            key = next((k for k in ("cache", "past_key_values") if out.get(k) is not None), None)
            if key is None:
                raise RuntimeError(f"{type(self.model).__name__} returned no KV cache (use_cache=True)")
            past, logits = (key, out[key]), out.logits[:, -1].float()
            # over the ids that may be sampled: a padded head's extra rows are no part of the behaviour policy
            raw = (logits if req.allowed is None else logits[..., : req.allowed]).log_softmax(-1)
            nxt = sample_next(logits, req, generator)
            own = raw.gather(-1, nxt[:, None]).squeeze(-1).tolist()
            top = raw.topk(req.logprobs, dim=-1) if req.logprobs else None
            for r in (~done).nonzero().flatten().tolist():
                t = int(nxt[r])
                tokens[r].append(t)
                logprobs[r].append(own[r])
                if req.logprobs is not None:
                    entry = {f"token_id:{t}": own[r]}
                    if top is not None:
                        pairs = zip(top.indices[r].tolist(), top.values[r].tolist())
                        entry.update({f"token_id:{i}": v for i, v in pairs})
                    tops[r].append(entry)
            done |= torch.isin(nxt, stop)
            if bool(done.all()):
                break
            step_ids = torch.where(done, self.pad_id, nxt)[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            positions = positions[:, -1:] + 1
        return tokens, logprobs, tops

    # -------------------------------------------------------------------------------------------- updates
    def load_adapter(self, body: Any) -> str:
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        if name == self.model_name:
            raise RequestError(400, f"lora_name {name!r} is the base model's name; choose another")
        if name in self.adapters:
            raise RequestError(400, f"the LoRA adapter {name!r} has already been loaded; unload it first, or load it "
                                    f"under a new lora_name")  # fmt: skip
        if not (Path(path) / "adapter_config.json").is_file():
            raise RequestError(400, f"lora_path {path!r} holds no adapter_config.json: save the adapter with PEFT's "
                                    f"save_pretrained into a directory this server can read")  # fmt: skip
        state = read_adapter(path)  # read and checked whole before anything is injected
        with self.lock:
            self.peft = attach_adapter(self.model, self.peft, name, path, state)
            self.adapters[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_adapter(self, body: Any) -> str:
        name = _field(body, "lora_name")
        if name not in self.adapters:
            raise RequestError(400, f"no LoRA adapter {name!r} is loaded (loaded: {sorted(self.adapters)})")
        with self.lock:
            del self.adapters[name]
            if self.adapters:
                self.peft.delete_adapter(name)
            else:  # the last one: the LoRA layers go, the model's own modules (and tensor names) come back
                self.peft.unload()
                self.peft = None
        return f"Success: LoRA adapter '{name}' removed successfully."

    def update_weights_from_disk(self, body: Any) -> dict[str, Any]:
        path = _field(body, "model_path")
        count, weights_id = self.apply_state(read_safetensors(path, self.check_state))
        return {"success": True, "message": f"updated {count} tensors from {path}", "num_tensors": count,
                **self.weights_fields(weights_id)}  # fmt: skip

    def check_state(self, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Refuse (400) an update of these (shape, dtype) tensors before any weight changes (weight_updates.py)."""
        if self.adapters:
            raise RequestError(400, f"LoRA adapters {sorted(self.adapters)} are loaded: unload them before a "
                                    f"full-weight update (their layers rename the model's tensors)")  # fmt: skip
        check_update(self.model, tensors)

    def apply_state(self, state: dict[str, torch.Tensor]) -> tuple[int, int]:
        """Copy `state` into the model, all tensors or none (checked first), and bump weight_version; the count and
        the weights_id of these weights, read under the lock: the trainer takes it from the update's reply, and one
        read after the lock is released could already name another update's weights."""
        with self.lock, torch.no_grad():  # checked under the lock: no adapter comes or goes in between
            self.check_state({name: (tuple(t.shape), t.dtype) for name, t in state.items()})
            check_finite(self.model, state)
            own = self.model.state_dict()
            for name, tensor in state.items():
                own[name].copy_(tensor.to(device=own[name].device, dtype=own[name].dtype))
            self.weight_version += 1
            weights_id = self.weights_id
        return len(state), weights_id


def _field(body: Any, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise RequestError(400, f"{name} must be a non-empty string; got {json.dumps(value)[:60]}")
    return value


def add_generation_routes(app: Any, engine: GenerationEngine, error: Any) -> None:
    """The adapter and weight-update routes on the FastAPI `app` (`error(status, message)` builds the refusal)."""
    import asyncio

    from fastapi import Request
    from fastapi.responses import JSONResponse, PlainTextResponse

    from .validation import CONTROL_BODY_BYTES, parse_body, read_body
    from .weight_receiver import WeightReceiver, add_weight_transfer_routes

    def route(path: str, method, reply, run=None):
        """POST `path`: `method(body)` in a worker thread, or through `run(path, method, body)` when given."""

        async def endpoint(request: Request):
            try:
                raw = await read_body(request, CONTROL_BODY_BYTES, "send the route's JSON object alone")
                body = parse_body(raw) if raw.strip() else None
                result = await (asyncio.to_thread(method, body) if run is None else run(path, method, body))
            except RequestError as e:
                return error(e.status, e.message)
            return reply(result)

        app.post(path)(endpoint)

    route("/v1/load_lora_adapter", engine.load_adapter, PlainTextResponse)
    route("/v1/unload_lora_adapter", engine.unload_adapter, PlainTextResponse)
    route("/update_weights_from_disk", engine.update_weights_from_disk, JSONResponse)
    add_weight_transfer_routes(route, WeightReceiver(engine), JSONResponse)
