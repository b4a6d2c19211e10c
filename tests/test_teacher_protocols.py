"""Parsers of inference-engine replies, on replies written by hand to vLLM's and SGLang's documented formats, and
under malformed input, by hand and by hypothesis: a reply either parses into top-k that can be a distribution's or
raises TeacherReplyError; a request either validates into prompts the server can score or is a RequestError (400 /
413). Never another exception type."""

import json
import math
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from liger_patch_kd import teacher as TD
from liger_patch_kd.server.app import vllm_prompt_logprobs
from liger_patch_kd.server.validation import Limits, RequestError, parse_body, validated_completion
from liger_patch_kd.wire import protocols as P

INF = math.inf


def _vllm_choice(index, prompt_logprobs):
    return {"index": index, "text": "", "logprobs": None, "finish_reason": "length", "prompt_logprobs": prompt_logprobs}


# prompt [5, 9, 2] with prompt_logprobs=2: position 1 scores token 9 (in the top 2), position 2 scores token 2, which
# is outside the top 2 and so added as a third entry (vLLM's K + 1), listed first to check the sort
VLLM_PROMPT = [5, 9, 2]
VLLM_LOGPROBS = [
    None,
    {"9": {"logprob": -0.1, "rank": 1, "decoded_token": "b"}, "3": {"logprob": -2.5, "rank": 2, "decoded_token": "c"}},
    {"2": {"logprob": -4.0, "rank": 7, "decoded_token": "d"}, "7": {"logprob": -0.7, "rank": 1, "decoded_token": "e"},
     "8": {"logprob": -1.2, "rank": 2, "decoded_token": "f"}},
]  # fmt: skip
EXPECTED_IDS = [[9, 3], [7, 8], [-1, -1]]
EXPECTED_LP = [[-0.1, -2.5], [-0.7, -1.2], [-INF, -INF]]

# the same prompt from SGLang: input_top_logprobs of [logprob, token id, text] triples, the first position null
SGLANG_TOP = [None, [[-0.1, 9, None], [-2.5, 3, None]], [[-0.7, 7, "e"], [-1.2, 8, "f"]]]


def _check(topk, ids=EXPECTED_IDS, lp=EXPECTED_LP):
    i, v = topk
    assert i.dtype == torch.int32 and v.dtype == torch.float32
    assert i.tolist() == ids
    torch.testing.assert_close(v, torch.tensor(lp, dtype=torch.float32))


def test_vllm_prompt_logprobs_keep_the_top_k_row_aligned():
    _check(P.parse_vllm_prompt_logprobs(VLLM_LOGPROBS, 3, top_k=2, vocab_size=10, request="r"))
    reply = {"choices": [_vllm_choice(1, [None, {"4": -0.2, "1": -9999.0}]), _vllm_choice(0, VLLM_LOGPROBS)]}
    first, second = P.parse_vllm_reply(reply, [VLLM_PROMPT, [3, 4]], top_k=2, vocab_size=10, request="r")
    _check(first)  # choices are matched by index, not by order
    _check(second, [[4, 1], [-1, -1]], [[-0.2, -INF], [-INF, -INF]])  # -9999.0 is vLLM's -inf


def test_sglang_input_top_logprobs():
    _check(P.parse_sglang_input_top_logprobs(SGLANG_TOP, 3, top_k=2, vocab_size=10, request="r"))
    reply = [
        {"text": "", "meta_info": {"input_top_logprobs": SGLANG_TOP}},
        {"meta_info": {"input_top_logprobs": [None]}},
    ]
    first, single = P.parse_sglang_reply(reply, [VLLM_PROMPT, [4]], top_k=2, vocab_size=10, request="r")
    _check(first)
    _check(single, [[-1, -1]], [[-INF, -INF]])
    with pytest.raises(P.TeacherReplyError, match="no meta_info.input_top_logprobs"):
        P.parse_sglang_reply({"text": ""}, [[1, 2]], top_k=2, vocab_size=10, request="r")
    with pytest.raises(P.TeacherReplyError, match="triples"):
        P.parse_sglang_input_top_logprobs([None, [["x", 1]]], 2, top_k=1, vocab_size=10, request="r")


@pytest.mark.parametrize("parse", ["vllm", "sglang"])
def test_malformed_replies_name_the_request(parse):
    def run(entries, n=3, k=2, vocab=10):
        if parse == "vllm":
            return P.parse_vllm_prompt_logprobs(entries, n, top_k=k, vocab_size=vocab, request="request 7 to URL")
        return P.parse_sglang_input_top_logprobs(entries, n, top_k=k, vocab_size=vocab, request="request 7 to URL")

    good = VLLM_LOGPROBS if parse == "vllm" else SGLANG_TOP
    with pytest.raises(P.TeacherReplyError, match=r"request 7 to URL: .* 3 positions for a prompt of 4 tokens"):
        run(good, n=4)
    with pytest.raises(P.TeacherReplyError, match=r"request 7 to URL: .*\[0\] should be null"):
        run([good[1], *good[1:]])
    with pytest.raises(P.TeacherReplyError, match=r"request 7 to URL: .*\[1\] is null"):
        run([None, None, good[2]])
    with pytest.raises(P.TeacherReplyError, match=r"request 7 to URL: token id 9 .* outside vocab_size 9"):
        run(good, vocab=9)
    with pytest.raises(P.TeacherReplyError, match=r"request 7 to URL: position 1 has 2 log-probs, fewer than top_k=3"):
        run(good, k=3)
    nan = [None, {"9": {"logprob": float("nan"), "rank": 1}, "3": -1.0}, good[2]] if parse == "vllm" else [
        None, [[float("nan"), 9, None], [-1.0, 3, None]], good[2]]  # fmt: skip
    with pytest.raises(P.TeacherReplyError, match=r"request 7 to URL: NaN log-prob at row 0"):
        run(nan)


def test_reply_count_must_match_the_prompts():
    with pytest.raises(P.TeacherReplyError, match="1 choices for 2 prompts"):
        P.parse_vllm_reply({"choices": [_vllm_choice(0, VLLM_LOGPROBS)]}, [VLLM_PROMPT] * 2, top_k=2, vocab_size=10,
                           request="r")  # fmt: skip
    with pytest.raises(P.TeacherReplyError, match="1 results for 2 prompts"):
        P.parse_sglang_reply([{"meta_info": {"input_top_logprobs": SGLANG_TOP}}], [VLLM_PROMPT] * 2, top_k=2,
                             vocab_size=10, request="r")  # fmt: skip


def _valid_topk(n, k=4, vocab=50, g=None):
    """(n, k) top-k of a real distribution, row-aligned: distinct ids, log-probs summing below 1, last row padding."""
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)]).to(torch.int32)
    values = torch.log_softmax(torch.randn(n, vocab, generator=g), -1).topk(k, -1).values
    ids[-1], values[-1] = -1, -INF
    return ids, values


def test_binary_round_trip_and_checks():
    g = torch.Generator().manual_seed(0)
    topks = [_valid_topk(n, g=g) for n in (5, 1, 3)]
    seqs = [[1] * 5, [2], [3] * 3]
    for blob in (P.encode_binary(topks), P.encode_binary(topks, seqs)):  # LKD1, and LKD2 with the own tokens
        for (i, v), (j, w) in zip(topks, P.decode_binary(blob, seqs, top_k=4, vocab_size=50, request="r")):
            assert torch.equal(i, j) and torch.equal(v, w)
        with pytest.raises(P.TeacherReplyError, match="lengths"):
            P.decode_binary(blob, [[1] * 4, [2], [3] * 4], top_k=4, vocab_size=50, request="r")
        with pytest.raises(P.TeacherReplyError, match="outside vocab_size 40"):
            P.decode_binary(blob, seqs, top_k=4, vocab_size=40, request="r")
        with pytest.raises(P.TeacherReplyError, match="bytes"):
            P.decode_binary(blob[:-4], seqs, top_k=4, vocab_size=50, request="r")
        with pytest.raises(P.TeacherReplyError, match="not a liger binary reply"):
            P.decode_binary(b'{"choices": []}', seqs, top_k=4, vocab_size=50, request="r")
    with pytest.raises(P.TeacherReplyError, match="row 1 scores token 1, the prompt has 7 there: .* not aligned"):
        P.decode_binary(P.encode_binary(topks, seqs), [[1, 1, 7, 1, 1], [2], [3] * 3], top_k=4, vocab_size=50,
                        request="r")  # fmt: skip


def test_sglang_import_matches_the_vllm_import(tmp_path):
    vllm = [{"prompt_token_ids": VLLM_PROMPT, "prompt_logprobs": VLLM_LOGPROBS}]
    sglang = [{"input_ids": VLLM_PROMPT, "meta_info": {"input_top_logprobs": SGLANG_TOP}}]
    TD.import_vllm_logprobs(vllm, tmp_path / "v", vocab_size=10, top_k=2)
    TD.import_sglang_logprobs(sglang, tmp_path / "s", vocab_size=10, top_k=2)
    a = TD.TeacherLogprobsDataset(tmp_path / "v")[0]
    b = TD.TeacherLogprobsDataset(tmp_path / "s")[0]
    assert a["teacher_token_ids"].tolist() == b["teacher_token_ids"].tolist() == EXPECTED_IDS
    assert torch.equal(a["teacher_logprobs"], b["teacher_logprobs"])
    with pytest.raises(TD.TeacherStoreError, match=r"token id 9 .* outside \[0, 8\)"):
        TD.import_sglang_logprobs(sglang, tmp_path / "bad", vocab_size=8, top_k=2)


# ------------------------------------------------------------------------------------- fuzzing (hypothesis)
VOCAB, K = 12, 3
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
)  # fmt: skip
json_values = st.recursive(
    json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
token_keys = st.one_of(st.integers(-2, VOCAB + 2).map(str), st.text(max_size=4), st.just("1" * 40))
logprobs = st.one_of(
    st.floats(-20, 0.5), st.floats(allow_nan=True, allow_infinity=True), st.just(-9999.0), json_scalars
)
vllm_slot = st.one_of(logprobs, st.fixed_dictionaries({"logprob": logprobs, "rank": st.one_of(st.integers(0, 9),
                                                                                             json_scalars)}))
vllm_position = st.one_of(st.dictionaries(token_keys, vllm_slot, max_size=K + 2), json_values)
sglang_position = st.one_of(
    st.lists(st.tuples(logprobs, st.one_of(st.integers(-2, VOCAB + 2), json_scalars), json_scalars).map(list),
             max_size=K + 2),  # fmt: skip
    json_values,
)
prompts = st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5), min_size=1, max_size=3)


def assert_distribution(topks, sequences, top_k=K, vocab=VOCAB):
    """What every parsed reply must be: (T, K) int32 / float32, ids in [-1, vocab), no NaN, the last row padding,
    every other row a real slot, no token twice, probabilities summing to at most 1 (+ the tolerance)."""
    assert len(topks) == len(sequences)
    for (ids, values), seq in zip(topks, sequences):
        assert ids.shape == values.shape == (len(seq), top_k)
        assert ids.dtype == torch.int32 and values.dtype == torch.float32
        assert ((ids >= -1) & (ids < vocab)).all() and not values.isnan().any()
        real = (ids >= 0) & values.isfinite() & (values > -1e3)
        assert not real[-1].any() and real[:-1].any(-1).all()
        for row, keep in zip(ids.tolist(), real.tolist()):
            kept = [i for i, k in zip(row, keep) if k]
            assert len(set(kept)) == len(kept)
        mass = torch.where(real, values.double(), -INF).logsumexp(-1)
        assert (mass[:-1] <= P.MASS_TOLERANCE_NATS).all()


def _parses_or_refuses(parse, *args, **kwargs):
    try:
        return parse(*args, **kwargs)
    except P.TeacherReplyError:
        return None


@FUZZ
@given(prompts, st.data())
def test_vllm_replies_parse_into_distributions_or_raise_reply_errors(sequences, data):
    def choice(n, seq):
        positions = data.draw(st.lists(vllm_position, min_size=len(seq) - 1, max_size=len(seq)))
        first = data.draw(st.one_of(st.none(), json_values))
        entry = {"index": data.draw(st.one_of(st.just(n), json_scalars)), "prompt_logprobs": [first, *positions]}
        return data.draw(st.one_of(st.just(entry), json_values))

    reply = {"choices": [choice(n, s) for n, s in enumerate(sequences)]}
    reply = data.draw(st.one_of(st.just(reply), json_values))
    got = _parses_or_refuses(P.parse_vllm_reply, reply, sequences, top_k=K, vocab_size=VOCAB, request="r")
    if got is not None:
        assert_distribution(got, sequences)


@FUZZ
@given(prompts, st.data())
def test_sglang_replies_parse_into_distributions_or_raise_reply_errors(sequences, data):
    def item(seq):
        top = [None, *data.draw(st.lists(sglang_position, min_size=len(seq) - 1, max_size=len(seq)))]
        own = data.draw(st.one_of(st.none(), st.just([[None, seq[0], None]] + [[-1.0, t, None] for t in seq[1:]]),
                                  json_values))  # fmt: skip
        return data.draw(st.one_of(st.just({"meta_info": {"input_top_logprobs": top, "input_token_logprobs": own}}),
                                   json_values))  # fmt: skip

    reply = [item(s) for s in sequences]
    got = _parses_or_refuses(P.parse_sglang_reply, reply, sequences, top_k=K, vocab_size=VOCAB, request="r")
    if got is not None:
        assert_distribution(got, sequences)


def _valid_reply_topks(sequences, g):
    out = []
    for seq in sequences:
        ids = torch.stack([torch.randperm(VOCAB, generator=g)[:K] for _ in seq]).to(torch.int32)
        values = torch.log_softmax(torch.randn(len(seq), VOCAB, generator=g), -1).topk(K, -1).values
        ids[-1], values[-1] = -1, -INF
        out.append((ids, values))
    return out


@FUZZ
@given(prompts, st.data())
def test_binary_replies_decode_into_distributions_or_raise_reply_errors(sequences, data):
    blob = P.encode_binary(_valid_reply_topks(sequences, torch.Generator().manual_seed(0)), sequences)
    mutation = data.draw(st.sampled_from(["cut", "flip", "append", "random"]))
    if mutation == "cut":
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    elif mutation == "flip":
        at = data.draw(st.integers(0, len(blob) - 1))
        blob = blob[:at] + bytes([data.draw(st.integers(0, 255))]) + blob[at + 1 :]
    elif mutation == "append":
        blob += data.draw(st.binary(max_size=16))
    else:
        blob = data.draw(st.binary(max_size=64)) if data.draw(st.booleans()) else b"LKD2" + data.draw(st.binary())
    got = _parses_or_refuses(P.decode_binary, blob, sequences, top_k=K, vocab_size=VOCAB, request="r")
    if got is not None:
        assert_distribution(got, sequences)


@FUZZ
@given(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), st.floats(0.1, 300), st.integers(0, 2**31))
def test_true_distributions_always_pass(sequence, scale, seed):
    """No false alarm: the float32 top-k of any softmax (logits up to ~1e3 in size), as our server writes it."""
    g = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(torch.randn(len(sequence), VOCAB, generator=g) * scale, -1)
    values, ids = logprobs.topk(K, -1)
    own = logprobs.gather(-1, torch.tensor([*sequence[1:], 0])[:, None])[:, 0]
    ids, values = ids.to(torch.int32), values.clone()
    ids[-1], values[-1] = -1, -INF
    ranks = torch.ones(len(own), dtype=torch.long)
    choice = {"index": 0, "prompt_logprobs": vllm_prompt_logprobs(sequence, (ids, values), own, ranks)}
    reply = json.loads(json.dumps({"choices": [choice]}))
    assert_distribution(P.parse_vllm_reply(reply, [sequence], top_k=K, vocab_size=VOCAB, request="r"), [sequence])
    blob = P.encode_binary([(ids, values)], [sequence])
    assert_distribution(P.decode_binary(blob, [sequence], top_k=K, vocab_size=VOCAB, request="r"), [sequence])


LIMITS = Limits(max_top_k=K, vocab_size=VOCAB, max_context=6, max_request_tokens=10)
request_fields = st.fixed_dictionaries({}, optional={
    "prompt": st.one_of(prompts, st.lists(st.integers(-1, VOCAB + 1), max_size=8), json_values),
    "prompt_logprobs": st.one_of(st.integers(-1, K + 1), json_scalars),
    "temperature": json_scalars, "top_p": json_scalars, "max_tokens": json_scalars, "n": json_scalars,
    "stream": json_scalars, "model": json_scalars, "extra": json_values,
})  # fmt: skip


@FUZZ
@given(st.one_of(request_fields, json_values))
def test_requests_validate_or_are_refused_with_400_or_413(body):
    try:
        sequences, k = validated_completion(body, LIMITS)
    except RequestError as e:
        assert e.status in (400, 413) and "\n" not in e.message
        return
    assert 1 <= k <= K and type(k) is int
    assert sum(map(len, sequences)) <= 10
    assert all(0 < len(s) <= 6 and all(type(t) is int and 0 <= t < VOCAB for t in s) for s in sequences)
    temperature = body.get("temperature", 0.0)
    assert type(temperature) in (int, float) and temperature >= 0


@FUZZ
@given(st.one_of(st.binary(max_size=40), json_values.map(lambda v: json.dumps(v).encode())))
def test_request_bodies_are_json_or_400(raw):
    try:
        parse_body(raw)
    except RequestError as e:
        assert e.status == 400


# ------------------------------------------------------------------------- the adversarial replies, by hand
SEQ = [5, 9, 2, 4]


def _reply(positions):
    return {"choices": [{"index": 0, "text": "", "prompt_logprobs": [None, *positions]}]}


def _position(own, values, ids=(7, 8, 3)):
    entry = {str(i): {"logprob": v, "rank": r} for r, (i, v) in enumerate(zip(ids, values), 1)}
    entry.setdefault(str(own), {"logprob": -12.0, "rank": 99})
    return entry


GOOD = [_position(t, (-0.5, -1.5, -2.5)) for t in SEQ[1:]]


def _parse(reply, seqs=(SEQ,)):
    return P.parse_vllm_reply(reply, list(seqs), top_k=K, vocab_size=VOCAB, request="request 3 to URL")


def test_replies_that_cannot_be_distributions_are_refused():
    assert_distribution(_parse(_reply(GOOD)), [SEQ])
    heavy = [_position(t, (-0.01, -0.01, -0.01)) for t in SEQ[1:]]  # mass ~3
    with pytest.raises(P.TeacherReplyError, match=r"request 3 to URL prompt 0: row 0's top-k .* sum to 2.97 > 1"):
        _parse(_reply(heavy))
    with pytest.raises(P.TeacherReplyError, match=r"prompt_logprobs\[1\] has no entry for the prompt token 9 .*"
                                                  r"not aligned with the prompt"):  # fmt: skip
        _parse(_reply(GOOD[::-1]))  # positions in reverse order
    padding = [{"7": -9999.0, "8": -9999.0, "3": -9999.0, str(t): -9999.0} for t in SEQ[1:]]
    with pytest.raises(P.TeacherReplyError, match=r"row 0 \(scoring token 1\) is all padding: the KD loss would"):
        _parse(_reply(padding))
    rounding = [_position(t, (math.log(0.5) + 5e-4, math.log(0.3), math.log(0.2))) for t in SEQ[1:]]
    assert_distribution(_parse(_reply(rounding)), [SEQ])  # mass 1.0005: within MASS_TOLERANCE_NATS


def test_sglang_positions_must_be_the_prompts():
    top = [None, *([[-0.5, 7, None], [-1.5, 8, None], [-2.5, 3, None]] for _ in SEQ[1:])]
    own = [[None, SEQ[0], None], *([-1.0, t, None] for t in SEQ[1:])]
    meta = {"input_top_logprobs": top, "input_token_logprobs": own}
    assert_distribution(P.parse_sglang_reply({"meta_info": meta}, [SEQ], top_k=K, vocab_size=VOCAB, request="r"),
                        [SEQ])  # fmt: skip
    meta["input_token_logprobs"] = own[:1] + own[1:][::-1]
    with pytest.raises(P.TeacherReplyError, match=r"input_token_logprobs\[1\] .* not the prompt token 9"):
        P.parse_sglang_reply({"meta_info": meta}, [SEQ], top_k=K, vocab_size=VOCAB, request="r")


def test_malformed_choices_and_short_binary_replies_name_what_is_wrong():
    with pytest.raises(P.TeacherReplyError, match=r"choices\[0\] is str, not an object with prompt_logprobs"):
        _parse({"choices": ["text"]})
    with pytest.raises(P.TeacherReplyError, match=r"indices \[0, 0\] are not 0 .. 1"):
        _parse({"choices": [_reply(GOOD)["choices"][0]] * 2}, [SEQ, SEQ])
    with pytest.raises(P.TeacherReplyError, match=r"prompt_logprobs\[1\] is malformed at '7'"):
        _parse(_reply([{"7": {"logprob": True, "rank": 1}}, *GOOD[1:]]))  # a JSON bool is not a log-prob
    blob = P.encode_binary(_valid_reply_topks([SEQ] * 3, torch.Generator().manual_seed(1)), [SEQ] * 3)
    for cut in range(len(blob)):  # struct.error before: lengths read past the end
        with pytest.raises(P.TeacherReplyError, match=r"request 3|not a liger binary reply|cut short"):
            P.decode_binary(blob[:cut], [SEQ] * 3, top_k=K, vocab_size=VOCAB, request="request 3")
    header = struct.pack("<4sII", b"LKD2", 3, K)
    with pytest.raises(P.TeacherReplyError, match="cut short: 12 bytes, too few for 3 lengths"):
        P.decode_binary(header, [SEQ] * 3, top_k=K, vocab_size=VOCAB, request="r")
