"""benchmarks.common.corpus_token_ids: the tokenizers the teacher benchmarks train on (bench_fp8_teacher,
bench_sampled_kd). The BPE must be reproducible and wide enough for every top-k / sampled / hybrid row."""

import pytest

from benchmarks.common import corpus_token_ids
from benchmarks.loss.bench_sampled_kd import METHODS


def test_bpe_is_reproducible_and_holds_every_row():
    ids, vocab, chars_per_token = corpus_token_ids("bpe", 2048)
    # trained again (the tokenizers' hash maps get new random keys each time): the same merges, the same ids
    assert corpus_token_ids("bpe", 2048) == (ids, vocab, chars_per_token)
    assert 0 <= min(ids) and max(ids) < vocab and chars_per_token > 2  # words, not characters
    assert all(k + m <= vocab and k < vocab for _, k, m in METHODS)  # top-64, m = 55, the hybrids all exist
    char_ids, char_vocab, _ = corpus_token_ids("char")
    assert char_vocab == 48 and len(char_ids) > len(ids)
    with pytest.raises(ValueError, match="tokenizer="):
        corpus_token_ids("word")
