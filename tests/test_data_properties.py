"""Property tests of the data paths' parsers: arbitrary bytes, flipped bytes and arbitrary rows give either a valid
result holding exactly the input's values, or a TeacherStoreError / ValueError; never another exception type,
never a silently different value."""

import json
import os

import numpy as np
import pytest
import torch

from liger_patch_kd import teacher as TD
from liger_patch_kd.teacher.formats.common import rows_to_arrays
from liger_patch_kd.teacher.formats.distillkit_codec import CompressorConfig
from liger_patch_kd.teacher.store.ids import token_ids
from liger_patch_kd.teacher.store.shard import ShardDamaged, read_header

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FAST = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
VOCAB, K = 50, 3


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rows = [{"input_ids": [1, 2, 3], "teacher_token_ids": [[4, 5, 6], [7, 8, -1]], "teacher_logprobs":
             [[-0.5, -1.0, -2.0], [-0.1, -3.0, -np.inf]]}, {"input_ids": [9, 10], "teacher_token_ids": [[1, 2, 3]],
             "teacher_logprobs": [[-0.2, -0.3, -4.0]]}]  # fmt: skip
    path = TD.dataset_to_store(rows, tmp_path_factory.mktemp("s") / "store", vocab_size=VOCAB, top_k=K)
    return path, (path / "shard-00000.safetensors").read_bytes(), (path / TD.MANIFEST).read_text()


def _read_all(path):
    data = TD.TeacherLogprobsDataset(path)
    return [{k: v.float().tolist() for k, v in data[i].items()} for i in range(len(data))]


@FAST
@given(st.data())
def test_any_flipped_shard_byte_is_refused(store, data):
    path, blob, manifest = store
    reference = _read_all(path)
    at = data.draw(st.integers(0, len(blob) - 1))
    flip = data.draw(st.integers(1, 255))
    damaged = bytearray(blob)
    damaged[at] ^= flip
    (path / "shard-00000.safetensors").write_bytes(bytes(damaged))
    try:
        got = _read_all(path)  # every byte is covered by a checksum: no flip may read back
    except TD.TeacherStoreError:
        pass
    else:
        assert got != reference, f"flip at byte {at} read back as the original"
        pytest.fail(f"flip at byte {at} ^ {flip} read back silently as other values")
    finally:
        (path / "shard-00000.safetensors").write_bytes(blob)


@FAST
@given(st.binary(max_size=300), st.integers(0, 2**64 - 1) | st.none())
def test_arbitrary_bytes_as_a_shard_header(tmp_path_factory, body, length):
    path = tmp_path_factory.mktemp("h") / "x.safetensors"
    prefix = (length if length is not None else len(body)).to_bytes(8, "little")
    path.write_bytes(prefix + body)
    fd = os.open(path, os.O_RDONLY)
    try:
        raw, header = read_header(fd)
        assert isinstance(header, dict) and len(raw) <= len(body)
    except ShardDamaged:
        pass
    finally:
        os.close(fd)


_json = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**40) | st.floats() | st.text(max_size=5),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                     max_leaves=8)  # fmt: skip


@FAST
@given(st.sampled_from(["top_k", "vocab_size", "format_version", "encoding", "logprob_dtype", "num_sequences",
                        "shards", "temperature"]), _json)  # fmt: skip
def test_edited_manifest_fields(store, key, value):
    path, _, manifest = store
    meta = json.loads(manifest)
    reference = _read_all(path)
    (path / TD.MANIFEST).write_text(json.dumps({**meta, key: value}))
    try:
        got = _read_all(path)
    except TD.TeacherStoreError:
        pass
    else:  # accepted: then it reads the same data
        assert got == reference
    finally:
        (path / TD.MANIFEST).write_text(manifest)


_id = st.integers(-(2**65), 2**65) | st.floats(allow_nan=True) | st.sampled_from([0, 1, VOCAB - 1, VOCAB, -1, 2**31])


@FAST
@given(st.lists(_id, max_size=6), st.booleans())
def test_token_ids_are_exact_or_refused(values, padding):
    try:
        out = token_ids(values, "row 0", vocab_size=VOCAB, padding=padding)
    except ValueError:
        return
    assert out.tolist() == [int(v) for v in values] and all(-1 <= v < VOCAB for v in out.tolist())


_lp = st.floats(allow_nan=True) | st.sampled_from([-np.inf, 0.0, -1.5]) | st.text(max_size=2) | st.none()


@FAST
@given(st.lists(st.integers(0, VOCAB + 2), min_size=1, max_size=4),
       st.lists(st.lists(_id, max_size=4), max_size=4), st.lists(st.lists(_lp, max_size=4), max_size=4))
def test_converter_rows_are_exact_or_refused(seq, ids, lps):
    try:
        got_seq, got_ids, got_lp = rows_to_arrays(seq, ids, lps, K, VOCAB, "row 0")
    except ValueError:  # TeacherStoreError is a ValueError
        return
    assert got_seq.tolist() == seq
    for t, (i, v) in enumerate(zip(ids, lps)):  # every kept (id, log-prob) pair is the input's, unchanged
        kept = [(int(a), float(np.float32(b))) for a, b in zip(i, v) if a != -1 and np.isfinite(b)]
        stored = [(a, b) for a, b in zip(got_ids[t].tolist(), got_lp[t].tolist()) if a != -1]
        if len(kept) <= K:
            assert sorted(stored) == sorted(kept)
        else:  # more than top_k slots: the top_k most likely are kept
            assert set(stored) <= set(kept) and len(stored) == K


_value = st.none() | st.booleans() | st.integers(-2, 70) | st.floats(0, 70) | st.text(max_size=4) | st.sampled_from(
    ["float32", "bfloat16", "sqrt", [], [0, 1], [{"scale_dtype": "float16", "element_bits": 4, "num_elements": 2}]])


@FAST
@given(st.dictionaries(st.sampled_from(["d", "k", "exact_k", "residual_bins", "exact_dtype", "polynomial_terms",
                                        "term_dtype", "delta_encoding", "error_diffusion", "normalize_t", "x"]),
                       _value, max_size=10) | _json)  # fmt: skip
def test_compressor_settings_are_exact_or_refused(raw):
    base = {"d": 64, "k": 4, "exact_k": 4, "residual_bins": []}
    raw = {**base, **raw} if isinstance(raw, dict) and "x" not in raw else raw
    try:
        cfg = CompressorConfig.from_dict(raw)
    except ValueError:
        return
    for key, value in raw.items():  # accepted: every value as given, of its own type
        got = getattr(cfg, key)
        if key in ("polynomial_terms", "residual_bins"):
            assert len(got) == len(value or [])
        else:
            assert got == value and type(got) is type(value), key


@FAST
@given(st.integers(1, 4), st.binary(min_size=0, max_size=64))
def test_distillkit_rows_of_arbitrary_bytes(tmp_path_factory, positions, noise):
    cfg = {"d": 64, "k": 4, "exact_k": 2, "exact_dtype": "float16", "polynomial_terms": [0, 1],
           "term_dtype": "float16", "residual_bins": []}  # fmt: skip
    c = CompressorConfig.from_dict(cfg)
    raw = np.frombuffer((noise * 64)[: positions * (c.logprob_bytes + c.index_bytes)].ljust(
        positions * (c.logprob_bytes + c.index_bytes), b"\0"), dtype=np.uint8).reshape(positions, -1)  # fmt: skip
    row = {"input_ids": list(range(positions + 1)), "compressed_logprobs": raw[:, : c.logprob_bytes].tolist(),
           "bytepacked_indices": raw[:, c.logprob_bytes :].tolist()}  # fmt: skip
    out = tmp_path_factory.mktemp("dk") / "store"
    try:
        TD.distillkit_to_store([row], out, compressor=cfg)
    except ValueError:
        assert not out.exists()  # a refused conversion leaves nothing
        return
    item = TD.TeacherLogprobsDataset(out)[0]
    lp = item["teacher_logprobs"].float()
    finite = lp[torch.isfinite(lp)]
    assert (finite <= 1e-3).all() and torch.logsumexp(lp, -1).max() <= np.log1p(0.05) + 1e-6
