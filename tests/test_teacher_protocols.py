"""Parsers of inference-engine replies, on replies written by hand to vLLM's and SGLang's documented formats."""

import math

import pytest
import torch

from liger_patch_kd import teacher as TD
from liger_patch_kd.teacher.serve import protocols as P

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
    with pytest.raises(TD.TeacherStoreError, match="outside vocab_size"):
        TD.import_sglang_logprobs(sglang, tmp_path / "bad", vocab_size=8, top_k=2)
