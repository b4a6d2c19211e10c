"""API keys stay secret: kd_teacher_api_key / kd_generation_api_key are used in the run but never
written (no file of the output directory holds them: checkpoints' training_args.bin included, which push_to_hub
uploads), never shown (to_dict, to_json_string, str, repr, the logs), and the HTTP client never sends
`Authorization` to another origin when a server redirects."""

import copy
import http.server
import json
import threading
from pathlib import Path

import pytest
import torch

from liger_patch_kd.teacher.client.client import TeacherClient
from liger_patch_kd.teacher.client.transport import HttpEndpoint, TeacherServerError

from .test_onpolicy import PROMPTS, _args, tokenizer  # noqa: F401
from .tiny_models import tiny_model

TEACHER_KEY = "sk-teacher-secret-5f3a9c"


def test_api_keys_never_reach_the_output_dir_or_the_serialised_args(tmp_path, capsys, tokenizer):  # noqa: F811
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from liger_patch_kd.trainer import KDTrainer

    from .test_generation_server import KEY, running

    with running(tiny_model("llama", dtype=torch.float32, seed=1), api_key=KEY) as (url, app):
        args = _args(tmp_path, kd_generation_url=url, kd_generation_api_key=KEY, kd_teacher_api_key=TEACHER_KEY,
                     max_steps=2, save_strategy="steps", save_steps=1)  # fmt: skip
        trainer = KDTrainer(
            model=tiny_model("llama", dtype=torch.float32, seed=1), processing_class=tokenizer, args=args,
            teacher_model=tiny_model("llama", dtype=torch.float32, seed=2), train_dataset=PROMPTS,
        )  # fmt: skip
        trainer.train()  # the engine wants the key: it was sent
        trainer.save_model()
        assert app.state.engine.weight_version == 2
    written = [p for p in Path(args.output_dir).rglob("*") if p.is_file()]
    assert any(p.name == "training_args.bin" and "checkpoint-" in str(p) for p in written)
    for path in written:
        data = path.read_bytes()
        assert KEY.encode() not in data and TEACHER_KEY.encode() not in data, path
    saved = torch.load(Path(args.output_dir) / "training_args.bin", weights_only=False)
    assert saved.kd_generation_api_key is None and saved.kd_teacher_api_key is None and saved.max_steps == 2
    for shown in (args.to_json_string(), str(args), repr(args), json.dumps(args.to_sanitized_dict()),
                  capsys.readouterr().out):  # fmt: skip
        assert KEY not in shown and TEACHER_KEY not in shown
    assert '"kd_generation_api_key": "<KD_GENERATION_API_KEY>"' in args.to_json_string()
    assert args.kd_generation_api_key == KEY and copy.deepcopy(args).kd_teacher_api_key == TEACHER_KEY  # in process
    assert copy.copy(args).kd_generation_api_key == KEY


class Recording(http.server.BaseHTTPRequestHandler):
    """Answers 200 JSON and records each request's path and Authorization header on its server."""

    def do_GET(self):
        self.server.seen.append((self.command, self.path, self.headers.get("Authorization")))
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args):
        pass


def serve(handler):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def redirecting_to(target: str, code: int):
    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.server.seen.append((self.command, self.path, self.headers.get("Authorization")))
            if self.headers.get("Content-Length"):
                self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(code)
            self.send_header("Location", target + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args):
            pass

    return Redirect


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_authorization_never_follows_a_redirect_to_another_origin(code):
    other = serve(Recording)  # another port: another origin
    first = serve(redirecting_to(f"http://127.0.0.1:{other.server_port}", code))
    try:
        url = f"http://127.0.0.1:{first.server_port}"
        http_ = HttpEndpoint(url, timeout=5, retries=0, api_key="k-123")
        http_.send("GET", "/v1/models", None, "application/json")
        try:
            http_.post_json("/v1/completions", {"prompt": [[1]]})
        except TeacherServerError as e:  # urllib follows no POST redirect 307 / 308: refused, nothing forwarded
            assert code in (307, 308) and f"HTTP {code}" in str(e)
        TeacherClient(url, top_k=2, vocab_size=10, api_key="k-123").wait_until_ready(timeout=5)
        assert [a for _, _, a in first.seen] == ["Bearer k-123"] * len(first.seen)  # the server asked
        assert other.seen and all(auth is None for _, _, auth in other.seen), other.seen  # never the other origin
        assert {p for _, p, _ in other.seen} >= {"/v1/models", "/health"}
    finally:
        first.shutdown()
        other.shutdown()


def test_a_redirect_on_the_same_origin_keeps_the_key():
    class Both(Recording):
        def do_GET(self):
            if self.path.startswith("/same"):
                self.server.seen.append((self.command, self.path, self.headers.get("Authorization")))
                self.send_response(302)
                self.send_header("Location", "/landed")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            super().do_GET()

    server = serve(Both)
    try:
        HttpEndpoint(f"http://127.0.0.1:{server.server_port}", timeout=5, retries=0, api_key="k-123").send(
            "GET", "/same", None, "application/json"
        )
        assert server.seen == [("GET", "/same", "Bearer k-123"), ("GET", "/landed", "Bearer k-123")]
    finally:
        server.shutdown()
