"""Bad input to the store, the converters and precompute: a one-line error naming the input, before any long work;
nothing wrapped, truncated or dropped; a failure removes only what it wrote."""

import json
import math
import struct
import time

import numpy as np
import pytest
import torch

from liger_patch_kd import teacher as TD
from liger_patch_kd.teacher.precompute import read_jsonl_sequences, teacher_fingerprint

from .tiny_models import VOCAB, tiny_model

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _row(ids, k=2, vocab=50):
    n = len(ids)
    lp = np.log(np.full((n, k), 1.0 / (k + 1)))
    top = np.tile(np.arange(k), (n, 1)) % vocab
    return {"input_ids": ids, "teacher_token_ids": top.tolist(), "teacher_logprobs": lp.tolist()}


def _store(path, rows=None, **kw):
    rows = rows or [_row([1, 2, 3]), _row([4, 5])]
    return TD.dataset_to_store(rows, path, vocab_size=kw.pop("vocab_size", 50), top_k=kw.pop("top_k", 2), **kw)


# ------------------------------------------------------------------------------------------ item 4: ids
@pytest.mark.parametrize("bad, message", [
    (2**32 + 7, "token id 4294967303 .* outside"), (-3, "token id -3 .* outside"),
    (2.7, "token id 2.7 .* not an integer"),
    (50, "token id 50 .* outside \\[0, 50\\)"),
])  # fmt: skip
def test_input_ids_are_checked_before_any_cast(tmp_path, bad, message):
    with pytest.raises(TD.TeacherStoreError, match=f"row 1: input_ids: {message}"):
        _store(tmp_path / "s", [_row([1, 2]), _row([3, bad, 4])])
    assert not (tmp_path / "s").exists()  # the failed conversion removed what it made, manifest included
    writer = TD.StoreWriter.open(tmp_path / "w", teacher="t", vocab_size=50, top_k=1, tokenizer_fingerprint=None,
                                 logprob_dtype="float32", temperature=1.0, shard_size=4,
                                 num_sequences=None)  # fmt: skip
    with pytest.raises(ValueError, match="sequence 0: input_ids"):  # the writer itself: every converter's path
        writer.write_shard([np.array([1, bad], dtype=object)], torch.zeros(2, 1, dtype=torch.int32),
                           torch.zeros(2, 1))  # fmt: skip
    with pytest.raises(ValueError, match="teacher ids"):
        writer.write_shard([[1, 2]], torch.tensor([[1.5], [2.0]]), torch.zeros(2, 1))
    assert not (tmp_path / "w" / TD.MANIFEST).exists()


def test_teacher_ids_negative_or_fractional_are_refused_not_dropped(tmp_path):
    cases = ((-5, "token id -5"), (3.5, "token id 3.5 .* not an integer"), (2**40, "token id 1099511627776"))
    for bad, message in cases:
        row = _row([1, 2, 3])
        row["teacher_token_ids"][1][0] = bad
        with pytest.raises(TD.TeacherStoreError, match=f"row 0, position 1: ids: {message}"):
            _store(tmp_path / "s", [row])
    row = _row([1, 2, 3])
    row["teacher_token_ids"][1][1] = -1  # -1 is padding: kept as padding, the other slot as given
    data = TD.TeacherLogprobsDataset(_store(tmp_path / "ok", [row]))
    assert data[0]["teacher_token_ids"][1].tolist() == [0, -1]


def test_distillkit_uint64_ids_are_not_wrapped(tmp_path):
    from .test_distillkit_format import BINNED, _write_capture

    table, _ = _write_capture(tmp_path / "cap", BINNED, lengths=[5])
    row = {name: column[0] for name, column in table.items()}
    for bad in (2**40 + 3, 2**64 - 1):
        ids = np.asarray(row["input_ids"], dtype=np.uint64)
        ids[2] = bad
        with pytest.raises(TD.TeacherStoreError, match=f"input_ids: token id {bad} at index 2 is outside"):
            TD.distillkit_to_store([{**row, "input_ids": ids}], tmp_path / "s", compressor=BINNED)
        assert not (tmp_path / "s").exists()


# ------------------------------------------------------------------------------------------ item 6: DistillKit
def test_distillkit_settings_types_and_impossible_decodes(tmp_path):
    from .test_distillkit_format import BINNED, _write_capture

    _write_capture(tmp_path / "cap", BINNED, lengths=[6, 9])
    with pytest.raises(TD.TeacherStoreError, match="delta_encoding=False.*not the ones the data was written with"):
        TD.distillkit_to_store(tmp_path / "cap", tmp_path / "s", compressor={**BINNED, "delta_encoding": False})
    assert not (tmp_path / "s").exists()
    for change, message in (({"delta_encoding": "no"}, "delta_encoding = 'no' must be true or false"),
                            ({"d": 64.9}, "d = 64.9 must be an integer"), ({"k": True}, "k = True must be an int"),
                            ({"residual_bins": 5}, "residual_bins = 5 must be a list"),
                            ({"polynomial_terms": "x"}, "polynomial_terms = 'x' must be a list"),
                            ({"exact_k": "2"}, "exact_k = '2' must be an integer")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            TD.distillkit_to_store(tmp_path / "cap", tmp_path / "s", compressor={**BINNED, **change})
    for text, message in (("", "must be a mapping"), ("[1, 2]", "must be a mapping"), ("d: [", "do not parse")):
        (tmp_path / "bad.yaml").write_text(text)
        with pytest.raises(ValueError, match=message):
            TD.distillkit_to_store(tmp_path / "cap", tmp_path / "s", compressor=tmp_path / "bad.yaml")
    assert TD.TeacherLogprobsDataset(TD.distillkit_to_store(tmp_path / "cap", tmp_path / "ok"))[0]


# ------------------------------------------------------------------------------------------ item 16: rows
def test_malformed_rows_name_the_row_and_field(tmp_path):
    row = _row([1, 2, 3])
    row["teacher_token_ids"][1] = [1, 2, 3]  # three ids, two log-probs
    with pytest.raises(TD.TeacherStoreError, match="row 0, position 1: 3 token ids but 2 log-probs"):
        _store(tmp_path / "a", [row])
    with pytest.raises(TD.TeacherStoreError, match="row 1 has no field 'teacher_logprobs'"):
        _store(tmp_path / "a", [_row([1, 2]), {"input_ids": [1], "teacher_token_ids": [[1, 2]]}])
    row = _row([1, 2, 3])
    row["teacher_logprobs"][0][0] = 0.7  # a probability, not a log-prob
    with pytest.raises(TD.TeacherStoreError, match="row 0, position 0: log-prob 0.7"):
        _store(tmp_path / "a", [row])
    entries = [[{"token": "token_id:3", "logprob": -0.1}], [{"token": "token_id:4"}]]
    with pytest.raises(TD.TeacherStoreError, match="row 0, position 1, entry 0: expected"):
        TD.axolotl_to_store([{"input_ids": [1, 2, 3], "logprobs": entries}], tmp_path / "a", vocab_size=50, top_k=2)
    entries[1][0]["logprob"] = "high"
    with pytest.raises(TD.TeacherStoreError, match="logprob 'high' is not a number"):
        TD.axolotl_to_store([{"input_ids": [1, 2, 3], "logprobs": entries}], tmp_path / "a", vocab_size=50, top_k=2)
    assert not (tmp_path / "a").exists()


# ------------------------------------------------------------------------------------------ item 15: store files
def _shard(store):
    return store / "shard-00000.safetensors"


def test_damaged_shard_headers_and_manifests_name_the_file(tmp_path):
    store = _store(tmp_path / "s")
    blob = _shard(store).read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    cases = {
        "length prefix": (struct.pack("<Q", 2**62) + blob[8:], "header length 4611686018427387904 exceeds the file"),
        "prefix past the end": (struct.pack("<Q", len(blob)) + blob[8:], "exceeds the file"),
        "renamed key": (blob.replace(b'"data_offsets"', b'"data_offsetz"', 1), "is not \\{dtype, shape, data_offsets"),
        "short file": (blob[:5], "cut short"),
    }
    for name, (damaged, message) in cases.items():
        _shard(store).write_bytes(damaged)
        with pytest.raises(TD.TeacherStoreError, match=f"shard-00000.safetensors .* damaged: .*{message}"):
            TD.TeacherLogprobsDataset(store)[0]
    _shard(store).write_bytes(blob)
    meta = json.loads((store / TD.MANIFEST).read_text())
    packed = _store(tmp_path / "p", encoding="packed10")
    for change, message in (({"top_k": 3}, "topk_ids is I32 \\[5, 2\\].*implies I32 \\[5, 3\\]"),
                            ({"top_k": "2"}, "top_k '2' is not a slot count"),
                            ({"format_version": "2"}, "format_version '2' is not a store format"),
                            ({"format_version": 0}, "format_version 0"),
                            ({"encoding": {"name": "packed", "id_bits": 6, "logprob_bits": 99}},
                             "encoding .* not valid"),
                            ({"shards": [{**meta["shards"][0], "file": "../x.safetensors"}]}, "not a shard file"),
                            ({"shards": [{**meta["shards"][0], "num_sequences": -1}]},
                             "num_sequences -1")):  # fmt: skip
        (store / TD.MANIFEST).write_text(json.dumps({**meta, **change}))
        with pytest.raises(TD.TeacherStoreError, match=message):
            TD.TeacherLogprobsDataset(store)[0]
    (store / TD.MANIFEST).write_text(json.dumps(meta))
    (store / "shard-00000.safetensors").write_bytes(_shard(packed).read_bytes())  # a packed shard in a plain store
    meta["shards"][0] = json.loads((packed / TD.MANIFEST).read_text())["shards"][0]
    (store / TD.MANIFEST).write_text(json.dumps(meta))
    with pytest.raises(TD.TeacherStoreError, match="is a packed shard but the manifest's encoding is plain"):
        TD.TeacherLogprobsDataset(store)[0]


def test_verify_store_result_explains_itself(tmp_path):
    store = _store(tmp_path / "s", shard_size=1)
    result = TD.verify_store(store)
    assert result == 2 and int(result) == 2 and result.shards == 2 and result.sequences == 2 and result.bytes > 0
    assert "shards=2" in repr(result)
    assert "Returns the number of shards checked" in " ".join(TD.verify_store.__doc__.split())


# ------------------------------------------------------------------------------------------ item 11 + precompute
def test_precompute_removes_only_its_own_temporaries(tmp_path):
    teacher = tiny_model("llama", seed=3, dtype=torch.float32)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.tmp").write_text("mine")
    (out / "shard-1.safetensors.tmp").write_text("also mine")
    seqs = [[1, 2, 3], [4, 5]]
    TD.precompute(teacher, seqs, out, top_k=3, shard_size=1, progress=False)
    (out / "shard-00001.safetensors.tmp").write_bytes(b"half a shard")  # what an interrupted writer leaves
    TD.precompute(teacher, seqs, out, top_k=3, shard_size=1, progress=False)  # a resume: nothing left to do
    assert (out / "notes.tmp").read_text() == "mine" and (out / "shard-1.safetensors.tmp").exists()
    assert not (out / "shard-00001.safetensors.tmp").exists()


@pytest.mark.parametrize("change, message", [
    ({"temperature": 0}, "temperature .* > 0"), ({"temperature": float("nan")}, "temperature"),
    ({"top_k": 0}, "top_k .* \\[1, vocab_size"), ({"top_k": VOCAB + 1}, "top_k"), ({"batch_size": 0}, "batch_size"),
    ({"encoding": "packed99"}, "'plain' or 'packed4' .. 'packed16'"), ({"logprob_dtype": "int8"}, "logprob_dtype"),
])  # fmt: skip
def test_precompute_arguments_are_checked_before_any_work(tmp_path, change, message, monkeypatch):
    teacher = tiny_model("llama", seed=3, dtype=torch.float32)
    calls = []
    monkeypatch.setitem(TD.precompute.__globals__, "teacher_topk", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError, match=message):
        TD.precompute(teacher, [[1, 2, 3]], tmp_path / "out", progress=False, **{"top_k": 3, **change})
    assert not calls and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=f"sequence 1: token id {VOCAB} "):
        TD.precompute(teacher, [[1, 2], [3, VOCAB]], tmp_path / "out", top_k=3, progress=False)
    assert not calls and not (tmp_path / "out").exists()


def test_precompute_failing_at_its_first_step_leaves_no_manifest(tmp_path, monkeypatch):
    teacher = tiny_model("llama", seed=3, dtype=torch.float32)

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setitem(TD.precompute.__globals__, "teacher_topk", broken)
    with pytest.raises(RuntimeError):
        TD.precompute(teacher, [[1, 2, 3]], tmp_path / "out", top_k=3, temperature=2.0, progress=False)
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    TD.precompute(teacher, [[1, 2, 3]], tmp_path / "out", top_k=3, temperature=1.0, progress=False)  # the rerun


def test_max_length_zero_is_not_no_limit(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_length .* >= 1, or None"):
            read_jsonl_sequences(data, max_length=bad)
    assert read_jsonl_sequences(data, max_length=2)[0] == [[1, 2]]


# ------------------------------------------------------------------------------------------ item 7: fingerprint
def test_fingerprint_sees_every_row_and_is_fast():
    teacher = tiny_model("llama", seed=3, dtype=torch.float32)
    base = teacher_fingerprint(teacher)
    head = teacher.get_output_embeddings().weight
    for row in (head.shape[0] - 1, head.shape[0] // 2):
        for col in (0, head.shape[1] - 1):
            with torch.no_grad():
                old = head[row, col].clone()
                head[row, col] = torch.nextafter(old, torch.tensor(math.inf))  # the smallest change there is
                assert teacher_fingerprint(teacher) != base, (row, col)
                head[row, col] = old
    assert teacher_fingerprint(teacher) == base
    with torch.no_grad():  # two rows swapped
        head[[1, 2]] = head[[2, 1]]
    assert teacher_fingerprint(teacher) != base
    big = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(8))).to(torch.bfloat16)
    start = time.perf_counter()
    teacher_fingerprint(big)  # 8.4M parameters; ~2 s per 100M parameters on a busy 2-core CPU
    assert time.perf_counter() - start < 10
