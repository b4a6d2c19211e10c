"""A served teacher is asked what it serves at train() start (GET /v1/models: its --top-k, its vocabulary, its
name): a kd_teacher_top_k above the server's --top-k, or a vocabulary that is not the student's, is one line before
the first step, and no teacher forward runs. The real app, served by uvicorn in a thread of this process."""

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments  # noqa: E402

from .test_generation_server import running  # noqa: E402
from .tiny_models import VOCAB, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_patches")
ROWS = [{"input_ids": list(range(3, 3 + 8 + i))} for i in range(4)]


def served(model, top_k: int):
    """build_app(model) on 127.0.0.1 by uvicorn in a thread (test_generation_server.running); yields (url, app)."""
    return running(model, top_k=top_k, model_name="tiny-teacher")


def train(tmp_path, url, student=None, **overrides):
    args = KDTrainingArguments(**{**dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=1, report_to="none", use_cpu=True,
        save_strategy="no", disable_tqdm=True, use_kd_patch=True, kd_teacher_url=url, kd_teacher_protocol="liger",
        kd_teacher_top_k=8, kd_teacher_timeout=20,
    ), **overrides})  # fmt: skip
    student = student if student is not None else tiny_model("llama", dtype=torch.float32, seed=1)
    return KDTrainer(model=student, args=args, train_dataset=ROWS).train()


@pytest.fixture(scope="module")
def server():
    with served(tiny_model("llama", dtype=torch.float32), top_k=8) as running:
        yield running


def test_a_top_k_above_the_servers_is_one_line_before_any_teacher_work(tmp_path, server):
    url, app = server
    before = app.state.batcher.forwards_run
    with pytest.raises(ValueError, match=rf"kd_teacher_top_k=64 asks kd_teacher_url={url} \(model 'tiny-teacher'\) "
                                         r"for 64 .* at most 8 \(its --top-k\).*--top-k 64") as e:  # fmt: skip
        train(tmp_path, url, kd_teacher_top_k=64)
    assert "\n" not in str(e.value)
    assert app.state.batcher.forwards_run == before  # refused before the first request
    assert train(tmp_path, url, kd_teacher_top_k=8).global_step == 1  # within the server's top-k: it trains


def test_a_vocabulary_that_is_not_the_students_is_one_line(tmp_path, server):
    url, app = server
    before = app.state.batcher.forwards_run
    wider = tiny_model("llama", dtype=torch.float32, seed=1, vocab=VOCAB + 43)
    with pytest.raises(ValueError, match=rf"vocabulary of {VOCAB} ids and the student's lm_head {VOCAB + 43}.*"
                                         r"kd_vocab_size.*kd_teacher_tokenizer"):  # fmt: skip
        train(tmp_path, url, student=wider)
    assert app.state.batcher.forwards_run == before
    # the student's real tokens are the teacher's: its 43 extra rows are padding, kd_vocab_size says so
    wider = tiny_model("llama", dtype=torch.float32, seed=1, vocab=VOCAB + 43)
    assert train(tmp_path, url, student=wider, kd_vocab_size=VOCAB).global_step == 1
    with pytest.raises(ValueError, match=rf"vocabulary of {VOCAB} ids, fewer than kd_vocab_size={VOCAB + 1}"):
        train(tmp_path, url, student=tiny_model("llama", dtype=torch.float32, seed=1, vocab=VOCAB + 43),
              kd_vocab_size=VOCAB + 1)  # fmt: skip


@pytest.mark.parametrize("timing", [dict(kd_teacher_timeout=0), dict(kd_teacher_timeout=-1.0),
                                    dict(kd_teacher_retries=-1)])  # fmt: skip
@pytest.mark.parametrize("kind", [
    dict(kd_teacher_protocol="liger"), dict(kd_teacher_protocol="vllm"), dict(kd_teacher_samples=4),
    dict(kd_teacher_protocol="hidden"), dict(kd_teacher_url={"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"}),
])  # fmt: skip
def test_every_served_client_names_a_bad_timeout_or_retry_count_the_same_way(tmp_path, kind, timing):
    """One check (served.check_client_timing) for every kind of served teacher, when the arguments are made."""
    options = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", use_kd_patch=True,
                   kd_teacher_url="http://127.0.0.1:1", kd_teacher_protocol="liger", kd_teacher_top_k=8)  # fmt: skip
    with pytest.raises(ValueError, match=r"a served teacher needs kd_teacher_timeout > 0 \(seconds\) and "
                                         r"kd_teacher_retries >= 0; got"):  # fmt: skip
        KDTrainingArguments(**{**options, **kind, **timing})


@pytest.mark.parametrize(
    "options,named",
    [
        (dict(kd_teacher_top_k=16), "kd_teacher_top_k=16 is"),
        (dict(kd_teacher_samples=4, kd_teacher_protocol="liger"),
         "kd_teacher_protocol='liger' and kd_teacher_samples=4 are"),
        (dict(kd_teacher_hidden_dtype="fp8"), "kd_teacher_hidden_dtype='fp8' is"),
    ],
)
def test_server_options_without_a_server_are_said_to_be_unused(tmp_path, caplog, options, named):
    """A teacher model in process with options only a server reads: said once, naming them, before any step (not
    refused: one config may serve a served run and an in-process one); the defaults say nothing."""
    import logging

    args = KDTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to="none",
                               use_cpu=True, save_strategy="no", disable_tqdm=True, **options)  # fmt: skip
    student, teacher = tiny_model("llama", dtype=torch.float32, seed=1), tiny_model("llama", dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="liger_patch_kd"):
        KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=ROWS)
    said = [r.getMessage() for r in caplog.records if "read only from a teacher server" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(named) and "kd_teacher_url is not set" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="liger_patch_kd"):
        KDTrainer(model=student, teacher_model=teacher, args=KDTrainingArguments(
            output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True), train_dataset=ROWS)
    assert not [r for r in caplog.records if "read only from a teacher server" in r.getMessage()]
