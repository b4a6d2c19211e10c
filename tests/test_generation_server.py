"""`liger-kd serve` as a rollout engine: its generation endpoint (vLLM / OpenAI completions with token ids and the
sampled tokens' log-probs), seeded, spoken to by the `openai` client; its LoRA adapter and full-weight update routes;
bad requests and the API key. The real app, served by uvicorn in a thread of this process (`running`)."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest
import torch

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

import liger_patch_kd.models as M  # noqa: E402
from liger_patch_kd.server.app import build_app  # noqa: E402

from .tiny_models import VOCAB, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_patches")
TOP_K = 8
NAME = "tiny-student"
KEY = "engine-key-42"
# The server decodes one token at a time with its KV cache; the student scores the whole sequence in one forward.
# Both are float32 with products over hidden size 64 and a log-softmax over 257 ids: the two orders of summation
# differ by a few float32 ulp of O(1) values (~1e-6). 1e-5 leaves room for another BLAS; one optimizer step
# (lr 1e-2) or a token one position off moves these log-probs by more than 1e-3.
LOGPROB_ATOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(model, api_key=None, top_k=TOP_K, model_name=NAME, port=None, **options):
    """build_app(model) served on 127.0.0.1 by uvicorn in a thread; yields (url, app). `port` (default: a free
    one) lets a test restart a server where its clients already point."""
    app = build_app(model, top_k=top_k, model_name=model_name, api_key=api_key, **options)
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(10)


def post(url, path, body=None, raw=None, key=None):
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data, headers=headers)) as reply:
            text = reply.read().decode()
            return reply.status, json.loads(text) if reply.headers.get_content_type() == "application/json" else text
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def model_logprobs(model, prompt, completion):
    """log q(completion token t | prefix) of `model` in one float32 forward (its class's forward: accelerate wraps a
    bf16 run's instance forward in autocast)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = type(model).forward(model, input_ids=ids).logits.float().log_softmax(-1)[0]
    start = len(prompt)
    return logp[start - 1 : start - 1 + len(completion)].gather(-1, ids[0, start:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def served():
    model = tiny_model("llama", dtype=torch.float32, seed=1)
    with running(model) as (url, _):
        yield url, model


PROMPTS = [[1, 5, 9, 3], [1, 7], [4, 4, 4, 4, 4, 2, 8]]


def test_completions_carry_token_ids_and_the_models_logprobs_of_the_sampled_tokens(served):
    url, model = served
    status, reply = post(url, "/v1/completions", {"model": NAME, "prompt": PROMPTS, "n": 2, "max_tokens": 6,
                                                  "seed": 11, "logprobs": 2, "return_token_ids": True})  # fmt: skip
    assert status == 200 and reply["object"] == "text_completion" and reply["model"] == NAME
    choices = reply["choices"]
    assert [c["index"] for c in choices] == list(range(6))  # prompt i's j-th completion at i * n + j
    total = 0
    for c in choices:
        prompt, tokens = c["prompt_token_ids"], c["token_ids"]
        assert prompt == PROMPTS[c["index"] // 2] and 1 <= len(tokens) <= 6
        info = c["logprobs"]
        assert info["tokens"] == [f"token_id:{t}" for t in tokens] and len(info["top_logprobs"]) == len(tokens)
        for t, top in zip(tokens, info["top_logprobs"]):  # the sampled token plus the top 2
            assert f"token_id:{t}" in top and 2 <= len(top) <= 3
        want = model_logprobs(model, prompt, tokens)
        torch.testing.assert_close(torch.tensor(info["token_logprobs"]), want, rtol=0, atol=LOGPROB_ATOL)
        assert c["finish_reason"] == ("stop" if tokens[-1] == model.config.eos_token_id else "length")
        total += len(tokens)
    assert reply["usage"]["completion_tokens"] == total


def test_seeded_generation_is_reproducible(served):
    url, _ = served
    body = {"prompt": PROMPTS, "n": 3, "max_tokens": 8, "seed": 5, "return_token_ids": True}
    first = [c["token_ids"] for c in post(url, "/v1/completions", body)[1]["choices"]]
    again = [c["token_ids"] for c in post(url, "/v1/completions", body)[1]["choices"]]
    other = [c["token_ids"] for c in post(url, "/v1/completions", {**body, "seed": 6})[1]["choices"]]
    assert first == again and first != other
    assert len({tuple(t) for t in first[:3]}) > 1  # the n samples of one prompt are not copies of each other


def test_greedy_decoding_and_stop_token_ids(served):
    url, model = served
    prompt = PROMPTS[0]
    status, reply = post(url, "/v1/completions", {"prompt": prompt, "temperature": 0, "max_tokens": 4,
                                                  "return_token_ids": True})  # fmt: skip
    greedy = reply["choices"][0]["token_ids"]
    ids = torch.tensor([prompt])
    with torch.no_grad():  # greedy decoding, one token at a time, by hand
        for _ in range(4):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], -1)
    assert greedy == ids[0, len(prompt) :].tolist()
    stop = greedy[1]
    _, reply = post(url, "/v1/completions", {"prompt": prompt, "temperature": 0, "max_tokens": 4,
                                             "return_token_ids": True, "stop_token_ids": [stop]})  # fmt: skip
    choice = reply["choices"][0]
    cut = greedy.index(stop) + 1  # ends at the first stop id, which it keeps
    assert choice["token_ids"] == greedy[:cut] and choice["finish_reason"] == "stop" and choice["stop_reason"] == stop


def test_the_openai_client_calls_our_completions(served):
    openai = pytest.importorskip("openai")
    url, model = served
    api = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    completion = api.completions.create(model=NAME, prompt=[PROMPTS[0]], max_tokens=5, logprobs=0, seed=3,
                                        extra_body={"return_token_ids": True})  # fmt: skip
    choice = completion.choices[0]
    tokens = choice.model_extra["token_ids"]
    assert choice.finish_reason in ("stop", "length") and 1 <= len(tokens) <= 5
    want = model_logprobs(model, PROMPTS[0], tokens)
    torch.testing.assert_close(torch.tensor(choice.logprobs.token_logprobs), want, rtol=0, atol=LOGPROB_ATOL)


def test_bad_requests_are_400s_with_one_line_messages(served, tmp_path):
    url, _ = served
    ok = {"prompt": [1, 2, 3], "max_tokens": 2}
    cases = {
        "/v1/completions": [
            ({**ok, "n": 0}, "n must be an int >= 1"),
            ({**ok, "n": True}, "n must be an int >= 1"),
            ({**ok, "max_tokens": 0}, "max_tokens must be an int >= 1"),
            ({**ok, "max_tokens": 200}, "more than the model's context"),
            ({**ok, "logprobs": TOP_K + 1}, rf"logprobs must be null or an int in \[0, {TOP_K}\]"),
            ({**ok, "temperature": -1}, "temperature must be a number >= 0"),
            ({**ok, "top_p": 0}, "top_p must be a number in"),
            ({**ok, "stream": True}, "stream must be false"),
            ({**ok, "echo": True}, "echo=true is not served"),
            ({**ok, "presence_penalty": 0.5}, "presence_penalty=0.5 is not served"),
            ({**ok, "stop_token_ids": [VOCAB]}, "stop_token_ids must be a list of token ids"),
            ({**ok, "prompt": "text"}, "prompt must be token ids"),
            ({**ok, "prompt": [1, VOCAB]}, f"prompt 0 holds {VOCAB}"),
            ({**ok, "return_token_ids": "yes"}, "return_token_ids must be a boolean"),
            ({**ok, "seed": 2**64}, "seed must fit in 64 bits"),
        ],
        "/v1/load_lora_adapter": [
            ({"lora_name": "a"}, "lora_path must be a non-empty string"),
            ({"lora_name": "a", "lora_path": str(tmp_path)}, "holds no adapter_config.json"),
            ({"lora_name": NAME, "lora_path": str(tmp_path)}, "is the base model's name"),
        ],
        "/v1/unload_lora_adapter": [({"lora_name": "nope"}, "no LoRA adapter 'nope' is loaded")],
        "/update_weights_from_disk": [
            ({}, "model_path must be a non-empty string"),
            ({"model_path": str(tmp_path / "none")}, "neither a .safetensors file nor a directory of them"),
        ],
    }
    for path, bodies in cases.items():
        for body, message in bodies:
            status, reply = post(url, path, body)
            assert status == 400, (path, body, reply)
            assert set(reply) == {"error"} and "\n" not in reply["error"]
            assert pytest.importorskip("re").search(message, reply["error"]), (message, reply)
    status, reply = post(url, "/v1/completions", {**ok, "max_tokens": 2, "n": 100, "prompt": [[1] * 100] * 30})
    assert status == 413 and "over the server's --max-request-tokens" in reply["error"]


def test_full_weight_updates_check_every_tensor_before_changing_any(tmp_path):
    from safetensors.torch import save_file

    model = tiny_model("llama", dtype=torch.float32, seed=1)
    other = tiny_model("llama", dtype=torch.float32, seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with running(model) as (url, _):
        save_file({"model.norm.weight": torch.zeros(3)}, str(tmp_path / "bad_shape.safetensors"))
        status, reply = post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "bad_shape.safetensors")})
        assert status == 400 and "has shape (3,), the served model's (64,)" in reply["error"]
        save_file(
            {"model.norm.weight": torch.zeros(64), "extra.weight": torch.zeros(2)}, str(tmp_path / "x.safetensors")
        )
        status, reply = post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "x.safetensors")})
        assert status == 400 and "'extra.weight' is not a parameter or buffer" in reply["error"]
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing changed
        (tmp_path / "full").mkdir()
        partial = {k: v.contiguous() for k, v in other.state_dict().items() if k != "lm_head.weight"}
        save_file(partial, str(tmp_path / "partial.safetensors"))  # the served model's own head would stay old
        status, reply = post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "partial.safetensors")})
        assert status == 400 and "gives none of the served model's ['lm_head.weight']" in reply["error"]
        state = {k: v.contiguous() for k, v in other.state_dict().items()}
        save_file(state, str(tmp_path / "full" / "model.safetensors"))
        status, reply = post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "full")})
        assert status == 200 and reply["success"] and reply["num_tensors"] == len(state)
        assert reply["weight_version"] == 1
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
        health = json.loads(urllib.request.urlopen(url + "/health").read())
        assert health["weight_version"] == 1


def test_lora_adapters_load_serve_by_name_and_unload(tmp_path):
    peft = pytest.importorskip("peft")
    base = tiny_model("llama", dtype=torch.float32, seed=1)
    served_model = tiny_model("llama", dtype=torch.float32, seed=1)
    student = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                        init_lora_weights=False))  # fmt: skip
    student.save_pretrained(str(tmp_path / "adapter"))
    prompt = PROMPTS[2]
    with running(served_model) as (url, _):
        body = {"prompt": prompt, "max_tokens": 6, "seed": 2, "logprobs": 0, "return_token_ids": True}
        plain = post(url, "/v1/completions", body)[1]["choices"][0]
        status, text = post(url, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(tmp_path / "adapter")})
        assert status == 200 and "a1" in text
        status, reply = post(url, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(tmp_path / "adapter")})
        assert status == 400 and "already been loaded" in reply["error"]
        tuned = post(url, "/v1/completions", {**body, "model": "a1"})[1]
        assert tuned["model"] == "a1"
        choice = tuned["choices"][0]
        want = model_logprobs(student, prompt, choice["token_ids"])
        torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]), want, rtol=0, atol=LOGPROB_ATOL)
        # the base model's name (and the teacher scoring) still get the base model, adapters off
        again = post(url, "/v1/completions", {**body, "model": NAME})[1]["choices"][0]
        assert again["token_ids"] == plain["token_ids"] and again["logprobs"] == plain["logprobs"]
        status, _ = post(url, "/v1/unload_lora_adapter", {"lora_name": "a1"})
        assert status == 200
        status, reply = post(url, "/v1/completions", {**body, "model": "a1"})  # gone: never the base instead
        assert status == 404 and "the model 'a1' does not exist here" in reply["error"]
    assert set(served_model.state_dict()) == set(tiny_model("llama").state_dict())  # the LoRA layers are gone


def test_api_key_is_enforced_on_every_route_but_health():
    model = tiny_model("llama", dtype=torch.float32, seed=1)
    with running(model, api_key=KEY) as (url, _):
        for path, body in [("/v1/completions", {"prompt": [1, 2], "max_tokens": 1}),
                           ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}),
                           ("/update_weights_from_disk", {"model_path": "/x"})]:  # fmt: skip
            status, reply = post(url, path, body)
            assert status == 401 and "Authorization: Bearer" in reply["error"]
            assert post(url, path, body, key="wrong")[0] == 401
        status, reply = post(url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1}, key=KEY)
        assert status == 200 and len(reply["choices"]) == 1
        assert urllib.request.urlopen(url + "/health").status == 200


def test_a_patched_model_generates_what_the_plain_model_would(tmp_path):
    """`liger-kd serve` patches its model's kernels on a GPU: generation still goes through the KV cache (the
    patched forward's signature hides the cache argument's name) and gives the plain model's log-probs."""
    plain = tiny_model("llama", dtype=torch.float32, seed=1)
    patched = tiny_model("llama", dtype=torch.float32, seed=1)
    M.apply_kd_patch(model=patched)
    with running(patched) as (url, _):
        _, reply = post(url, "/v1/completions", {"prompt": PROMPTS, "max_tokens": 6, "seed": 1, "logprobs": 0,
                                                 "return_token_ids": True})  # fmt: skip
    for c in reply["choices"]:
        want = model_logprobs(plain, c["prompt_token_ids"], c["token_ids"])
        torch.testing.assert_close(torch.tensor(c["logprobs"]["token_logprobs"]), want, rtol=0, atol=LOGPROB_ATOL)
