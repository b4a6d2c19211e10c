"""Where a generated step's completions come from: the student in this process (rollouts.generate_rollouts), or an
inference engine at `kd_generation_url` speaking vLLM's /v1/completions (vLLM itself, or `liger-kd serve`).

The engine is asked for token-id prompts with `n` = kd_num_generations, the step's sampling settings, a seed per
call (rollouts.call_seed: the same seed gives the same completions), `logprobs: 0` and `return_token_ids: true`,
and answers each completion's token ids and the log-prob of each sampled token under the weights it sampled with
(the behaviour policy). Before a step's rollouts the student's weights reach the engine when `kd_sync_steps` steps
have passed since the last push (weight_sync.py), so a rollout is generated with weights up to kd_sync_steps - 1
steps old: its staleness, logged as kd_rollout_staleness. With kd_async_rollouts = k the requests of the next k
steps are sent while this one trains (asynchronous.py): a rollout is then k to k + kd_sync_steps - 1 steps old
(fewer at the start of an epoch, whose first step is asked for and waited on). The pg loss weighs each token by
min(exp(log q - log b), kd_pg_importance_cap) with the engine's log b (reference.policy_gradient_terms): unbiased
while no ratio exceeds the cap (ratio 1 with fresh weights), bounded where one does; the other losses take stale
rollouts as they come (a warning says so once). A reply that does not fit the request (rollouts_from_reply) is
refused before anything trains on it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

from torch import nn
from transformers.utils import logging

from ...models import unwrap_model
from ...teacher.client.transport import HttpEndpoint, TeacherServerError
from ...wire.conventions import API_KEY_ENV
from ...wire.protocols import TeacherReplyError
from ..arguments import checks_arguments
from .generate import Rollout, RolloutSettings, call_seed, generate_rollouts
from .weight_sender import TRANSPORTS, BroadcastSender
from .weight_sync import EngineWeightsLost, WeightSync

logger = logging.get_logger(__name__)

VLLM_NEG_INF = -9999.0  # how vLLM's OpenAI server writes a log-prob of -inf (JSON has no infinity)
RolloutSource = Callable[..., list[Rollout]]  # (generator, prompts, settings, *, pad_id, eos_ids, start_id, step)
_HINTS = {
    401: " (set kd_generation_api_key, or LIGER_KD_API_KEY, to the engine's --api-key)",
    404: " (the engine lacks this route. vLLM takes a PEFT student's adapter with --enable-lora and "
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, and full weights over its weight-transfer routes: "
    "kd_sync_transport='vllm-nccl', vLLM started with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
    "'{\"backend\": \"nccl\"}'; /update_weights_from_disk is SGLang's and `liger-kd serve`'s)",
}


def in_process_rollouts(generator: nn.Module, prompts: list[list[int]], settings: RolloutSettings, **kw) -> list:
    """The student (or teacher) in this process samples the completions: generate_rollouts."""
    return generate_rollouts(unwrap_model(generator), prompts, settings, **kw)


def rollout_source(args: Any) -> RolloutSource:
    """The source KDTrainingArguments choose: an EngineRollouts for kd_generation_url, else in_process_rollouts."""
    return EngineRollouts(args) if args.kd_generation_url else in_process_rollouts


@checks_arguments(rank=3)
def check_generation_args(args: Any) -> None:
    """KDTrainingArguments' kd_generation_url / kd_sync_steps, validated when the arguments are made."""
    if not isinstance(args.kd_sync_steps, int) or args.kd_sync_steps < 1:
        raise ValueError(
            f"kd_sync_steps must be an int >= 1 (optimizer steps between pushes); got {args.kd_sync_steps!r}"
        )
    if args.kd_sync_transport not in TRANSPORTS:
        raise ValueError(f"kd_sync_transport must be one of {TRANSPORTS}; got {args.kd_sync_transport!r}")
    ahead = args.kd_async_rollouts
    if not isinstance(ahead, int) or ahead < 0:  # True is 1
        raise ValueError(f"kd_async_rollouts must be an int >= 0 (optimizer steps whose rollouts are requested ahead; "
                         f"0: the trainer waits for each step's); got {ahead!r}")  # fmt: skip
    args.kd_async_rollouts = ahead = int(ahead)
    if ahead and not args.kd_generation_url:
        raise ValueError(
            f"kd_async_rollouts={ahead} requests rollouts from an engine while the student trains, and no engine is "
            f"set: give kd_generation_url (vLLM or `liger-kd serve`), or leave kd_async_rollouts=0 (in process the "
            f"student generates with the weights it trains)"
        )
    if not args.kd_generation_url:
        return
    if not str(args.kd_generation_url).startswith(("http://", "https://")):
        raise ValueError(f"kd_generation_url must be an http(s) URL; got {args.kd_generation_url!r}")
    if args.kd_sync_dir is not None and not os.path.isdir(args.kd_sync_dir):
        raise ValueError(f"kd_sync_dir {args.kd_sync_dir!r} is not a directory: create it (on a filesystem the engine "
                         f"reads too), or leave it None for the system's temporary directory")  # fmt: skip
    if args.kd_teacher_tokenizer:
        raise ValueError("kd_generation_url with a teacher of another tokenizer (kd_teacher_tokenizer) is not "
                         "supported yet: generate in process (leave kd_generation_url unset)")  # fmt: skip
    if args.kd_seq_kd:
        raise ValueError(
            "kd_generation_url serves the student's rollouts (its weights synced every kd_sync_steps); sequence-level "
            "KD (kd_seq_kd) samples from the teacher in this process: leave kd_generation_url unset"
        )
    if args.kd_lmbda <= 0:
        raise ValueError(f"kd_generation_url generates on-policy steps, and kd_lmbda={args.kd_lmbda} makes none: set "
                         f"kd_lmbda > 0 or leave kd_generation_url unset")  # fmt: skip
    if args.world_size > 1:
        raise ValueError(
            f"kd_generation_url with {args.world_size} processes is not supported yet (each would push its own shard "
            f"of the weights); run one process, or generate in process (leave kd_generation_url unset)"
        )


class EngineRollouts:
    """Completions from the engine at args.kd_generation_url; the student reaches it every args.kd_sync_steps."""

    def __init__(self, args: Any) -> None:
        api_key = args.kd_generation_api_key or args.kd_teacher_api_key or os.environ.get(API_KEY_ENV) or None
        self.http = HttpEndpoint(
            args.kd_generation_url, timeout=args.kd_teacher_timeout, retries=args.kd_teacher_retries, api_key=api_key,
            what="the generation engine", needed="rollouts", hints=_HINTS,
        )  # fmt: skip
        sender = None if args.kd_sync_transport == "disk" else BroadcastSender(self.http, args.kd_sync_transport)
        self.sync = WeightSync(self.http, args.kd_sync_steps, args.kd_sync_dir, sender)
        self.vocab_size: int | None = None
        self._allowed: int | None = None
        self.staleness: list[int] = []  # per generated step: steps since the engine's weights were the student's
        self._served_name: str | None = None
        self.ahead = args.kd_async_rollouts  # steps ahead the rollouts are requested (asynchronous.py)
        self.pg = args.kd_onpolicy_loss == "pg"  # weighs each token by the engine's log-prob: every one needed
        self._warned = self.pg or (args.kd_sync_steps == 1 and not self.ahead)

    def __call__(
        self, generator: nn.Module, prompts: list[list[int]], settings: RolloutSettings, *, pad_id: int,
        eos_ids: set[int], start_id: int, step: int = 0,
    ) -> list[Rollout]:  # fmt: skip
        """Step `step`'s rollouts, now: the student pushed first when kd_sync_steps say so, and again when the
        engine answers with other weights than the last push's (it restarted between pushes)."""
        if self.sync.due(step):
            self.sync.push(generator, step)
        staleness, request = self.ask(generator, prompts, settings, eos_ids=eos_ids, start_id=start_id, step=step)
        try:
            rollouts = request()
        except EngineWeightsLost as lost:
            logger.warning(f"{lost}; pushing the student's weights again (step {step})")
            self.sync.engine_lost()  # nothing of ours is on it: load afresh, unload nothing
            self.sync.push(generator, step)  # the weights this step starts with: staleness 0
            staleness, request = self.ask(generator, prompts, settings, eos_ids=eos_ids, start_id=start_id, step=step)
            rollouts = request()  # lost again: the engine keeps changing under this run, which stops
        self.staleness.append(staleness)
        return rollouts

    def ask(
        self, generator: nn.Module, prompts: list[list[int]], settings: RolloutSettings, *, eos_ids: set[int],
        start_id: int, step: int,
    ) -> tuple[int, Callable[[], list[Rollout]]]:  # fmt: skip
        """(staleness, request) for step `step`'s rollouts: the steps between `step` and the weights the engine holds
        once the pushes made or staged so far are loaded, and a callable sending the requests (now, or from the
        asynchronous worker after those loads: asynchronous.py) and returning the rollouts, prompt-major."""
        staleness = step - self.sync.synced_step
        if staleness and not self._warned:
            logger.warning(
                f"on-policy rollouts from the engine are {staleness} steps stale here (kd_sync_steps="
                f"{self.sync.every}, kd_async_rollouts={self.ahead}: up to {self.sync.every - 1 + self.ahead}); only "
                f"kd_onpolicy_loss='pg' corrects for that (importance ratio to the engine's log-probs), the "
                f"divergence and k1 / k3 losses train off-policy by that many steps"
            )
            self._warned = True
        if self.vocab_size is None:  # the real ids: a head padded past them (kd_vocab_size) never samples its extras
            head_rows = unwrap_model(generator).get_output_embeddings().weight.shape[0]
            self.vocab_size = min(head_rows, settings.vocab_size or head_rows)
            self._allowed = self.vocab_size if self.vocab_size < head_rows else None
        model, vocab_size, allowed, pg = self.sync.model_name, self.vocab_size, self._allowed, self.pg
        rows = [p if p else [start_id] for p in prompts]
        per_call = settings.batch_size or len(rows)

        def request() -> list[Rollout]:
            name_asked = model or self._base_name()
            out: list[Rollout] = []
            for call, first in enumerate(range(0, len(rows), per_call)):
                chunk = rows[first : first + per_call]
                seed = call_seed(settings.seed, step, call)
                body = completion_request(chunk, settings, name_asked, seed, eos_ids, allowed)
                name = f"step {step} call {call} to {self.http.url}/v1/completions"
                raw = self._complete(body, model, name)
                reply = _json(raw, name)
                self._check_weights(reply, name)
                out += rollouts_from_reply(reply, chunk, settings, eos_ids, vocab_size, name, need_logprobs=pg)
            return out

        return staleness, request

    def close(self) -> None:
        self.sync.close()

    def _complete(self, body: dict, adapter: str | None, request: str) -> bytes:
        """POST /v1/completions; a 404 for a request naming this run's LoRA adapter is EngineWeightsLost: the engine
        loaded it and now lacks it, so it restarted (or another process unloaded it), and loading it again fixes
        that as a full-weight push does; the route-missing hint of a plain 404 would mislead here."""
        try:
            raw, _ = self.http.post_json("/v1/completions", body)
        except TeacherServerError as e:
            if adapter is None or e.status != 404:
                raise
            raise EngineWeightsLost(
                f"{request}: the engine no longer holds this run's LoRA adapter {adapter!r} (HTTP 404: it restarted, "
                f"or another process unloaded it); restart the run if the engine keeps losing it"
            ) from e
        return raw

    def _check_weights(self, reply: Any, request: str) -> None:
        """EngineWeightsLost unless the reply's weights_id is the one the engine reported for this run's last push:
        rollouts of other weights never count as the student's. An engine that reported none (vLLM) is unchecked;
        once one has, a reply naming none is not trusted either (a gateway dropping the field, another engine
        behind the URL): its weights cannot be told from a restarted engine's. Read when the reply arrives, so
        asynchronous rollouts compare against the loads run before."""
        said, held = reply.get("weights_id") if isinstance(reply, dict) else None, self.sync.engine_weights
        if held is None or said == held:
            return
        if not isinstance(said, int) or isinstance(said, bool):
            raise EngineWeightsLost(
                f"{request}: the reply carries no weights_id though the engine reported {held:#x} for this run's last "
                f"push, so its rollouts cannot be told from other weights'; let a proxy / gateway pass the field "
                f"through, or point kd_generation_url at the engine itself"
            )
        raise EngineWeightsLost(
            f"{request}: the engine answered with weights_id {said:#x}, not {held:#x} (this run's last push, "
            f"kd_sync_steps): it restarted or another process updated its weights"
        )

    def _base_name(self) -> str:
        if self._served_name is None:
            raw, _ = self.http.send("GET", "/v1/models", None, "application/json")
            try:
                self._served_name = _json(raw, f"{self.http.url}/v1/models")["data"][0]["id"]
            except (KeyError, IndexError, TypeError) as e:
                raise TeacherReplyError(f"{self.http.url}/v1/models lists no model ({raw[:200]!r})") from e
        return self._served_name


def completion_request(
    prompts: list[list[int]], settings: RolloutSettings, model: str, seed: int, eos_ids: set[int],
    allowed: int | None = None,
) -> dict[str, Any]:
    """vLLM's /v1/completions body for `prompts`: n completions each, the sampled tokens' ids and log-probs (the
    seed folded into 63 bits, what a torch generator takes); `allowed` k: only ids below k are sampled (vLLM's
    allowed_token_ids, for a head padded past the real vocabulary). The penalties and min_p are sent at their
    neutral values: vLLM takes unsent ones from the model's generation_config.json (its default
    --generation-config auto: Qwen2.5-Instruct's repetition_penalty), which would sample another distribution than
    the one the returned log-probs describe, as in process (rollouts.decode.sampling_only)."""
    extra = {} if allowed is None else {"allowed_token_ids": list(range(allowed))}
    return {**extra,
        "model": model, "prompt": prompts, "n": settings.num_generations, "max_tokens": settings.max_new_tokens,
        "temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k or -1,
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0,
        "seed": seed % 2**63, "logprobs": 0, "return_token_ids": True, "stop_token_ids": sorted(eos_ids),
    }  # fmt: skip


def rollouts_from_reply(
    reply: Any, prompts: list[list[int]], settings: RolloutSettings, eos_ids: set[int], vocab_size: int, request: str,
    *, need_logprobs: bool = False,
) -> list[Rollout]:  # fmt: skip
    """The reply's completions as Rollouts, prompt-major (choice index i * n + j is prompt i's j-th), each cut at
    its first EOS (kept) and carrying the engine's log-prob of each of its tokens; TeacherReplyError naming the
    request, the choice and the fix when the reply does not fit it: a choice missing, extra or indexed twice, more
    tokens than max_tokens, a finish_reason other than "stop" / "length", or a log-prob no sampled token can have.

    A completion that ended at an EOS / stop id trains that id as its last scored token, as the in-process rollouts
    do (they keep it): an engine that stopped without returning it (finish_reason "stop", no EOS in token_ids, e.g.
    a first token that is EOS dropped from the reply) gets it appended, with no log-prob, which only the pg loss
    (`need_logprobs`) needs: it refuses such a reply. An empty completion is never a silent row at loss 0."""
    n = settings.num_generations
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or len(choices) != len(prompts) * n:
        got = len(choices) if isinstance(choices, list) else type(choices).__name__
        raise TeacherReplyError(f"{request}: {got} choices for {len(prompts)} prompts x n={n}")
    indices = [c.get("index") if isinstance(c, dict) else None for c in choices]
    if sorted(i for i in indices if isinstance(i, int) and not isinstance(i, bool)) != list(range(len(choices))):
        raise TeacherReplyError(f"{request}: the choices' indices {str(indices)[:80]} are not 0 .. {len(choices) - 1} "
                                f"once each: a completion is missing or repeated")  # fmt: skip
    floor = logprob_floor(settings.temperature)
    out = []
    for i, choice in enumerate(sorted(choices, key=lambda c: c["index"])):
        prompt, where = prompts[i // n], f"{request} choice {i} (prompt {i // n}, completion {i % n})"
        tokens, logprobs = _tokens_and_logprobs(choice, where)
        if choice.get("prompt_token_ids") not in (None, prompt):
            raise TeacherReplyError(f"{where}: prompt_token_ids differ from the prompt sent: the reply is misaligned")
        if len(tokens) > settings.max_new_tokens:
            raise TeacherReplyError(f"{where}: {len(tokens)} tokens for max_tokens={settings.max_new_tokens}: the "
                                    f"engine ignored the request's length (is it another server?)")  # fmt: skip
        bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise TeacherReplyError(f"{where}: token id {bad} outside the student's vocabulary [0, {vocab_size})")
        cut = next((k + 1 for k, t in enumerate(tokens) if t in eos_ids), len(tokens))
        tokens, logprobs = tokens[:cut], logprobs[:cut]
        for k, value in enumerate(logprobs):
            _check_logprob(value, floor, settings.temperature, f"{where}: logprobs.token_logprobs[{k}]")
        finished = bool(tokens) and tokens[-1] in eos_ids
        if not finished:
            stop = _stop_without_token(choice, len(tokens), settings.max_new_tokens, eos_ids, where)
            if stop is not None:
                if need_logprobs:
                    raise TeacherReplyError(
                        f"{where}: the engine stopped at EOS / stop id {stop} without returning it (token_ids "
                        f"{tokens[:8]}), so its log-prob is unknown and kd_onpolicy_loss='pg' cannot weigh it: use an "
                        f"engine that returns the stop token (vLLM does), or another kd_onpolicy_loss"
                    )
                tokens, logprobs, finished = tokens + [stop], None, True
        out.append(Rollout(prompt, tokens, finished, None if logprobs is None else tuple(logprobs)))
    return out


def logprob_floor(temperature: float) -> float:
    """The lowest log-prob (temperature 1, the engine's raw log-softmax) a token sampled at `temperature` can have.

    The sampler (vLLM's, `liger-kd serve`'s) draws from float32 probabilities: a token it draws had probability at
    least 2**-149 (the smallest float32 > 0) among the tokens top-k / top-p kept, whose mass is at least the top
    token's, >= 1 / V; so its log-prob at the sampling temperature T is >= ln 2**-149 - ln V. At temperature 1 that
    is >= T times it for T >= 1 (T * logsumexp(z / T) >= logsumexp(z)), and >= it for T < 1. With V < 2**32 ids:
    log q >= -max(T, 1) * 125.5. A lower value (vLLM writes -inf as -9999.0; -1e30; a fault) is no sampled token's
    log-prob, and one such value makes the pg loss's importance ratio exp(log q - log b) overflow."""
    return -max(temperature, 1.0) * (149 + 32) * math.log(2)


def _check_logprob(value: Any, floor: float, temperature: float, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TeacherReplyError(f"{where} is {str(value)[:40]!r}, not a number: the engine's reply is malformed")
    if value == VLLM_NEG_INF:
        raise TeacherReplyError(f"{where} = -9999.0, vLLM's encoding of -inf: a sampled token cannot have "
                                f"probability 0, so the engine's log-probs are not the sampled tokens' (vLLM: "
                                f"--logprobs-mode raw_logprobs, the default) or it is faulty")  # fmt: skip
    if not (math.isfinite(value) and floor <= value <= 0):
        raise TeacherReplyError(
            f"{where} = {value!r}: a sampled token's log-prob is finite, <= 0 and >= {floor:.1f} (float32 sampling "
            f"at temperature {temperature:g}, engine.logprob_floor): the engine's log-probs are not the sampled "
            f"tokens' raw log-probs, or it is faulty; nothing was trained on this reply"
        )


def _stop_without_token(choice: dict, count: int, max_tokens: int, eos_ids: set[int], where: str) -> int | None:
    """For a completion of `count` tokens with no EOS: None when it ran to max_tokens ("length"), else the EOS /
    stop id the engine stopped at without returning it (its stop_reason, or the one EOS id)."""
    reason = choice.get("finish_reason")
    if reason == "length" and count == max_tokens:
        return None
    if reason != "stop":
        raise TeacherReplyError(
            f"{where}: {count} tokens with no EOS and finish_reason {reason!r} for max_tokens={max_tokens}; a "
            f"completion ends at an EOS / stop id (\"stop\") or after max_tokens tokens (\"length\")"
        )
    if count >= max_tokens:  # the stop id it did not return would be token max_tokens + 1, past the context checked
        raise TeacherReplyError(
            f"{where}: finish_reason 'stop' after {count} tokens (max_tokens={max_tokens}) with no EOS / stop id "
            f"among them: no sampled token ended it; the reply is malformed"
        )
    said = choice.get("stop_reason")
    if isinstance(said, int) and not isinstance(said, bool) and said in eos_ids:
        return said
    if len(eos_ids) == 1:
        return next(iter(eos_ids))
    raise TeacherReplyError(f"{where}: finish_reason 'stop' with no EOS in its {count} tokens and stop_reason "
                            f"{said!r}, one of {sorted(eos_ids)}: which id ended it is unknown")  # fmt: skip


def _tokens_and_logprobs(choice: Any, where: str) -> tuple[list[int], list[Any]]:
    if not isinstance(choice, dict):
        raise TeacherReplyError(f"{where}: a choice is {type(choice).__name__}, not an object")
    info = choice.get("logprobs") or {}
    tokens = choice.get("token_ids")
    if tokens is None and isinstance(info.get("tokens"), list):  # vLLM's --return-tokens-as-token-ids names
        names = info["tokens"]
        if all(isinstance(t, str) and t.startswith("token_id:") and t[9:].isdigit() for t in names):
            tokens = [int(t[9:]) for t in names]
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise TeacherReplyError(
            f"{where}: no token ids in the reply; vLLM >= 0.10.2 sends them for return_token_ids=true (older: start it "
            f"with --return-tokens-as-token-ids)"
        )
    logprobs = info.get("token_logprobs")
    if not isinstance(logprobs, list) or len(logprobs) != len(tokens):
        got = len(logprobs) if isinstance(logprobs, list) else type(logprobs).__name__
        raise TeacherReplyError(
            f"{where}: logprobs.token_logprobs must give a log-prob <= 0 for each of the {len(tokens)} sampled tokens; "
            f"got {got} (the request asks logprobs=0)"
        )
    return tokens, logprobs


def _json(raw: bytes, request: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise TeacherReplyError(f"{request}: the reply is not JSON ({raw[:80]!r}...)") from e
