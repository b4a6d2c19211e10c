"""`liger-kd serve`'s routes agree on what a request means and what a reply may hold: the `model` field (an adapter's
name scores with that adapter, an unknown name is a 404 on every route), the body limit (/v1/hidden_states reads
its body as bounded as /v1/completions does), a top-K over fewer allowed ids than K (a 400, not a 500), and a
served model whose output holds NaN (a 500 naming it, never a 200 carrying NaN). The real app, served by uvicorn in
a thread of this process (test_generation_server.running)."""

import json
import re
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from liger_patch_kd.wire.protocols import BINARY_MEDIA_TYPE  # noqa: E402

from .test_generation_server import NAME, PROMPTS, post, running  # noqa: E402
from .test_serve_faults import _send_body  # noqa: E402
from .tiny_models import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_patches")
SCORE = {"prompt": PROMPTS[2], "prompt_logprobs": 4, "max_tokens": 1}
LOGPROB_ATOL = 1e-5  # float32 forwards of one model batched differently (test_generation_server.LOGPROB_ATOL)


def _refused(status, reply, want, *needles):
    assert status == want, (status, reply)
    assert set(reply) == {"error"} and "\n" not in reply["error"], reply
    assert all(re.search(n, reply["error"]) for n in needles), (needles, reply["error"])


def _send(url, path, body=None, accept="application/json"):
    """(status, the reply's bytes, or its JSON error): GET without a body, POST with one."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, headers={"Content-Type": "application/json", "Accept": accept})
    try:
        with urllib.request.urlopen(request) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _top(choice, model_scores):
    """The served top-4 of each position against `model_scores` (T, V) log-probs of the same prompt."""
    for t, entry in enumerate(choice["prompt_logprobs"][1:]):
        for tok, v in entry.items():
            assert abs(v["logprob"] - model_scores[t, int(tok)].item()) < LOGPROB_ATOL, (t, tok)


def test_the_model_field_picks_the_adapter_on_every_route_and_an_unknown_name_is_a_404(tmp_path):
    """The scoring route ignored `model`: an adapter's name got the base model's scores (200), and an unknown name
    a 200 on /v1/completions with prompt_logprobs and on /v1/hidden_states, where generation answered 404."""
    peft = pytest.importorskip("peft")
    student = peft.get_peft_model(tiny_model("llama", dtype=torch.float32, seed=1),
                                  peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    student.save_pretrained(str(tmp_path / "adapter"))  # fmt: skip
    base = tiny_model("llama", dtype=torch.float32, seed=1)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        want_base = base(ids).logits[0].float().log_softmax(-1)
        want_tuned = student(ids).logits[0].float().log_softmax(-1)
    assert (want_base - want_tuned).abs().max() > 100 * LOGPROB_ATOL  # the adapter moves the scores
    with running(tiny_model("llama", dtype=torch.float32, seed=1)) as (url, _):
        for path, body in (("/v1/completions", SCORE), ("/v1/hidden_states", {"prompt": [PROMPTS[2]]}),
                           ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2})):  # fmt: skip
            status, reply = post(url, path, {**body, "model": "no-such-model"})
            _refused(status, reply, 404, "model: the model 'no-such-model' does not exist here", NAME)
        status, text = post(url, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(tmp_path / "adapter")})
        assert status == 200, text
        status, tuned = post(url, "/v1/completions", {**SCORE, "model": "a1"})
        assert status == 200 and tuned["model"] == "a1", tuned
        _top(tuned["choices"][0], want_tuned)
        for body in (SCORE, {**SCORE, "model": NAME}):  # the base model's name, or none: adapters off
            status, plain = post(url, "/v1/completions", body)
            assert status == 200 and plain["model"] == NAME
            _top(plain["choices"][0], want_base)
        status, reply = post(url, "/v1/hidden_states", {"prompt": [PROMPTS[2]], "model": "a1"})
        _refused(status, reply, 400, "model 'a1' is a LoRA adapter: /v1/hidden_states serves the base model's")
        assert post(url, "/v1/unload_lora_adapter", {"lora_name": "a1"})[0] == 200
        status, reply = post(url, "/v1/completions", {**SCORE, "model": "a1"})  # gone: never the base instead
        _refused(status, reply, 404, "the model 'a1' does not exist here")


def test_hidden_states_bodies_are_bounded_as_completions_bodies_are():
    """/v1/hidden_states read its body whole (`await request.body()`): a 400 MB body was held and answered 200."""
    with running(tiny_model("llama", dtype=torch.float32, seed=1)) as (url, _):
        port = url.rsplit(":", 1)[1]
        status, reply = _send_body(port, "/v1/hidden_states", 10**12, declared=None)  # announced, never sent
        _refused(status, reply, 413, r"the request body is over \d+ bytes, this server's limit for /v1/hidden_states")
        status, reply = _send_body(port, "/v1/hidden_states", 2**31, declared=False)  # chunked: stops past the limit
        _refused(status, reply, 413, "this server's limit for /v1/hidden_states")
        assert _send(url, "/v1/hidden_states", {"prompt": [PROMPTS[0]]})[0] == 200  # under it: served


def test_logprobs_over_the_allowed_ids_is_a_400_naming_both_fields():
    """A top-5 over allowed_token_ids [0, 1] raised `selected index k out of range`: a 500, which clients retry."""
    with running(tiny_model("llama", dtype=torch.float32, seed=1)) as (url, _):
        body = {"prompt": [1, 2, 3], "max_tokens": 2, "allowed_token_ids": [0, 1]}
        status, reply = post(url, "/v1/completions", {**body, "logprobs": 5})
        _refused(status, reply, 400, "logprobs 5 is more than the 2 allowed_token_ids", "logprobs at most 2")
        status, reply = post(url, "/v1/completions", {**body, "logprobs": 2})
        assert status == 200 and len(reply["choices"][0]["logprobs"]["top_logprobs"][0]) == 2, reply


def test_a_model_whose_output_is_nan_gets_a_500_naming_it_never_a_200_carrying_nan():
    """A teacher with a NaN lm_head row was scored with NaN in the JSON (not JSON at all), greedy generation
    returned tokens drawn from NaN logits with NaN log-probs, and the head went out with its NaN row."""
    model = tiny_model("llama", dtype=torch.float32, seed=1)
    with torch.no_grad():
        model.lm_head.weight[7] = float("nan")
    with running(model) as (url, _):
        for accept in ("application/json", BINARY_MEDIA_TYPE):
            status, reply = _send(url, "/v1/completions", SCORE, accept)
            _refused(status, reply, 500, "NonFiniteOutput: the teacher's log-probs hold NaN or infinite values")
        status, reply = post(url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0,
                                                      "logprobs": 0})  # fmt: skip
        _refused(status, reply, 500, "generation failed: NonFiniteOutput: the model's log-probs of the sampled")
        status, reply = _send(url, "/v1/head")
        _refused(status, reply, 500, "the teacher's lm_head weights hold NaN or infinite values")
    model = tiny_model("llama", dtype=torch.float32, seed=1)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")  # the final hidden states themselves
    with running(model) as (url, _):
        status, reply = post(url, "/v1/hidden_states", {"prompt": [PROMPTS[0]]})
        _refused(status, reply, 500, "the teacher's final hidden states hold NaN or infinite values")
