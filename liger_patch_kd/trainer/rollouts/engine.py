"""Where a generated step's completions come from: the student in this process (rollouts.generate_rollouts), or an
inference engine at `kd_generation_url` speaking vLLM's /v1/completions (vLLM itself, or `liger-kd serve`).

The engine is asked for token-id prompts with `n` = kd_num_generations, the step's sampling settings, a seed per
call (rollouts.call_seed: the same seed gives the same completions), `logprobs: 0` and `return_token_ids: true`,
and answers each completion's token ids and the log-prob of each sampled token under the weights it sampled with
(the behaviour policy). Before a step's rollouts the student's weights reach the engine when `kd_sync_steps` steps
have passed since the last push (weight_sync.py), so a rollout is generated with weights up to kd_sync_steps - 1
steps old: its staleness, logged as kd_rollout_staleness. With kd_async_rollouts = k the requests of the next k
steps are sent while this one trains (async_rollouts.py): a rollout is then k to k + kd_sync_steps - 1 steps old
(fewer at the start of an epoch, whose first step is asked for and waited on). The pg loss weighs each token by
exp(log q - log b) with the engine's log b (reference.policy_gradient_terms): exact for any staleness, ratio 1 with
fresh weights; the other losses take stale rollouts as they come (a warning says so once).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from torch import nn
from transformers.utils import logging

from ...models import unwrap_model
from ...teacher.serve.client import API_KEY_ENV
from ...teacher.serve.protocols import TeacherReplyError
from ...teacher.serve.transport import HttpEndpoint
from ..arguments import checks_arguments
from .generate import Rollout, RolloutSettings, call_seed, generate_rollouts
from .weight_sender import TRANSPORTS, BroadcastSender
from .weight_sync import WeightSync

logger = logging.get_logger(__name__)

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
        self.ahead = args.kd_async_rollouts  # steps ahead the rollouts are requested (async_rollouts.py)
        self._warned = args.kd_onpolicy_loss == "pg" or (args.kd_sync_steps == 1 and not self.ahead)

    def __call__(
        self, generator: nn.Module, prompts: list[list[int]], settings: RolloutSettings, *, pad_id: int,
        eos_ids: set[int], start_id: int, step: int = 0,
    ) -> list[Rollout]:  # fmt: skip
        """Step `step`'s rollouts, now: the student pushed first when kd_sync_steps say so."""
        if self.sync.due(step):
            self.sync.push(generator, step)
        staleness, request = self.ask(generator, prompts, settings, eos_ids=eos_ids, start_id=start_id, step=step)
        self.staleness.append(staleness)
        return request()

    def ask(
        self, generator: nn.Module, prompts: list[list[int]], settings: RolloutSettings, *, eos_ids: set[int],
        start_id: int, step: int,
    ) -> tuple[int, Callable[[], list[Rollout]]]:  # fmt: skip
        """(staleness, request) for step `step`'s rollouts: the steps between `step` and the weights the engine holds
        once the pushes made or staged so far are loaded, and a callable sending the requests (now, or from the
        asynchronous worker after those loads: async_rollouts.py) and returning the rollouts, prompt-major."""
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
        model, vocab_size, allowed = self.sync.model_name, self.vocab_size, self._allowed
        rows = [p if p else [start_id] for p in prompts]
        per_call = settings.batch_size or len(rows)

        def request() -> list[Rollout]:
            name_asked = model or self._base_name()
            out: list[Rollout] = []
            for call, first in enumerate(range(0, len(rows), per_call)):
                chunk = rows[first : first + per_call]
                seed = call_seed(settings.seed, step, call)
                body = completion_request(chunk, settings, name_asked, seed, eos_ids, allowed)
                raw, _ = self.http.post_json("/v1/completions", body)
                name = f"step {step} call {call} to {self.http.url}/v1/completions"
                reply = _json(raw, name)
                out += rollouts_from_reply(reply, chunk, settings.num_generations, eos_ids, vocab_size, name)
            return out

        return staleness, request

    def close(self) -> None:
        self.sync.close()

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
    allowed_token_ids, for a head padded past the real vocabulary)."""
    extra = {} if allowed is None else {"allowed_token_ids": list(range(allowed))}
    return {**extra,
        "model": model, "prompt": prompts, "n": settings.num_generations, "max_tokens": settings.max_new_tokens,
        "temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k or -1,
        "seed": seed % 2**63, "logprobs": 0, "return_token_ids": True, "stop_token_ids": sorted(eos_ids),
    }  # fmt: skip


def rollouts_from_reply(
    reply: Any, prompts: list[list[int]], n: int, eos_ids: set[int], vocab_size: int, request: str
) -> list[Rollout]:
    """The reply's completions as Rollouts, prompt-major (choice index i * n + j is prompt i's j-th), each cut at
    its first EOS (kept) and carrying the engine's log-prob of each of its tokens; TeacherReplyError naming the
    request when the reply does not fit it."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or len(choices) != len(prompts) * n:
        got = len(choices) if isinstance(choices, list) else type(choices).__name__
        raise TeacherReplyError(f"{request}: {got} choices for {len(prompts)} prompts x n={n}")
    by_index = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
    out = []
    for i, choice in enumerate(by_index):
        prompt, where = prompts[i // n], f"{request} choice {i}"
        tokens, logprobs = _tokens_and_logprobs(choice, where)
        if choice.get("prompt_token_ids") not in (None, prompt):
            raise TeacherReplyError(f"{where}: prompt_token_ids differ from the prompt sent: the reply is misaligned")
        bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise TeacherReplyError(f"{where}: token id {bad} outside the student's vocabulary [0, {vocab_size})")
        cut = next((k + 1 for k, t in enumerate(tokens) if t in eos_ids), len(tokens))
        finished = cut < len(tokens) or choice.get("finish_reason") == "stop"
        out.append(Rollout(prompt, tokens[:cut], finished, tuple(logprobs[:cut])))
    return out


def _tokens_and_logprobs(choice: Any, where: str) -> tuple[list[int], list[float]]:
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
    ok = isinstance(logprobs, list) and len(logprobs) == len(tokens)
    if not ok or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0 for v in logprobs):
        raise TeacherReplyError(
            f"{where}: logprobs.token_logprobs must give a log-prob <= 0 for each of the {len(tokens)} sampled tokens; "
            f"got {str(logprobs)[:80]}"
        )
    return tokens, [float(v) for v in logprobs]


def _json(raw: bytes, request: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise TeacherReplyError(f"{request}: the reply is not JSON ({raw[:80]!r}...)") from e
