"""An engine's bad replies never train silently: a behaviour log-prob no sampled token can
have, a completion longer than asked, a missing / repeated choice, an empty completion, each refused in one line
naming the choice and the fix, or (an empty completion that stopped at EOS) trained as the in-process rollouts
train it; and a PEFT run leaves no adapter on the engine (a full-weight run against it works next)."""

import http.server
import json
import threading
from contextlib import contextmanager

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from liger_patch_kd.trainer import KDTrainer  # noqa: E402
from liger_patch_kd.trainer.rollouts.engine import logprob_floor, rollouts_from_reply  # noqa: E402
from liger_patch_kd.trainer.rollouts.generate import RolloutSettings, generate_rollouts, rollout_batch  # noqa: E402
from liger_patch_kd.wire import TeacherReplyError  # noqa: E402

from .test_generation_server import running  # noqa: E402
from .test_onpolicy import PROMPTS, _args, tokenizer  # noqa: E402, F401
from .tiny_models import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_patches")
EOS = 2


@contextmanager
def fake_engine(complete):
    """An engine on 127.0.0.1 answering /v1/completions with the JSON text `complete(body)` returns, every other
    POST (weight pushes) with success, GET /v1/models with one model."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self._send(json.dumps({"data": [{"id": "fake"}]}))

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self._send(complete(body) if self.path == "/v1/completions" else json.dumps({"success": True}))

        def _send(self, text):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(text.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


def choices_text(body, tokens, logprobs, finish="stop"):
    """The JSON text of a reply giving every (prompt, generation) of `body` the same completion; `logprobs` are
    spliced in as JSON text, so they may be -Infinity or NaN as a server writes them."""
    rows = [
        f'{{"index": {i}, "token_ids": {json.dumps(tokens)}, "finish_reason": {json.dumps(finish)}, '
        f'"logprobs": {{"token_logprobs": [{", ".join(logprobs)}]}}}}'
        for i in range(len(body["prompt"]) * body["n"])
    ]
    return f'{{"choices": [{", ".join(rows)}]}}'


def parse(text, settings, prompts=([1, 5], [7]), need_logprobs=False):
    return rollouts_from_reply(json.loads(text), list(prompts), settings, {EOS}, 50, "req", need_logprobs=need_logprobs)


SETTINGS = RolloutSettings(max_new_tokens=4, num_generations=2)
BODY = {"prompt": [[1, 5], [7]], "n": 2}


@pytest.mark.parametrize("value", ["-9999.0", "-Infinity", "NaN", "-1e30", "1e400", "-126.0", "0.25", '"x"', "null",
                                   "true"])  # fmt: skip
def test_a_behaviour_logprob_no_sampled_token_can_have_is_refused_in_one_line(value):
    good = choices_text(BODY, [5, 6, EOS], ["-1.0", "-0.5", "-0.1"])
    assert [r.logprobs for r in parse(good, SETTINGS)][0] == (-1.0, -0.5, -0.1)
    reply = json.loads(good)
    reply["choices"][1]["logprobs"]["token_logprobs"][1] = "PLACEHOLDER"
    text = json.dumps(reply).replace('"PLACEHOLDER"', value)
    with pytest.raises(TeacherReplyError) as refused:
        parse(text, SETTINGS)
    message = str(refused.value)
    assert "choice 1 (prompt 0, completion 1)" in message and "token_logprobs[1]" in message and "\n" not in message
    assert ("-9999.0, vLLM's encoding of -inf" if value == "-9999.0" else "engine") in message


def test_the_logprob_floor_is_what_float32_sampling_allows():
    # a token sampled from float32 probabilities had p >= 2**-149 among the kept tokens (mass >= 1 / V, V < 2**32)
    assert logprob_floor(1.0) == pytest.approx(-181 * 0.6931471805599453) and -126 < logprob_floor(0.7) < -125
    assert logprob_floor(2.0) == 2 * logprob_floor(1.0)  # at T >= 1 the raw log-prob is >= T x the tempered one
    torch.manual_seed(0)  # the bound holds: a raw log-prob sampled at T = 2 from logits spread over 200 nats
    logits = torch.randn(20, 1000) * 60
    drawn = torch.multinomial((logits / 2).softmax(-1), 50, replacement=True)
    assert float(logits.log_softmax(-1).gather(-1, drawn).min()) >= logprob_floor(2.0)
    near = choices_text(BODY, [5, 6, EOS], ["-120.0", "-0.5", "-0.1"])  # rare but possible at T = 1
    assert parse(near, SETTINGS)[0].logprobs[0] == -120.0
    hot = choices_text(BODY, [5, 6, EOS], ["-240.0", "-0.5", "-0.1"])
    assert parse(hot, RolloutSettings(max_new_tokens=4, num_generations=2, temperature=2.0))[0].logprobs[0] == -240.0


def test_an_absurd_behaviour_logprob_stops_the_pg_run_before_any_weight_moves(tmp_path, tokenizer):  # noqa: F811
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    before = [p.detach().clone() for p in student.parameters()]
    with fake_engine(lambda body: choices_text(body, [5, 6, EOS], ["-1.0", "-9999.0", "-0.5"])) as url:
        trainer = KDTrainer(
            model=student, teacher_model=tiny_model("llama", dtype=torch.float32, seed=2), processing_class=tokenizer,
            args=_args(tmp_path, kd_generation_url=url, kd_onpolicy_loss="pg", max_steps=2), train_dataset=PROMPTS,
        )  # fmt: skip
        with pytest.raises(TeacherReplyError, match=r"token_logprobs\[1\] = -9999.0, vLLM's encoding of -inf"):
            trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, student.parameters()))


@pytest.mark.parametrize(
    "tokens, finish, message",
    [
        (list(range(10, 54)), "length", "44 tokens for max_tokens=4"),  # 44 tokens when 4 were asked
        ([], "length", "0 tokens with no EOS and finish_reason 'length' for max_tokens=4"),
        ([5, 6], "length", "2 tokens with no EOS and finish_reason 'length'"),  # cut short, no reason given
        ([5, 6], "abort", "finish_reason 'abort'"),  # vLLM's aborted request
        ([5, 6, 7, 8], None, "finish_reason None"),
        # 4 tokens, no EOS, "stop": the EOS it did not return was appended as a 5th token (past max_tokens)
        ([5, 6, 7, 8], "stop", r"finish_reason 'stop' after 4 tokens \(max_tokens=4\) with no EOS"),
    ],
)
def test_engine_replies_are_length_checked(tokens, finish, message):
    text = choices_text(BODY, tokens, ["-1.0"] * len(tokens), finish=finish)
    with pytest.raises(TeacherReplyError, match=message):
        parse(text, SETTINGS)
    assert len(parse(choices_text(BODY, [5, 6, 7, 8], ["-1.0"] * 4, finish="length"), SETTINGS)) == 4


def test_missing_extra_or_repeated_choices_are_refused():
    reply = json.loads(choices_text(BODY, [5, EOS], ["-1.0", "-0.5"]))
    for choices, message in [
        (reply["choices"][:3], "3 choices for 2 prompts x n=2"),
        (reply["choices"] + reply["choices"][:1], "5 choices for 2 prompts x n=2"),
        ([reply["choices"][0]] * 4, r"indices \[0, 0, 0, 0\] are not 0 .. 3 once each"),
        ([{**c, "index": None} for c in reply["choices"]], "indices"),
    ]:
        with pytest.raises(TeacherReplyError, match=message):
            parse(json.dumps({"choices": choices}), SETTINGS)


def eos_first(model):
    """`model` made to emit EOS first: +100 on its EOS logit."""
    bonus = torch.zeros(model.config.vocab_size)
    bonus[EOS] = 100.0
    model.lm_head.register_forward_hook(lambda module, inputs, out: out + bonus.to(out.dtype))
    return model


def test_an_empty_completion_that_stopped_trains_its_eos_as_the_in_process_rollouts_do():
    prompts = [[1, 5], [7]]
    in_process = generate_rollouts(eos_first(tiny_model("llama", dtype=torch.float32, seed=1)), prompts, SETTINGS,
                                   pad_id=0, eos_ids={EOS}, start_id=1)  # fmt: skip
    assert [r.completion for r in in_process] == [[EOS]] * 4  # the EOS is kept: the loss scores stopping
    returned = parse(choices_text(BODY, [EOS], ["-0.01"]), SETTINGS)  # vLLM returns the stop token
    dropped = parse(choices_text(BODY, [], []), SETTINGS)  # an engine that dropped it
    for rollouts in (returned, dropped):
        assert [(r.prompt, r.completion, r.finished) for r in rollouts] == [
            (r.prompt, r.completion, r.finished) for r in in_process
        ]
    batch = rollout_batch(dropped, pad_id=0)
    assert torch.equal(batch["labels"], rollout_batch(in_process, pad_id=0)["labels"])
    assert int((batch["labels"] == EOS).sum()) == 4  # one scored token per row, never a row at loss 0
    # stop_reason names which of several EOS ids ended it; the pg loss needs the dropped token's log-prob
    several = json.loads(choices_text(BODY, [], []))
    for c in several["choices"]:
        c["stop_reason"] = 9
    assert parse(json.dumps(several), SETTINGS, need_logprobs=False)[0].completion == [EOS]  # 9 is no EOS
    named = rollouts_from_reply(several, prompts, SETTINGS, {EOS, 9}, 50, "req")
    assert named[0].completion == [9] and named[0].logprobs is None
    del several["choices"][0]["stop_reason"]
    with pytest.raises(TeacherReplyError, match="stop_reason None, one of \\[2, 9\\]"):
        rollouts_from_reply(several, prompts, SETTINGS, {EOS, 9}, 50, "req")
    with pytest.raises(TeacherReplyError, match="stopped at EOS / stop id 2 without returning it.*kd_onpolicy_loss"):
        parse(choices_text(BODY, [], []), SETTINGS, need_logprobs=True)


def test_a_step_of_empty_engine_completions_trains_like_the_in_process_step(tmp_path, tokenizer):  # noqa: F811
    """The engine answers every prompt with nothing but a stop: the step trains each row's EOS, the loss the
    in-process rollouts of a student that emits EOS first give (not 0)."""
    teacher = tiny_model("llama", dtype=torch.float32, seed=2)
    losses = {}
    with fake_engine(lambda body: choices_text(body, [], [])) as url:
        for where, extra in (("in process", {}), ("engine", {"kd_generation_url": url})):
            trainer = KDTrainer(
                model=eos_first(tiny_model("llama", dtype=torch.float32, seed=1)), teacher_model=teacher,
                processing_class=tokenizer, args=_args(tmp_path, max_steps=1, **extra), train_dataset=PROMPTS,
            )  # fmt: skip
            trainer.train()
            losses[where] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses["engine"][0] > 1e-5, losses  # all rows ignored would be exactly 0
    torch.testing.assert_close(losses["engine"], losses["in process"], rtol=1e-6, atol=0)


class Spy:
    """A rollout source that runs `before()` ahead of each call."""

    def __init__(self, inner, before):
        self.inner, self.before = inner, before

    def __call__(self, *args, **kwargs):
        self.before()
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_peft_run_unloads_its_adapter_and_a_full_weight_run_then_works(tmp_path, tokenizer):  # noqa: F811
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    teacher = tiny_model("llama", dtype=torch.float32, seed=2)
    with running(tiny_model("llama", dtype=torch.float32, seed=1)) as (url, app):
        engine = app.state.engine
        seen = []
        trainer = KDTrainer(
            model=peft.get_peft_model(tiny_model("llama", dtype=torch.float32, seed=1), lora), teacher_model=teacher,
            processing_class=tokenizer, args=_args(tmp_path, kd_generation_url=url, max_steps=2), train_dataset=PROMPTS,
        )  # fmt: skip
        trainer.onpolicy.source = Spy(trainer.onpolicy.source, lambda: seen.append(set(engine.adapters)))
        trainer.train()
        assert [len(s) for s in seen] == [0, 1] and engine.adapters == {}  # loaded, then unloaded at the end
        # a failed PEFT run unloads too
        failing = KDTrainer(
            model=peft.get_peft_model(tiny_model("llama", dtype=torch.float32, seed=1), lora), teacher_model=teacher,
            processing_class=tokenizer, args=_args(tmp_path, kd_generation_url=url, max_steps=2), train_dataset=PROMPTS,
        )  # fmt: skip

        def broken(*args, **kwargs):
            assert engine.adapters  # the adapter is on the engine while the step trains
            raise RuntimeError("a step fails")

        failing.compute_loss = broken
        with pytest.raises(RuntimeError, match="a step fails"):
            failing.train()
        assert engine.adapters == {}
        # the engine is the base model again: a full-weight run pushes its weights every step
        full = KDTrainer(
            model=tiny_model("llama", dtype=torch.float32, seed=3), teacher_model=teacher, processing_class=tokenizer,
            args=_args(tmp_path, kd_generation_url=url, max_steps=2), train_dataset=PROMPTS,
        )  # fmt: skip
        full.train()
        assert engine.weight_version == 2


def test_an_unload_that_fails_at_the_end_warns_and_leaves_nothing_of_ours(monkeypatch):
    from liger_patch_kd.teacher.client.transport import HttpEndpoint, TeacherServerError
    from liger_patch_kd.trainer.rollouts import weight_sync
    from liger_patch_kd.trainer.rollouts.weight_sync import WeightSync

    warned = []
    monkeypatch.setattr(weight_sync.logger, "warning", warned.append)

    class Down(HttpEndpoint):
        def post_json(self, path, body):
            raise TeacherServerError(f"{self.url}{path} is down")

    sync = WeightSync(Down("http://127.0.0.1:1", timeout=1, retries=0), every=1)
    sync._on_engine.append("liger-kd-x-step0")
    sync.loaded_name = sync.model_name = "liger-kd-x-step0"
    root = sync._directory()
    sync.close()  # no raise: a failed run's own error must not be hidden by its cleanup
    assert not root.exists() and sync.synced_step is None and sync.model_name is None
    assert len(warned) == 1 and "could not unload the LoRA adapter 'liger-kd-x-step0'" in warned[0]
