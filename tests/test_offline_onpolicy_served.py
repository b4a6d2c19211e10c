"""A rollout store made with served models (`liger-kd precompute --rollouts-from http://... / --teacher-url ...`):
the completions and behaviour log-probs from an engine, the scores from a served teacher (top-k, sampled, hidden
states), each against the store the in-process models write; its bad inputs, refused in one line before any model
loads; a killed run over an engine, resumed to the uninterrupted store. The servers are the real `liger-kd serve`
app: the engine served by uvicorn in a thread of this process (test_generation_server.running), the teacher
by `liger-kd serve` in a subprocess (test_teacher_server.Server)."""

import json
import socket
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from transformers import AutoModelForCausalLM  # noqa: E402

from liger_patch_kd.cli import main  # noqa: E402
from liger_patch_kd.teacher import TeacherLogprobsDataset  # noqa: E402
from liger_patch_kd.teacher.store import read_manifest  # noqa: E402
from liger_patch_kd.trainer.offline_onpolicy import ScoreOptions, precompute_rollouts  # noqa: E402
from liger_patch_kd.trainer.offline_onpolicy.engine_student import EngineStudent  # noqa: E402
from liger_patch_kd.trainer.rollouts.generate import RolloutSettings  # noqa: E402

from .test_generation_server import running  # noqa: E402
from .test_offline_onpolicy import PROMPTS, _prompts, _tokenizer, resumed_store_is_the_uninterrupted_one  # noqa: E402
from .tiny_models import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_patches")
KEY = "rollout-key-7"
TOP_K = 4
# The engine decodes a token at a time with its KV cache (left-padded rows), the in-process path scores each whole
# sequence in one right-padded forward: float32 products over hidden size 64 and a log-softmax over 257 ids summed in
# other orders, a few float32 ulp of O(1) values apart (~1e-6). 1e-5 leaves room for another BLAS; a token one
# position off, or another model's log-prob, is more than 1e-2 away.
BEHAVIOUR_ATOL = 1e-5
# The served teacher is float64 (its log-probs rounded to float32 at the end, as in process): the server's forward
# runs other batch shapes and attention code, which move the float64 logits by ~1e-15, so its float32 log-probs are
# the in-process ones but for a rare rounding of the last bit (~1e-6 at |log-prob| ~ 10): 2 float32 ulp at 10.
TEACHER_ATOL = 2e-6


def _teacher():
    """A float64 teacher whose distributions are far from uniform (its head x8), so top-k orders are well apart."""
    model = tiny_model("llama", seed=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    return model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-rollouts")
    tokenizer = _tokenizer()
    for name, model in (("student", tiny_model("llama", dtype=torch.float32, seed=1)), ("teacher", _teacher()),
                        ("narrow", tiny_model("llama", dtype=torch.float32, seed=2, vocab=150))):  # fmt: skip
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    other = _tokenizer(300, "lorem ipsum dolor sit amet. " * 20)
    tiny_model("llama", dtype=torch.float32, seed=2).save_pretrained(root / "other")
    other.save_pretrained(root / "other")
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return root


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype="auto").eval()


@pytest.fixture(scope="module")
def engine(dirs):
    """The student served, with an API key (read by the command from LIGER_KD_API_KEY)."""
    with running(_load(dirs / "student"), api_key=KEY, model_name="student-engine") as (url, _):
        yield url


@pytest.fixture(scope="module")
def teacher_server(dirs):
    """`liger-kd serve` in a subprocess (top-k 8): its hidden-state route patches the model it serves, which this
    process's tests must not share."""
    from .test_teacher_server import Server

    server = Server(dirs / "teacher").start()
    try:
        yield server.url
    finally:
        server.stop()


def _precompute(dirs, out, *extra, student=None, teacher=None):
    student = student or str(dirs / "student")
    scorer = ["--teacher", teacher or str(dirs / "teacher")] if not any(a == "--teacher-url" for a in extra) else []
    argv = ["precompute", *scorer, "--rollouts-from", student, "--data", str(dirs / "prompts.jsonl"), "--out",
            str(out), "--top-k", str(TOP_K), "--max-new-tokens", "5", "--num-generations", "2", "--dtype", "float32",
            "--batch-size", "2", "--shard-size", "4", "--device", "cpu", *extra]  # fmt: skip
    return main(argv)


def _items(path):
    data = TeacherLogprobsDataset(path)
    return [data[i] for i in range(len(data))]


def test_engine_rollouts_are_the_in_process_student_s(tmp_path, dirs, engine, monkeypatch):
    """Greedy (--generation-top-k 1): the engine's tokens are the in-process student's, its behaviour log-probs the
    same log-probs to float32 rounding, and the teacher's scores of those tokens the very same values."""
    monkeypatch.setenv("LIGER_KD_API_KEY", KEY)
    assert _precompute(dirs, tmp_path / "here", "--generation-top-k", "1") == 0
    assert _precompute(dirs, tmp_path / "url", "--generation-top-k", "1", "--tokenizer", str(dirs / "student"),
                       student=engine) == 0  # fmt: skip
    here, there = _items(tmp_path / "here"), _items(tmp_path / "url")
    assert len(here) == len(there) == 8
    for a, b in zip(here, there):
        assert a["input_ids"].tolist() == b["input_ids"].tolist() and torch.equal(a["labels"], b["labels"])
        torch.testing.assert_close(b["behaviour_logprobs"], a["behaviour_logprobs"], atol=BEHAVIOUR_ATOL, rtol=0)
        assert (b["behaviour_logprobs"][a["labels"] != -100] < 0).all()
        for key in ("teacher_token_logprobs", "teacher_token_ids", "teacher_logprobs"):  # one teacher, same tokens
            assert torch.equal(a[key], b[key]), key
    meta = read_manifest(tmp_path / "url")
    assert meta["rollouts"]["generator_engine"] == {"url": engine, "model": "student-engine"}
    assert meta["rollouts"]["generator_fingerprint"] is None and meta["generator"] == engine
    assert len(meta["rollouts"]["teacher_fingerprint"]) == 16
    for path in (tmp_path / "url").iterdir():  # the key was sent (the engine refuses requests without it), not kept
        assert KEY.encode() not in path.read_bytes(), path.name


@pytest.mark.parametrize("protocol,extra", [
    ("topk", ()),
    ("sampled", ("--samples", "6")),
    ("hidden", ("--samples", "6")),
    ("auto", ()),
])  # fmt: skip
def test_a_served_teacher_scores_as_the_in_process_one(tmp_path, dirs, teacher_server, protocol, extra):
    assert _precompute(dirs, tmp_path / "here", *extra) == 0
    assert _precompute(dirs, tmp_path / "served", "--teacher-url", teacher_server, "--teacher-protocol", protocol,
                       *extra) == 0  # fmt: skip
    here, served = _items(tmp_path / "here"), _items(tmp_path / "served")
    for a, b in zip(here, served):
        for key in ("input_ids", "labels", "behaviour_logprobs"):  # the student here in both
            assert torch.equal(a[key], b[key]), key
        torch.testing.assert_close(b["teacher_token_logprobs"], a["teacher_token_logprobs"], atol=TEACHER_ATOL,
                                   rtol=0)  # fmt: skip
        assert torch.equal(a["teacher_token_ids"], b["teacher_token_ids"])  # far apart: the same order
        torch.testing.assert_close(b["teacher_logprobs"], a["teacher_logprobs"], atol=TEACHER_ATOL, rtol=0)
        if extra:  # the draws: each sequence's own generator over the same distribution, so the same tokens
            assert torch.equal(a["teacher_sample_ids"], b["teacher_sample_ids"])
            assert torch.equal(a["teacher_sample_counts"], b["teacher_sample_counts"])
            torch.testing.assert_close(b["teacher_sample_logprobs"], a["teacher_sample_logprobs"], atol=TEACHER_ATOL,
                                       rtol=0)  # fmt: skip
    section = read_manifest(tmp_path / "served")["rollouts"]
    chosen = {"auto": "topk"}.get(protocol, protocol)
    assert section["teacher_server"] == {"url": teacher_server, "model": str(dirs / "teacher"), "protocol": chosen}
    assert section["teacher_fingerprint"] is None


def test_a_store_scored_by_a_served_teacher_refuses_a_teacher_model(tmp_path, dirs, teacher_server):
    from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments

    assert _precompute(dirs, tmp_path / "s", "--teacher-url", teacher_server) == 0
    args = KDTrainingArguments(output_dir=str(tmp_path / "o"), use_kd_patch=True, kd_store_refresh_steps=1,
                               report_to="none", use_cpu=True, max_steps=1)  # fmt: skip
    with pytest.raises(ValueError, match="scored by the served teacher '.*teacher' at http"):
        KDTrainer(model=_load(dirs / "student"), teacher_model=_load(dirs / "teacher"), args=args,
                  train_dataset=TeacherLogprobsDataset(tmp_path / "s"), processing_class=_tokenizer())  # fmt: skip


def test_a_killed_run_over_an_engine_resumes_to_the_uninterrupted_store(tmp_path, dirs, engine, monkeypatch):
    """Sampled at temperature 1: each call's request carries its own seed, so the engine samples a resumed call as
    it sampled it the first time."""
    tokenizer, teacher = _tokenizer(), _load(dirs / "teacher")
    settings = RolloutSettings(max_new_tokens=5, num_generations=2, seed=3)

    def store(out):
        student = EngineStudent(engine, api_key=KEY)
        return precompute_rollouts(student, teacher, _prompts(tokenizer), out, settings=settings,
                                   score=ScoreOptions(top_k=TOP_K), prompts_per_call=2, shard_size=4,
                                   tokenizer=tokenizer, progress=False)  # fmt: skip

    whole = resumed_store_is_the_uninterrupted_one(store, tmp_path, monkeypatch)
    completions = {tuple(item["input_ids"].tolist()) for item in _items(whole)}
    assert len(completions) > len(PROMPTS)  # sampled: a prompt's two completions differ somewhere


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case,needle", [
    ("engine unreachable", "--rollouts-from http://127.0.0.1:{port}: no server answers"),
    ("teacher unreachable", "--teacher-url http://127.0.0.1:{port}: no server answers"),
    ("both teachers", "both name the teacher"),
    ("no teacher", "no teacher: give --teacher"),
    ("protocol without url", "--teacher-protocol hidden says how to ask a served teacher"),
    ("both served, no tokenizer", "give --tokenizer"),
    ("key in the url", "the URL holds credentials"),
    ("engine vocabulary", "has a vocabulary of 257 ids and the teacher --teacher"),
    ("engine tokenizer", "has another tokenizer than --rollouts-from http"),
    ("served teacher vocabulary", "has a vocabulary of 257 ids and the teacher --teacher-url"),
    ("samples over topk", "--samples 4: the top-k protocol draws no teacher tokens"),
    ("top-k beyond the server's", "serves at most 8 log-probs per position"),
    ("tempered top-k", "--temperature 2: a server's top-k is at temperature 1"),
])  # fmt: skip
def test_bad_inputs_are_one_line_before_any_model_loads(tmp_path, dirs, engine, teacher_server, capsys,
                                                       monkeypatch, case, needle):  # fmt: skip
    import transformers

    def never(*_, **__):
        raise AssertionError("a model loaded before the inputs were checked")

    narrow = _load(dirs / "narrow") if case == "served teacher vocabulary" else None
    capsys.readouterr()  # its loading's progress bar
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    monkeypatch.setenv("LIGER_KD_API_KEY", KEY)
    port = _free_port()
    nowhere = f"http://127.0.0.1:{port}"
    tok = ("--tokenizer", str(dirs / "student"))
    served = ("--teacher-url", teacher_server)
    run = {
        "engine unreachable": lambda: _precompute(dirs, tmp_path / "o", *tok, "--url-retries", "0", student=nowhere),
        "teacher unreachable": lambda: _precompute(dirs, tmp_path / "o", "--teacher-url", nowhere, "--url-retries",
                                                   "0"),
        "both teachers": lambda: main(["precompute", "--teacher", str(dirs / "teacher"), *served, "--rollouts-from",
                                       str(dirs / "student"), "--data", str(dirs / "prompts.jsonl"), "--out",
                                       str(tmp_path / "o")]),
        "no teacher": lambda: main(["precompute", "--rollouts-from", str(dirs / "student"), "--data",
                                    str(dirs / "prompts.jsonl"), "--out", str(tmp_path / "o")]),
        "protocol without url": lambda: _precompute(dirs, tmp_path / "o", "--teacher-protocol", "hidden"),
        "both served, no tokenizer": lambda: _precompute(dirs, tmp_path / "o", *served, student=engine),
        "key in the url": lambda: _precompute(dirs, tmp_path / "o", *tok,
                                              student=engine.replace("http://", f"http://me:{KEY}@")),
        "engine vocabulary": lambda: _precompute(dirs, tmp_path / "o", *tok, student=engine,
                                                 teacher=str(dirs / "narrow")),
        "engine tokenizer": lambda: _precompute(dirs, tmp_path / "o", *tok, student=engine,
                                                teacher=str(dirs / "other")),
        "served teacher vocabulary": None,
        "samples over topk": lambda: _precompute(dirs, tmp_path / "o", *served, "--teacher-protocol", "topk",
                                                 "--samples", "4"),
        "top-k beyond the server's": lambda: _precompute(dirs, tmp_path / "o", *served, "--top-k", "9"),
        "tempered top-k": lambda: _precompute(dirs, tmp_path / "o", *served, "--temperature", "2"),
    }[case]
    if case == "served teacher vocabulary":  # a served teacher of a narrower vocabulary than the student's tokens
        with running(narrow, model_name="narrow") as (url, _):
            start = time.monotonic()
            assert _precompute(dirs, tmp_path / "o", "--teacher-url", url) == 2
    else:
        start = time.monotonic()
        assert run() == 2
    assert time.monotonic() - start < 30  # an unreachable URL fails fast (no retries asked), not after a timeout
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle.format(port=port) in err, err
    assert KEY not in err
    assert not (tmp_path / "o").exists()  # nothing written


def test_own_token_logprobs_of_json_replies():
    """The teacher's log-prob of each sequence's own next token, read off vLLM's prompt_logprobs (the token's own
    entry, outside the top-k too) and SGLang's input_token_logprobs; anything else is refused naming the token."""
    from liger_patch_kd.wire.protocols import TeacherReplyError, own_token_logprobs

    seq = [5, 7, 9]
    vllm = {"choices": [{"index": 0, "prompt_logprobs": [
        None, {"3": {"logprob": -0.1, "rank": 1}, "7": {"logprob": -4.5, "rank": 9}},
        {"9": {"logprob": -0.25, "rank": 1}},
    ]}]}  # fmt: skip
    sglang = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-4.5, 7, None], [-0.25, 9, None]]}}
    for protocol, reply in (("vllm", vllm), ("sglang", sglang)):
        (got,) = own_token_logprobs(protocol, reply, [seq], request="r")
        assert got.tolist() == [-4.5, -0.25, float("-inf")], protocol
    vllm["choices"][0]["prompt_logprobs"][2]["9"]["logprob"] = 0.5
    with pytest.raises(TeacherReplyError, match="the log-prob of token 2 \\(9\\) is '0.5'"):
        own_token_logprobs("vllm", vllm, [seq], request="r")


def test_nothing_listening_is_one_line_naming_the_student_or_the_teacher_it_was_asked_for():
    """A URL where nothing listens: one line naming the flag, the connection's own error and what to start there
    (the student's engine for --rollouts-from), not the training client's words about a teacher."""
    from liger_patch_kd.trainer.offline_onpolicy.engine_student import EngineStudent
    from liger_patch_kd.trainer.offline_onpolicy.served_teacher import ServedTeacher

    with socket.socket() as s:  # a port just freed: nothing listens there
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ValueError) as student:
        EngineStudent(url, retries=0)
    with pytest.raises(ValueError) as teacher:
        ServedTeacher(url, retries=0)
    for error, flag in ((student, "--rollouts-from"), (teacher, "--teacher-url")):
        text = str(error.value)
        assert text.startswith(f"{flag} {url}: no server answers GET /v1/models (") and "\n" not in text
        assert "teacher server" not in text and "training" not in text
    assert "start the student's engine" in str(student.value)
