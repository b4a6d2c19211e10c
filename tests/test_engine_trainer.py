"""On-policy rollouts from an engine (kd_generation_url) through KDTrainer.train(), against the real `liger-kd serve`
app: the student's weights (or its LoRA adapter) synced every kd_sync_steps, the engine's log-probs of the sampled
tokens equal to the student's own after each sync, staleness logged, the pg loss importance-corrected with the
engine's log-probs (checked against the materialised reference), and the engine's replies and arguments checked."""

import copy
import os

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import liger_patch_kd.models as M  # noqa: E402
from liger_patch_kd import KDLossConfig, reference  # noqa: E402
from liger_patch_kd.batch.prompts import PromptCollator  # noqa: E402
from liger_patch_kd.losses import fused_linear_jsd  # noqa: E402
from liger_patch_kd.teacher.client import TeacherServerError  # noqa: E402
from liger_patch_kd.trainer import KDTrainer  # noqa: E402
from liger_patch_kd.trainer.rollouts.engine import EngineRollouts, completion_request, rollouts_from_reply  # noqa: E402
from liger_patch_kd.trainer.rollouts.generate import BEHAVIOUR, RolloutSettings  # noqa: E402
from liger_patch_kd.trainer.rollouts.onpolicy import OnPolicySteps  # noqa: E402
from liger_patch_kd.wire import TeacherReplyError  # noqa: E402

from .test_generation_server import KEY, LOGPROB_ATOL, model_logprobs, running  # noqa: E402
from .test_onpolicy import PROMPTS, _args, tokenizer  # noqa: E402, F401
from .tiny_models import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_patches")


class Recorder:
    """Wraps a trainer's rollout source: per generated step, the largest |engine log-prob - the student's own| of
    the sampled tokens, the student's log-probs taken right then (the weights the step starts with)."""

    def __init__(self, trainer, student):
        self.inner, self.student, self.gaps = trainer.onpolicy.source, student, []
        self.root = None
        trainer.onpolicy.source = self

    def __call__(self, generator, prompts, settings, **kw):
        rollouts = self.inner(generator, prompts, settings, **kw)
        self.root = self.root or self.inner.sync._root
        gap = max(
            float((model_logprobs(self.student, r.prompt, r.completion) - torch.tensor(r.logprobs)).abs().max())
            for r in rollouts
        )
        self.gaps.append(gap)
        return rollouts

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _engine_args(tmp_path, url, **overrides):
    return _args(tmp_path, kd_generation_url=url, learning_rate=1e-2, kd_num_generations=2, **overrides)


def test_full_weight_student_trains_against_the_served_engine_synced_every_step(tmp_path, tokenizer):  # noqa: F811
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    served = tiny_model("llama", dtype=torch.float32, seed=7)  # other weights until the first push
    with running(served) as (url, app):
        trainer = KDTrainer(
            model=student, teacher_model=tiny_model("llama", dtype=torch.float32, seed=2), processing_class=tokenizer,
            args=_engine_args(tmp_path, url, bf16=True, kd_onpolicy_loss="pg", max_steps=3), train_dataset=PROMPTS,
        )  # fmt: skip
        recorder = Recorder(trainer, student)
        trainer.train()
        assert app.state.engine.weight_version == 3  # one push before each step's rollouts
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(torch.isfinite(torch.tensor([h["loss"] for h in logs])))
    assert [h["kd_rollout_staleness"] for h in logs] == [0, 0, 0]
    # after every push the engine's log-probs of its samples are the student's own (float32; LOGPROB_ATOL's note)
    assert len(recorder.gaps) == 3 and max(recorder.gaps) <= LOGPROB_ATOL, recorder.gaps
    assert recorder.root is not None and not recorder.root.exists()  # the pushed weights' directory is gone


def test_stale_rollouts_are_logged_and_importance_weighted(tmp_path, tokenizer):  # noqa: F811
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    with running(tiny_model("llama", dtype=torch.float32, seed=7)) as (url, app):
        trainer = KDTrainer(
            model=student, teacher_model=tiny_model("llama", dtype=torch.float32, seed=2), processing_class=tokenizer,
            args=_engine_args(tmp_path, url, kd_onpolicy_loss="pg", kd_sync_steps=2, max_steps=4),
            train_dataset=PROMPTS,
        )  # fmt: skip
        recorder = Recorder(trainer, student)
        seen = []
        compute_loss = trainer.compute_loss

        def spy(model, inputs, *args, **kwargs):
            seen.append(inputs.get(BEHAVIOUR))
            return compute_loss(model, inputs, *args, **kwargs)

        trainer.compute_loss = spy
        trainer.train()
        assert app.state.engine.weight_version == 2  # pushed before steps 0 and 2
    assert [h["kd_rollout_staleness"] for h in trainer.state.log_history if "loss" in h] == [0, 1, 0, 1]
    fresh, stale = recorder.gaps[0::2], recorder.gaps[1::2]
    assert max(fresh) <= LOGPROB_ATOL and min(stale) > 1e-3, recorder.gaps  # a step of lr 1e-2 shows
    assert all(b is not None and b.dtype == torch.float32 for b in seen)  # the engine's log-probs reach the loss


def pg_rollout_case(tmp_path, tokenizer):  # noqa: F811
    """A rollout batch to score with pg: (student, teacher, generated rows, scored label count, student logits,
    teacher logits), two generations of four prompts sampled from the float64 student (as float32, as an engine
    would), both models' logits on them in float64."""
    student, teacher = tiny_model("qwen3", seed=1), tiny_model("qwen3", seed=2)  # float64
    batch = PromptCollator(tokenizer)(PROMPTS[:4])
    steps = OnPolicySteps(_args(tmp_path, kd_num_generations=2))
    (generated,) = steps.replace(copy.deepcopy(student).float(), [batch], tokenizer=tokenizer, step=0,
                                 device=torch.device("cpu"))  # fmt: skip
    scored = int((generated["labels"][:, 1:] != -100).sum())
    with torch.no_grad():
        logits_s, logits_t = student(input_ids=generated["input_ids"]).logits, teacher(generated["input_ids"]).logits
    return student, teacher, generated, scored, logits_s, logits_t


@pytest.mark.parametrize("use_kd_patch", [True, False])
def test_pg_loss_with_behaviour_logprobs_equals_the_materialised_reference(tmp_path, tokenizer, use_kd_patch):  # noqa: F811
    """compute_loss on a rollout batch with the engine's log-probs: the patched (fused) and unpatched
    (materialised) paths equal reference.kd_loss on the logits with rho = exp(log q - log b); with b = q it is
    the uncorrected loss, value and gradient."""
    student, teacher, generated, scored, logits_s, logits_t = pg_rollout_case(tmp_path, tokenizer)
    labels = generated["labels"]
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    own = -reference.cross_entropy_per_row(logits_s, targets, -100)  # log q of each label, row-aligned
    g = torch.Generator().manual_seed(0)
    cases = {
        "stale": torch.where(labels != -100, -torch.rand(labels.shape, generator=g, dtype=torch.float64) * 6, 0.0),
        "fresh": torch.nn.functional.pad(own[:, :-1], (1, 0)),  # b = q, label-aligned
    }
    cases["stale"][labels == -100] = float("nan")  # never read
    for name, behaviour in cases.items():
        model = copy.deepcopy(student)
        trainer = KDTrainer(
            model=model, teacher_model=teacher, processing_class=tokenizer, train_dataset=PROMPTS,
            args=_args(tmp_path, use_kd_patch=use_kd_patch, kd_onpolicy_loss="pg"),
        )  # fmt: skip
        loss = trainer.compute_loss(model, {**generated, BEHAVIOUR: behaviour}, num_items_in_batch=torch.tensor(scored))
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        M.revert_kd_patch(model=model)
        ref_model = copy.deepcopy(student)
        logits = ref_model(input_ids=generated["input_ids"]).logits
        b = torch.nn.functional.pad(behaviour[:, 1:], (0, 1), value=0.0)
        want = reference.kd_loss(logits, logits_t, targets, estimator="pg", num_items_in_batch=scored,
                                 behaviour_logprobs=None if name == "fresh" else b)  # fmt: skip
        want.backward()
        # float64 models; the fused path sums in another order: ~1e-13 relative through the decoder
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-9, atol=1e-12)
        for a, w in zip(grads, (p.grad for p in ref_model.parameters())):
            torch.testing.assert_close(a, w, rtol=1e-7, atol=1e-10)
        if name == "stale":
            plain = reference.kd_loss(logits.detach(), logits_t, targets, estimator="pg", num_items_in_batch=scored)
            assert abs(float(plain) - float(want)) > 1e-3  # the ratio is not 1 here: the test can tell


def test_fused_behaviour_logprobs_match_the_reference_and_are_refused_off_pg():
    g = torch.Generator().manual_seed(3)
    n, h, v = 12, 16, 40
    x = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    w, xt, wt = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((v, h), (n, h), (v, h)))
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[0, 5]] = -100
    b = -torch.rand(n, generator=g, dtype=torch.float64) * 4
    b[labels == -100] = float("nan")
    got = fused_linear_jsd(x, w, xt, wt, labels, config=KDLossConfig(estimator="pg"), behaviour_logprobs=b)
    (dx,) = torch.autograd.grad(got, x)
    x2 = x.detach().clone().requires_grad_(True)
    want = reference.kd_loss(x2 @ w.T, xt @ wt.T, labels, estimator="pg", behaviour_logprobs=b)
    (dx2,) = torch.autograd.grad(want, x2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, dx2, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(dx).all()
    with pytest.raises(ValueError, match="set estimator='pg'"):
        fused_linear_jsd(x, w, xt, wt, labels, config=KDLossConfig(estimator="k3"), behaviour_logprobs=b)
    with pytest.raises(ValueError, match="estimator 'pg', not 'k1'"):
        reference.kd_loss(x2 @ w.T, xt @ wt.T, labels, estimator="k1", behaviour_logprobs=b)


def test_a_peft_student_syncs_its_lora_adapter(tmp_path, tokenizer):  # noqa: F811
    peft = pytest.importorskip("peft")
    student = peft.get_peft_model(tiny_model("llama", dtype=torch.float32, seed=1),
                                  peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))  # fmt: skip
    served = tiny_model("llama", dtype=torch.float32, seed=1)  # the same base model
    sync_dir = tmp_path / "shared"
    sync_dir.mkdir()
    (sync_dir / "keep.txt").write_text("not ours")
    with running(served) as (url, app):
        trainer = KDTrainer(
            model=student, teacher_model=tiny_model("llama", dtype=torch.float32, seed=2), processing_class=tokenizer,
            args=_engine_args(tmp_path, url, max_steps=2, kd_sync_dir=str(sync_dir)), train_dataset=PROMPTS,
        )  # fmt: skip
        recorder = Recorder(trainer, student)
        engine, held, push = app.state.engine, [], recorder.inner.sync.push
        recorder.inner.sync.push = lambda *a: (push(*a), held.append(sorted(engine.adapters)))
        trainer.train()
        assert [len(h) for h in held] == [1, 1] and held[1][0].endswith("-step1")  # the old one unloaded
        assert engine.adapters == {}  # and the last one at the end of train()
        assert engine.weight_version == 0  # the base weights never moved
    assert max(recorder.gaps) <= LOGPROB_ATOL, recorder.gaps
    assert sorted(os.listdir(sync_dir)) == ["keep.txt"]  # only what the trainer made is gone


def test_engine_replies_that_do_not_fit_the_request_are_refused():
    prompts, eos, settings = [[1, 2], [3]], {2}, RolloutSettings(max_new_tokens=3, num_generations=1)

    def reply(**choice):
        base = {"index": 0, "token_ids": [5, 2, 7], "prompt_token_ids": [1, 2],
                "logprobs": {"token_logprobs": [-1.0, -0.5, -2.0]}, "finish_reason": "stop"}  # fmt: skip
        return {"choices": [{**base, **choice}, {**base, "index": 1, "prompt_token_ids": [3]}]}

    (a, b) = rollouts_from_reply(reply(), prompts, settings, eos, 10, "r")
    assert a.completion == [5, 2] and a.finished and a.logprobs == (-1.0, -0.5)  # cut at EOS, which it keeps
    named = reply(token_ids=None, logprobs={"tokens": ["token_id:4", "token_id:6", "token_id:2"],
                                            "token_logprobs": [-1.0, -1.5, -0.1]})  # fmt: skip
    assert rollouts_from_reply(named, prompts, settings, eos, 10, "r")[0].completion == [4, 6, 2]  # vLLM's names
    for bad, message in [
        ({"choices": []}, "0 choices for 2 prompts x n=1"),
        (reply(prompt_token_ids=[9]), "prompt_token_ids differ"),
        (reply(token_ids=None, logprobs={"token_logprobs": [-1.0]}), "no token ids in the reply"),
        (reply(logprobs={"token_logprobs": [-1.0, 0.5, -1.0]}), r"token_logprobs\[1\] = 0.5: a sampled token's"),
        (reply(logprobs=None), "log-prob <= 0 for each"),
        (reply(token_ids=[5, 12, 2]), "token id 12 outside the student's vocabulary"),
    ]:
        with pytest.raises(TeacherReplyError, match=message):
            rollouts_from_reply(bad, prompts, settings, eos, 10, "r")


def test_generation_arguments_are_checked_and_the_key_kept_secret(tmp_path):
    url = "http://127.0.0.1:1"
    with pytest.raises(ValueError, match="kd_sync_steps must be an int >= 1"):
        _args(tmp_path, kd_generation_url=url, kd_sync_steps=0)
    with pytest.raises(ValueError, match="must be an http"):
        _args(tmp_path, kd_generation_url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="kd_lmbda=0.0 makes none"):
        _args(tmp_path, kd_generation_url=url, kd_lmbda=0.0)
    with pytest.raises(ValueError, match="kd_sync_dir .* is not a directory"):
        _args(tmp_path, kd_generation_url=url, kd_sync_dir=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="sequence-level"):
        _args(tmp_path, kd_generation_url=url, kd_seq_kd=True)
    args = _args(tmp_path, kd_generation_url=url, kd_generation_api_key="s3cret")
    assert "s3cret" not in str(args) and "s3cret" not in str(args.to_dict())


def test_the_engines_api_key_is_sent_and_a_wrong_one_is_a_clear_error(tmp_path):
    settings = RolloutSettings(max_new_tokens=3, num_generations=2)
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    with running(tiny_model("llama", dtype=torch.float32, seed=1), api_key=KEY) as (url, _):
        wrong = EngineRollouts(_args(tmp_path, kd_generation_url=url, kd_generation_api_key="wrong"))
        with pytest.raises(TeacherServerError, match="HTTP 401.*kd_generation_api_key"):
            wrong(student, [[1, 2]], settings, pad_id=0, eos_ids={2}, start_id=1)
        wrong.close()
        source = EngineRollouts(_args(tmp_path, kd_generation_url=url, kd_generation_api_key=KEY))
        rollouts = source(student, [[1, 2], []], settings, pad_id=0, eos_ids={2}, start_id=1)
        source.close()
    assert [r.prompt for r in rollouts] == [[1, 2], [1, 2], [1], [1]]  # n per prompt; an empty one starts at BOS


def test_engine_rollouts_are_seeded_and_split_by_kd_rollout_batch_size(tmp_path):
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    prompts = [[1, 5, 9], [1, 7], [3, 3, 3, 3]]
    with running(tiny_model("llama", dtype=torch.float32, seed=1)) as (url, app):
        source = EngineRollouts(_args(tmp_path, kd_generation_url=url, kd_sync_steps=100))
        sent = []
        post_json = source.http.post_json
        source.http.post_json = lambda path, body: sent.append((path, body)) or post_json(path, body)
        run = dict(pad_id=0, eos_ids={2}, start_id=1)
        one_call = RolloutSettings(max_new_tokens=6, num_generations=2, seed=4)
        first = source(student, prompts, one_call, step=3, **run)
        again = source(student, prompts, one_call, step=3, **run)
        split = source(student, prompts, RolloutSettings(max_new_tokens=6, num_generations=2, seed=4, batch_size=2),
                       step=3, **run)  # fmt: skip
        source.close()
        assert app.state.engine.weight_version == 1  # pushed once: kd_sync_steps=100
    completions = [[r.completion for r in rs] for rs in (first, again, split)]
    assert completions[0] == completions[1]  # the same seed and step: the same completions
    assert [r.prompt for r in split] == [p for p in prompts for _ in range(2)]  # prompt-major, n adjacent
    calls = [body for path, body in sent if path == "/v1/completions"]
    assert [len(b["prompt"]) for b in calls] == [3, 3, 2, 1]  # kd_rollout_batch_size prompts per request
    assert calls[2]["seed"] != calls[3]["seed"] and calls[0]["seed"] == calls[1]["seed"] == calls[2]["seed"]
    assert all(b["n"] == 2 and b["max_tokens"] == 6 and b["stop_token_ids"] == [2] for b in calls)
    assert all(len(r.logprobs) == len(r.completion) for rs in (first, split) for r in rs)


def test_a_full_weight_student_against_vllm_gets_a_clear_error(tmp_path):
    """vLLM has no disk-based full-weight route (its transfer is NCCL): the 404 is named, with what to do."""
    import http.server
    import threading

    class NoDiskRoute(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"detail": "Not Found"}')

        def log_message(self, *args):
            pass

    stub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoDiskRoute)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    try:
        source = EngineRollouts(_args(tmp_path, kd_generation_url=f"http://127.0.0.1:{stub.server_port}"))
        refused = "update_weights_from_disk refused the request: HTTP 404.*vllm-nccl"
        with pytest.raises(TeacherServerError, match=refused):
            source(tiny_model("llama", dtype=torch.float32), [[1, 2]], RolloutSettings(), pad_id=0, eos_ids={2},
                   start_id=1)  # fmt: skip
        root = source.sync._root
        source.close()
        assert root is not None and not root.exists()  # the refused push left nothing behind
    finally:
        stub.shutdown()


def test_rollout_requests_pin_what_vllm_would_take_from_the_generation_config():
    """vLLM fills a request's unsent penalties and min_p from the model's generation_config.json (its default
    --generation-config auto): a rollout request sends them neutral, so the engine samples the distribution whose
    log-probs it returns."""
    body = completion_request([[5, 6]], RolloutSettings(max_new_tokens=3, temperature=0.7), "m", seed=9, eos_ids={2})
    assert {k: body[k] for k in ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p")} == {
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
    assert body["temperature"] == 0.7 and body["top_k"] == -1 and body["stop_token_ids"] == [2]
