"""The real `liger-kd serve` (a subprocess) under faults and bad input: a LoRA adapter that fails to load,
weight-transfer inits to an address where no trainer answers, malformed full-weight updates, vLLM sampling fields
it does not implement, max_tokens past the context. Each leaves the server as it was, answers one 4xx line naming
the field and the fix, and keeps answering everyone else."""

import json
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from liger_patch_kd.teacher.client import TeacherServerError  # noqa: E402
from liger_patch_kd.teacher.client.transport import HttpEndpoint  # noqa: E402

from .test_generation_server import post  # noqa: E402
from .test_serve_hardening import _health, _post  # noqa: E402
from .test_teacher_server import Server, _rows, _teacher, teacher_dir  # noqa: E402, F401

pytestmark = [pytest.mark.usefixtures("clean_patches"), pytest.mark.multiprocess]
CONTEXT = 128  # tests/tiny_models: max_position_embeddings


@pytest.fixture(scope="module")
def served(teacher_dir):  # noqa: F811
    srv = Server(teacher_dir).start()
    yield srv
    srv.stop()


def _scores(url, seq):
    status, reply = _post(url, {"prompt": seq, "prompt_logprobs": 4, "max_tokens": 1})
    assert status == 200, reply
    return reply["choices"]


def _refused(reply, status, want, *needles):
    assert status == want, (status, reply)
    assert set(reply) == {"error"} and "\n" not in reply["error"], reply
    assert all(re.search(n, reply["error"]) for n in needles), (needles, reply["error"])


# ------------------------------------------------------------------------------------------ item 1: adapters
def test_a_lora_adapter_that_fails_to_load_leaves_the_served_model_as_it_was(served, tmp_path):
    """PEFT injected the adapter's layers before loading its weights: a failed load moved every teacher score and
    made every full-weight update fail (`...q_proj.weight is not a parameter`) until a restart."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file, save_file

    good = tmp_path / "good"
    student = peft.get_peft_model(_teacher(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                              init_lora_weights=False))  # fmt: skip
    student.save_pretrained(str(good))
    weights = load_file(str(good / "adapter_model.safetensors"))
    config = (good / "adapter_config.json").read_text()

    def adapter(name, tensors=None, raw=None):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(config)
        if tensors is not None:
            save_file(tensors, str(tmp_path / name / "adapter_model.safetensors"))
        if raw is not None:
            (tmp_path / name / "adapter_model.safetensors").write_bytes(raw)
        return str(tmp_path / name)

    whole = (good / "adapter_model.safetensors").read_bytes()
    cases = {
        adapter("shapes", {k: torch.zeros(3, 3, dtype=v.dtype) if "lora_A" in k else v for k, v in weights.items()}):
            "does not load on this model .*size mismatch",
        adapter("no-weights"): "holds no adapter_model.safetensors",
        adapter("truncated", raw=whole[: len(whole) // 2]): "weights do not read .*truncated",
        adapter("nan", {k: v.clone().fill_(float("nan")) if "lora_B" in k else v for k, v in weights.items()}):
            "holds NaN or infinite values",
        adapter("half", dict(list(weights.items())[::2])): "does not load on this model .*lacks",
    }  # fmt: skip
    seq = _rows(1, seed=5)[0].tolist()
    before = _scores(served.url, seq)
    for n, (path, message) in enumerate(cases.items()):
        status, reply = _post(served.url, {"lora_name": f"bad{n}", "lora_path": path}, path="/v1/load_lora_adapter")
        _refused(reply, status, 400, message)
        assert _scores(served.url, seq) == before  # bit for bit: the JSON's floats are the same
    status, reply = _post(served.url, {"prompt": seq, "max_tokens": 1, "model": "bad0"})
    assert status == 404  # no adapter of that name came to exist
    # a full-weight update still names the model's own tensors (the teacher's weights again: same scores)
    _teacher().save_pretrained(tmp_path / "full", safe_serialization=True)
    version = _health(served.url)["weight_version"]
    status, reply = _post(served.url, {"model_path": str(tmp_path / "full")}, path="/update_weights_from_disk")
    assert status == 200 and reply["weight_version"] == version + 1, reply
    assert _scores(served.url, seq) == before
    status, _ = post(served.url, "/v1/load_lora_adapter", {"lora_name": "good", "lora_path": str(good)})
    assert status == 200  # and a good adapter still loads, and unloads
    assert post(served.url, "/v1/unload_lora_adapter", {"lora_name": "good"})[0] == 200
    assert _scores(served.url, seq) == before


# -------------------------------------------------------------------------------- items 8 and 11: updates
def test_malformed_weight_updates_are_one_400_line_and_change_nothing(served, tmp_path):
    from safetensors.torch import save_file

    from liger_patch_kd.trainer.rollouts.weight_sender import BroadcastSender

    seq = _rows(1, seed=6)[0].tolist()
    before, version = _scores(served.url, seq), _health(served.url)["weight_version"]
    state = {k: v.contiguous() for k, v in _teacher().state_dict().items()}
    save_file(state, str(tmp_path / "whole.safetensors"))
    blob = (tmp_path / "whole.safetensors").read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(blob[: len(blob) - 1000])
    save_file({**state, "model.norm.weight": torch.arange(64)}, str(tmp_path / "ints.safetensors"))
    save_file({**state, "model.extra.weight": torch.zeros(2, dtype=torch.float64)}, str(tmp_path / "x.safetensors"))
    save_file({**state, "model.norm.weight": torch.full((64,), float("nan"), dtype=torch.float64)},
              str(tmp_path / "nan.safetensors"))  # fmt: skip
    disk = {
        "truncated": "does not read as safetensors .*truncated",
        "ints": "'model.norm.weight' is int64, the served model's is float64: send it as a float tensor",
        "x": "'model.extra.weight' is not a parameter or buffer",
        "nan": "'model.norm.weight' holds NaN or infinite values",
    }
    for name, message in disk.items():
        status, reply = _post(served.url, {"model_path": str(tmp_path / f"{name}.safetensors")},
                              path="/update_weights_from_disk")  # fmt: skip
        _refused(reply, status, 400, message)
    endpoint = HttpEndpoint(served.url, timeout=30, retries=3, backoff=0.01)
    with pytest.raises(TeacherServerError, match="HTTP 400"):
        endpoint.post_json("/update_weights_from_disk", {"model_path": str(tmp_path / "truncated.safetensors")})
    assert endpoint.retried == 0  # a 400 is the request's fault: never sent again as a server fault
    init = {"master_address": "127.0.0.1", "master_port": 70000, "rank_offset": 1, "world_size": 2}
    status, reply = _post(served.url, {"init_info": init}, path="/init_weight_transfer_engine")
    _refused(reply, status, 400, r"init_info.master_port must be an integer in \[1, 65535\]; got 70000")
    status, reply = _post(served.url, {"init_info": {**init, "master_port": 1234, "rank_offset": 2**70}},
                          path="/init_weight_transfer_engine")  # fmt: skip
    _refused(reply, status, 400, r"init_info.rank_offset must be an integer in \[1, 65535\]")
    assert _health(served.url)["weight_version"] == version and _scores(served.url, seq) == before

    # over a real weight-transfer group (this test is the trainer, rank 0)
    sender = BroadcastSender(HttpEndpoint(served.url, timeout=60, retries=0), "broadcast")
    model = _teacher()
    malformed = r"update_info.shapes\[0\] \(model.norm.weight\) must be a list of ints >= 0"
    bad_shapes = [
        (["abc", 64], malformed),
        ([-1, 64], malformed),
        ([True], malformed),
        ([2**40], r"'model.norm.weight' has shape \(1099511627776,\), the served model's \(64,\)"),
    ]
    for shape, message in bad_shapes:
        sender.push(model, step=0)  # joins (again: each refusal retires the group)
        info = {"names": ["model.norm.weight"], "dtype_names": ["float64"], "shapes": [shape]}
        status, reply = _post(served.url, {"update_info": info}, path="/update_weights")
        _refused(reply, status, 400, message, "nothing was received: POST /init_weight_transfer_engine again")
    sender.push(model, step=1)
    names = list(sender.snapshot(model))
    wrong_dtype = {"names": names, "dtype_names": ["int64" if n == "model.norm.weight" else "float64" for n in names],
                   "shapes": [list(state[n].shape) for n in names]}  # fmt: skip
    replies = []
    post = threading.Thread(target=lambda: replies.append(
        _post(served.url, {"update_info": wrong_dtype}, path="/update_weights")))  # fmt: skip
    post.start()
    for n, tensor in sender.snapshot(model).items():  # the model's size: drained, so the group stays in step
        tensor = tensor.long() if n == "model.norm.weight" else tensor
        sender.group.broadcast(tensor, 0).wait()
    post.join(60)
    _refused(replies[0][1], replies[0][0], 400, "'model.norm.weight' is int64, the served model's is float64")
    sender.push(model, step=2)  # the same group, still in step
    sender.close()
    assert _scores(served.url, seq) == before  # the teacher's own weights throughout


# --------------------------------------------------------------------------------------- item 5: inits
def test_an_init_to_an_address_where_no_trainer_answers_cannot_hold_the_server(teacher_dir):  # noqa: F811
    """Each init waited 10 minutes on one of the few worker threads: six stopped scoring and generation, and the
    process ignored SIGTERM. Now: one at a time (409), off the workers, 504 after a bounded wait, SIGTERM obeyed."""
    srv = Server(teacher_dir).start()
    listener = socket.socket()  # accepts and never says a word: a store that never completes its handshake
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held = []
    threading.Thread(target=lambda: [held.append(listener.accept()) for _ in range(16)], daemon=True).start()
    init = {"init_info": {"master_address": "127.0.0.1", "master_port": listener.getsockname()[1], "rank_offset": 1,
                          "world_size": 2}}  # fmt: skip
    try:
        pending = []
        start = time.monotonic()
        first = threading.Thread(target=lambda: pending.append(
            (_post(srv.url, init, path="/init_weight_transfer_engine"), time.monotonic() - start)))  # fmt: skip
        first.start()
        time.sleep(1.0)
        status, reply = _post(srv.url, init, path="/init_weight_transfer_engine")
        _refused(reply, status, 409, "/init_weight_transfer_engine is still running", "after it answers")
        seqs = [r.tolist() for r in _rows(12, seed=7)]
        with ThreadPoolExecutor(12) as pool:  # more than the default worker threads
            answers = list(pool.map(lambda s: _post(srv.url, {"prompt": s, "prompt_logprobs": 2})[0], seqs))
            generated = _post(srv.url, {"prompt": seqs[0], "max_tokens": 2})[0]
        assert answers == [200] * 12 and generated == 200 and first.is_alive()  # answered while the init waits
        first.join(60)
        (status, reply), waited = pending[0]
        _refused(reply, status, 504, r"127.0.0.1:\d+: no trainer's store answered within 20 s")
        assert waited < 45, waited

        def pending_init():
            try:
                _post(srv.url, init, path="/init_weight_transfer_engine")
            except OSError:  # the server exits under it (below): its connection is closed unanswered
                pass

        again = threading.Thread(target=pending_init, daemon=True)
        again.start()
        time.sleep(1.0)
        stopped = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(timeout=30)  # not the 15+ minutes it took
        assert time.monotonic() - stopped < 20
    finally:
        srv.stop()
        listener.close()


# ----------------------------------------------------------------------------------- item 10: sampling fields
def test_sampling_fields_the_server_does_not_implement_are_400s(served):
    seq = _rows(1, seed=8)[0].tolist()
    gen = {"prompt": seq, "max_tokens": 2}
    for field, value in [("min_tokens", 2), ("logit_bias", {"5": 10}), ("bad_words", ["x"]),
                         ("truncate_prompt_tokens", 2), ("guided_choice", ["a", "b"]), ("presence_penalty", 0.5),
                         ("stream", True), ("no_such_field", 1), ("return_tokens_as_token_ids", False)]:  # fmt: skip
        status, reply = _post(served.url, {**gen, field: value})
        _refused(reply, status, 400, re.escape(field))
    for field, value in [("truncate_prompt_tokens", 2), ("echo", True), ("no_such_field", 1)]:  # the scores move
        status, reply = _post(served.url, {"prompt": seq, "prompt_logprobs": 2, field: value})
        _refused(reply, status, 400, re.escape(field))
    harmless = {"model": str(served.teacher_dir), "stream": False, "n": 1, "echo": False, "user": "u", "min_tokens": 0,
                "logit_bias": None, "skip_special_tokens": True, "best_of": 1, "stop": []}  # fmt: skip
    assert _post(served.url, {**gen, **harmless})[0] == 200
    assert _post(served.url, {"prompt": seq, "prompt_logprobs": 2, "min_tokens": 1, **harmless})[0] == 200


def test_the_openai_client_as_others_use_it(served):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    seq = _rows(1, seed=9)[0].tolist()[:20]
    done = api.completions.create(model=str(served.teacher_dir), prompt=[seq], max_tokens=3, n=1, stream=False,
                                  echo=False, user="someone", seed=2, logprobs=1, temperature=0.7, top_p=0.9,
                                  presence_penalty=0, frequency_penalty=0, best_of=1)  # fmt: skip
    assert len(done.choices) == 1 and 1 <= len(done.choices[0].logprobs.token_logprobs) <= 3
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model=str(served.teacher_dir), prompt=[seq], max_tokens=3, extra_body={"min_tokens": 2})
    assert "min_tokens=2 is not served" in refused.value.response.json()["error"]


# ------------------------------------------------------------------------------------------ item 14c: context
@pytest.mark.parametrize("length, max_tokens, message", [
    (100, 50, r"prompt 0 has 100 tokens \+ max_tokens 50 = 150, more than the model's context "
              r"\(max_position_embeddings 128\): ask for at most max_tokens=28, or shorten the prompt"),
    (128, 1, r"prompt 0 has 128 tokens, which leaves no room .* for max_tokens 1: shorten the prompt to at most 127"),
    (500, 16, r"prompt 0 has 500 tokens, which leaves no room .*: shorten the prompt to at most 127 tokens"),
])  # fmt: skip
def test_max_tokens_past_the_context_names_a_fix_that_can_be_taken(served, length, max_tokens, message):
    """The 400 advised "truncate it to -372 tokens"."""
    status, reply = _post(served.url, {"prompt": [1] * length, "max_tokens": max_tokens})
    _refused(reply, status, 400, message)
    assert not re.search(r"-\d", reply["error"]), reply
    assert json.dumps(reply)


def test_a_second_adapter_that_fails_to_load_leaves_the_first_as_it_was(tmp_path):
    """With an adapter already loaded, a failing one is deleted from the PeftModel again: the first still answers
    what it answered, and unloading it gives back the model's own modules."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file, save_file

    from liger_patch_kd.server.generation import GenerationEngine, validated_generation
    from liger_patch_kd.server.validation import Limits, RequestError

    from .tiny_models import tiny_model

    student = peft.get_peft_model(
        tiny_model("llama", dtype=torch.float32, seed=1),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    student.save_pretrained(str(tmp_path / "good"))
    weights = load_file(str(tmp_path / "good" / "adapter_model.safetensors"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text((tmp_path / "good" / "adapter_config.json").read_text())
    save_file({k: torch.zeros(3, 3) if "lora_A" in k else v for k, v in weights.items()},
              str(tmp_path / "bad" / "adapter_model.safetensors"))  # fmt: skip
    model = tiny_model("llama", dtype=torch.float32, seed=1)
    own = list(model.state_dict())
    engine = GenerationEngine(model, "base")
    engine.load_adapter({"lora_name": "a", "lora_path": str(tmp_path / "good")})
    limits = Limits(max_top_k=4, vocab_size=257, max_context=128, max_request_tokens=4096)
    ask = validated_generation({"prompt": [1, 5, 9], "max_tokens": 5, "seed": 3, "logprobs": 2, "model": "a"}, limits)
    loaded, first = list(model.state_dict()), engine.complete(ask)["choices"]
    with pytest.raises(RequestError, match="does not load on this model .*size mismatch") as refused:
        engine.load_adapter({"lora_name": "b", "lora_path": str(tmp_path / "bad")})
    assert refused.value.status == 400 and "\n" not in refused.value.message
    assert list(model.state_dict()) == loaded and "b" not in engine.peft.peft_config and "b" not in engine.adapters
    assert engine.complete(ask)["choices"] == first
    engine.unload_adapter({"lora_name": "a"})
    assert list(model.state_dict()) == own


def test_inits_stuck_in_a_connect_are_capped():
    """A store that accepts and never answers holds TCPStore's connect past its timeout: the init answers 504 and
    leaves that thread behind. Past MAX_STUCK_JOINS of them a further init is refused (429) instead of adding one."""
    from liger_patch_kd.server import weight_receiver as WT
    from liger_patch_kd.server.generation import GenerationEngine
    from liger_patch_kd.server.validation import RequestError

    from .tiny_models import tiny_model

    receiver = WT.WeightReceiver(GenerationEngine(tiny_model("llama", dtype=torch.float32), "m"))
    release = threading.Event()
    stuck = [threading.Thread(target=release.wait, name=WT.JOIN_THREAD, daemon=True) for _ in range(WT.MAX_STUCK_JOINS)]
    for t in stuck:
        t.start()
    try:
        init = {"master_address": "127.0.0.1", "master_port": 9, "rank_offset": 1, "world_size": 2}
        with pytest.raises(RequestError, match=f"{WT.MAX_STUCK_JOINS} earlier inits are still stuck") as refused:
            receiver.init({"init_info": init})
        assert refused.value.status == 429
    finally:
        release.set()


# -------------------------------------------------------- an update past the served dtype, bodies too deep or large
def test_an_update_that_overflows_the_served_dtype_is_refused(teacher_dir, tmp_path):  # noqa: F811
    """float64 values past float32's range are finite where they are sent and infinities once cast into the served
    float32 weights: answered 200 before, and every later score was NaN until a restart."""
    from safetensors.torch import save_file

    srv = Server(teacher_dir, extra=("--dtype", "float32")).start()
    try:
        seq = _rows(1, seed=6)[0].tolist()
        before, version = _scores(srv.url, seq), _health(srv.url)["weight_version"]
        state = {k: v.contiguous() for k, v in _teacher().state_dict().items()}  # float64, as a float64 student sends
        save_file({**state, "model.norm.weight": torch.full((64,), 1e300, dtype=torch.float64)},
                  str(tmp_path / "big.safetensors"))  # fmt: skip
        status, reply = _post(srv.url, {"model_path": str(tmp_path / "big.safetensors")},
                              path="/update_weights_from_disk")  # fmt: skip
        _refused(reply, status, 400, r"'model.norm.weight' holds values up to 1e\+300, past the served model's "
                                     r"float32 range .*no weight changed")  # fmt: skip
        assert _health(srv.url)["weight_version"] == version and _scores(srv.url, seq) == before
        save_file(state, str(tmp_path / "fits.safetensors"))  # float64 values within float32's range still load
        status, reply = _post(srv.url, {"model_path": str(tmp_path / "fits.safetensors")},
                              path="/update_weights_from_disk")  # fmt: skip
        assert status == 200 and reply["weight_version"] == version + 1, reply
    finally:
        srv.stop()


def test_json_nested_too_deep_is_a_400_not_a_500(served):
    """Python's JSON parser recurses once per level: 100 000 nested arrays raised RecursionError, a bare 500."""
    for path in ("/v1/completions", "/update_weights_from_disk"):
        status, reply = _post(served.url, raw=b"[" * 100_000 + b"]" * 100_000, path=path)
        _refused(reply, status, 400, "nests JSON arrays or objects too deep")
    assert _health(served.url)["status"] == "ok"


def _send_body(port, path, size, declared=True):
    """POST `size` bytes of JSON whitespace with a Content-Length (declared True), chunked (False), or only
    announced (None: the Content-Length, no byte of the body); (status, JSON reply)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.putrequest("POST", path)
    conn.putheader("Content-Type", "application/json")
    conn.putheader(*(("Transfer-Encoding", "chunked") if declared is False else ("Content-Length", str(size))))
    conn.endheaders()
    chunk, sent = b" " * 2**20, 0
    try:
        while declared is not None and sent < size:
            piece = chunk[: size - sent]
            conn.send(piece if declared else b"%x\r\n%s\r\n" % (len(piece), piece))
            sent += len(piece)
        if declared is False:
            conn.send(b"0\r\n\r\n")
    except OSError:  # the server answered 413 and stopped reading: its reply is still there
        pass
    reply = conn.getresponse()
    return reply.status, json.loads(reply.read())


def test_a_body_past_the_limit_is_a_413_before_it_is_held_in_memory(served):
    """The server read every body whole before any check: a local process streaming gigabytes could run it out of
    memory (a 400 MB body grew it by 400 MB). A Content-Length past the limit is refused unread, a chunked body
    as soon as it passes it; a body under the limit is still read."""
    from liger_patch_kd.server.validation import CONTROL_BODY_BYTES

    for path in ("/v1/completions", "/update_weights_from_disk"):
        status, reply = _send_body(served.url.rsplit(":", 1)[1], path, 10**12, declared=None)  # declared, never sent
        _refused(reply, status, 413, rf"the request body is over \d+ bytes, this server's limit for {path}")
    status, reply = _send_body(served.url.rsplit(":", 1)[1], "/update_weights_from_disk", CONTROL_BODY_BYTES + 2**20,
                               declared=False)  # fmt: skip
    _refused(reply, status, 413, "over 16777216 bytes, this server's limit for /update_weights_from_disk")
    status, reply = _send_body(served.url.rsplit(":", 1)[1], "/update_weights_from_disk", 2**20, declared=False)
    _refused(reply, status, 400, "model_path must be a non-empty string")  # under the limit: read, then checked
    assert _health(served.url)["status"] == "ok"


def test_a_port_in_use_is_refused_in_one_line_before_the_teacher_loads(teacher_dir, capsys, monkeypatch):  # noqa: F811
    """Another process listening on --port: `liger-kd serve` says so in one line naming --host / --port and the fix,
    before it reads the teacher's config or weights (not uvicorn's [Errno 98] after the model has loaded)."""
    import transformers

    from liger_patch_kd.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("the teacher was loaded before the port was checked")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["serve", "--teacher", str(teacher_dir), "--top-k", "4", "--host", "127.0.0.1", "--port",
                     str(port), "--device", "cpu"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"--host 127.0.0.1 --port {port}: cannot listen there" in err[0] and "pass a free --port" in err[0], err
