"""Stores of sampled teacher tokens through `liger-kd convert`: to a `datasets.Dataset` (and parquet) and back, and
store to store, equal item by item; the formats with top-k columns only (axolotl, DistillKit) refuse them, naming
themselves, rather than drop the draws."""

import pytest
import torch

from liger_patch_kd import teacher as TD
from liger_patch_kd.teacher.formats.converters import ConvertOptions, convert
from liger_patch_kd.teacher.formats.hf_datasets import dataset_to_store, store_to_dataset
from liger_patch_kd.teacher.store import read_manifest

from .helpers import random_sequences
from .tiny_models import VOCAB, tiny_model

pytest.importorskip("datasets")


def _store(path, top_k, logprob_dtype="float32"):
    teacher = tiny_model("llama", dtype=torch.float32, seed=2)
    return TD.precompute(teacher, random_sequences(VOCAB, 5, seed=0), path, top_k=top_k, samples=6, seed=4,
                         temperature=1.5, batch_size=2, shard_size=3, progress=False,
                         logprob_dtype=logprob_dtype)  # fmt: skip


def _assert_same_store(a, b):
    da, db = TD.TeacherLogprobsDataset(a), TD.TeacherLogprobsDataset(b)
    assert len(da) == len(db) == 5
    for key in ("samples", "top_k", "temperature", "vocab_size", "format_version"):
        assert da.meta[key] == db.meta[key], key
    for i in range(len(da)):
        x, y = da[i], db[i]
        assert x.keys() == y.keys()
        for name in x:
            assert torch.equal(x[name], y[name]), (i, name)  # float32 and bf16 values are exact in float32


@pytest.mark.parametrize(("top_k", "dtype"), [(0, "float32"), (2, "bfloat16")])
def test_a_sampled_store_round_trips_through_a_dataset(tmp_path, top_k, dtype):
    store = _store(tmp_path / "s", top_k, dtype)
    table = store_to_dataset(store, cache_dir=tmp_path / "cache")
    assert {"teacher_sample_ids", "teacher_sample_counts", "teacher_sample_logprobs"} <= set(table.column_names)
    assert table[0]["teacher_sample_temperature"] == 1.5
    back = dataset_to_store(table, tmp_path / "back", vocab_size=VOCAB, top_k=top_k, logprob_dtype=dtype)
    _assert_same_store(store, back)
    meta = read_manifest(back)
    assert meta["samples"] == 6 and meta["temperature"] == 1.5


def test_liger_kd_convert_carries_samples_through_parquet_and_store_to_store(tmp_path):
    store = _store(tmp_path / "s", 2)
    options = ConvertOptions(vocab_size=VOCAB, top_k=2)
    convert("store", "hf", str(store), str(tmp_path / "t.parquet"), options)
    back = convert("hf", "store", str(tmp_path / "t.parquet"), str(tmp_path / "back"), options)
    _assert_same_store(store, back)
    again = convert("store", "store", str(store), str(tmp_path / "again"), ConvertOptions())
    _assert_same_store(store, again)
    assert read_manifest(again)["sample_seed"] == 4


def test_a_dataset_of_draws_is_checked_row_by_row(tmp_path):
    table = store_to_dataset(_store(tmp_path / "s", 0), cache_dir=tmp_path / "cache")
    rows = [dict(r) for r in table]
    rows[1]["teacher_sample_temperature"] = 1.0
    with pytest.raises(TD.TeacherStoreError, match="row 1: draws at temperature 1.0, the first row's at 1.5"):
        dataset_to_store(rows, tmp_path / "a", vocab_size=VOCAB, top_k=0)
    rows[1]["teacher_sample_temperature"] = 1.5
    rows[2]["teacher_sample_counts"] = [c[:3] for c in rows[2]["teacher_sample_counts"]]
    with pytest.raises(TD.TeacherStoreError, match="row 2: teacher_sample_counts is .* not .* of the first row's 6"):
        dataset_to_store(rows, tmp_path / "b", vocab_size=VOCAB, top_k=0)
    assert not (tmp_path / "b" / "manifest.json").exists()  # a failed conversion leaves no store


@pytest.mark.parametrize(("to", "name"), [("axolotl", "axolotl's layout"), ("distillkit", "DistillKit's")])
def test_formats_without_sample_columns_refuse_a_sampled_store(tmp_path, to, name):
    store = _store(tmp_path / "s", 2)
    options = ConvertOptions(compressor=str(tmp_path / "unused.yaml"))
    with pytest.raises(TD.TeacherStoreError, match=f"samples=6\\), which {name}.* cannot hold .* --to hf"):
        convert("store", to, str(store), str(tmp_path / "out"), options)
