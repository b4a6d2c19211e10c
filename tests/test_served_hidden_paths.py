"""The exact served teacher, beyond test_served_hidden.py: the sampled-token estimators on generated rows
(a served top-k teacher cannot give them: the sampled token may be outside its top-k), the loss on materialised
logits (use_kd_patch=False) and the server's API key on the hidden-state routes. The server runs in a thread
(server/app.build_app under uvicorn)."""

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from liger_patch_kd.ops.fp8 import fp8_available  # noqa: E402
from liger_patch_kd.teacher.client import TeacherServerError  # noqa: E402
from liger_patch_kd.teacher.client.hidden_client import HiddenClient  # noqa: E402

from .test_generation_server import running  # noqa: E402
from .test_served_hidden import VOCAB, _assert_same_training, _train  # noqa: E402
from .tiny_models import tiny_model  # noqa: E402

KEY = "hidden-s3cret"


def _teacher():
    return tiny_model("llama", dtype=torch.float32, seed=3)


def _prompts(n=8):
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (5,), generator=g)
        rows.append({"input_ids": ids, "labels": torch.full_like(ids, -100)})  # prompts only
    return rows


@pytest.mark.parametrize("estimator", ["k1", "pg"])
def test_onpolicy_estimators_train_as_with_the_in_process_teacher(tmp_path, estimator):
    """kd_lmbda=1 with kd_onpolicy_loss k1 / pg: each generated token scored by the teacher's full distribution from
    its served hidden states and head, so the losses and weights are the in-process teacher's (float32; the server
    runs each sequence in a batch of its own making: see test_served_hidden._assert_same_training's tolerance)."""
    rows = _prompts()
    common = dict(kd_lmbda=1.0, kd_max_new_tokens=4, max_steps=2, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, kd_onpolicy_loss=estimator, learning_rate=1e-3)  # fmt: skip
    want = _train(tmp_path / "in", rows, _teacher(), **common)
    with running(_teacher()) as (url, _):
        got = _train(tmp_path / "served", rows, kd_teacher_url=url, kd_teacher_protocol="hidden", **common)
    _assert_same_training(got, want)
    assert got[2].teacher_source.client.tokens_received > 0  # the generated rows were asked of the server


def test_materialised_loss_reads_the_served_hidden_states(tmp_path):
    """use_kd_patch=False: the teacher's logits made from its served hidden states and head (models/materialised.py)
    give the in-process teacher's losses and weights, with a temperature and a hard-loss term."""
    rows = [{"input_ids": r["input_ids"]} for r in _prompts()]
    common = dict(use_kd_patch=False, kd_beta=0.5, kd_temperature=2.0, kd_hard_weight=0.25, max_steps=2)
    want = _train(tmp_path / "in", rows, _teacher(), **common)
    with running(_teacher()) as (url, _):
        got = _train(tmp_path / "served", rows, kd_teacher_url=url, kd_teacher_protocol="hidden", **common)
    _assert_same_training(got, want)


class _Tokenizer:
    """What KDTrainer reads of a tokenizer here: its length (the real ids) and its pad id."""

    pad_token_id = 0

    def __len__(self) -> int:
        return VOCAB


def test_heads_padded_past_the_tokenizer_take_its_vocabulary_from_the_served_head(tmp_path):
    """Student and teacher heads padded to different sizes past one tokenizer, kd_vocab_size unset: the vocabulary
    is read from the served head when training starts (len(tokenizer), as KDTrainer takes it for an in-process
    teacher) and the run is the in-process one."""
    from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments

    rows = [{"input_ids": r["input_ids"]} for r in _prompts(4)]

    def run(out, **teacher):
        args = KDTrainingArguments(output_dir=str(tmp_path / out), per_device_train_batch_size=2, max_steps=2,
                                   learning_rate=5e-3, logging_steps=1, report_to="none", use_cpu=True,
                                   save_strategy="no", disable_tqdm=True, seed=0, data_seed=0, kd_beta=0.5,
                                   kd_patch_config={"rope": False, "swiglu": False, "rms_norm": False},
                                   **teacher.get("args", {}))  # fmt: skip
        student = tiny_model("llama", dtype=torch.float32, seed=1, vocab=VOCAB + 3)
        trainer = KDTrainer(model=student, teacher_model=teacher.get("model"), args=args, train_dataset=rows,
                            processing_class=_Tokenizer())  # fmt: skip
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return losses, [p.detach().clone() for p in student.parameters()], trainer

    padded_teacher = lambda: tiny_model("llama", dtype=torch.float32, seed=3, vocab=VOCAB + 7)  # noqa: E731
    want = run("in", model=padded_teacher())
    with running(padded_teacher()) as (url, _):
        got = run("served", args=dict(kd_teacher_url=url, kd_teacher_protocol="hidden"))
    assert want[2].kd_config.vocab_size == got[2].kd_config.vocab_size == VOCAB
    _assert_same_training(got, want)


def test_the_api_key_guards_the_hidden_routes():
    """With an API key the server answers /v1/head and /v1/hidden_states only to a client that sends it."""
    seqs, teacher = [[1, 2, 3], [4, 5]], _teacher()
    with running(teacher, api_key=KEY) as (url, _):
        for client in (HiddenClient(url, timeout=30, retries=0), HiddenClient(url, timeout=30, retries=0,
                                                                                api_key="wrong")):  # fmt: skip
            with pytest.raises(TeacherServerError, match="401"):
                client.head()
            with pytest.raises(TeacherServerError, match="401"):
                client.fetch(seqs)
        client = HiddenClient(url, timeout=30, retries=0, api_key=KEY)
        replies = client.fetch(seqs)
        hidden = teacher.config.hidden_size
        assert [tuple(h.shape) for h, _ in replies] == [(3, hidden), (2, hidden)] and client.head_fetches == 1


@pytest.mark.skipif(not fp8_available(torch.device("cpu"))[0], reason=fp8_available(torch.device("cpu"))[1])
def test_fp8_teacher_logits_read_the_served_hidden_states(tmp_path):
    """kd_teacher_logits_fp8 with the hidden protocol: the fused loss quantises the served hidden rows and the cached
    head as it quantises the in-process teacher's, so the runs agree. Tolerance: the two teachers' float32 hidden
    states may differ by ~1e-7 relative (test_served_hidden._assert_same_training), which can move one value across
    an e4m3 rounding boundary: one logit by at most 2^-4 of one term of its sum, the loss by far less than 1e-4
    relative. The FP8 product itself moves the loss by ~2e-3 here, so a path that dropped the option fails."""
    rows = [{"input_ids": r["input_ids"]} for r in _prompts()]
    common = dict(kd_beta=0.5, kd_temperature=2.0, max_steps=2)
    want = _train(tmp_path / "in", rows, _teacher(), kd_teacher_logits_fp8=True, **common)
    bf16_logits = _train(tmp_path / "in_bf16", rows, _teacher(), **common)
    with running(_teacher()) as (url, _):
        got = _train(tmp_path / "served", rows, kd_teacher_url=url, kd_teacher_protocol="hidden",
                     kd_teacher_logits_fp8=True, **common)  # fmt: skip
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-4, atol=0)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    fp8_effect = (torch.tensor(want[0]) - torch.tensor(bf16_logits[0])).abs() / torch.tensor(bf16_logits[0])
    assert fp8_effect.max() > 5e-4, fp8_effect  # the option reached the loss
