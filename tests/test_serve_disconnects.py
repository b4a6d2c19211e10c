"""`liger-kd serve` drops the work of clients that hung up: a generation stops at its next decode step and releases
the model, one still waiting for the model never runs, so an honest request is answered at once instead of after
every abandoned completion; the server is left as it was (a seeded request gives the reply of a fresh server).
Clients here send a raw HTTP request and close the socket, as a client that gives up does."""

import json
import socket
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from .test_generation_server import post, running  # noqa: E402
from .test_serve_hardening import _health, _post  # noqa: E402
from .test_teacher_server import Server, teacher_dir  # noqa: E402, F401
from .tiny_models import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_patches")
# an honest request's wait behind abandoned work: the abandoned requests hold 20-30 s of decoding, so a bound well
# under that fails on a server that finishes them, with room left for a loaded 2-core CI machine
HONEST_BOUND_S = 6.0
PROMPT = [5, 6, 7]


def _abandoned(url: str, body: dict) -> socket.socket:
    """A connection that has sent `body` to /v1/completions; closing it hangs up without reading the reply."""
    host, port = url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    conn.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return conn


def _until(condition, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _without_ids(reply: dict) -> dict:
    return {k: v for k, v in reply.items() if k not in ("id", "created")}


@pytest.mark.parametrize("path", ["plain", "engine"])
def test_generations_of_clients_that_hung_up_stop_and_release_the_model(monkeypatch, path):
    """Three requests of 8 completions x 100 tokens at STEP_S a decode step (30 s of work): one decoding, two waiting
    for the model, all three hung up. The decoding one stops within a couple of steps, the waiting ones never
    decode, an honest scoring request is answered within HONEST_BOUND_S, and a seeded generation afterwards is the
    reply it got before (the engine: the session cut short is reused, and samples as before)."""
    from liger_patch_kd.generation.engine import DecodeSession, release_sessions, session_of

    step_s, slow, steps = 0.1, [False], []  # decode steps run while `slow`: the abandoned requests'

    def step_taken():
        if slow[0]:
            steps.append(1)
            time.sleep(step_s)

    model = tiny_model("llama", dtype=torch.float32, seed=1).eval()
    model.set_attn_implementation("sdpa")  # what the engine's masks need (the plain loop takes any)
    if path == "plain":  # generation forwards only (scoring uses no cache)
        model.register_forward_pre_hook(lambda m, a, k: step_taken() if k.get("use_cache") else None, with_kwargs=True)
    else:
        run_step = DecodeSession.run_step
        monkeypatch.setattr(DecodeSession, "run_step", lambda self: (step_taken(), run_step(self)))
    body = {"prompt": PROMPT, "n": 8, "max_tokens": 100, "seed": 7, "return_token_ids": True, "logprobs": 2,
            "stop_token_ids": []}  # fmt: skip
    with running(model) as (url, app):
        engine = app.state.engine
        engine.captured = path == "engine"  # what a CUDA device sets; on a CPU the same step runs eagerly
        status, fresh = post(url, "/v1/completions", body)
        assert status == 200 and len(fresh["choices"]) == 8, fresh
        assert (session_of(model) is not None) == (path == "engine")
        slow[0] = True
        first = _abandoned(url, body)
        _until(lambda: len(steps) >= 2)  # decoding, under the model's lock
        queued = [_abandoned(url, body), _abandoned(url, body)]
        time.sleep(0.3)  # read by the server, their threads waiting for the lock
        assert engine.lock.locked() and len(steps) < 20
        for conn in (first, *queued):
            conn.close()
        hung_up_at, started = len(steps), time.monotonic()
        status, reply = _post(url, {"prompt": PROMPT, "prompt_logprobs": 4, "max_tokens": 1})
        waited = time.monotonic() - started
        assert status == 200 and len(reply["choices"][0]["prompt_logprobs"]) == len(PROMPT), reply
        assert waited < HONEST_BOUND_S, f"the honest request waited {waited:.1f} s behind hung-up generations"
        _until(lambda: _health(url)["generations_cancelled"] == 3)
        # the decoding one ran at most the step in flight and one begun before the disconnect was read; the
        # queued ones none (of 3 x 99 steps)
        assert len(steps) - hung_up_at <= 2, (hung_up_at, len(steps))
        assert not engine.lock.locked()
        slow[0] = False
        status, again = post(url, "/v1/completions", body)
        assert status == 200 and _without_ids(again) == _without_ids(fresh)
    release_sessions(model)


@pytest.mark.multiprocess
def test_the_served_teacher_answers_at_once_after_abandoned_generations(teacher_dir):  # noqa: F811
    """The real `liger-kd serve` (a subprocess): three requests of 512 completions x 120 tokens (seconds each on
    a CPU) hung up; a scoring request right after is answered within HONEST_BOUND_S, /health counts the three
    cancelled, and a seeded generation gives the reply it gave before them."""
    server = Server(teacher_dir).start()
    try:
        seeded = {"prompt": PROMPT, "n": 4, "max_tokens": 20, "seed": 3, "return_token_ids": True, "logprobs": 1}
        status, fresh = _post(server.url, seeded)
        assert status == 200, fresh
        heavy = {"prompt": PROMPT, "n": 512, "max_tokens": 120, "stop_token_ids": []}
        conns = [_abandoned(server.url, heavy)]
        time.sleep(0.5)  # the first one decoding
        conns += [_abandoned(server.url, heavy), _abandoned(server.url, heavy)]
        time.sleep(0.3)
        for conn in conns:
            conn.close()
        started = time.monotonic()
        status, reply = _post(server.url, {"prompt": PROMPT, "prompt_logprobs": 4, "max_tokens": 1})
        waited = time.monotonic() - started
        assert status == 200, reply
        assert waited < HONEST_BOUND_S, f"the honest request waited {waited:.1f} s behind hung-up generations"
        _until(lambda: _health(server.url)["generations_cancelled"] == 3)
        status, again = _post(server.url, seeded)
        assert status == 200 and _without_ids(again) == _without_ids(fresh)
    finally:
        server.stop()
