"""The real `liger-kd serve` (a subprocess, as test_teacher_server starts it) under bad requests, with its hardening
options (--api-key, --max-request-tokens, --batch-invariant), and spoken to by the `openai` package's client and
parsed by TRL's own vLLM reply formatter."""

import json
import re
import sys
import urllib.error
import urllib.request

import pytest
import torch

from .helpers import run_child

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from liger_patch_kd import teacher as TD  # noqa: E402
from liger_patch_kd.wire import protocols as P  # noqa: E402

from .test_teacher_server import ROOT, TOP_K, VOCAB, Server, _rows, server, teacher_dir  # noqa: E402, F401

pytestmark = [pytest.mark.usefixtures("clean_patches"), pytest.mark.multiprocess]  # `liger-kd serve` subprocesses
KEY = "test-key-123"
CONTEXT = 128  # tests/tiny_models: max_position_embeddings


@pytest.fixture(scope="module")
def strict(teacher_dir):  # noqa: F811
    """A server with a key, a small request limit, small batches and batch-invariant replies."""
    srv = Server(teacher_dir, api_key=KEY, extra=("--api-key", KEY, "--max-request-tokens", "200",
                                                  "--max-batch-tokens", "64", "--batch-invariant")).start()  # fmt: skip
    yield srv
    srv.stop()


def _post(url, body=None, raw=None, headers=(), path="/v1/completions"):
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, method="POST" if data is not None else "GET",
                                     headers={"Content-Type": "application/json", **dict(headers)})  # fmt: skip
    try:
        with urllib.request.urlopen(request) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _health(url):
    return json.loads(urllib.request.urlopen(url + "/health").read())


def test_bad_requests_are_400s_naming_the_field(server):  # noqa: F811
    ok = {"model": str(server.teacher_dir), "prompt": [1, 2, 3], "prompt_logprobs": TOP_K, "max_tokens": 1}
    cases = {
        b"{not json": "not valid JSON",
        json.dumps([1, 2]).encode(): "not an object",
        json.dumps({**ok, "temperature": "hot"}).encode(): "temperature must be a number >= 0",
        json.dumps({**ok, "temperature": [1]}).encode(): "temperature must be",
        json.dumps({**ok, "temperature": None}).encode(): "temperature must be",
        json.dumps({**ok, "temperature": -1}).encode(): "temperature must be",
        json.dumps({**ok, "top_p": "x"}).encode(): "top_p must be a number in",
        json.dumps({**ok, "prompt": [True, False]}).encode(): "prompt 0 holds true: token ids must be ints",
        json.dumps({**ok, "prompt": [[1, 2], [3, VOCAB]]}).encode(): f"prompt 1 holds {VOCAB}",
        json.dumps({**ok, "prompt": "some text"}).encode(): "prompt must be token ids",
        json.dumps({**ok, "prompt_logprobs": True}).encode(): "prompt_logprobs must be an int in",
        json.dumps({**ok, "prompt_logprobs": TOP_K + 1}).encode(): f"\\[1, {TOP_K}\\]",
        json.dumps({**ok, "prompt": [1] * (CONTEXT + 1)}).encode(): f"129 tokens, more than the model's context "
                                                                    f"\\(max_position_embeddings {CONTEXT}\\)",
        json.dumps({**ok, "stream": True}).encode(): "stream must be false",
    }  # fmt: skip
    before = _health(server.url)["batches_run"]
    for raw, message in cases.items():
        status, reply = _post(server.url, raw=raw)
        assert status == 400, (raw, reply)
        assert set(reply) == {"error"} and "\n" not in reply["error"]
        assert re.search(message, reply["error"]), (message, reply)
    assert _health(server.url)["batches_run"] == before  # refused before any teacher work
    status, _ = _post(server.url, {**ok, "prompt": [1] * CONTEXT})
    assert status == 200


def test_temperature_shapes_only_the_completion_token(server):  # noqa: F811
    """vLLM's meaning: any temperature >= 0 is accepted (ms-swift sends 0.0) and prompt_logprobs stay at T = 1."""
    seq = _rows(1, seed=4)[0].tolist()
    replies = []
    for temperature in (0.0, 0.7, 1.0, 2):
        status, reply = _post(server.url, {"prompt": seq, "prompt_logprobs": TOP_K, "max_tokens": 1,
                                           "temperature": temperature, "top_p": 1.0})  # fmt: skip
        assert status == 200, reply
        replies.append(P.parse_vllm_reply(reply, [seq], top_k=TOP_K, vocab_size=VOCAB, request="r")[0])
    for ids, values in replies[1:]:  # one request at a time: the same forward shapes, the same bits
        assert torch.equal(ids, replies[0][0]) and torch.equal(values, replies[0][1])


def test_too_large_a_top_k_is_refused_at_start(teacher_dir):  # noqa: F811
    cmd = [sys.executable, "-m", "liger_patch_kd.cli", "serve", "--teacher", str(teacher_dir), "--top-k", "300",
           "--device", "cpu"]  # fmt: skip
    done = run_child(cmd, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"liger-kd serve: error: --top-k 300 must be in [1, {VOCAB}] (the teacher's vocabulary size); lower it"
    ]


def test_an_unknown_precision_is_refused_before_the_weights_load(tmp_path):
    """serve() called directly (the CLI's --precision has its choices): a one-line error naming the choices,
    before it reads the teacher (here a path that does not exist)."""
    pytest.importorskip("uvicorn")
    from liger_patch_kd.server.app import serve

    with pytest.raises(ValueError, match=r"precision must be one of \('bf16', 'fp8', 'fp8_fast_accum'\); got 'fp16'"):
        serve(str(tmp_path / "no-such-teacher"), top_k=4, precision="fp16")


def test_api_key(strict, monkeypatch):
    seq = _rows(1)[0].tolist()
    body = {"prompt": seq, "prompt_logprobs": TOP_K}
    assert urllib.request.urlopen(strict.url + "/health").status == 200  # /health needs no key
    for headers in ((), (("Authorization", "Bearer wrong"),), (("Authorization", KEY),)):
        assert _post(strict.url, body, headers=headers)[0] == 401
        assert _post(strict.url, None, headers=headers, path="/v1/models")[0] == 401
    status, reply = _post(strict.url, body, headers=(("Authorization", f"Bearer {KEY}"),))
    assert status == 200 and len(reply["choices"]) == 1
    client = TD.TeacherClient(strict.url, "vllm", top_k=TOP_K, vocab_size=VOCAB, retries=3, backoff=0.01)
    with pytest.raises(TD.TeacherServerError, match="HTTP 401: .*set kd_teacher_api_key, or LIGER_KD_API_KEY"):
        client.fetch([seq])
    assert client.retried == 0  # a 4xx is never retried
    with_key = TD.TeacherClient(strict.url, "liger", top_k=TOP_K, vocab_size=VOCAB, api_key=KEY).fetch([seq])
    monkeypatch.setenv("LIGER_KD_API_KEY", KEY)
    from_env = TD.TeacherClient(strict.url, "vllm", top_k=TOP_K, vocab_size=VOCAB).fetch([seq])
    assert torch.equal(with_key[0][0], from_env[0][0]) and torch.equal(with_key[0][1], from_env[0][1])


def test_binding_beyond_loopback_warns_without_a_key(teacher_dir):  # noqa: F811
    for env, warned in (({}, True), ({"LIGER_KD_API_KEY": KEY}, False)):
        srv = Server(teacher_dir, extra=("--host", "0.0.0.0"), env=env, api_key=env.get("LIGER_KD_API_KEY"))
        try:
            srv.start()
            status = _post(srv.url, {"prompt": [1, 2], "prompt_logprobs": 1})[0]
        finally:
            srv.stop()
        stderr = srv.proc.stderr.read().decode()
        assert ("WARNING: listening on 0.0.0.0 without --api-key" in stderr) is warned, stderr
        assert status == (401 if env else 200)  # the key from LIGER_KD_API_KEY is required


def test_large_requests_are_split_across_batches_or_refused(strict):
    auth = (("Authorization", f"Bearer {KEY}"),)
    status, reply = _post(strict.url, {"prompt": [[1] * 40] * 5 + [[2]], "prompt_logprobs": 1}, headers=auth)
    assert status == 413 and "201 prompt tokens, over the server's --max-request-tokens 200" in reply["error"]
    before = _health(strict.url)["batches_run"]
    seqs = [r.tolist() for r in _rows(6, seed=5)]  # 6 sequences of 5-12 tokens over --max-batch-tokens 64
    seqs = [(s * 3)[:30] for s in seqs]
    client = TD.TeacherClient(strict.url, "liger", top_k=TOP_K, vocab_size=VOCAB, api_key=KEY,
                              sequences_per_request=6)  # fmt: skip
    together = client.fetch(seqs)
    assert _health(strict.url)["batches_run"] - before >= 3  # 180 tokens: at most 2 sequences of 30 per batch
    for seq, (i, v) in zip(seqs, together):
        j, w = client.fetch([seq])[0]
        assert torch.equal(i, j) and torch.equal(v, w)


def test_batch_invariant_replies_are_bit_identical_to_solo_ones(strict):
    seqs = [r.tolist() for r in _rows(12, seed=6)]
    solo = [TD.TeacherClient(strict.url, "liger", top_k=TOP_K, vocab_size=VOCAB, api_key=KEY).fetch([s])[0]
            for s in seqs]  # fmt: skip
    for protocol, per_request in (("liger", 1), ("vllm", 3)):
        client = TD.TeacherClient(strict.url, protocol, top_k=TOP_K, vocab_size=VOCAB, api_key=KEY,
                                  sequences_per_request=per_request, max_in_flight=8)  # fmt: skip
        for (i, v), (j, w) in zip(client.fetch(seqs), solo):
            assert torch.equal(i, j) and torch.equal(v, w)


def test_the_openai_client_and_trls_reply_formatter(strict):
    openai = pytest.importorskip("openai")  # the `test` extra installs it
    from trl.generation.vllm_client import VLLMClient

    seq = _rows(1, seed=7)[0].tolist()
    api = openai.OpenAI(base_url=strict.url + "/v1", api_key=KEY)
    completion = api.completions.create(model=str(strict.teacher_dir), prompt=seq, max_tokens=1, temperature=0.0,
                                        extra_body={"prompt_logprobs": TOP_K})  # fmt: skip
    choice = completion.choices[0].model_dump()
    ids, values = P.parse_vllm_prompt_logprobs(choice["prompt_logprobs"], len(seq), top_k=TOP_K, vocab_size=VOCAB,
                                               request="openai", sequence=seq)  # fmt: skip
    want = TD.TeacherClient(strict.url, "liger", top_k=TOP_K, vocab_size=VOCAB, api_key=KEY).fetch([seq])[0]
    assert torch.equal(ids, want[0]) and torch.equal(values, want[1])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=strict.url + "/v1", api_key="wrong").completions.create(
            model="m", prompt=seq, max_tokens=1, extra_body={"prompt_logprobs": TOP_K})
    # TRL 1.16's own parser of vLLM prompt_logprobs (its VLLMClient's), from position 1 on: sorted by rank, top K
    trl = VLLMClient._format_sequence_logprobs(choice, seq, 1, TOP_K)
    assert trl["logprob_token_ids"] == ids[:-1].tolist()
    torch.testing.assert_close(torch.tensor(trl["logprobs"], dtype=torch.float32), values[:-1], rtol=0, atol=0)
    assert trl["actual_token_ids"] == [[t] for t in seq[1:]]
    for t, ((own,), row_ids, row_values) in enumerate(zip(trl["actual_logprobs"], ids.tolist(), values.tolist())):
        if seq[t + 1] in row_ids:
            assert own == pytest.approx(row_values[row_ids.index(seq[t + 1])], abs=1e-6)
