"""Which fields of a /v1/completions body `liger-kd serve` takes: an allow-list, not a deny-list.

vLLM honours many sampling fields (min_tokens, logit_bias, bad_words, guided decoding, ...). A field this server
does not implement must not be answered 200 as if it were (the completions would silently not be what was asked):
every field is one of
  - SERVED: implemented (and checked by validation.py / generation.py);
  - AT_DEFAULT: not implemented, taken only at the value that means "off" (null always), as clients send them;
  - HARMLESS: no bearing on the token ids or log-probs this server returns (it has no tokenizer and sends no text);
and anything else is a 400 naming the field. A scoring request (with prompt_logprobs) generates nothing the client
reads, so there the sampling fields of AT_DEFAULT are ignored, but a field that changes the prompt is not.
"""

from __future__ import annotations

import json
from typing import Any

from ..wire.conventions import is_number
from .validation import RequestError

SERVED = frozenset({
    "prompt", "model", "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "stop_token_ids",
    "allowed_token_ids", "return_token_ids", "prompt_logprobs", "samples", "sample_seed", "sample_temperature",
})  # fmt: skip
AT_DEFAULT: dict[str, tuple] = {  # field -> the values that mean "off" (null is always taken)
    "stream": (False,), "echo": (False,), "ignore_eos": (False,), "min_p": (0,), "presence_penalty": (0,),
    "frequency_penalty": (0,), "repetition_penalty": (1,), "length_penalty": (1,), "best_of": (1,), "suffix": (),
    "stop": ([], ""), "min_tokens": (0,), "logit_bias": ({},), "bad_words": ([],), "use_beam_search": (False,),
    "include_stop_str_in_output": (False,), "return_tokens_as_token_ids": (True,), "guided_json": (),
    "guided_regex": (), "guided_choice": (), "guided_grammar": (), "guided_decoding_backend": (),
    "guided_whitespace_pattern": (), "structured_outputs": (), "response_format": (), "logits_processors": (),
    "truncate_prompt_tokens": (), "prompt_embeds": (), "stream_options": (), "vllm_xargs": (),
}  # fmt: skip
CHANGES_THE_PROMPT = frozenset({"truncate_prompt_tokens", "prompt_embeds", "echo", "suffix"})
HARMLESS = frozenset({
    "user", "request_id", "skip_special_tokens", "spaces_between_special_tokens", "add_special_tokens",
    "priority", "cache_salt", "detokenize",
})  # fmt: skip


def _off(value: Any, defaults: tuple) -> bool:
    if value is None:
        return True
    for default in defaults:
        same_kind = type(value) is type(default) or (is_number(value) and is_number(default))
        if same_kind and value == default:
            return True
    return False


def check_fields(body: dict, scoring: bool) -> None:
    """RequestError(400) naming the first field this server does not serve at the value given."""
    for field, value in body.items():
        if field in SERVED or field in HARMLESS:
            continue
        if field not in AT_DEFAULT:
            raise RequestError(400, f"{field!r} is not a field liger-kd serve takes (it serves "
                                    f"{sorted(SERVED)}); leave it out")  # fmt: skip
        if scoring and field not in CHANGES_THE_PROMPT:
            continue  # shapes only the completion token, which a scoring request does not read
        if not _off(value, AT_DEFAULT[field]):
            taken = [json.dumps(v) for v in AT_DEFAULT[field]]
            raise RequestError(400, f"{field}={json.dumps(value)[:40]} is not served by liger-kd serve (it takes "
                                    f"only {' or '.join(['null', *taken])}); leave it out")  # fmt: skip
