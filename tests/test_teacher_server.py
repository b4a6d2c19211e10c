"""A teacher behind a server: `liger-kd serve` in a subprocess, the client, the prefetching DataLoader and KDTrainer
against it, and its faults (server killed mid-run, never answering, down at start, 5xx)."""

import http.server
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import liger_patch_kd.models as M  # noqa: E402
from liger_patch_kd import teacher as TD  # noqa: E402
from liger_patch_kd.ops.fp8 import fp8_available  # noqa: E402
from liger_patch_kd.teacher.client import prefetch  # noqa: E402
from liger_patch_kd.teacher.client.client import protocol_for  # noqa: E402
from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments  # noqa: E402
from liger_patch_kd.wire import protocols  # noqa: E402

from .helpers import stop_with_stacks, subprocess_env  # noqa: E402
from .tiny_models import VOCAB, tiny_model  # noqa: E402

TOP_K = 8
ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("clean_patches")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`liger-kd serve` in a subprocess on 127.0.0.1; stop() kills it by its PID."""

    def __init__(
        self, teacher_dir: Path, port: int | None = None, extra: tuple[str, ...] = (), env: dict | None = None,
        api_key: str | None = None,
    ) -> None:
        self.teacher_dir, self.port, self.extra = teacher_dir, port or _free_port(), list(extra)
        self.env, self.api_key = env or {}, api_key
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self, wait: bool = True) -> "Server":
        # one thread: the server shares CI's two cores with the training process
        env = subprocess_env(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **self.env)
        cmd = [sys.executable, "-m", "liger_patch_kd.cli", "serve", "--teacher", str(self.teacher_dir), "--top-k",
               str(TOP_K), "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
               "--attn-implementation", "eager", *self.extra]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if wait:
            # refused until the subprocess has imported torch and bound its port: retries enough for a busy CI
            client = TD.TeacherClient(self.url, top_k=TOP_K, vocab_size=VOCAB, timeout=90, retries=20,
                                      api_key=self.api_key)  # fmt: skip
            try:
                client.wait_until_ready()
            except TD.TeacherServerError as e:  # a server slow to start says where it is, and is not left running
                raise AssertionError(f"{e}\nthe server's stderr:\n{stop_with_stacks(self.proc)}") from None
            except BaseException:
                self.stop()
                raise
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _teacher():
    """A tiny float64 teacher whose distributions are far from uniform, so the losses are not all near 0."""
    model = tiny_model("llama", seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    return model


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher")
    _teacher().save_pretrained(path)  # float64: the server loads it as saved
    return path


@pytest.fixture(scope="module")
def server(teacher_dir):
    srv = Server(teacher_dir).start()
    yield srv
    srv.stop()


# The server runs float64 teachers but returns float32 log-probs (log_softmax of the logits cast to float32), and it
# batches whatever requests are waiting when a batch starts: which sequences share a forward, and how far they are
# padded, depends on timing. A float64 GEMM over other shapes may reduce in another order on another BLAS, so the
# same sequence can come back one float32 ulp apart (|log-prob| <~ 50 here: ulp <= 4e-6), and two log-probs within
# that of each other can swap places in the top-k. Replies are therefore compared to SERVED_ATOL, and ids only
# through the values they point at (tie-robust); a wrong id or a row of another position is off by >= 1e-4.
SERVED_ATOL = 1e-5


def assert_same_topk(ids, values, ref_logprobs, atol=SERVED_ATOL):
    """(T, K) served ids / log-probs against (T, V) reference log-probs: ids unique per row, each id's reference
    log-prob is its served value, and the served values are the reference's K largest, so any order of ties passes."""
    ids, values = ids.long(), values.double()
    assert all(len(set(row)) == len(row) for row in ids.tolist())
    torch.testing.assert_close(values, ref_logprobs.gather(-1, ids), rtol=0, atol=atol)
    torch.testing.assert_close(values, ref_logprobs.topk(ids.shape[-1], -1).values, rtol=0, atol=atol)


def _rows(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (int(torch.randint(5, 13, (1,), generator=g)),), generator=g) for _ in range(n)]


@pytest.mark.multiprocess  # a `liger-kd serve` subprocess
def test_replies_are_the_teachers_topk_in_json_and_binary(server, teacher_dir):
    """vLLM-style JSON (top K plus the prompt token when outside it) and binary replies against log_softmax of the
    teacher's materialised float64 logits."""
    teacher = _teacher()
    seqs = [r.tolist() for r in _rows(5)]
    as_json = TD.TeacherClient(server.url, "vllm", top_k=TOP_K, vocab_size=VOCAB, sequences_per_request=2).fetch(seqs)
    as_binary = TD.TeacherClient(server.url, "liger", top_k=TOP_K, vocab_size=VOCAB).fetch(seqs)
    body = {"model": str(server.teacher_dir), "prompt": seqs[0], "prompt_logprobs": TOP_K, "max_tokens": 1}
    request = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    raw = json.loads(urllib.request.urlopen(request).read())["choices"][0]["prompt_logprobs"]
    for seq, (i, v), (j, w) in zip(seqs, as_json, as_binary):
        # the JSON client's 3 concurrent requests and the binary client's 2 meet the batcher at different times, so
        # the two replies of one sequence may come from forwards of different batches: not bit-equal (see above)
        with torch.no_grad():
            ref = torch.log_softmax(teacher(torch.tensor([seq])).logits[0].double(), -1)
        for ids, values in ((i, v), (j, w)):
            assert_same_topk(ids[:-1], values[:-1], ref[:-1])
            assert (ids[-1] == -1).all() and (values[-1] == -math.inf).all()
    assert raw[0] is None and len(raw) == len(seqs[0])
    with torch.no_grad():
        ref = torch.log_softmax(teacher(torch.tensor([seqs[0]])).logits[0].double(), -1)
    for t in range(1, len(seqs[0])):
        own, own_lp = str(seqs[0][t]), ref[t - 1, seqs[0][t]]
        assert len(raw[t]) == TOP_K + (own not in {str(x) for x in as_json[0][0][t - 1].tolist()})
        assert raw[t][own]["logprob"] == pytest.approx(float(own_lp), abs=SERVED_ATOL)
        # the server ranks in float32: a log-prob within SERVED_ATOL of the token's own may count either way
        above = int((ref[t - 1] > own_lp + SERVED_ATOL).sum())
        near = int((ref[t - 1] - own_lp).abs().le(SERVED_ATOL).sum())
        assert above + 1 <= raw[t][own]["rank"] <= above + near


@pytest.mark.multiprocess  # a `liger-kd serve` subprocess
@pytest.mark.skipif(not fp8_available(torch.device("cpu"))[0], reason=fp8_available(torch.device("cpu"))[1])
@pytest.mark.parametrize("precision", ["fp8", "fp8_fast_accum"])
def test_fp8_server_serves_the_quantised_teacher(teacher_dir, precision):
    """`liger-kd serve --precision fp8` (or fp8_fast_accum): the replies are those of the teacher quantised in
    process, and not the bf16 teacher's (the flag took effect)."""
    from liger_patch_kd.models import apply_teacher_precision

    seqs = [r.tolist() for r in _rows(3)]
    srv = Server(teacher_dir, extra=("--precision", precision, "--dtype", "bfloat16")).start()
    try:
        served = TD.TeacherClient(srv.url, "liger", top_k=TOP_K, vocab_size=VOCAB).fetch(seqs)
    finally:
        srv.stop()
    bf16 = _teacher().to(torch.bfloat16).eval().requires_grad_(False)
    fp8 = _teacher().to(torch.bfloat16).eval().requires_grad_(False)
    apply_teacher_precision(fp8, precision)
    for seq, (ids, values) in zip(seqs, served):
        with torch.no_grad():
            logits = {m: m(torch.tensor([seq])).logits[0].float() for m in (bf16, fp8)}
        logp = {m: torch.log_softmax(z, -1) for m, z in logits.items()}
        top = logp[fp8].topk(TOP_K, -1)
        # the server takes its head's products in fp32, the model's own logits (the reference) are rounded to bf16:
        # the served first choice is the reference's best up to that rounding (ties of the x40 head break either way)
        served_first = logp[fp8].gather(-1, ids[:-1, :1].clamp_min(0))[:, 0]
        rounding = 2.0**-8 * float(logits[fp8].abs().max())
        assert bool((top.values[:-1, 0] - served_first <= rounding).all()), (top.values[:-1, 0] - served_first)
        near = (values[:-1, 0] - top.values[:-1, 0]).abs().max()
        far = (values[:-1, 0] - logp[bf16].gather(-1, ids[:-1, :1].clamp_min(0))[:, 0]).abs().max()
        assert near < far, (near, far)


@pytest.mark.multiprocess  # a `liger-kd serve` subprocess
def test_concurrent_requests_are_batched(server):
    client = TD.TeacherClient(server.url, "liger", top_k=TOP_K, vocab_size=VOCAB, sequences_per_request=1,
                              max_in_flight=8)  # fmt: skip
    seqs = [r.tolist() for r in _rows(16, seed=1)]
    before = json.loads(urllib.request.urlopen(server.url + "/health").read())["batches_run"]
    together = client.fetch(seqs)
    after = json.loads(urllib.request.urlopen(server.url + "/health").read())["batches_run"]
    assert after - before < len(seqs)  # some requests shared a teacher forward
    teacher = _teacher()
    for seq, (i, v) in zip(seqs, together):  # and each got its own rows: batched and alone agree to SERVED_ATOL
        j, w = client.fetch([seq])[0]
        with torch.no_grad():
            ref = torch.log_softmax(teacher(torch.tensor([seq])).logits[0].double(), -1)
        assert_same_topk(i[:-1], v[:-1], ref[:-1])
        assert_same_topk(j[:-1], w[:-1], ref[:-1])


def _args(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=8, learning_rate=5e-3,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        data_seed=0, dataloader_num_workers=0, kd_beta=0.5, use_kd_patch=True,
        kd_patch_config={"rope": False, "swiglu": False, "rms_norm": False},  # the fused loss only: fast on CPU
    )  # fmt: skip
    return KDTrainingArguments(**{**base, **overrides})


def _train(tmp_path, data, collator=None, callbacks=None, **overrides):
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    trainer = KDTrainer(model=student, args=_args(tmp_path, **overrides), train_dataset=data,
                        data_collator=collator or TD.TeacherDataCollator(), callbacks=callbacks)  # fmt: skip
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, [p.detach().clone() for p in student.parameters()], trainer


def _assert_same_training(losses, params, want_losses, want_params):
    """Float32 student trained on teacher rows that may differ by float32 ulps. Measured: 30 % of a store's log-probs
    moved by one ulp move these losses by <= 1.8e-7 relative and the weights by <= 1.1e-6 after the Adam steps (lr
    5e-3; an EPYC saw 1.1e-7 on a loss); allowed: 1e-5 for both. Wrong teacher rows or a lost step move each Adam
    step's weights by ~lr = 5e-3 and the loss by > 1e-3."""
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
    for a, b in zip(params, want_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def offline_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("store")
    rows = _rows()
    TD.precompute(_teacher(), [r.tolist() for r in rows], path, top_k=TOP_K, batch_size=1,
                  logprob_dtype="float32", progress=False)  # fmt: skip
    return rows, TD.TeacherLogprobsDataset(path, vocab_size=VOCAB)


@pytest.mark.multiprocess  # a `liger-kd serve` subprocess
def test_training_against_the_server_equals_training_from_a_store(tmp_path, server, offline_store):
    """Same seed, same data order, gradient accumulation, two epochs: the same losses and weights, up to the float32
    ulps by which the served log-probs may differ from the store's (the store ran one sequence per forward, the server
    batches by arrival time: see SERVED_ATOL)."""
    rows, store = offline_store
    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=5)
    offline_losses, offline_params, _ = _train(tmp_path / "offline", store, **common)
    served_losses, served_params, _ = _train(tmp_path / "served", [{"input_ids": r} for r in rows],
                                             kd_teacher_url=server.url, kd_teacher_protocol="liger",
                                             kd_teacher_top_k=TOP_K, **common)  # fmt: skip
    assert len(served_losses) == 5
    _assert_same_training(served_losses, served_params, offline_losses, offline_params)


@pytest.mark.multiprocess  # a `liger-kd serve` subprocess
def test_packed_batches_get_each_sequences_teacher_rows(server):
    from transformers import DataCollatorWithFlattening

    rows = _rows(3, seed=2)
    client = TD.TeacherClient(server.url, "vllm", top_k=TOP_K, vocab_size=VOCAB)
    packed = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": r.tolist()} for r in rows])
    batches = list(prefetch.TeacherPrefetcher([packed, TD.TeacherDataCollator()([{"input_ids": r} for r in rows])],
                                              client, depth=2))  # fmt: skip
    flat, padded = batches
    start = 0
    for row, r in enumerate(rows):
        n = len(r)
        for key in ("teacher_token_ids", "teacher_logprobs"):
            assert torch.equal(flat[key][0, start : start + n], padded[key][row, :n])
            assert (padded[key][row, n:] == (-1 if key == "teacher_token_ids" else -math.inf)).all()
        assert (flat["teacher_token_ids"][0, start + n - 1] == -1).all()  # no teacher row across the boundary
        start += n
    student = M.apply_kd_patch_to_llama(model=tiny_model("llama", seed=1), reduction="sum")
    # float64 student, but packed (1 x sum(n)) and padded (3 x max(n)) batches go through BLAS and attention in other
    # shapes and reduction orders: ~1e-9 relative on an EPYC's BLAS; a teacher row given to another sequence is O(1)
    torch.testing.assert_close(student(**flat).loss, student(**padded).loss, rtol=1e-7, atol=1e-10)


@pytest.mark.multiprocess  # a `liger-kd serve` subprocess
def test_training_with_packing_against_the_server(tmp_path, server):
    from transformers import DataCollatorWithFlattening

    data = [{"input_ids": r.tolist()} for r in _rows()]
    losses, _, _ = _train(tmp_path, data, DataCollatorWithFlattening(return_tensors="pt"), max_steps=4,
                          kd_teacher_url=server.url, kd_teacher_top_k=TOP_K)  # fmt: skip
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)


@pytest.mark.multiprocess  # a `liger-kd serve` subprocess
def test_server_killed_mid_run_and_restarted(tmp_path, teacher_dir, server):
    """The server dies after step 1 (by its PID) and comes back: the retries carry training on, to the very same
    result as a run that never lost it."""
    from transformers import TrainerCallback

    rows = [{"input_ids": r} for r in _rows(8)]  # two batches an epoch: the second epoch's requests meet no server
    flaky = Server(teacher_dir).start()
    common = dict(kd_teacher_top_k=TOP_K, kd_teacher_protocol="liger", kd_teacher_retries=8, max_steps=4)
    state = {}

    class KillAtStep1(TrainerCallback):
        def on_step_end(self, args, st, control, train_dataloader=None, **kwargs):
            state["loader"] = train_dataloader
            if st.global_step == 1:
                flaky.stop()
                threading.Timer(1.0, lambda: flaky.start(wait=False)).start()

    try:
        losses, params, _ = _train(tmp_path / "flaky", rows, callbacks=[KillAtStep1()], kd_teacher_url=flaky.url,
                                   **common)  # fmt: skip
    finally:
        flaky.stop()
    assert state["loader"].client.retried > 0  # the lost server was noticed and waited for
    steady_losses, steady_params, _ = _train(tmp_path / "steady", rows, kd_teacher_url=server.url, **common)
    _assert_same_training(losses, params, steady_losses, steady_params)  # batches met the batcher differently


class _Stub(http.server.BaseHTTPRequestHandler):
    """/health answers; POST replies as `behaviour` says: hang, or fail with 503 `fail` times and then answer."""

    behaviour: dict = {}

    def do_GET(self):
        self._reply(200, b'{"status": "ok", "data": [{"id": "stub"}]}', "application/json")

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        b = type(self).behaviour
        if b.get("hang"):
            b["release"].wait(30)
            return
        b["posts"] = b.get("posts", 0) + 1
        if b["posts"] <= b.get("fail", 0):
            self._reply(503, b"busy", "text/plain")
        elif b.get("bad_request"):
            self._reply(400, b"prompt_logprobs too large", "text/plain")
        else:
            ids = torch.stack([torch.arange(TOP_K, dtype=torch.int32), torch.full((TOP_K,), -1, dtype=torch.int32)])
            topk = (ids, torch.tensor([[-3.0] * TOP_K, [-math.inf] * TOP_K]))  # a distribution's top-k, row-aligned
            self._reply(200, protocols.encode_binary([topk], [[1, 2]]), protocols.BINARY_MEDIA_TYPE)

    def _reply(self, code, payload, content_type):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    srv.daemon_threads = True
    _Stub.behaviour = {"release": threading.Event()}
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", _Stub.behaviour
    _Stub.behaviour["release"].set()
    srv.shutdown()


def test_5xx_is_retried_and_4xx_is_not(stub):
    url, behaviour = stub
    behaviour["fail"] = 2
    client = TD.TeacherClient(url, "liger", top_k=TOP_K, vocab_size=VOCAB, retries=2, backoff=0.01)
    ((ids, _),) = client.fetch([[1, 2]])
    assert ids.shape == (2, TOP_K) and client.retried == 2
    behaviour.update(posts=0, fail=5)
    with pytest.raises(TD.TeacherServerError, match=rf"{url}/v1/completions failed 3 times .*HTTP 503"):
        client.fetch([[1, 2]])
    behaviour.update(posts=0, fail=0, bad_request=True)
    retried = client.retried
    with pytest.raises(TD.TeacherServerError, match="refused the request: HTTP 400: prompt_logprobs too large"):
        client.fetch([[1, 2]])
    assert client.retried == retried and behaviour["posts"] == 1  # a 4xx is not sent again


def test_a_server_that_never_answers_stops_training_with_the_timeout_error(tmp_path, stub):
    url, behaviour = stub
    behaviour["hang"] = True
    start = time.monotonic()
    with pytest.raises(TD.TeacherTimeoutError, match=rf"{url}/v1/completions sent nothing for 1.5 s"):
        _train(tmp_path, [{"input_ids": r} for r in _rows(8)], kd_teacher_url=url, kd_teacher_protocol="liger",
               kd_teacher_top_k=TOP_K, kd_teacher_timeout=1.5, max_steps=2)  # fmt: skip
    assert time.monotonic() - start < 20


def test_server_down_at_start_is_a_clear_error_within_the_timeout(tmp_path):
    url = f"http://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    with pytest.raises(TD.TeacherServerError, match=rf"no teacher server answers at {url}/health within 2 s"):
        _train(tmp_path, [{"input_ids": r} for r in _rows(8)], kd_teacher_url=url, kd_teacher_top_k=TOP_K,
               kd_teacher_timeout=2, max_steps=2)  # fmt: skip
    assert time.monotonic() - start < 2 + 5


def test_an_address_where_nothing_listens_fails_in_its_retries_not_the_whole_timeout(tmp_path, caplog):
    """Connection refused by a host that is up: the wait is said at once (the URL, the timeout, the retries), then
    kd_teacher_retries tries, not kd_teacher_timeout's 120 s."""
    url = f"http://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="liger_patch_kd.teacher.client.client"):
        with pytest.raises(TD.TeacherServerError, match=rf"nothing listens at {url} \(.*Connection refused; tried 3 "
                                                        rf"times .*kd_teacher_retries"):  # fmt: skip
            _train(tmp_path, [{"input_ids": r} for r in _rows(8)], kd_teacher_url=url, kd_teacher_top_k=TOP_K,
                   kd_teacher_timeout=120, kd_teacher_retries=2, max_steps=2)  # fmt: skip
    assert time.monotonic() - start < 30  # the retries wait 0.5 + 1 s; the timeout was 120 s
    said = [r.getMessage() for r in caplog.records if "does not answer yet" in r.getMessage()]
    assert len(said) == 1 and f"{url}/health" in said[0] and "waiting up to 120 s" in said[0], said
    assert "2 retries" in said[0]


def test_a_server_that_starts_listening_within_the_retries_is_waited_for():
    """Refused at first (a server still starting), then answering: the client waits for it."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"

    def start_late():
        time.sleep(1.0)
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Stub)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()

    threading.Thread(target=start_late, daemon=True).start()
    client = TD.TeacherClient(url, "liger", top_k=TOP_K, vocab_size=VOCAB, retries=6, backoff=0.1, timeout=60)
    client.wait_until_ready()  # refused for about 1 s: within 6 retries from 0.1 s (6.3 s in all)


def test_a_server_that_listens_but_is_loading_is_waited_for_the_timeout():
    """`liger-kd serve` listens before its weights load (validation.listening_socket): a client connecting then is
    not refused, so it waits for the timeout, however few its retries."""
    from liger_patch_kd.server.validation import listening_socket

    with listening_socket("127.0.0.1", 0) as loading:  # listening, never answering: the teacher still loading
        url = f"http://127.0.0.1:{loading.getsockname()[1]}"
        client = TD.TeacherClient(url, "liger", top_k=TOP_K, vocab_size=VOCAB, retries=0, timeout=1.5)
        start = time.monotonic()
        with pytest.raises(TD.TeacherServerError, match=rf"no teacher server answers at {url}/health within 1.5 s"):
            client.wait_until_ready()
        assert time.monotonic() - start >= 1.5


@pytest.mark.multiprocess  # a `liger-kd serve` subprocess
def test_auto_protocol_speaks_binary_to_liger_kd_serve(tmp_path, server, caplog, monkeypatch):
    """kd_teacher_protocol's default, "auto": the real server's /v1/models says owned_by liger-kd, so the batches'
    top-k come as binary replies (not vLLM's JSON), the choice logged once."""
    assert KDTrainingArguments(output_dir=str(tmp_path)).kd_teacher_protocol == "auto"
    decoded, original = [], protocols.decode_binary
    monkeypatch.setattr(protocols, "decode_binary", lambda *a, **k: decoded.append(1) or original(*a, **k))
    with caplog.at_level("INFO", logger="liger_patch_kd.teacher.client.client"):
        losses, _, trainer = _train(tmp_path, [{"input_ids": r} for r in _rows(8)], kd_teacher_url=server.url,
                                    kd_teacher_top_k=TOP_K, max_steps=2)  # fmt: skip
    assert trainer.teacher_source.prefetcher.client.protocol == "liger" and decoded
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    said = [r.getMessage() for r in caplog.records if "protocol 'auto'" in r.getMessage()]
    assert len(said) == 1 and f"{server.url}/v1/models says owned_by 'liger-kd'" in said[0] and "'liger'" in said[0]


class _FakeVLLM(http.server.BaseHTTPRequestHandler):
    """A server that is not ours, as vLLM answers: /v1/models owned_by vllm, /v1/completions' prompt_logprobs in
    JSON (whatever the Accept header), each position the top TOP_K of one fixed distribution. Records what it was
    asked to send (`accepts`)."""

    accepts: list = []
    logprobs = torch.log_softmax(torch.linspace(4.0, -4.0, VOCAB, dtype=torch.float64), -1)

    def do_GET(self):
        if self.path == "/v1/models":
            body = {"object": "list", "data": [{"id": "fake-vllm", "object": "model", "owned_by": "vllm"}]}
        else:
            body = {}
        self._reply(json.dumps(body).encode())

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).accepts.append(self.headers["Accept"])
        def position(token):  # the top K, and the prompt's own token (ids rank in order: linspace falls)
            ids = {*range(request["prompt_logprobs"]), token}
            return {str(i): {"logprob": float(self.logprobs[i]), "rank": i + 1, "decoded_token": "t"} for i in ids}

        choices = [{"index": n, "text": "", "prompt_logprobs": [None] + [position(t) for t in p[1:]]}
                   for n, p in enumerate(request["prompt"])]  # fmt: skip
        self._reply(json.dumps({"choices": choices}).encode())

    def _reply(self, payload):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def test_auto_protocol_speaks_json_to_a_server_that_is_not_ours(tmp_path, caplog):
    """Against a vLLM-style server, "auto" asks for vLLM's JSON (Accept: application/json), logged once; an explicit
    protocol is kept as given; sampled tokens, which only `liger-kd serve` draws, are refused naming the server."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeVLLM)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        _FakeVLLM.accepts = []
        with caplog.at_level("INFO", logger="liger_patch_kd.teacher.client.client"):
            losses, _, trainer = _train(tmp_path, [{"input_ids": r} for r in _rows(8)], kd_teacher_url=url,
                                        kd_teacher_top_k=TOP_K, max_steps=2)  # fmt: skip
        assert trainer.teacher_source.prefetcher.client.protocol == "vllm"
        assert _FakeVLLM.accepts and set(_FakeVLLM.accepts) == {"application/json"}
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
        said = [r.getMessage() for r in caplog.records if "protocol 'auto'" in r.getMessage()]
        assert len(said) == 1 and "owned_by 'vllm'" in said[0] and "'vllm' protocol" in said[0]
        ((ids, values),) = TD.TeacherClient(url, top_k=TOP_K, vocab_size=VOCAB).fetch([[1, 2, 3]])
        assert ids[0].tolist() == list(range(TOP_K)) and (ids[-1] == -1).all()  # the fixed distribution's top
        torch.testing.assert_close(values[0].double(), _FakeVLLM.logprobs[:TOP_K], rtol=0, atol=1e-6)
        _FakeVLLM.accepts = []
        explicit = TD.TeacherClient(url, "liger", top_k=TOP_K, vocab_size=VOCAB)
        explicit.fetch([[1, 2, 3]])
        assert explicit.protocol == "liger" and _FakeVLLM.accepts == [protocols.BINARY_MEDIA_TYPE]
        sampled = TD.TeacherClient(url, top_k=0, vocab_size=VOCAB, samples=4)
        with pytest.raises(TD.TeacherServerError, match=rf"served by `liger-kd serve` only, and {url}/v1/models "
                                                        rf"says owned_by 'vllm'"):  # fmt: skip
            sampled.fetch([[1, 2, 3]])
    finally:
        srv.shutdown()
    owners = ("liger-kd", "sglang", "vllm", None)
    assert [protocol_for(o) for o in owners] == ["liger", "sglang", "vllm", "vllm"]  # SGLang's owned_by: sglang


def test_served_teacher_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="kd_teacher_protocol"):
        _args(tmp_path, kd_teacher_url="http://x", kd_teacher_protocol="grpc")
    with pytest.raises(ValueError, match="kd_seq_kd"):
        _args(tmp_path, kd_teacher_url="http://x", kd_seq_kd=True)
    with pytest.raises(ValueError, match="not both"):
        KDTrainer(model=tiny_model("llama"), teacher_model=tiny_model("llama"),
                  args=_args(tmp_path, kd_teacher_url="http://x"))  # fmt: skip


@pytest.mark.multiprocess
def test_on_policy_rollouts_are_scored_by_the_served_teacher(tmp_path, server):
    """kd_lmbda=1 with kd_teacher_url: every generated micro-batch is sent to the real server before it trains, and
    each completion position carries the teacher's own top-k of that generated text."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(8):
        ids = torch.randint(3, VOCAB, (5,), generator=g)
        rows.append({"input_ids": ids, "labels": torch.full_like(ids, -100)})  # prompts only
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    args = _args(tmp_path, kd_teacher_url=server.url, kd_teacher_protocol="liger", kd_teacher_top_k=TOP_K,
                 kd_lmbda=1.0, kd_max_new_tokens=4, max_steps=2, per_device_train_batch_size=2,
                 gradient_accumulation_steps=2)  # fmt: skip
    trainer = KDTrainer(model=student, args=args, train_dataset=rows, data_collator=TD.TeacherDataCollator())
    trainer.get_train_dataloader()  # connects the served teacher
    (batch,) = trainer.onpolicy.replace(
        student, [TD.TeacherDataCollator()(rows[:2])], tokenizer=None, step=0, device=torch.device("cpu"),
        attach_teacher=trainer._served.with_teacher,
    )  # fmt: skip
    teacher = _teacher()
    for row in range(2):
        keep = batch["attention_mask"][row].bool()
        seq = batch["input_ids"][row][keep]
        with torch.no_grad():
            ref = torch.log_softmax(teacher(seq[None]).logits[0].double(), -1)
        ids, values = batch["teacher_token_ids"][row][keep], batch["teacher_logprobs"][row][keep]
        assert_same_topk(ids[:-1], values[:-1], ref[:-1])  # the last position has no next token to score
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    # one generation pass per optimizer step, after the one made by hand above
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))) and len(trainer.kd_rollout_seconds) == 3


@pytest.mark.multiprocess  # a `liger-kd serve` subprocess
def test_evaluation_against_the_server_equals_evaluation_from_a_store(tmp_path, server, offline_store):
    """trainer.evaluate() asks the server about the evaluation rows as training asks about its own: the eval_loss is
    the store's (the in-process teacher's top-k, precomputed), up to the served float32 ulps (SERVED_ATOL); and
    evaluations during training (eval_strategy="steps") are asked while the training batches' requests are in
    flight."""
    rows, store = offline_store
    plain = [{"input_ids": r} for r in rows]
    common = dict(per_device_eval_batch_size=3, max_steps=2, eval_strategy="steps", eval_steps=1)

    def trainer(data, **overrides):
        return KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1), train_dataset=data,
                         eval_dataset=data, args=_args(tmp_path, **common, **overrides),
                         data_collator=TD.TeacherDataCollator())  # fmt: skip

    served = trainer(plain, kd_teacher_url=server.url, kd_teacher_protocol="liger", kd_teacher_top_k=TOP_K)
    want, got = trainer(store).evaluate()["eval_loss"], served.evaluate()["eval_loss"]
    assert want > 0
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    served.train()
    evaluated = [h["eval_loss"] for h in served.state.log_history if "eval_loss" in h]
    assert len(evaluated) == 2 and all(math.isfinite(x) for x in evaluated)


def test_a_calls_sequences_fill_requests_of_one_server_batch():
    """A step's rows go out in requests of up to tokens_per_request padded tokens (the longest times their number),
    in order, at least one sequence each (a longer one alone), so they fill the server's forwards instead of
    arriving four at a time; sequences_per_request fixes the count instead."""
    client = TD.TeacherClient("http://127.0.0.1:9", "liger", top_k=1, vocab_size=10, tokens_per_request=1000)
    seqs = [[1] * n for n in (100, 100, 300, 50, 2000, 10, 10)]
    chunks = client.requests_of(seqs)
    assert [len(c) for c in chunks] == [3, 1, 1, 2]  # 3 x 300 <= 1000 < 4 x 300; 2000 alone; 2 x 10
    assert [s for c in chunks for s in c] == seqs
    assert all(max(map(len, c)) * len(c) <= 1000 for c in chunks if len(c) > 1)
    fixed = TD.TeacherClient("http://127.0.0.1:9", "liger", top_k=1, vocab_size=10, sequences_per_request=2)
    assert [len(c) for c in fixed.requests_of(seqs)] == [2, 2, 2, 1]
    for bad in (dict(sequences_per_request=0), dict(tokens_per_request=0)):
        with pytest.raises(ValueError, match="sequences_per_request >= 1"):
            TD.TeacherClient("http://127.0.0.1:9", "liger", top_k=1, vocab_size=10, **bad)
