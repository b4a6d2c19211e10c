"""Full weights to the rollout engine by broadcast (kd_sync_transport="broadcast"): vLLM's weight-transfer routes
against the real `liger-kd serve` app, the tensors over a gloo group; trained through KDTrainer.train() with the
engine's log-probs equal to the student's after each push, and every refusal prompt (no one waits out a timeout)."""

import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from liger_patch_kd.teacher.client import TeacherServerError  # noqa: E402
from liger_patch_kd.teacher.client.transport import HttpEndpoint  # noqa: E402
from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments  # noqa: E402
from liger_patch_kd.trainer.rollouts.weight_sender import BroadcastSender  # noqa: E402

from .test_engine_trainer import Recorder, _engine_args  # noqa: E402
from .test_generation_server import LOGPROB_ATOL, post, running  # noqa: E402
from .test_onpolicy import PROMPTS, tokenizer  # noqa: E402, F401
from .tiny_models import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_patches")


def _sender(url: str) -> BroadcastSender:
    return BroadcastSender(HttpEndpoint(url, timeout=30, retries=0, what="the generation engine"), "broadcast")


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_full_weight_student_trains_with_its_weights_broadcast_every_step(tmp_path, tokenizer):  # noqa: F811
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    with running(tiny_model("llama", dtype=torch.float32, seed=7)) as (url, app):
        args = _engine_args(tmp_path, url, bf16=True, kd_onpolicy_loss="pg", max_steps=3, kd_sync_transport="broadcast")
        trainer = KDTrainer(model=student, teacher_model=tiny_model("llama", dtype=torch.float32, seed=2),
                            processing_class=tokenizer, args=args, train_dataset=PROMPTS)  # fmt: skip
        recorder = Recorder(trainer, student)
        trainer.train()
        assert app.state.engine.weight_version == 3  # one broadcast before each step's rollouts
        assert recorder.inner.sync.sender.group is None  # closed at the end of train(): the group is shut down
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["kd_rollout_staleness"] for h in logs] == [0, 0, 0]
    # after every push the engine samples with the student's own weights (float32; LOGPROB_ATOL's note)
    assert len(recorder.gaps) == 3 and max(recorder.gaps) <= LOGPROB_ATOL, recorder.gaps
    assert recorder.root is None  # nothing was written to disk


def test_the_broadcast_copies_every_tensor_and_a_tied_head_once():
    served = tiny_model("llama", dtype=torch.float32, seed=7, tie_word_embeddings=True)
    student = tiny_model("llama", dtype=torch.float32, seed=1, tie_word_embeddings=True)
    with running(served) as (url, app):
        sender = _sender(url)
        calls = []
        http_post = sender.http.post_json
        sender.http.post_json = lambda path, body: calls.append((path, body)) or http_post(path, body)
        sender.push(student, step=4)
        names = next(body["update_info"]["names"] for path, body in calls if path == "/update_weights")
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # one storage, sent once
        assert [p for p, _ in calls] == ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                                         "/finish_weight_update"]  # fmt: skip
        assert calls[-1][1] == {"weight_version": "4"}
        assert _same_weights(served, student) and app.state.engine.weight_version == 1
        with torch.no_grad():
            next(student.parameters()).add_(1.0)
        sender.push(student, step=5)  # the same group again
        assert _same_weights(served, student) and app.state.engine.weight_version == 2
        sender.close()
        assert sender.group is None


def test_a_refused_broadcast_changes_nothing_and_fails_at_once():
    served = tiny_model("llama", dtype=torch.float32, seed=7)
    before = {k: v.clone() for k, v in served.state_dict().items()}
    other = tiny_model("llama", dtype=torch.float32, seed=1, hidden=32)  # another shape everywhere
    with running(served) as (url, app):
        sender = _sender(url)
        start = time.monotonic()
        with pytest.raises(TeacherServerError, match="update_weights refused the request: HTTP 400.*shape"):
            sender.push(other, step=0)
        assert time.monotonic() - start < 20  # the server drained the broadcast and answered; nobody timed out
        assert all(torch.equal(before[k], v) for k, v in served.state_dict().items())
        assert app.state.engine.weight_version == 0 and sender.group is None
        student = tiny_model("llama", dtype=torch.float32, seed=1)
        sender.push(student, step=1)  # a fresh group after the refusal
        assert _same_weights(served, student)
        sender.close()


def test_the_weight_transfer_routes_check_their_bodies():
    with running(tiny_model("llama", dtype=torch.float32)) as (url, _):
        status, reply = post(url, "/update_weights", {"update_info": {"names": []}})
        assert status == 400 and "init_weight_transfer_engine first" in str(reply)
        status, reply = post(url, "/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1"}})
        assert status == 400 and "master_port" in str(reply)
        body = {"init_info": {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 3}}
        status, reply = post(url, "/init_weight_transfer_engine", body)
        assert status == 400 and "world_size" in str(reply)


def test_an_init_the_server_refuses_fails_at_once(tmp_path):
    with running(tiny_model("llama", dtype=torch.float32)) as (url, _):
        sender = BroadcastSender(HttpEndpoint(url + "/missing", timeout=30, retries=0), "broadcast")
        start = time.monotonic()
        with pytest.raises(TeacherServerError, match="HTTP 404"):
            sender.push(tiny_model("llama", dtype=torch.float32), step=0)
        assert time.monotonic() - start < 20 and sender.group is None


def test_sync_transport_is_checked(tmp_path):
    with pytest.raises(ValueError, match="kd_sync_transport must be one of"):
        KDTrainingArguments(output_dir=str(tmp_path), kd_sync_transport="nccl", report_to=[])
    sender = _sender("http://127.0.0.1:9")
    with pytest.raises(ValueError, match="vllm-nccl.*GPU"):
        BroadcastSender(sender.http, "vllm-nccl").push(tiny_model("llama", dtype=torch.float32), step=0)


def test_an_engine_never_samples_a_padded_heads_extra_rows(tmp_path):
    """A head padded past kd_vocab_size: the engine is asked for allowed_token_ids 0 .. V-1 (vLLM's field) and
    `liger-kd serve` masks the rest, so no id outside the loss's vocabulary reaches the teacher."""
    from liger_patch_kd.trainer.rollouts.engine import EngineRollouts
    from liger_patch_kd.trainer.rollouts.generate import RolloutSettings

    from .test_onpolicy import _args
    from .tiny_models import VOCAB

    padded = tiny_model("llama", dtype=torch.float32, seed=1, vocab=VOCAB + 7)
    with torch.no_grad():  # the padding rows dominate every position's logits
        padded.lm_head.weight[VOCAB:] = 50 * padded.model.norm.weight
    run = dict(pad_id=0, eos_ids=set(), start_id=1)
    with running(padded) as (url, _):
        for vocab, inside in ((None, False), (VOCAB, True)):
            source = EngineRollouts(_args(tmp_path, kd_generation_url=url, kd_sync_transport="broadcast"))
            settings = RolloutSettings(max_new_tokens=4, vocab_size=vocab)
            rollouts = source(padded, [[3, 4], [5]], settings, **run)
            assert all(t < VOCAB for r in rollouts for t in r.completion) is inside
            assert all(len(r.completion) == 4 and len(r.logprobs) == 4 for r in rollouts)
            source.close()
        status, reply = post(url, "/v1/completions", {"prompt": [[3]], "allowed_token_ids": [5, 6]})
        assert status == 400 and "allowed_token_ids" in str(reply)


@pytest.mark.parametrize("student_tied", [True, False])
def test_tied_embeddings_on_one_side_only_are_refused_not_half_applied(student_tied):
    """A tied student sends the embedding once: an untied served model would keep its old lm_head (the engine would
    sample with a head the student never had); an untied student sends both, and a tied served model would take
    whichever came last as both. Either is refused whole, naming the tensors."""
    served = tiny_model("llama", dtype=torch.float32, seed=7, tie_word_embeddings=not student_tied)
    before = {k: v.clone() for k, v in served.state_dict().items()}
    student = tiny_model("llama", dtype=torch.float32, seed=1, tie_word_embeddings=student_tied)
    with running(served) as (url, app):
        sender = _sender(url)
        with pytest.raises(TeacherServerError, match="HTTP 400.*lm_head.weight.*tie_word_embeddings"):
            sender.push(student, step=0)
        assert all(torch.equal(before[k], v) for k, v in served.state_dict().items())
        assert app.state.engine.weight_version == 0
        sender.close()


def test_a_server_that_lost_its_group_between_pushes_is_joined_again():
    """A restarted engine holds no weight-transfer group: the next full push makes a new one (it sends every tensor
    anyway) instead of failing every push after it on the stale group."""
    served = tiny_model("llama", dtype=torch.float32, seed=7)
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    with running(served) as (url, app):
        sender = _sender(url)
        sender.push(student, step=0)
        assert post(url, "/shutdown_weight_transfer_engine", {})[0] == 200  # what a restart leaves
        with torch.no_grad():
            next(student.parameters()).add_(1.0)
        sender.push(student, step=1)
        assert _same_weights(served, student) and app.state.engine.weight_version == 2
        sender.close()
        sender.close()  # twice: nothing left to shut down
        assert sender.group is None


def test_an_engine_asked_for_allowed_ids_returns_their_distributions_log_probs():
    """The behaviour log-probs of a padded head's rollouts are those of the distribution sampled (the real ids',
    normalised over them), as the student's log q in the loss is: over the full head, the importance ratio of every
    token was inflated by 1 / (1 - the padding rows' mass)."""
    from .tiny_models import VOCAB

    padded = tiny_model("llama", dtype=torch.float32, seed=1, vocab=VOCAB + 7)
    with torch.no_grad():  # padding rows with real mass
        padded.lm_head.weight[VOCAB:] = 3 * padded.model.norm.weight
    with running(padded) as (url, _):
        body = {"prompt": [[3, 4]], "max_tokens": 1, "logprobs": 2, "seed": 1, "allowed_token_ids": list(range(VOCAB))}
        status, reply = post(url, "/v1/completions", body)
    assert status == 200
    entry = reply["choices"][0]["logprobs"]
    token = int(entry["tokens"][0].removeprefix("token_id:"))
    with torch.no_grad():
        logits = padded(torch.tensor([[3, 4]])).logits[0, -1].float()
    expected = logits[:VOCAB].log_softmax(-1)
    assert abs(entry["token_logprobs"][0] - float(expected[token])) <= LOGPROB_ATOL
    assert abs(float(logits.log_softmax(-1)[token]) - float(expected[token])) > 0.1  # the check can tell
    assert all(int(k.removeprefix("token_id:")) < VOCAB for k in entry["top_logprobs"][0])


def test_a_refused_init_leaves_no_thread_waiting_for_the_engine():
    import threading

    with running(tiny_model("llama", dtype=torch.float32)) as (url, _):
        sender = BroadcastSender(HttpEndpoint(url + "/missing", timeout=30, retries=0), "broadcast")
        for _ in range(2):  # each refused init used to leave a thread (and its listening port) for 10 minutes
            with pytest.raises(TeacherServerError, match="HTTP 404"):
                sender.push(tiny_model("llama", dtype=torch.float32), step=0)
        deadline = time.monotonic() + 5
        while any(t.name.startswith("liger-kd /") for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [t.name for t in threading.enumerate() if t.name.startswith("liger-kd /")]


def test_a_broadcast_that_breaks_midway_changes_no_weight_and_says_where():
    """The trainer dies after the first tensor: one clean refusal naming the tensor, the group closed, the engine's
    weights as they were (nothing half-applied), and a later update asks for a new init."""
    from liger_patch_kd.server.generation import GenerationEngine
    from liger_patch_kd.server.validation import RequestError
    from liger_patch_kd.server.weight_receiver import WeightReceiver

    model = tiny_model("llama", dtype=torch.float32, seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    receiver = WeightReceiver(GenerationEngine(model, "student"))

    class DyingGroup:
        calls = 0

        def broadcast(self, tensor, src):
            DyingGroup.calls += 1
            if DyingGroup.calls == 2:
                raise RuntimeError("Connection closed by peer [127.0.0.1]:29500\nmore detail")
            return type("Work", (), {"wait": lambda self: None})()

    receiver.group = DyingGroup()
    names = list(before)[:3]
    info = {"names": names, "dtype_names": ["float32"] * 3, "shapes": [list(before[n].shape) for n in names]}
    with pytest.raises(RequestError, match=rf"broke at tensor 2 of 3 \({names[1]}\): Connection closed by peer") as e:
        receiver.update({"update_info": info})
    assert e.value.status == 500 and "\n" not in e.value.message
    assert receiver.group is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(RequestError, match="POST /init_weight_transfer_engine first"):
        receiver.update({"update_info": info})
