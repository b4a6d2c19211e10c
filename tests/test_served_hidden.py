"""The exact served teacher: `liger-kd serve`'s hidden states and head over the wire, and KDTrainer with
kd_teacher_protocol="hidden" training on exactly the in-process teacher's objective."""

import json
import math
import threading
import urllib.error
import urllib.request

import pytest
import torch

from liger_patch_kd.ops.fp8 import FP8_MAX
from liger_patch_kd.teacher.client import TeacherClient
from liger_patch_kd.wire import TeacherReplyError
from liger_patch_kd.wire.hidden_wire import (
    FP8_DTYPE,
    TeacherHead,
    decode_head,
    decode_hidden,
    encode_head,
    encode_hidden,
)

from .tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")


# ------------------------------------------------------------------------------------------------ the wire
def _states(hidden=96, lengths=(5, 1, 12), seed=0):
    g = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    # rows of very different magnitudes, and a row of zeros: the per-row scale must follow each
    states = [torch.randn(n, hidden, generator=g) * torch.logspace(-3, 2, n)[:, None] for n in lengths]
    states[1].zero_()
    return sequences, states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE])
def test_hidden_reply_round_trip_and_bytes(dtype):
    sequences, states = _states()
    blob = encode_hidden(states, sequences, dtype, version=3)
    back, version = decode_hidden(blob, sequences, request="r")
    assert version == 3 and [b.shape for b in back] == [s.shape for s in states]
    tokens, hidden = sum(map(len, sequences)), states[0].shape[-1]
    per_token = (len(blob) - 24 - 4 * len(sequences)) / tokens  # the header and lengths come once per reply
    assert per_token == {torch.float32: 4 * hidden + 4, torch.bfloat16: 2 * hidden + 4, FP8_DTYPE: hidden + 8}[dtype]
    assert dtype != torch.bfloat16 or per_token <= 2 * hidden + 16  # the budget
    for b, s in zip(back, states):
        if dtype == torch.float32:
            assert torch.equal(b, s)
        elif dtype == torch.bfloat16:
            assert torch.equal(b, s.to(torch.bfloat16))
        else:
            # e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself; values below the smallest
            # normal (2^-6 of the scale) by at most half the subnormal step, 2^-10 of the row's scale
            scale = s.abs().amax(-1, keepdim=True) / FP8_MAX
            bound = torch.maximum(s.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
            assert ((b - s).abs() <= bound).all()
            assert b.dtype == torch.float32


def test_hidden_reply_is_checked_against_the_request():
    sequences, states = _states()
    blob = encode_hidden(states, sequences, torch.bfloat16, version=0)
    with pytest.raises(TeacherReplyError, match="row 0 is of token"):
        decode_hidden(blob, [[(sequences[0][0] + 1) % VOCAB, *sequences[0][1:]], *sequences[1:]], request="r")
    with pytest.raises(TeacherReplyError, match="expected"):
        decode_hidden(blob[:-2], sequences, request="r")
    with pytest.raises(TeacherReplyError, match="not a liger hidden-state reply"):
        decode_hidden(b"LKD2" + blob[4:], sequences, request="r")
    states[2][4, 7] = math.nan
    with pytest.raises(TeacherReplyError, match="row 10 holds NaN"):
        decode_hidden(encode_hidden(states, sequences, torch.float32, 0), sequences, request="r")


@pytest.mark.parametrize("bias", [False, True])
def test_head_round_trip(bias):
    weight = torch.randn(VOCAB + 7, 32, dtype=torch.bfloat16)
    head = TeacherHead(5, weight, torch.randn(VOCAB + 7) if bias else None, 30.0 if bias else None, VOCAB, 0.3)
    back = decode_head(encode_head(head), request="r")
    assert torch.equal(back.weight, weight) and back.version == 5 and back.vocab_size == VOCAB
    assert back.softcap == head.softcap and back.logit_scale == 0.3
    assert back.bias is None if not bias else torch.equal(back.bias, head.bias.to(torch.bfloat16))


# ------------------------------------------------------------------------------------- against the real server
def _teacher(arch="llama", vocab=VOCAB, seed=3):
    """A float32 teacher whose distributions are far from uniform (its head x8), saved and served as float32."""
    model = tiny_model(arch, dtype=torch.float32, seed=seed, vocab=vocab)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    return model


TEACHERS = {"llama": {}, "gemma2": {}, "cohere": {}, "padded": {"vocab": VOCAB + 7}}  # soft-capped, scaled, padded


@pytest.fixture(scope="module")
def teacher_dirs(tmp_path_factory):
    dirs = {}
    for name, extra in TEACHERS.items():
        dirs[name] = tmp_path_factory.mktemp(name)
        _teacher("llama" if name == "padded" else name, **extra).save_pretrained(dirs[name])
    return dirs


@pytest.fixture(scope="module")
def servers(teacher_dirs):
    from .test_teacher_server import Server

    started = {}
    try:
        for name, path in teacher_dirs.items():
            started[name] = Server(path).start(wait=False)
        for srv in started.values():  # started together, waited for in turn: the CPU loads them side by side
            TeacherClient(srv.url, top_k=8, vocab_size=VOCAB, timeout=300, retries=20).wait_until_ready()
        yield started
    finally:
        for srv in started.values():
            srv.stop()


def _rows(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, VOCAB, (int(torch.randint(5, 13, (1,), generator=g)),), generator=g)}
            for _ in range(n)]  # fmt: skip


def _train(tmp_path, rows, teacher=None, callbacks=None, collator="padding", **overrides):
    from liger_patch_kd import teacher as TD
    from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments

    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=4, learning_rate=5e-3,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        data_seed=0, dataloader_num_workers=0, use_kd_patch=True,
        kd_patch_config={"rope": False, "swiglu": False, "rms_norm": False},  # the fused loss only: fast on CPU
    )  # fmt: skip
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    args = KDTrainingArguments(**{**base, **overrides})
    trainer = KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows,
                        data_collator=TD.TeacherDataCollator() if collator == "padding" else collator,
                        callbacks=callbacks)  # fmt: skip
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, [p.detach().clone() for p in student.parameters()], trainer


def _in_process(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")


def _assert_same_training(got, want):
    """Both runs are float32 with the same teacher weights; the in-process teacher runs the Trainer's padded (B, T)
    batch, the server each sequence in a batch of its own making (its arrival order), so the teacher's hidden states
    differ by the rounding of float32 products of other shapes (~1e-7 relative), which moves the losses by ~1e-7 and
    the weights after the Adam steps by ~1e-6 (as the served top-k test measures, test_teacher_server.py). Allowed:
    1e-5 for both; a wrong or missing teacher row, another soft-cap, temperature or vocabulary moves each loss by
    > 1e-3 and each step's weights by ~lr = 5e-3."""
    (losses, params, _), (want_losses, want_params, _) = got, want
    assert len(losses) == len(want_losses) and all(math.isfinite(x) for x in losses)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
    for a, b in zip(params, want_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.multiprocess  # `liger-kd serve` subprocesses
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_hidden_protocol_trains_as_the_in_process_teacher(tmp_path, teacher_dirs, servers, beta):
    """kd_beta 0 / 0.5 / 1 at temperature 2, a hard-loss term, gradient accumulation: the same losses and weights."""
    rows = _rows()
    common = dict(kd_beta=beta, kd_temperature=2.0, kd_hard_weight=0.25, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2)  # fmt: skip
    want = _train(tmp_path / "in", rows, _in_process(teacher_dirs["llama"]), **common)
    got = _train(tmp_path / "served", rows, kd_teacher_url=servers["llama"].url, kd_teacher_protocol="hidden", **common)
    _assert_same_training(got, want)
    assert got[2].teacher_source.client.head_fetches == 1  # the head is sent once


@pytest.mark.multiprocess  # `liger-kd serve` subprocesses
def test_evaluation_is_scored_by_the_served_hidden_states(tmp_path, teacher_dirs, servers):
    """trainer.evaluate() asks the server about the evaluation rows (before any training, and from a trainer whose
    training steps are all generated, whose training DataLoader asks nothing): the in-process teacher's eval_loss."""
    from liger_patch_kd import teacher as TD
    from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments

    rows = _rows(7)

    def eval_loss(teacher=None, **overrides):
        args = KDTrainingArguments(
            output_dir=str(tmp_path / "out"), per_device_eval_batch_size=3, report_to="none", use_cpu=True,
            disable_tqdm=True, use_kd_patch=True, kd_beta=0.5, kd_temperature=2.0, kd_hard_weight=0.25,
            kd_patch_config={"rope": False, "swiglu": False, "rms_norm": False}, **overrides,
        )  # fmt: skip
        trainer = KDTrainer(model=tiny_model("llama", dtype=torch.float32, seed=1), teacher_model=teacher, args=args,
                            train_dataset=rows, eval_dataset=rows, data_collator=TD.TeacherDataCollator())  # fmt: skip
        return torch.tensor(trainer.evaluate()["eval_loss"])

    want = eval_loss(_in_process(teacher_dirs["llama"]))
    assert want > 0
    for overrides in ({}, {"kd_lmbda": 1.0}):  # see _assert_same_training for the tolerance
        got = eval_loss(kd_teacher_url=servers["llama"].url, kd_teacher_protocol="hidden", **overrides)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.multiprocess  # `liger-kd serve` subprocesses
@pytest.mark.parametrize("name", ["gemma2", "cohere", "padded"])
def test_soft_capped_scaled_and_padded_teachers(tmp_path, teacher_dirs, servers, name):
    """A soft-capped teacher (Gemma-2's final_logit_softcapping), a scaled one (Cohere's logit_scale, folded into
    the served hidden states and bias as in process) and a head padded beyond the tokenizer's vocabulary."""
    rows = _rows(8)
    common = dict(kd_beta=0.5, kd_temperature=1.5, kd_vocab_size=VOCAB if name == "padded" else None)
    want = _train(tmp_path / "in", rows, _in_process(teacher_dirs[name]), **common)
    got = _train(tmp_path / "served", rows, kd_teacher_url=servers[name].url, kd_teacher_protocol="hidden", **common)
    _assert_same_training(got, want)
    head = got[2].teacher_source.client.cached_head
    assert head.weight.shape[0] == (VOCAB + 7 if name == "padded" else VOCAB)
    assert (head.softcap == 5.0) == (name == "gemma2") and (head.logit_scale != 1.0) == (name == "cohere")


@pytest.mark.multiprocess  # `liger-kd serve` subprocesses
def test_on_policy_rows_are_scored_by_the_served_hidden_states(tmp_path, teacher_dirs, servers):
    """kd_lmbda=1: every step trains on completions the student generates; the server is asked about each generated
    micro-batch before it trains, and the result is the in-process teacher's."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(8):
        ids = torch.randint(3, VOCAB, (5,), generator=g)
        rows.append({"input_ids": ids, "labels": torch.full_like(ids, -100)})  # prompts only
    common = dict(kd_lmbda=1.0, kd_max_new_tokens=4, max_steps=2, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, kd_beta=0.5)  # fmt: skip
    want = _train(tmp_path / "in", rows, _in_process(teacher_dirs["llama"]), **common)
    got = _train(tmp_path / "served", rows, kd_teacher_url=servers["llama"].url, kd_teacher_protocol="hidden",
                 **common)  # fmt: skip
    _assert_same_training(got, want)
    assert got[2].teacher_source.client.tokens_received > 0


@pytest.mark.multiprocess  # `liger-kd serve` subprocesses
def test_privileged_teacher_prompts_are_asked_of_the_server(tmp_path, teacher_dirs, servers):
    """Rows whose teacher reads its own prompt before the completion (teacher_input_ids): the server is asked about
    the teacher's rows, and the completion positions' hidden states are paired with the student's as in process."""
    from .test_privileged import _features
    from .test_privileged import _rows as privileged_rows

    rows = _features(privileged_rows()) + _features(privileged_rows(seed=1))
    common = dict(max_steps=2, per_device_train_batch_size=2, remove_unused_columns=False, kd_beta=0.5)
    want = _train(tmp_path / "in", rows, _in_process(teacher_dirs["llama"]), collator=None, **common)
    got = _train(tmp_path / "served", rows, collator=None, kd_teacher_url=servers["llama"].url,
                 kd_teacher_protocol="hidden", **common)  # fmt: skip
    _assert_same_training(got, want)


@pytest.fixture(scope="module")
def own_server(teacher_dirs):
    """A server of the llama teacher for the tests that kill it or change its weights."""
    from .test_teacher_server import Server

    srv = Server(teacher_dirs["llama"]).start(wait=False)
    TeacherClient(srv.url, top_k=8, vocab_size=VOCAB, timeout=300, retries=20).wait_until_ready()
    yield srv
    srv.stop()


@pytest.mark.multiprocess  # `liger-kd serve` subprocesses
def test_server_killed_mid_run_loses_nothing(tmp_path, teacher_dirs, servers, own_server):
    """The server dies after step 1 (by its PID) and comes back a second later: the retries carry training on, every
    batch trains with its teacher, to the result of a run that never lost it."""
    from transformers import TrainerCallback

    rows = _rows(8)
    common = dict(kd_teacher_protocol="hidden", kd_teacher_retries=10, max_steps=4, kd_beta=0.5)

    class KillAtStep1(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                own_server.stop()
                threading.Timer(1.0, lambda: own_server.start(wait=False)).start()

    got = _train(tmp_path / "flaky", rows, callbacks=[KillAtStep1()], kd_teacher_url=own_server.url, **common)
    assert got[2].teacher_source.client.retried > 0  # the lost server was noticed and waited for
    steady = _train(tmp_path / "steady", rows, kd_teacher_url=servers["llama"].url, **common)
    _assert_same_training(got, steady)


def _update_weights(url: str, path) -> dict:
    body = json.dumps({"model_path": str(path)}).encode()
    request = urllib.request.Request(url + "/update_weights_from_disk", body, method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    return json.loads(urllib.request.urlopen(request, timeout=120).read())


@pytest.mark.multiprocess  # `liger-kd serve` subprocesses
def test_a_head_of_a_new_weight_version_is_fetched_again(tmp_path, own_server):
    """Weights pushed to the server (its /update_weights_from_disk) bump its version: the next hidden-state reply
    names it, and the client fetches the new head before using them; both are the new teacher's."""
    from liger_patch_kd.teacher.client.hidden_client import HiddenClient

    TeacherClient(own_server.url, top_k=8, vocab_size=VOCAB, timeout=300, retries=20).wait_until_ready()
    client = HiddenClient(own_server.url, timeout=120)
    seqs = [r["input_ids"].tolist() for r in _rows(3, seed=4)]
    before = client.fetch(seqs)
    assert client.head_fetches == 1 and client.fetch(seqs)[0][1] is before[0][1]  # cached, not fetched again
    new = _teacher(seed=5)
    new.save_pretrained(tmp_path / "new")
    reply = _update_weights(own_server.url, tmp_path / "new")
    version = reply["weights_id"]  # the head's version: this server start's id, then its weight version
    assert reply["weight_version"] == 1 and version & 0xFFFFFFFF == 1
    after = client.fetch(seqs)
    head = after[0][1]
    assert client.head_fetches == 2 and head.version == version != before[0][1].version
    assert torch.equal(head.weight, new.lm_head.weight)
    with torch.no_grad():
        for seq, (hidden, _) in zip(seqs, after):
            want = new(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]
            torch.testing.assert_close(hidden, want, rtol=1e-5, atol=1e-6)  # float32, other batch shapes


def test_hidden_protocol_arguments_are_checked(tmp_path):
    from liger_patch_kd.trainer import KDTrainingArguments

    def args(**kw):
        return KDTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                   kd_teacher_protocol="hidden", **kw)  # fmt: skip

    args(kd_teacher_url={"a": "http://x", "b": "http://y"})  # several hidden teachers: test_multi_teacher_served
    with pytest.raises(ValueError, match=r"per-teacher protocols do not take \['kd_seq_kd'\]"):
        args(kd_teacher_url={"a": "http://x", "b": "http://y"}, kd_seq_kd=True)
    with pytest.raises(ValueError, match="kd_teacher_hidden_dtype must be one of"):
        args(kd_teacher_url="http://x", kd_teacher_hidden_dtype="fp4")
    with pytest.raises(ValueError, match=r"does not take \['kd_teacher_samples'\]"):
        args(kd_teacher_url="http://x", kd_teacher_samples=4)
    with pytest.raises(ValueError, match="kd_teacher_protocol must be one of"):
        KDTrainingArguments(output_dir=str(tmp_path), report_to="none", kd_teacher_url="http://x",
                            kd_teacher_protocol="hiden")  # fmt: skip


@pytest.mark.multiprocess  # `liger-kd serve` subprocesses
def test_bad_hidden_requests_get_a_4xx_naming_the_field(servers):
    def post(body):
        request = urllib.request.Request(servers["llama"].url + "/v1/hidden_states", json.dumps(body).encode(),
                                         method="POST", headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            urllib.request.urlopen(request, timeout=60)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())["error"]
        return 200, ""

    code, message = post({"prompt": "some text"})
    assert code == 400 and message.startswith("prompt must be token ids")
    code, message = post({"prompt": [[1, 2]], "dtype": "fp4"})
    assert code == 400 and message.startswith("dtype must be one of")
    code, message = post({"prompt": [[1, VOCAB]]})
    assert code == 400 and "token ids must be ints in [0, 257)" in message
    code, message = post({"prompt": [[1, 2]], "top_k": 3})
    assert code == 400 and message.startswith("top_k is not a field")
    code, message = post({"prompt": [[1] * 300_000]})
    assert code == 413


@pytest.mark.multiprocess  # `liger-kd serve` subprocesses
def test_fp8_transport_is_the_teachers_states_to_e4m3_rounding(servers):
    """kd_teacher_hidden_dtype='fp8': the server quantises each row with its own scale; the client gets the float32
    teacher's states back within e4m3's rounding (as the wire's unit test bounds it), in H + 8 bytes a token."""
    from liger_patch_kd.teacher.client.hidden_client import HiddenClient

    seqs = [r["input_ids"].tolist() for r in _rows(4, seed=7)]
    exact = HiddenClient(servers["llama"].url, dtype="fp32", sequences_per_request=4).fetch(seqs)
    client = HiddenClient(servers["llama"].url, dtype="fp8", sequences_per_request=4)
    fp8 = client.fetch(seqs)
    hidden = exact[0][0].shape[-1]
    assert client.bytes_received == 24 + 4 * len(seqs) + sum(map(len, seqs)) * (hidden + 8)
    for (h8, _), (h, _) in zip(fp8, exact):
        scale = h.abs().amax(-1, keepdim=True) / FP8_MAX
        assert ((h8 - h).abs() <= torch.maximum(h.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)).all()
        assert not torch.equal(h8, h)
