"""A server that restarts, or keeps failing, is never trained on silently and never waited on without bound: a
hidden-states teacher restarted with other weights (both at weight version 0) gets its head fetched again; a
rollout engine restarted between two pushes is pushed again before its rollouts count; a persistent 5xx is retried
with each wait capped (transport.retry_delay). The real app (`running`: build_app under uvicorn in a thread),
restarted on the same port. Once the engine names its weights, its word is taken from this run's own update (not a
/health read after it), and a reply naming no weights is not trusted; a LoRA student's adapter lost in a restart is
loaded again."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from liger_patch_kd.server.generation import GenerationEngine  # noqa: E402
from liger_patch_kd.teacher.client import TeacherServerError  # noqa: E402
from liger_patch_kd.teacher.client import transport as T  # noqa: E402
from liger_patch_kd.teacher.client.hidden_client import HiddenClient  # noqa: E402
from liger_patch_kd.trainer import KDTrainingArguments  # noqa: E402
from liger_patch_kd.trainer.rollouts.engine import EngineRollouts  # noqa: E402
from liger_patch_kd.trainer.rollouts.generate import RolloutSettings  # noqa: E402
from liger_patch_kd.trainer.rollouts.weight_sync import EngineWeightsLost, unique_tensors  # noqa: E402

from .test_generation_server import free_port, model_logprobs, running  # noqa: E402
from .tiny_models import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_patches")
SEQ = [4, 8, 15, 16, 23, 42]


def _model(seed):
    model = tiny_model("llama", seed=seed).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # teachers of different seeds then differ by nats, not hundredths
    return model


def _served_logprobs(client, seq):
    ((hidden, head),) = client.fetch([seq])
    return torch.log_softmax(hidden.double() @ head.weight.double().T, -1)


def _own_logprobs(model, seq):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([seq])).logits[0].double(), -1)


def test_a_hidden_teacher_restarted_with_other_weights_sends_its_own_head():
    """Both starts are at weight version 0: the head's id must tell the two server instances apart, or teacher A's
    cached head is paired with teacher B's hidden states (log-probs of neither teacher)."""
    a, b, port = _model(3), _model(11), free_port()
    assert (_own_logprobs(a, SEQ) - _own_logprobs(b, SEQ)).abs().max() > 1  # two teachers a stale head would mix
    client = HiddenClient(f"http://127.0.0.1:{port}", dtype="fp32", timeout=30, retries=2, backoff=0.01)
    try:
        with running(a, port=port):
            assert (_served_logprobs(client, SEQ) - _own_logprobs(a, SEQ)).abs().max() < 1e-4
        with running(b, port=port):
            assert (_served_logprobs(client, SEQ) - _own_logprobs(b, SEQ)).abs().max() < 1e-4
        assert client.head_fetches == 2
    finally:
        client.close()


def test_an_engine_restarted_between_pushes_is_pushed_again_before_its_rollouts_count(tmp_path):
    """kd_sync_steps=3: the engine restarts (its checkpoint's weights) after step 0's push; step 1's rollouts would
    come from the checkpoint while counted as the student's at staleness 1. The trainer notices (the engine's
    weights_id in each reply against the one it held after the push) and pushes again."""
    checkpoint, student, port = _model(3), _model(1), free_port()
    args = KDTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, kd_lmbda=1.0,
                               kd_generation_url=f"http://127.0.0.1:{port}", kd_sync_steps=3, kd_teacher_retries=2,
                               kd_onpolicy_loss="pg")  # fmt: skip
    source, settings = EngineRollouts(args), RolloutSettings(max_new_tokens=6, seed=0)
    prompts = [[5, 6, 7], [9, 10, 11]]

    def rollouts_match_student(step):
        rollouts = source(student, prompts, settings, pad_id=0, eos_ids={2}, start_id=1, step=step)
        for r in rollouts:
            want = model_logprobs(student, r.prompt, r.completion)
            assert torch.allclose(torch.tensor(r.logprobs, dtype=torch.float64), want.double(), atol=1e-4), step

    try:
        with running(_model(3), port=port):
            rollouts_match_student(0)
        with running(checkpoint, port=port):  # the same address, the checkpoint's weights, weight_version 0
            rollouts_match_student(1)
            assert source.sync.pushes == 2 and source.staleness == [0, 0]
            rollouts_match_student(2)  # the engine holds step 1's push: no third one
            assert source.sync.pushes == 2 and source.staleness == [0, 0, 1]
    finally:
        source.close()


def test_a_persistent_5xx_waits_at_most_retries_times_the_cap(monkeypatch):
    """A server answering 500 to every request (its forward fails): kd_teacher_retries=12 waited 0.5 x (2^12 - 1) s
    (34 minutes) before the cap; now each wait is at most MAX_BACKOFF_S, the same for every client (one retry loop,
    transport.HttpEndpoint.send)."""
    waits = []
    monkeypatch.setattr(T, "time", SimpleNamespace(sleep=waits.append))  # transport's waits recorded, not slept
    model = _model(3)
    with running(model) as (url, _):
        with torch.no_grad():
            model.model.norm.weight = torch.nn.Parameter(torch.ones(3))  # every forward raises: a 500
        client = HiddenClient(url, dtype="fp32", timeout=30, retries=12)
        try:
            with pytest.raises(TeacherServerError, match="failed 13 times"):
                client.fetch([SEQ])
        finally:
            client.close()
    assert len(waits) == 12 and max(waits) == T.MAX_BACKOFF_S and sum(waits) <= 12 * T.MAX_BACKOFF_S
    assert waits[:5] == [0.5, 1.0, 2.0, 4.0, 8.0]  # the default retries wait as they always did
    assert T.retry_delay(10_000, 0.5) == T.MAX_BACKOFF_S  # no float overflow however many retries


def _engine_source(tmp_path, port):
    args = KDTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, kd_lmbda=1.0,
                               kd_generation_url=f"http://127.0.0.1:{port}", kd_sync_steps=3, kd_teacher_retries=2,
                               kd_onpolicy_loss="pg")  # fmt: skip
    return EngineRollouts(args)


def _assert_student_rollouts(source, student, step):
    rollouts = source(student, [[5, 6, 7], [9, 10, 11]], RolloutSettings(max_new_tokens=6, seed=0), pad_id=0,
                      eos_ids={2}, start_id=1, step=step)  # fmt: skip
    for r in rollouts:
        want = model_logprobs(student, r.prompt, r.completion)
        assert torch.allclose(torch.tensor(r.logprobs, dtype=torch.float64), want.double(), atol=1e-4), step


def test_a_reply_naming_no_weights_is_not_trusted_once_the_engine_named_them(tmp_path, monkeypatch):
    """/health and the update name a weights_id, the completion replies none (a gateway keeping vLLM's fields only):
    a restart behind it would go unseen, so the run stops with the fix instead of training on unknown weights."""
    complete = GenerationEngine.complete
    monkeypatch.setattr(GenerationEngine, "complete", lambda self, req, *cancel: {
        k: v for k, v in complete(self, req, *cancel).items() if k != "weights_id"})  # fmt: skip
    port = free_port()
    source = _engine_source(tmp_path, port)
    try:
        with running(_model(3), port=port):
            with pytest.raises(EngineWeightsLost, match="carries no weights_id.*pass the field through"):
                _assert_student_rollouts(source, _model(1), 0)
    finally:
        source.close()


def test_the_weights_id_is_the_one_of_this_runs_update_not_of_a_later_health_read(tmp_path, monkeypatch):
    """Another process's update lands right after ours (before any /health read): its weights must not pass for
    the student's. The trainer holds the id of its own update's reply, sees the other one in the completions and
    pushes again."""
    student, other = _model(1), _model(7)
    update, raced = GenerationEngine.update_weights_from_disk, []

    def update_then_another(self, body):
        reply = update(self, body)
        if not raced:  # once: the other process's update, applied as the server applies any
            raced.append(self.apply_state(unique_tensors(other.state_dict())))
        return reply

    monkeypatch.setattr(GenerationEngine, "update_weights_from_disk", update_then_another)
    port = free_port()
    source = _engine_source(tmp_path, port)
    try:
        with running(_model(3), port=port):
            _assert_student_rollouts(source, student, 0)
        assert raced and source.sync.pushes == 2 and source.staleness == [0]
    finally:
        source.close()


def test_a_lora_students_adapter_lost_in_an_engine_restart_is_loaded_again(tmp_path):
    """The engine restarts after step 0's adapter load: step 1 asks for an adapter it lacks (a 404, which read as
    "the engine lacks this route" and stopped the run). The adapter is loaded again, as full weights are pushed."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    student = peft.get_peft_model(_model(3), config).eval()
    with torch.no_grad():
        for name, param in student.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # an adapter that moves the log-probs by nats
    port = free_port()
    source = _engine_source(tmp_path, port)
    try:
        with running(_model(3), port=port):
            _assert_student_rollouts(source, student, 0)
        with running(_model(3), port=port):
            _assert_student_rollouts(source, student, 1)
            assert source.sync.pushes == 2 and source.staleness == [0, 0]
            _assert_student_rollouts(source, student, 2)  # the adapter loaded again serves step 2: no third load
            assert source.sync.pushes == 2
    finally:
        source.close()
