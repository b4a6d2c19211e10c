"""The store's compact encoding, vocabulary semantics, the precompute CLI's input handling and kill-resume, and the
converters (axolotl, Hugging Face datasets)."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import liger_patch_kd.models as M
from liger_patch_kd import KDLossConfig
from liger_patch_kd import teacher as TD
from liger_patch_kd.cli import main
from liger_patch_kd.teacher.store.compact import PackedCodec, codec_from_spec

from .helpers import random_sequences, subprocess_env
from .tiny_models import VOCAB, tiny_model

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("clean_patches")


def _sequences(n=7, seed=0):
    return random_sequences(VOCAB, n, seed)


def _topk_rows(vocab, k, rows=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp, ids = torch.log_softmax(torch.randn(rows, vocab, generator=g) * 4, -1).topk(k, -1)
    ids, lp = ids.int().numpy(), lp.numpy()
    ids[3, k // 2 :], lp[3, k // 2 :] = -1, -np.inf  # a partly padded row
    ids[4], lp[4] = -1, -np.inf  # a fully padded row (a sequence's last position)
    return ids, lp


@pytest.mark.parametrize("vocab,k", [(151936, 64), (262144, 5), (131072, 3), (50, 50), (1000, 13)])
@pytest.mark.parametrize("bits", [8, 10, 12])
def test_packed_codec_round_trip(vocab, k, bits):
    ids, lp = _topk_rows(vocab, k, seed=bits)
    codec = PackedCodec(vocab, k, bits)
    assert codec.id_bits == vocab.bit_length()  # 151936 -> 18, 262144 -> 19 (the padding code), 131072 -> 18
    rows = codec.encode(ids, lp)
    assert rows.shape == (len(ids), codec.row_bytes) and codec.row_bytes == 8 + codec.padded_k * codec.field_bits // 8
    got_ids, got_lp = codec.decode(rows)
    np.testing.assert_array_equal(got_ids, ids)  # exact, padding included
    finite = np.isfinite(lp)
    np.testing.assert_array_equal(np.isneginf(got_lp), ~finite)
    span = (np.where(finite, lp, -np.inf).max(1) - np.where(finite, lp, np.inf).min(1))[finite.any(1)]
    bound = span.max() / (2 * (2**bits - 2)) + 1e-5  # half a step of the widest row, plus fp32 rounding
    assert np.abs(got_lp[finite] - lp[finite]).max() <= bound
    np.testing.assert_array_equal(got_lp[:, 0][finite[:, 0]], lp[:, 0][finite[:, 0]])  # the top slot is exact


def test_codec_specs_are_validated():
    assert codec_from_spec("plain", 10, 2) is None
    for bad in ("zip", "packed99", "packed3", "packed"):  # the message names the valid encodings
        with pytest.raises(ValueError, match=r"--encoding.*'plain' or 'packed4' .. 'packed16'"):
            codec_from_spec(bad, 10, 2)
    with pytest.raises(ValueError, match="logprob_bits"):
        PackedCodec(10, 2, 20)


def _written_store(out, shard_lengths, encoding, samples=0, rollouts=False, k=4, vocab=50, **options):
    """A store written by StoreWriter itself, one shard per list of sequence lengths: random top-k rows (and draws
    from outside them, and rollout columns) for each position, read back as a TeacherLogprobsDataset."""
    g = torch.Generator().manual_seed(len(shard_lengths))
    extra = {"samples": samples} if samples else {}
    if rollouts:
        extra["rollouts"] = {"generator_fingerprint": "g", "teacher_fingerprint": "t"}
    writer = TD.StoreWriter.open(out, vocab_size=vocab, top_k=k, encoding=encoding, **extra, **options)
    for lengths in shard_lengths:
        rows = sum(lengths)
        seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
        lp, ids = torch.log_softmax(torch.randn(rows, vocab, generator=g), -1).topk(k + samples, -1)
        draws = (ids[:, k:], torch.ones(rows, samples, dtype=torch.int32), lp[:, k:]) if samples else None
        columns = {"labels": torch.cat(seqs) if rows else torch.zeros(0, dtype=torch.long),
                   "behaviour_logprobs": -torch.rand(rows, generator=g),
                   "teacher_token_logprobs": -torch.rand(rows, generator=g)} if rollouts else None  # fmt: skip
        writer.write_shard(seqs, ids[:, :k], lp[:, :k], samples=draws, rollouts=columns)
    writer.finish()
    return TD.TeacherLogprobsDataset(out, vocab_size=vocab)


def _assert_empty_item(item, k=4, samples=0):
    assert item["input_ids"].shape == (0,) and item["input_ids"].dtype == torch.int64
    assert item["teacher_token_ids"].shape == item["teacher_logprobs"].shape == (0, k)
    assert item["teacher_token_ids"].dtype == torch.int32 and item["teacher_logprobs"].dtype == torch.float32
    for name in ("teacher_sample_ids", "teacher_sample_counts", "teacher_sample_logprobs") if samples else ():
        assert item[name].shape == (0, samples)


@pytest.mark.parametrize("samples", [0, 2])
def test_a_packed_store_reads_an_empty_sequence_as_the_plain_one_does(tmp_path, samples):
    codec = PackedCodec(50, 4, 10)
    ids, lp = codec.decode(codec.encode(np.zeros((0, 4), np.int32), np.zeros((0, 4), np.float32)))
    assert ids.shape == lp.shape == (0, 4) and ids.dtype == np.int32 and lp.dtype == np.float32
    lengths = [[3, 0, 2]]
    plain = _written_store(tmp_path / "plain", lengths, "plain", samples, logprob_dtype="float32")
    packed = _written_store(tmp_path / "packed", lengths, "packed10", samples, logprob_dtype="float32")
    _assert_empty_item(packed[1], samples=samples)
    for i in range(len(plain)):
        want, got = plain[i], packed[i]
        assert want.keys() == got.keys()
        for name in want:
            assert (got[name].shape, got[name].dtype) == (want[name].shape, want[name].dtype), (i, name)
        for name in ("input_ids", "teacher_token_ids") + (("teacher_sample_ids",) if samples else ()):
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
        for name in ("teacher_logprobs",) + (("teacher_sample_logprobs",) if samples else ()):
            if want[name].numel():  # packed10: at most half a step, the row's span / 1022, off (plus fp32 rounding)
                bound = (want[name].amax(-1) - want[name].amin(-1)).max() / (2 * 1022) + 1e-5
                assert (got[name] - want[name]).abs().max() <= bound


@pytest.mark.parametrize("encoding,samples,rollouts",
                         [("plain", 0, False), ("packed10", 0, False), ("plain", 2, False), ("packed10", 2, False),
                          ("plain", 0, True)])  # fmt: skip
def test_a_shard_of_empty_sequences_is_written_and_read_back(tmp_path, encoding, samples, rollouts):
    data = _written_store(tmp_path / "s", [[0, 0], [2, 0]], encoding, samples, rollouts, logprob_dtype="float32")
    assert len(data) == 4 and TD.verify_store(tmp_path / "s").sequences == 4
    for i in (0, 1, 3):
        _assert_empty_item(data[i], samples=samples)
        if rollouts:
            assert all(data[i][name].shape == (0,) for name in ("labels", "behaviour_logprobs"))
    assert data[2]["input_ids"].shape == (2,) and data[2]["teacher_token_ids"].shape == (2, 4)


@pytest.mark.parametrize("top_k,samples", [(0, 2), (2, 2), (2, 0)])
def test_a_store_opened_without_logprob_dtype_writes_float32(tmp_path, top_k, samples):
    data = _written_store(tmp_path / "s", [[3, 2]], "plain", samples, k=top_k)  # the option check's default
    columns = {"teacher_logprobs": top_k, "teacher_sample_logprobs": samples}
    for name, slots in columns.items():
        if slots:
            assert data[0][name].dtype == torch.float32 and data[0][name].shape == (3, slots)


def test_packed_store_trains_like_the_plain_one(tmp_path):
    teacher = tiny_model("llama", seed=3, dtype=torch.float32)
    seqs = _sequences(9)
    losses = {}
    for encoding in ("plain", "packed8", "packed12"):
        TD.precompute(teacher, seqs, tmp_path / encoding, top_k=16, shard_size=4, logprob_dtype="float32",
                      encoding=encoding, progress=False)  # fmt: skip
        data = TD.TeacherLogprobsDataset(tmp_path / encoding, vocab_size=VOCAB)
        batch = TD.TeacherDataCollator()([data[i] for i in range(len(data))])
        student = M.apply_kd_patch_to_llama(model=tiny_model("llama", seed=1, dtype=torch.float64),
                                            kd_config=KDLossConfig(beta=0.5, tail="bucket"))  # fmt: skip
        losses[encoding] = student(**batch).loss.item()
        M.revert_kd_patch()
        if encoding != "plain":
            plain = TD.TeacherLogprobsDataset(tmp_path / "plain")
            for i in range(len(data)):
                torch.testing.assert_close(data[i]["teacher_token_ids"], plain[i]["teacher_token_ids"], rtol=0, atol=0)
                err = (data[i]["teacher_logprobs"] - plain[i]["teacher_logprobs"]).nan_to_num(0).abs().max()
                assert err < (2e-2 if encoding == "packed8" else 2e-3)
    assert losses["packed12"] == pytest.approx(losses["plain"], rel=1e-3)
    assert losses["packed8"] == pytest.approx(losses["plain"], rel=1e-2)


def test_store_serves_a_student_with_another_head_size(tmp_path):
    """Ids, not head sizes, decide; the check reads the manifest, not the shards."""
    teacher = tiny_model("llama", seed=3, dtype=torch.float32)
    TD.precompute(teacher, _sequences(6), tmp_path, top_k=4, shard_size=4, progress=False)
    meta = TD.read_manifest(tmp_path)
    highest = max(max(s["max_id"], s["max_input_id"]) for s in meta["shards"])
    assert meta["vocab_size"] == VOCAB and highest < VOCAB
    assert len(TD.TeacherLogprobsDataset(tmp_path, vocab_size=VOCAB + 128)) == 6  # a larger student head
    assert len(TD.TeacherLogprobsDataset(tmp_path, vocab_size=highest + 1)) == 6  # a smaller one that covers the ids
    with pytest.raises(TD.TeacherStoreError, match=f"token id {highest} .*vocab_size={highest}"):
        TD.TeacherLogprobsDataset(tmp_path, vocab_size=highest)


@pytest.fixture(scope="module")
def saved_teacher(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher") / "teacher"
    tiny_model("llama", seed=3, dtype=torch.float32).save_pretrained(path)
    return path


def test_precompute_bad_lines_and_resume_fingerprint(tmp_path, saved_teacher, capsys):
    data = tmp_path / "data.jsonl"
    good = [json.dumps({"input_ids": s}) for s in _sequences(4)]
    lines = [
        good[0],
        json.dumps({"input_ids": []}),
        good[1],
        "{not json",
        json.dumps({"input_ids": [1, VOCAB]}),
        good[2],
    ]
    data.write_text("\n".join(lines) + "\n")
    base = ["precompute", "--teacher", str(saved_teacher), "--data", str(data), "--top-k", "4", "--device", "cpu"]
    for expected in [f"{data}:2: the line holds no tokens", f"{data}:4: not valid JSON",
                     f"{data}:5: token id {VOCAB} is outside the teacher's vocabulary"]:  # fmt: skip
        code = main([*base, "--out", str(tmp_path / "store")])  # a mistake is one line and exit status 2
        err = capsys.readouterr().err.strip().splitlines()[-1]  # (above it: transformers' loading bar)
        assert code == 2 and err.startswith("liger-kd precompute: error: ")
        assert expected in err and "--skip-bad-lines" in err
        lines.pop(int(expected.split(":")[1]) - 1)  # fix that line, see the next one reported
        lines.insert(int(expected.split(":")[1]) - 1, good[3])
        data.write_text("\n".join(lines) + "\n")
    data.write_text("\n".join([good[0], json.dumps({"input_ids": []}), "{", good[1]]) + "\n")
    main([*base, "--out", str(tmp_path / "store"), "--skip-bad-lines"])
    assert "skipped 2 bad lines: 1 no tokens, 1 invalid JSON" in capsys.readouterr().out
    assert len(TD.TeacherLogprobsDataset(tmp_path / "store")) == 2
    # a resume with the teacher under another path string is accepted; another data file or --max-length is not
    relative = os.path.relpath(saved_teacher)
    main(["precompute", "--teacher", relative, *base[3:], "--out", str(tmp_path / "store"), "--skip-bad-lines"])
    capsys.readouterr()
    for change, name in [(["--max-length", "3"], "max_length"), (["--top-k", "5"], "top_k")]:
        assert main([*base, "--out", str(tmp_path / "store"), "--skip-bad-lines", *change]) == 2
        assert f"other inputs: {name} (store:" in capsys.readouterr().err
    data.write_text("\n".join([good[0], good[1]]) + "\n")
    assert main([*base, "--out", str(tmp_path / "store"), "--skip-bad-lines"]) == 2
    assert "data file (store:" in capsys.readouterr().err


def test_precompute_checks_its_data_before_loading_the_weights(tmp_path, saved_teacher, capsys, monkeypatch):
    """A bad line or option is reported from the config's vocabulary, without the minutes a large teacher's
    weights take to load."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were loaded before the data was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, VOCAB]}) + "\n")
    base = ["precompute", "--teacher", str(saved_teacher), "--data", str(data), "--out", str(tmp_path / "s")]
    assert main([*base, "--top-k", "4"]) == 2
    assert f"token id {VOCAB} is outside the teacher's vocabulary" in capsys.readouterr().err
    data.write_text(json.dumps({"input_ids": [1, 2]}) + "\n")
    assert main([*base, "--top-k", str(VOCAB + 1)]) == 2
    assert f"vocab_size={VOCAB}" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_precompute_never_writes_over_files_it_did_not_write(tmp_path, saved_teacher, capsys, monkeypatch):
    """A folder holding a shard name (or its temporary) but no manifest is someone else's: refused before the
    weights load, the files untouched; the writer itself (converters use it too) refuses it the same way."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were loaded before --out was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    for name in ("shard-00000.safetensors", "shard-00003.safetensors.tmp", "manifest.json.tmp"):
        out = tmp_path / name.replace(".", "_")
        out.mkdir()
        (out / name).write_bytes(b"USER DATA")
        (out / "notes.txt").write_bytes(b"USER NOTES")
        args = ["precompute", "--teacher", str(saved_teacher), "--data", str(data), "--out", str(out), "--top-k", "4"]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert f"--out {out} holds {name} but no manifest.json" in err and len(err.strip().splitlines()) == 1
        with pytest.raises(TD.TeacherStoreError, match="pass an empty or new folder"):
            TD.StoreWriter.open(out, vocab_size=VOCAB, top_k=4)
        assert sorted(p.name for p in out.iterdir()) == sorted([name, "notes.txt"])
        assert (out / name).read_bytes() == b"USER DATA"


def test_a_rerun_starts_over_what_an_interrupted_run_left(tmp_path, saved_teacher, monkeypatch):
    """Killed after its first shard was renamed but before its manifest (or mid-way through a temporary), a run leaves
    files without a manifest: it recorded the shard as its own (folder.PENDING) before the rename, so the same
    command runs again and writes the store an uninterrupted run writes, byte for byte."""
    from liger_patch_kd.teacher.store import folder, writer

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": s}) for s in _sequences(6, seed=4)) + "\n")

    def run(out):
        return main(["precompute", "--teacher", str(saved_teacher), "--data", str(data), "--out", str(out),
                     "--top-k", "4", "--device", "cpu", "--shard-size", "2"])  # fmt: skip

    assert run(tmp_path / "whole") == 0
    whole = {p.name: p.read_bytes() for p in (tmp_path / "whole").iterdir()}
    assert folder.PENDING not in whole  # a finished store keeps no record of its run
    for left in ("first shard, no manifest", "a cut temporary", "an empty temporary"):
        out = tmp_path / left.replace(" ", "_")
        out.mkdir()
        shard = whole["shard-00000.safetensors"]
        if left.startswith("first"):

            def killed(*args):  # the moment between the first shard's rename and its manifest
                raise KeyboardInterrupt

            with monkeypatch.context() as m:
                m.setattr(writer, "write_manifest", killed)
                assert run(out) == 130
            assert sorted(p.name for p in out.iterdir()) == sorted([folder.PENDING, "shard-00000.safetensors"])
        else:
            (out / "shard-00000.safetensors.tmp").write_bytes(shard[: len(shard) // 2] if "cut" in left else b"")
        assert run(out) == 0, left
        assert {p.name: p.read_bytes() for p in out.iterdir()} == whole, left


def test_a_shard_another_run_wrote_is_refused_never_overwritten(tmp_path, saved_teacher, capsys, monkeypatch):
    """A shard carries the tool's mark wherever it came from: one copied from another store (into an empty --out, a
    killed run's --out, or a store being resumed) is someone else's, refused in one line naming it, left as it was."""
    from liger_patch_kd.teacher.store import writer

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": s}) for s in _sequences(6, seed=4)) + "\n")
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(json.dumps({"input_ids": s}) for s in _sequences(6, seed=5)) + "\n")

    def run(out, rows=data):
        return main(["precompute", "--teacher", str(saved_teacher), "--data", str(rows), "--out", str(out),
                     "--top-k", "4", "--device", "cpu", "--shard-size", "2"])  # fmt: skip

    assert run(tmp_path / "another", rows=other) == 0
    copied = (tmp_path / "another" / "shard-00001.safetensors").read_bytes()
    assert b"liger_patch_kd teacher store" in copied[:4096]  # marked as this tool's, yet not this run's

    def killed_after(shards):
        def write_manifest(store_dir, meta):
            if len(meta["shards"]) > shards:
                raise KeyboardInterrupt
            TD.store.write_manifest(store_dir, meta)

        return write_manifest

    for case in ("an empty --out", "a killed run's --out", "a store being resumed"):
        out = tmp_path / case.replace(" ", "_").replace("'", "")
        out.mkdir()
        if case != "an empty --out":  # killed after its first shard: no manifest, or a manifest listing one shard
            with monkeypatch.context() as m:
                m.setattr(writer, "write_manifest", killed_after(0 if "killed" in case else 1))
                assert run(out) == 130
            capsys.readouterr()
        (out / "shard-00001.safetensors").write_bytes(copied)
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        capsys.readouterr()
        assert run(out) == 2, case  # before the weights load: their progress bar would be on stderr
        err = capsys.readouterr().err
        assert f"--out {out} holds shard-00001.safetensors" in err and len(err.strip().splitlines()) == 1, case
        assert ("does not list" if "resumed" in case else "but no manifest.json") in err, case
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before, case
        (out / "shard-00001.safetensors").unlink()  # moved out, as the message says: the run resumes and finishes
        assert run(out) == 0, case
        assert TD.TeacherLogprobsDataset(out)[2]["input_ids"].tolist() == _sequences(6, seed=4)[2], case


def test_every_option_documents_its_default(capsys):
    """Every option that takes a value and has a default shows it in --help; a flag shows none (`--no-x` stores
    False when given, so a "default: True" would read as the opposite of what the flag does)."""
    import argparse

    from liger_patch_kd import cli

    subparsers = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("demo", "precompute", "convert", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        valued = [a for a in subparsers.choices[command]._actions
                  if a.option_strings and a.nargs != 0 and a.default not in (None, argparse.SUPPRESS)]  # fmt: skip
        flags = [a for a in subparsers.choices[command]._actions if a.option_strings and a.nargs == 0]
        for action in valued:
            assert f"(default: {action.default})" in text or f"default: {action.default}" in text, (
                command, action.option_strings)
        shown = subparsers.choices[command].formatter_class(prog=command)
        for action in flags:
            assert "%(default)" not in shown._get_help_string(action), (command, action.option_strings)


@pytest.mark.multiprocess
def test_precompute_survives_sigkill_at_random_points(tmp_path, saved_teacher):
    """SIGKILL the real CLI at random moments while it writes shards, several times; resume; byte-identical."""
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": s}) for s in _sequences(60, seed=1)) + "\n")
    args = ["precompute", "--teacher", str(saved_teacher), "--data", str(data), "--top-k", "4", "--shard-size", "2",
            "--batch-size", "2", "--device", "cpu"]  # fmt: skip
    main([*args, "--out", str(tmp_path / "full")])
    store, rng, kills = tmp_path / "killed", random.Random(0), 0
    env = subprocess_env()
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "liger_patch_kd.cli", *args, "--out", str(store)], cwd=ROOT,
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        deadline = time.monotonic() + 60
        while not (store / TD.MANIFEST).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.4))  # somewhere in the shard loop
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
    assert kills >= 2
    main([*args, "--out", str(store)])
    names = sorted(p.name for p in (tmp_path / "full").iterdir())
    assert names == sorted(p.name for p in store.iterdir())
    for name in names:
        if name != TD.MANIFEST:
            assert (store / name).read_bytes() == (tmp_path / "full" / name).read_bytes(), name
    TD.verify_store(store)


# --------------------------------------------------------------------------------------------- converters
def _store(tmp_path, k=5, n=5):
    teacher = tiny_model("llama", seed=3, dtype=torch.float32)
    return TD.precompute(teacher, _sequences(n), tmp_path / "store", top_k=k, shard_size=2, logprob_dtype="float32",
                         progress=False)  # fmt: skip


def _assert_same_store(a, b):
    da, db = TD.TeacherLogprobsDataset(a), TD.TeacherLogprobsDataset(b)
    assert len(da) == len(db)
    for i in range(len(da)):
        for key in ("input_ids", "teacher_token_ids", "teacher_logprobs"):
            assert torch.equal(da[i][key], db[i][key]), (i, key)


def test_hf_datasets_round_trip(tmp_path):
    store = _store(tmp_path)
    ds = TD.store_to_dataset(store, cache_dir=tmp_path / "cache")
    assert ds.column_names == ["input_ids", "teacher_token_ids", "teacher_logprobs"] and len(ds) == 5
    assert ds.cache_files  # Arrow on disk, memory-mapped
    TD.dataset_to_store(ds, tmp_path / "back", vocab_size=VOCAB, top_k=5)
    _assert_same_store(store, tmp_path / "back")
    short = ds.filter(lambda r: len(r["input_ids"]) < 8)
    TD.dataset_to_store(short, tmp_path / "short", vocab_size=VOCAB, top_k=5)
    assert len(TD.TeacherLogprobsDataset(tmp_path / "short")) == len(short) < 5


def test_axolotl_layouts_and_cli_round_trip(tmp_path):
    store = _store(tmp_path)
    assert main(["convert", "--from", "store", "--to", "axolotl", "--input", str(store),
                 "--out", str(tmp_path / "ax.parquet")]) == 0  # fmt: skip
    table = TD.load_table(tmp_path / "ax.parquet")
    assert {"input_ids", "target_token_ids", "target_logprobs", "target_mask"} <= set(table.column_names)
    main(["convert", "--from", "axolotl", "--to", "store", "--input", str(tmp_path / "ax.parquet"),
          "--out", str(tmp_path / "back"), "--vocab-size", str(VOCAB), "--top-k", "5"])  # fmt: skip
    _assert_same_store(store, tmp_path / "back")
    # the older layout: per position a list of {"token": "token_id:N", "logprob": x}
    older = [{"input_ids": [3, 7, 9], "logprobs": [[{"token": "token_id:7", "logprob": -0.25},
                                                     {"token": "token_id:2", "logprob": -1.5}],
                                                    [{"token": "token_id:9", "logprob": -0.5}]]}]  # fmt: skip
    TD.axolotl_to_store(older, tmp_path / "older", vocab_size=VOCAB, top_k=2)
    item = TD.TeacherLogprobsDataset(tmp_path / "older")[0]
    assert item["teacher_token_ids"].tolist() == [[7, 2], [9, -1], [-1, -1]]
    assert item["teacher_logprobs"][:2].tolist() == [[-0.25, -1.5], [-0.5, float("-inf")]]


def test_axolotl_temperature_is_undone_only_when_exact(tmp_path):
    rows = [{"input_ids": [1, 2], "target_token_ids": [[0, 1]], "target_logprobs": [[-0.1, -2.0]],
             "target_mask": [[1, 1]]}]  # fmt: skip
    with pytest.raises(TD.TeacherStoreError, match="exact only with the full distribution"):
        TD.axolotl_to_store(rows, tmp_path / "a", vocab_size=VOCAB, top_k=2, temperature=2.0)
    TD.axolotl_to_store(rows, tmp_path / "b", vocab_size=VOCAB, top_k=2, temperature=2.0, keep_temperature=True)
    assert TD.read_manifest(tmp_path / "b")["temperature"] == 2.0
    full = torch.log_softmax(torch.tensor([1.0, -0.5, 0.25]), -1)  # a 3-token vocabulary, rows at T = 2
    tempered = (full / 2).log_softmax(-1).tolist()
    rows = [{"input_ids": [0, 1], "target_token_ids": [[0, 1, 2]], "target_logprobs": [tempered],
             "target_mask": [[1, 1, 1]]}]  # fmt: skip
    TD.axolotl_to_store(rows, tmp_path / "c", vocab_size=3, top_k=3, temperature=2.0)
    got = TD.TeacherLogprobsDataset(tmp_path / "c")[0]["teacher_logprobs"][0]
    torch.testing.assert_close(got, full, rtol=0, atol=1e-6)


def _bpe(size):
    from transformers import PreTrainedTokenizerFast

    from liger_patch_kd.demo import load_corpus
    from liger_patch_kd.demo.cross_tokenizer import train_bpe_tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=train_bpe_tokenizer(load_corpus()[:8000], size))


def test_a_store_of_another_tokenizer_is_refused_when_the_trainer_is_built(tmp_path):
    """The manifest's tokenizer fingerprint against processing_class, with no vocab_size= / tokenizer= given to the
    store: another tokenizer is one line naming both fingerprints (training and evaluation stores); the store's own
    tokenizer builds. Offline rows alone with evaluation rows that carry no teacher data are refused too."""
    from liger_patch_kd.trainer import KDTrainer, KDTrainingArguments

    theirs, ours = _bpe(300), _bpe(270)
    assert TD.tokenizer_fingerprint(theirs) != TD.tokenizer_fingerprint(ours)
    teacher = tiny_model("llama", seed=3, dtype=torch.float32)
    TD.precompute(teacher, _sequences(4), tmp_path / "store", top_k=4, progress=False,
                  tokenizer_fp=TD.tokenizer_fingerprint(theirs))  # fmt: skip
    store = TD.TeacherLogprobsDataset(tmp_path / "store")  # nothing to check it against here
    args = KDTrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, max_steps=1)

    def build(tokenizer, train=store, evaluation=None):
        return KDTrainer(model=tiny_model("llama", dtype=torch.float32), args=args, train_dataset=train,
                         eval_dataset=evaluation, processing_class=tokenizer)  # fmt: skip

    fp, store_fp = TD.tokenizer_fingerprint(ours), TD.tokenizer_fingerprint(theirs)
    with pytest.raises(ValueError, match=rf"train_dataset: .* fingerprint {store_fp}, and processing_class "
                                         rf"\({type(ours).__name__}, 270 tokens\) has fingerprint {fp}"):  # fmt: skip
        build(ours)
    rows = [{"input_ids": store[i]["input_ids"], "teacher_token_ids": store[i]["teacher_token_ids"],
             "teacher_logprobs": store[i]["teacher_logprobs"]} for i in range(len(store))]  # fmt: skip
    with pytest.raises(ValueError, match=r"eval_dataset\['held'\]: the store"):
        build(ours, rows, {"held": store})
    build(theirs, evaluation={"held": store})
    with pytest.raises(ValueError, match=r"eval_dataset\['plain'\]'s rows carry no teacher data"):
        build(theirs, evaluation={"held": store, "plain": [{"input_ids": [1, 2, 3]}]})
