"""Sampled teacher tokens served by the real `liger-kd serve` (liger protocol, binary): the draws are precompute's for
the same teacher and seed, follow the teacher at the asked temperature, are checked on the wire, refused with a 400
naming the field when asked wrongly, and KDTrainer trains on them as on a store of them."""

import copy
import json
import math
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import liger_patch_kd.models as M  # noqa: E402
from liger_patch_kd import teacher as TD  # noqa: E402
from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments  # noqa: E402
from liger_patch_kd.wire.protocols import TeacherReplyError  # noqa: E402
from liger_patch_kd.wire.sampled_tokens import SampledTokens  # noqa: E402
from liger_patch_kd.wire.sampled_wire import SampleAsk, decode_sampled, encode_sampled  # noqa: E402

from .helpers import random_sequences  # noqa: E402
from .test_teacher_server import Server  # noqa: E402
from .tiny_models import VOCAB, tiny_model  # noqa: E402

pytestmark = [pytest.mark.usefixtures("clean_patches"), pytest.mark.multiprocess]  # a `liger-kd serve` subprocess
SEED, M_DRAWS, T = 5, 6, 1.5
# The server and this process compute the teacher's float32 log-probs in separate processes (one thread each when
# OMP_NUM_THREADS=1, maybe not in CI): a log-prob may come back one float32 ulp apart (|log-prob| < ~30 here: 4e-6).
# Ids and counts are compared exactly: a draw flips only when a uniform lands within that ulp of a bin's edge.
SERVED_ATOL = 1e-5


def _teacher():
    model = tiny_model("llama", seed=3)  # float64, saved and served as such
    with torch.no_grad():
        model.lm_head.weight.mul_(4)  # peaked enough that draws repeat, flat enough that they differ
    return model


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher")
    _teacher().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(teacher_dir):
    # every sequence in a forward of its own; draws at T unless a request names another temperature
    srv = Server(teacher_dir, extra=("--batch-invariant", "--sample-temperature", str(T))).start()
    yield srv
    srv.stop()


def _client(server, top_k=0, **kw):
    return TD.TeacherClient(server.url, "liger", top_k=top_k, vocab_size=VOCAB, samples=M_DRAWS, sample_seed=SEED,
                            sample_temperature=T, **kw)  # fmt: skip


def _store(tmp_path, seqs, top_k):
    out = TD.precompute(_teacher(), seqs, tmp_path / f"store{top_k}", top_k=top_k, samples=M_DRAWS, seed=SEED,
                        temperature=T, batch_size=1, logprob_dtype="float32", progress=False)  # fmt: skip
    return TD.TeacherLogprobsDataset(out, vocab_size=VOCAB)


@pytest.mark.parametrize("top_k", [0, 3])
def test_served_draws_are_precomputes_for_the_same_seed(tmp_path, server, top_k):
    seqs = random_sequences(VOCAB, 5, seed=1)
    served = _client(server, top_k, sequences_per_request=2).fetch(seqs)
    alone = _client(server, top_k, sequences_per_request=1).fetch(seqs)  # other requests: the same draws
    other_seed = TD.TeacherClient(server.url, "liger", top_k=top_k, vocab_size=VOCAB, samples=M_DRAWS,
                                  sample_seed=SEED + 1, sample_temperature=T).fetch(seqs)  # fmt: skip
    store = _store(tmp_path, seqs, top_k)
    for n, (d, a) in enumerate(zip(served, alone)):
        item = store[n]
        assert torch.equal(d.ids, item["teacher_sample_ids"]) and torch.equal(d.ids, a.ids)
        assert torch.equal(d.counts, item["teacher_sample_counts"]) and torch.equal(d.counts, a.counts)
        torch.testing.assert_close(d.logprobs, item["teacher_sample_logprobs"], rtol=0, atol=SERVED_ATOL)
        if top_k:
            assert torch.equal(d.topk_ids, item["teacher_token_ids"])
            torch.testing.assert_close(d.topk_logprobs, item["teacher_logprobs"], rtol=0, atol=SERVED_ATOL)
    assert any(not torch.equal(d.ids, o.ids) for d, o in zip(served, other_seed))  # the seed matters


def test_served_draws_follow_the_teacher_at_the_asked_temperature(server):
    seqs = random_sequences(VOCAB, 3, seed=2)
    teacher = _teacher()
    for d, seq in zip(_client(server, top_k=2).fetch(seqs), seqs):
        with torch.no_grad():
            ref = torch.log_softmax(teacher(torch.tensor([seq])).logits[0].double() / T, -1)[:-1]
        present = d.counts[:-1] > 0
        ids = d.ids[:-1].long().clamp(min=0)
        torch.testing.assert_close(d.logprobs[:-1][present].double(), ref.gather(-1, ids)[present], rtol=0,
                                   atol=SERVED_ATOL)  # fmt: skip
        torch.testing.assert_close(d.topk_logprobs[:-1].double(), ref.topk(2, -1).values, rtol=0, atol=SERVED_ATOL)
        assert (d.counts[:-1].sum(-1) == M_DRAWS).all() and (d.counts[-1] == 0).all()
        assert not (ids[:, :, None] == d.topk_ids[:-1, None, :].long()).logical_and(present[:, :, None]).any()


def test_a_request_naming_no_temperature_draws_at_the_servers(server):
    seqs = random_sequences(VOCAB, 2, seed=5)
    status, blob = _post(server, {"model": str(server.teacher_dir), "prompt": seqs, "prompt_logprobs": 0,
                                  "samples": M_DRAWS, "sample_seed": SEED, "max_tokens": 1})  # fmt: skip
    assert status == 200
    drawn = decode_sampled(blob, seqs, SampleAsk(M_DRAWS, 0, SEED, T), vocab_size=VOCAB, request="r")
    for d, want in zip(drawn, _client(server).fetch(seqs)):
        assert torch.equal(d.ids, want.ids) and torch.equal(d.counts, want.counts)
    listed = json.loads(urllib.request.urlopen(server.url + "/v1/models").read())["data"][0]
    assert listed["sample_temperature"] == T
    from liger_patch_kd.server.app import check_serve_options

    with pytest.raises(ValueError, match="--sample-temperature must be a finite number > 0; got 0"):
        check_serve_options(8, VOCAB, 16, 16, 0)


def test_packed_batches_get_each_sequences_draws(server):
    from transformers import DataCollatorWithFlattening

    from liger_patch_kd.teacher.client import TeacherPrefetcher

    seqs = random_sequences(VOCAB, 3, seed=6)
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": s} for s in seqs])
    client = _client(server, top_k=2)
    out = TeacherPrefetcher([batch], client).with_teacher(batch)
    alone = client.fetch(seqs)
    start = 0
    for s, d in zip(seqs, alone):
        rows = slice(start, start + len(s))
        assert torch.equal(out["teacher_sample_ids"][0, rows], d.ids)
        assert torch.equal(out["teacher_sample_counts"][0, rows], d.counts)
        assert torch.equal(out["teacher_token_ids"][0, rows], d.topk_ids)
        torch.testing.assert_close(out["teacher_sample_logprobs"][0, rows], d.logprobs, rtol=0, atol=0)
        start += len(s)
    assert out["teacher_sample_ids"].shape == (1, start, M_DRAWS)


def _post(server, body, accept="application/octet-stream"):
    request = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Accept": accept})  # fmt: skip
    try:
        with urllib.request.urlopen(request) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


@pytest.mark.parametrize(
    ("fields", "accept", "message"),
    [
        ({"samples": 0}, None, "samples must be an int in [1, 255]"),
        ({"samples": True}, None, "samples must be an int"),
        ({"samples": 4, "sample_seed": -1}, None, "sample_seed must be an int >= 0"),
        ({"samples": 4, "sample_temperature": 0}, None, "sample_temperature must be a number > 0"),
        ({"sample_seed": 3, "prompt_logprobs": 1}, None, "sample_seed is given without samples"),
        ({"samples": 4}, "application/json", "sampled teacher tokens come only in the liger binary reply"),
        ({"samples": 255, "prompt_logprobs": 8}, None, "samples 255 + prompt_logprobs 8 exceed the vocabulary"),
    ],
)
def test_bad_sample_fields_are_a_400_naming_the_field(server, fields, accept, message):
    body = {"model": str(server.teacher_dir), "prompt": [[1, 2, 3]], "prompt_logprobs": 0, "max_tokens": 1, **fields}
    status, error = _post(server, body, accept or "application/octet-stream")
    assert status == 400 and message in error and "\n" not in error


def test_the_wire_checks_the_draws():
    seqs = [[1, 2, 3]]
    ask = SampleAsk(2, 0, 0, 1.0)
    good = SampledTokens(torch.tensor([[4, 5], [6, -1], [-1, -1]], dtype=torch.int32),
                         torch.tensor([[1, 1], [2, 0], [0, 0]], dtype=torch.int32),
                         torch.tensor([[-1.0, -2.0], [-0.5, -math.inf], [-math.inf, -math.inf]]))  # fmt: skip
    (back,) = decode_sampled(encode_sampled([good], seqs, ask), seqs, ask, vocab_size=VOCAB, request="r")
    assert torch.equal(back.ids, good.ids) and torch.equal(back.counts, good.counts)
    positive = good.logprobs.clone()
    positive[0, 0] = 0.5

    def i32(rows):
        return torch.tensor(rows, dtype=torch.int32)

    bad = {
        "counts that do not sum": good._replace(counts=i32([[1, 2], [2, 0], [0, 0]])),
        "draws an id twice": good._replace(ids=i32([[4, 4], [6, -1], [-1, -1]])),
        "outside \\[0, vocab_size": good._replace(ids=i32([[4, VOCAB], [6, -1], [-1, -1]])),
        "draws on the last row": good._replace(
            ids=i32([[4, 5], [6, -1], [7, -1]]), counts=i32([[1, 1], [2, 0], [2, 0]])
        ),
        "log-prob not finite or > 0": good._replace(logprobs=positive),
    }
    for message, drawn in bad.items():
        with pytest.raises(TeacherReplyError, match=message):
            decode_sampled(encode_sampled([drawn], seqs, ask), seqs, ask, vocab_size=VOCAB, request="r")
    with pytest.raises(TeacherReplyError, match="asked 1, 0, 3"):
        decode_sampled(encode_sampled([good], seqs, ask), seqs, SampleAsk(3), vocab_size=VOCAB, request="r")


def _args(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=5e-3, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        seed=0, data_seed=0, dataloader_num_workers=0, kd_beta=0.0, kd_temperature=T, bf16=True,
        kd_patch_config={"rope": False, "swiglu": False, "rms_norm": False},  # the fused loss only: fast on CPU
    )  # fmt: skip
    return KDTrainingArguments(**{**base, **overrides})


def _train(tmp_path, data, student, **overrides):
    trainer = KDTrainer(model=student, args=_args(tmp_path, **overrides), train_dataset=data,
                        data_collator=TD.TeacherDataCollator())  # fmt: skip
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], [p.detach() for p in student.parameters()]


def test_kdtrainer_trains_on_served_samples_as_on_a_store_of_them(tmp_path, server):
    """bf16 autocast, gradient accumulation: served samples (hybrid top-2 + 6 draws) train the student exactly as
    precompute's store of the same draws (the same batches up to the served float32 ulps), and the fused loss
    agrees with the materialised reference on them."""
    seqs = random_sequences(VOCAB, 8, seed=3)
    served = dict(kd_teacher_url=server.url, kd_teacher_protocol="liger", kd_teacher_top_k=2,
                  kd_teacher_samples=M_DRAWS, kd_teacher_sample_seed=SEED)  # fmt: skip
    student = tiny_model("llama", dtype=torch.float32, seed=1)
    runs = {}
    for name, data, extra in (
        ("store", _store(tmp_path, seqs, 2), {}),
        ("served", [{"input_ids": s} for s in seqs], served),
        ("served_materialised", [{"input_ids": s} for s in seqs], {**served, "use_kd_patch": False}),
    ):
        model = copy.deepcopy(student)
        runs[name] = _train(tmp_path / name, data, model, **extra)
        M.revert_kd_patch(model=model)
    (store_losses, store_params), (losses, params) = runs["store"], runs["served"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    # the served log-probs may be a float32 ulp (<= 4e-6 here) off the store's: that moves a loss (a mean of
    # count-weighted log-probs) by at most as much, and the weights (through the top-k's gradient) by far less than
    # an Adam step's lr 5e-3, which a wrong or missing draw would cost
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(store_losses), rtol=0, atol=1e-5)
    for a, b in zip(params, store_params):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert any(not torch.equal(a, b) for a, b in zip(params, student.parameters()))
    # fused against materialised under bf16 autocast: logits rounded at 2^-8 move each drawn id's log S by ~1e-2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(runs["served_materialised"][0]), rtol=0, atol=2e-2)


def test_served_sample_arguments_are_checked(tmp_path):
    url = dict(kd_teacher_url="http://127.0.0.1:9", kd_teacher_samples=4)
    with pytest.raises(ValueError, match="kd_teacher_protocol='liger' or 'auto'.*got kd_teacher_protocol='vllm'"):
        _args(tmp_path, **url, kd_teacher_protocol="vllm")
    assert _args(tmp_path, **url).kd_teacher_protocol == "auto"  # accepted: the server is asked at train()
    with pytest.raises(ValueError, match="kd_beta: kd_teacher_samples asks for sampled teacher tokens; beta=0.5"):
        _args(tmp_path, **url, kd_teacher_protocol="liger", kd_beta=0.5)
    with pytest.raises(ValueError, match="kd_teacher_samples must be None or an int in \\[1, 255\\]"):
        _args(tmp_path, **{**url, "kd_teacher_samples": 0}, kd_teacher_protocol="liger")
    with pytest.raises(ValueError, match="leave kd_lmbda=0"):
        _args(tmp_path, **url, kd_teacher_protocol="liger", kd_lmbda=0.5)
    args = _args(tmp_path, **url, kd_teacher_protocol="liger", kd_teacher_top_k=0)  # draws alone
    assert args.kd_teacher_samples == 4


def test_a_batch_of_requests_draws_each_sequence_as_alone(tmp_path):
    """The batcher without --batch-invariant: top-k requests and draws of two seeds, queued before it runs, share
    one padded batch (one forward for the top-k, one for the draws); each sequence still gets its own draws, those
    precompute writes for it alone (the float64 teacher's padded forward rounds to the same float32 log-probs)."""
    import asyncio

    from liger_patch_kd.server.app import TeacherBatcher

    seqs = random_sequences(VOCAB, 4, seed=4)
    teacher = _teacher().eval()
    batcher = TeacherBatcher(teacher, max_top_k=4)
    asks = [SampleAsk(M_DRAWS, 0, SEED, T), SampleAsk(M_DRAWS, 0, SEED + 1, T)]

    async def run():
        replies = asyncio.gather(batcher.draw(seqs[:2], asks[0]), batcher.score(seqs[2:3], 4),
                                 batcher.draw(seqs[3:], asks[1]))  # fmt: skip
        await asyncio.sleep(0)  # every request is waiting before the batcher starts: one batch
        task = asyncio.create_task(batcher.run())
        try:
            return await replies
        finally:
            task.cancel()

    first, _, second = asyncio.run(run())
    assert batcher.batches_run == 1 and batcher.forwards_run == 2
    for ask, part, drawn in ((asks[0], seqs[:2], first), (asks[1], seqs[3:], second)):
        out = TD.precompute(teacher, part, tmp_path / f"s{ask.seed}", top_k=0, samples=M_DRAWS, seed=ask.seed,
                            temperature=T, batch_size=1, logprob_dtype="float32", progress=False)  # fmt: skip
        store = TD.TeacherLogprobsDataset(out)
        for n, d in enumerate(drawn):
            assert torch.equal(d.ids, store[n]["teacher_sample_ids"])
            assert torch.equal(d.counts, store[n]["teacher_sample_counts"])
            torch.testing.assert_close(d.logprobs, store[n]["teacher_sample_logprobs"], rtol=0, atol=SERVED_ATOL)
