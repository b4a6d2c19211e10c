"""Asynchronous on-policy rollouts (kd_async_rollouts) through KDTrainer.train() with bf16 and gradient accumulation,
against the real `liger-kd serve` app: each step trains on the rollouts its schedule says (the prompts the Trainer's
sampler gives that step, generated with the weights of the step the staleness names, whose log-probs the engine
returned), staleness logged per step, reproducible, and a fault (the engine dropped, an error in the step) raises
and leaves no thread running and no pushed weights behind."""

import copy
import threading

import pytest
import torch
from transformers import TrainerCallback

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from liger_patch_kd.teacher.client import TeacherServerError  # noqa: E402
from liger_patch_kd.trainer import KDTrainer  # noqa: E402
from liger_patch_kd.trainer.rollouts.asynchronous import WORKER_NAME  # noqa: E402
from liger_patch_kd.trainer.rollouts.generate import BEHAVIOUR  # noqa: E402

from .test_engine_trainer import _engine_args  # noqa: E402
from .test_generation_server import LOGPROB_ATOL, model_logprobs, running  # noqa: E402
from .test_onpolicy import PROMPTS, tokenizer  # noqa: E402, F401
from .tiny_models import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_patches")


class Snapshots(TrainerCallback):
    """weights[s]: the student's state dict when optimizer step s starts (float32 master weights)."""

    def __init__(self):
        self.weights = {}

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.weights[state.global_step] = copy.deepcopy(model.state_dict())

    def on_step_end(self, args, state, control, model=None, **kw):
        self.weights[state.global_step] = copy.deepcopy(model.state_dict())


def rows_of(batch):
    """(prompt, completion, behaviour log-probs) per row of a generated micro-batch (labels on the completion)."""
    out = []
    for ids, labels, b in zip(batch["input_ids"], batch["labels"], batch[BEHAVIOUR]):
        scored = (labels != -100).nonzero().flatten()
        first, last = int(scored[0]), int(scored[-1]) + 1
        out.append((ids[:first].tolist(), ids[first:last].tolist(), b[first:last]))
    return out


def train(tmp_path, tokenizer, *, fault=None, dataset=PROMPTS, resume=None, **overrides):  # noqa: F811
    """One run against a fresh engine: (trainer, {step: rows trained}, snapshots, the engine's weight_version)."""
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    snapshots, seen = Snapshots(), {}
    with running(tiny_model("llama", dtype=torch.float32, seed=7)) as (url, app):
        args = _engine_args(tmp_path, url, **{"bf16": True, "kd_onpolicy_loss": "pg", "max_steps": 4, **overrides})
        trainer = KDTrainer(
            model=student, teacher_model=tiny_model("llama", dtype=torch.float32, seed=2), processing_class=tokenizer,
            args=args, train_dataset=dataset, callbacks=[snapshots],
        )  # fmt: skip
        compute_loss = trainer.compute_loss

        def spy(model, inputs, *a, **kw):
            rows = rows_of(inputs) if BEHAVIOUR in inputs else [None] * len(inputs["input_ids"])  # None: the dataset's
            seen.setdefault(trainer.state.global_step, []).extend(rows)
            if fault is not None:
                fault(trainer)
            return compute_loss(model, inputs, *a, **kw)

        trainer.compute_loss = spy
        trainer.train(resume_from_checkpoint=resume)
        return trainer, seen, snapshots.weights, app.state.engine.weight_version


def logged_staleness(trainer):
    return [h["kd_rollout_staleness"] for h in trainer.state.log_history if "loss" in h]


def no_worker_left():
    return not any(t.name.startswith(WORKER_NAME) for t in threading.enumerate())


def check_behaviour(trainer, seen, weights):
    """Every generated row's behaviour log-probs are the student's own at the weights of step s - staleness[s] (and
    not at step s's own, where they differ: the check can tell)."""
    assert sorted(seen) == list(range(trainer.state.global_step))
    reference = tiny_model("llama", dtype=torch.float32, seed=1)
    for step, rows in seen.items():
        assert len(rows) == 8  # 2 micro-batches x 2 prompts x kd_num_generations=2
        sampled_with = step - trainer.onpolicy.staleness[step]
        for weights_of in {sampled_with, step}:
            reference.load_state_dict(weights[weights_of])
            gaps = [float((model_logprobs(reference, p, c) - b).abs().max()) for p, c, b in rows]
            if weights_of == sampled_with:
                assert max(gaps) <= LOGPROB_ATOL, (step, gaps)
            else:
                assert min(gaps) > 1e-3, (step, gaps)


@pytest.mark.parametrize("transport", ["disk", "broadcast"])
def test_each_step_trains_on_the_rollouts_of_the_weights_its_staleness_names(tmp_path, tokenizer, transport):  # noqa: F811
    """Depth 1, pushed every step: step s >= 1 trains on completions the engine sampled with the weights step s - 1
    started with, and their behaviour log-probs are those weights' own; the first step of an epoch (12 prompts, 4
    per step: steps 0-2, then 3) is requested and waited for. The prompts of each step are the synchronous run's.
    Full weights from disk or broadcast (vLLM's weight-transfer routes), each staged as a copy when taken."""
    trainer, seen, weights, pushes = train(tmp_path / "async", tokenizer, kd_async_rollouts=1,
                                           kd_sync_transport=transport)  # fmt: skip
    assert logged_staleness(trainer) == [0, 1, 1, 0]
    assert pushes == 3  # before steps 0, 1 (step 2's request) and 3; step 2 sends nothing (the epoch ends)
    assert no_worker_left() and not trainer.onpolicy.source.sync._root
    check_behaviour(trainer, seen, weights)
    synchronous, sync_seen, _, _ = train(tmp_path / "sync", tokenizer)
    assert logged_staleness(synchronous) == [0, 0, 0, 0]
    prompts = {step: sorted(map(tuple, (r[0] for r in rows))) for step, rows in seen.items()}
    assert prompts == {step: sorted(map(tuple, (r[0] for r in rows))) for step, rows in sync_seen.items()}


def test_depth_two_with_sync_every_second_step_is_reproducible(tmp_path, tokenizer):  # noqa: F811
    """k = 2, kd_sync_steps = 2: staleness k to k + 1 once the pipeline is full; a second run gives the same
    rollouts."""
    runs = [train(tmp_path / str(i), tokenizer, dataset=PROMPTS * 2, max_steps=6, kd_async_rollouts=2,
                  kd_sync_steps=2) for i in range(2)]  # fmt: skip
    # step 0: pushed, steps 0-2 asked (weights 0); step 1: step 3 asked (weights 0); step 2: pushed, step 4 asked;
    # step 3: step 5 asked (weights 2); steps 4 and 5 ask nothing (max_steps)
    assert [logged_staleness(trainer) for trainer, *_ in runs] == [[0, 1, 2, 3, 2, 3]] * 2
    assert [pushes for *_, pushes in runs] == [2, 2]
    (_, first, _, _), (_, again, _, _) = runs
    completions = [{step: [r[1] for r in rows] for step, rows in run.items()} for run in (first, again)]
    assert completions[0] == completions[1]
    check_behaviour(runs[0][0], first, runs[0][2])
    assert no_worker_left()


def test_a_kd_lmbda_mix_generates_the_same_steps_as_waiting(tmp_path, tokenizer):  # noqa: F811
    """kd_lmbda=0.5: which steps generate is drawn in step order, so the asynchronous run generates the waited-for
    run's steps (the others train on the rows' completions, held like the rest)."""
    rows = [{**row, "completion": " the cat sat."} for row in PROMPTS]
    runs = [train(tmp_path / str(k), tokenizer, dataset=rows, kd_lmbda=0.5, kd_async_rollouts=k) for k in (0, 1)]
    generated = [[step for step, seen in sorted(run.items()) if seen[0] is not None] for _, run, _, _ in runs]
    assert generated[0] == generated[1] and 0 < len(generated[0]) < 4, generated  # seed 0: a mix
    prompts = [
        {s: sorted(tuple(r[0]) for r in seen) for s, seen in run.items() if s in generated[0]} for _, run, _, _ in runs
    ]
    assert prompts[0] == prompts[1]
    assert len(runs[1][0].onpolicy.staleness) == len(generated[1])  # one per generated step trained


def test_a_resumed_run_trains_the_steps_it_had_drawn_ahead(tmp_path, tokenizer):  # noqa: F811
    """Held steps were drawn from the iterator, not trained: a run resumed from step 2's checkpoint draws them again
    (the Trainer skips the trained batches only), so steps 2 and 3 train on the uninterrupted run's prompts."""
    saving = dict(kd_async_rollouts=1, save_strategy="steps", save_steps=2)
    _, whole, _, _ = train(tmp_path, tokenizer, **saving)
    resumed, again, _, _ = train(tmp_path, tokenizer, resume=str(tmp_path / "out" / "checkpoint-2"), **saving)
    assert sorted(again) == [2, 3] and logged_staleness(resumed)[-2:] == [0, 0]  # each the first of its iterator
    assert {s: sorted(tuple(r[0]) for r in whole[s]) for s in (2, 3)} == {
        s: sorted(tuple(r[0]) for r in again[s]) for s in (2, 3)
    }


def test_a_dropped_engine_raises_and_no_step_trains_without_its_rollouts(tmp_path, tokenizer):  # noqa: F811
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    engine = running(tiny_model("llama", dtype=torch.float32, seed=7))
    url, _ = engine.__enter__()

    class Drop(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:
                engine.__exit__(None, None, None)  # the server goes away mid-run

    trainer = KDTrainer(
        model=student, teacher_model=tiny_model("llama", dtype=torch.float32, seed=2), processing_class=tokenizer,
        args=_engine_args(tmp_path, url, bf16=True, kd_async_rollouts=1, kd_teacher_retries=0, max_steps=4),
        train_dataset=PROMPTS, callbacks=[Drop()],
    )  # fmt: skip
    with pytest.raises(TeacherServerError, match="the generation engine at .* failed 1 times") as raised:
        trainer.train()
    assert any("kd_async_rollouts=1: raised in the background" in note for note in raised.value.__notes__)
    # step 1's rollouts may have come before the drop; nothing after it trained, and every step had its own
    assert trainer.state.global_step in (1, 2)
    assert len(trainer.onpolicy.staleness) == trainer.state.global_step
    assert no_worker_left() and not trainer.onpolicy.source.sync._root


def test_an_error_in_the_step_closes_the_worker(tmp_path, tokenizer):  # noqa: F811
    def fail(trainer):
        if trainer.state.global_step == 1:
            raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError, match="the step failed"):
        train(tmp_path, tokenizer, fault=fail, kd_async_rollouts=2)
    assert no_worker_left()


def test_the_losses_that_take_stale_rollouts_as_they_come_are_warned_once(tmp_path, monkeypatch):
    """The divergence (GKD / JSD) loss on asynchronous rollouts trains off-policy by the staleness: said once, with
    the bound; pg corrects for it and is not warned."""
    from liger_patch_kd.trainer.rollouts import engine
    from liger_patch_kd.trainer.rollouts.generate import RolloutSettings

    from .test_onpolicy import _args

    warned = []
    monkeypatch.setattr(engine.logger, "warning", lambda message, *a: warned.append(message))
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    for loss in ("divergence", "pg"):
        source = engine.EngineRollouts(_args(tmp_path, kd_generation_url="http://127.0.0.1:1", kd_async_rollouts=2,
                                             kd_sync_steps=2, kd_onpolicy_loss=loss))  # fmt: skip
        source.sync.synced_step = 0  # as after the first push (nothing is sent: ask only prepares the request)
        for step in (1, 2):
            staleness, _ = source.ask(student, [[1, 5]], RolloutSettings(), eos_ids={2}, start_id=1, step=step)
            assert staleness == step
    assert len(warned) == 1 and "up to 3" in warned[0] and "divergence and k1 / k3 losses train off-policy" in warned[0]


def test_async_arguments_are_checked(tmp_path):
    from .test_onpolicy import _args

    with pytest.raises(ValueError, match="kd_async_rollouts=1 requests rollouts from an engine.*kd_generation_url"):
        _args(tmp_path, kd_async_rollouts=1)
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ValueError, match="kd_async_rollouts must be an int >= 0"):
            _args(tmp_path, kd_generation_url="http://127.0.0.1:1", kd_async_rollouts=bad)
    assert _args(tmp_path, kd_generation_url="http://127.0.0.1:1", kd_async_rollouts=True).kd_async_rollouts == 1


@pytest.mark.parametrize("transport", ["disk", "broadcast"])
def test_a_staged_push_loads_the_weights_of_its_step_not_later_ones(tmp_path, transport):
    """WeightSync.stage copies the weights when called; the load (file and request, or broadcast), sent later by
    the worker, gives the engine those, whatever the optimizer did in between (a CPU model's tensors too)."""
    from liger_patch_kd.teacher.client.transport import HttpEndpoint
    from liger_patch_kd.trainer.rollouts.weight_sender import BroadcastSender
    from liger_patch_kd.trainer.rollouts.weight_sync import WeightSync

    student = tiny_model("llama", dtype=torch.float32, seed=1)
    with running(tiny_model("llama", dtype=torch.float32, seed=7)) as (url, app):
        http = HttpEndpoint(url, timeout=30, retries=0)
        sender = BroadcastSender(http, "broadcast") if transport == "broadcast" else None
        sync = WeightSync(http, every=1, sender=sender)
        want = copy.deepcopy(student.state_dict())
        load = sync.stage(student, 0)
        with torch.no_grad():
            for p in student.parameters():
                p.add_(1.0)  # the next optimizer step, before the load ran
        load()
        got = app.state.engine.model.state_dict()
        sync.close()
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())


def test_a_peft_student_syncs_its_adapter_asynchronously(tmp_path, tokenizer):  # noqa: F811
    peft = pytest.importorskip("peft")
    student = peft.get_peft_model(tiny_model("llama", dtype=torch.float32, seed=1),
                                  peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))  # fmt: skip
    with running(tiny_model("llama", dtype=torch.float32, seed=1)) as (url, app):  # the same base model
        trainer = KDTrainer(
            model=student, teacher_model=tiny_model("llama", dtype=torch.float32, seed=2), processing_class=tokenizer,
            args=_engine_args(tmp_path, url, bf16=True, kd_onpolicy_loss="pg", kd_async_rollouts=1, max_steps=3),
            train_dataset=PROMPTS,
        )  # fmt: skip
        http, adapters = trainer.onpolicy.source.sync.http, []
        post_json = http.post_json
        http.post_json = lambda path, body: adapters.append((path, body.get("lora_name"))) or post_json(path, body)
        trainer.train()
        engine = app.state.engine
        # pushed before steps 0 and 1 (step 2 asks for nothing: the epoch ends); the older adapter unloaded, the
        # last one at the end of train()
        sent = [(path.split("_")[0].removeprefix("/v1/"), name.rsplit("-", 1)[1]) for path, name in adapters if name]
        assert sent == [("load", "step0"), ("load", "step1"), ("unload", "step0"), ("unload", "step1")]
        assert engine.adapters == {} and engine.weight_version == 0
    assert logged_staleness(trainer) == [0, 1, 1] and no_worker_left()
