"""DistillKit's compressed parquet (compressed_logprobs + bytepacked_indices): files written by an encoder here,
written from the format's description (one position at a time, bit strings and struct), read by the importer;
the store -> distillkit -> store round trip; bad input; the command line."""

import struct

import numpy as np
import pytest
import torch

from liger_patch_kd import teacher as TD
from liger_patch_kd.cli import main

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
yaml = pytest.importorskip("yaml")

# Relative rounding of the exact values: half an ulp, at most 2**-p of the value for p significant bits (bf16 8,
# fp16 11, fp32 24).
HALF_ULP = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24, "float64": 2.0**-53}
# DistillKit's README's recommended settings, with a small vocabulary and k
RECOMMENDED = {"d": 1000, "k": 16, "exact_k": 4, "exact_dtype": "bfloat16", "term_dtype": "float32",
               "polynomial_terms": [0, 1, 2, 3, 4, "sqrt"], "residual_bins": [], "delta_encoding": False,
               "error_diffusion": False}  # fmt: skip
BINNED = {"d": 1000, "k": 16, "exact_k": 2, "exact_dtype": "float32", "polynomial_terms": [0, 1, "exp"],
          "term_dtype": "float32", "normalize_t": True, "delta_encoding": True, "error_diffusion": True,
          "residual_bins": [{"scale_dtype": "float16", "element_bits": 8, "num_elements": 6},
                            {"scale_dtype": "bfloat16", "element_bits": 3, "num_elements": 5},
                            {"scale_dtype": "float32", "element_bits": 1, "num_elements": 2}]}  # fmt: skip
EXACT_ONLY = {"d": 300, "k": 8, "exact_k": 8, "exact_dtype": "float16", "residual_bins": [], "delta_encoding": False}


# ------------------------------------------------------------------------ an encoder from the format description
def _rounded(x: float, dtype: str) -> tuple[float, bytes]:
    """x rounded to `dtype` and its little-endian bytes."""
    if dtype == "bfloat16":
        t = torch.tensor([x], dtype=torch.float64).to(torch.bfloat16)
        return float(t.float()), struct.pack("<h", int(t.view(torch.int16)))
    fmt = {"float16": "<e", "float32": "<f", "float64": "<d"}[dtype]
    raw = struct.pack(fmt, x)
    return struct.unpack(fmt, raw)[0], raw


def _bit_bytes(values, width: int) -> bytes:
    bits = "".join(format(int(v), f"0{width}b") for v in values)
    bits += "0" * (-len(bits) % 8)
    return bytes(int(bits[i : i + 8], 2) for i in range(0, len(bits), 8))


def _encode_position(ids, logprobs, cfg: dict) -> tuple[bytes, bytes, np.ndarray, np.ndarray]:
    """One position's (compressed_logprobs, bytepacked_indices), the values a correct reader must return, and the
    a-priori error bound of each slot (rounding of exact values, quantisation of residuals, the fit where no bin)."""
    k, e = cfg["k"], cfg["exact_k"]
    d = np.diff(logprobs, prepend=0.0) if cfg.get("delta_encoding", True) else np.asarray(logprobs, float)
    out, recon, bound = b"", np.zeros(k), np.zeros(k)
    for i in range(e):
        recon[i], raw = _rounded(d[i], cfg.get("exact_dtype", "float32"))
        out += raw
        bound[i] = abs(d[i]) * HALF_ULP[cfg.get("exact_dtype", "float32")]
    m, terms = k - e, cfg.get("polynomial_terms") or []
    fit = np.zeros(m)
    if terms:
        x = np.linspace(0, 1, m) if cfg.get("normalize_t") else np.arange(m, dtype=float)
        basis = np.stack([np.sqrt(x) if t == "sqrt" else np.exp(x) if t == "exp" else x**t for t in terms], -1)
        coeffs = np.linalg.lstsq(basis, d[e:], rcond=None)[0]
        stored = [_rounded(c, "float32") for c in coeffs]
        out += b"".join(raw for _, raw in stored)
        fit = (basis.astype(np.float32) * np.array([c for c, _ in stored], np.float32)).sum(-1).astype(float)
    residual, tail, tail_bound, at = d[e:] - fit, fit.copy(), np.abs(d[e:] - fit), 0
    for b in cfg["residual_bins"]:
        r, bits = residual[at : at + b["num_elements"]], b["element_bits"]
        big = float(np.abs(r).max()) or 1.0
        scale, raw = _rounded(big if bits == 1 else big / 2 ** (bits - 1), b["scale_dtype"])
        if bits == 1:  # a sign: code 1 is +scale, code 0 is -scale
            codes, levels = (r >= 0).astype(int), np.where(r >= 0, 1.0, -1.0)
        else:
            levels = np.clip(np.round(r / scale), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
            codes = (levels + 2 ** (bits - 1)).astype(int)
        out += raw + _bit_bytes(codes, bits)
        tail[at : at + len(r)] += levels * scale
        tail_bound[at : at + len(r)] = scale * 1.01  # within scale / 2, or one step at the clamped maximum
        at += len(r)
    recon[e:], bound[e:] = tail, tail_bound
    if cfg.get("delta_encoding", True):
        recon, bound = np.cumsum(recon), np.cumsum(bound)
    index_bits = int(np.ceil(np.log2(cfg["d"])))
    return out, _bit_bytes(ids, index_bits), recon, bound


def _teacher_rows(rng, positions: int, cfg: dict):
    logits = torch.from_numpy(rng.normal(0, 3, size=(positions, cfg["d"])))
    values, ids = torch.log_softmax(logits, -1).topk(cfg["k"], dim=-1)
    return ids.numpy(), values.numpy()


def _write_capture(folder, cfg: dict, lengths, seed: int = 0):
    """A DistillKit capture: data_0.parquet (len - 1 rows per sequence) and compression_config.yaml."""
    rng = np.random.default_rng(seed)
    table, truth = {"input_ids": [], "compressed_logprobs": [], "bytepacked_indices": []}, []
    for n in lengths:
        ids, lp = _teacher_rows(rng, n - 1, cfg)
        encoded = [_encode_position(i, v, cfg) for i, v in zip(ids, lp)]
        table["input_ids"].append(rng.integers(0, cfg["d"], n).tolist())
        table["compressed_logprobs"].append([list(c[0]) for c in encoded])
        table["bytepacked_indices"].append([list(c[1]) for c in encoded])
        truth.append((ids, lp, np.array([c[2] for c in encoded]), np.array([c[3] for c in encoded])))
    folder.mkdir(parents=True, exist_ok=True)
    byte_rows = pa.list_(pa.list_(pa.uint8()))
    schema = pa.schema([("input_ids", pa.list_(pa.uint64())), ("compressed_logprobs", byte_rows),
                        ("bytepacked_indices", byte_rows)])  # fmt: skip
    pq.write_table(pa.table(table, schema=schema), folder / "data_0.parquet")
    (folder / "compression_config.yaml").write_text(yaml.safe_dump(cfg))
    return table, truth


@pytest.mark.parametrize("cfg", [RECOMMENDED, BINNED, EXACT_ONLY], ids=["recommended", "binned-delta", "exact"])
def test_reads_files_written_from_the_format_description(tmp_path, cfg):
    table, truth = _write_capture(tmp_path / "capture", cfg, lengths=[6, 1, 9])
    TD.distillkit_to_store(tmp_path / "capture", tmp_path / "store")
    data = TD.TeacherLogprobsDataset(tmp_path / "store", vocab_size=cfg["d"])
    assert len(data) == 3 and data.top_k == cfg["k"]
    for item, tokens, (ids, lp, recon, bound) in zip(data, table["input_ids"], truth):
        assert item["input_ids"].tolist() == tokens
        assert (item["teacher_token_ids"][-1] == -1).all()  # the last token has no target: padding
        got, n = item["teacher_logprobs"][:-1].double().numpy(), len(tokens) - 1
        assert item["teacher_token_ids"][:-1].tolist() == ids.tolist()
        if n:
            # what the bytes hold, to float32 storage; and the truth within the format's own error
            np.testing.assert_allclose(got, recon, rtol=2e-6, atol=2e-6)
            assert (np.abs(got - lp) <= bound + 1e-5).all(), np.abs(got - lp).max()
    if cfg is EXACT_ONLY:  # fp16 values: relative error at most 2**-11
        assert (np.abs(got - lp) <= np.abs(lp) * HALF_ULP["float16"] + 1e-6).all()


def test_packed_rows_are_split_at_the_attention_mask_segments(tmp_path):
    rng = np.random.default_rng(1)
    ids, lp = _teacher_rows(rng, 9, RECOMMENDED)
    encoded = [_encode_position(i, v, RECOMMENDED) for i, v in zip(ids, lp)]
    row = {"input_ids": list(range(10, 19)), "attention_mask": [1, 1, 1, 2, 2, 2, 2, 3, 3], "labels": [0] * 9,
           "compressed_logprobs": [list(c[0]) for c in encoded],
           "bytepacked_indices": [list(c[1]) for c in encoded]}  # fmt: skip
    TD.distillkit_to_store([row], tmp_path / "s", compressor=RECOMMENDED)
    data = TD.TeacherLogprobsDataset(tmp_path / "s")
    assert [d["input_ids"].tolist() for d in data] == [[10, 11, 12], [13, 14, 15, 16], [17, 18]]
    assert torch.cat([d["teacher_token_ids"] for d in data]).tolist() == ids.tolist()  # every row is real here
    recon = np.array([c[2] for c in encoded])
    got = torch.cat([d["teacher_logprobs"] for d in data]).double().numpy()
    np.testing.assert_allclose(got, recon, rtol=2e-6, atol=2e-6)


def _random_store(path, vocab=1000, top_k=10, lengths=(5, 8, 3)):
    rng = np.random.default_rng(2)
    rows = []
    for n in lengths:
        ids, lp = _teacher_rows(rng, n - 1, {"d": vocab, "k": top_k})
        rows.append({"input_ids": rng.integers(0, vocab, n), "teacher_token_ids": ids, "teacher_logprobs": lp})
    return TD.dataset_to_store(rows, path, vocab_size=vocab, top_k=top_k)


def test_store_round_trip_exact_when_lossless_and_within_the_bound_otherwise(tmp_path):
    store = _random_store(tmp_path / "store", top_k=8)
    lossless = {"k": 8, "exact_k": 8, "exact_dtype": "float32", "residual_bins": [], "delta_encoding": False}
    TD.store_to_distillkit(store, tmp_path / "dk", compressor=lossless)  # d: the store's vocab_size
    TD.distillkit_to_store(tmp_path / "dk", tmp_path / "back")
    a, b = TD.TeacherLogprobsDataset(store), TD.TeacherLogprobsDataset(tmp_path / "back")
    for x, y in zip(a, b, strict=True):
        for key in ("input_ids", "teacher_token_ids", "teacher_logprobs"):
            assert torch.equal(x[key], y[key]), key
    # lossy: 2 exact bf16 slots, a quadratic tail and 8-bit residuals over the other 6
    lossy = {"k": 8, "exact_k": 2, "exact_dtype": "bfloat16", "polynomial_terms": [0, 1, 2], "delta_encoding": False,
             "residual_bins": [{"scale_dtype": "float32", "element_bits": 8, "num_elements": 6}]}  # fmt: skip
    TD.store_to_distillkit(store, tmp_path / "dk2", compressor=lossy)
    TD.distillkit_to_store(tmp_path / "dk2", tmp_path / "back2")
    x_ = np.arange(6.0)
    basis = np.stack([x_**0, x_, x_**2], -1)
    for x, y in zip(a, TD.TeacherLogprobsDataset(tmp_path / "back2"), strict=True):
        assert torch.equal(x["teacher_token_ids"], y["teacher_token_ids"])
        want, got = x["teacher_logprobs"][:-1].double().numpy(), y["teacher_logprobs"][:-1].double().numpy()
        assert (np.abs(got[:, :2] - want[:, :2]) <= np.abs(want[:, :2]) * HALF_ULP["bfloat16"] + 1e-7).all()
        residual = want[:, 2:] - (basis @ np.linalg.lstsq(basis, want[:, 2:].T, rcond=None)[0]).T
        step = np.abs(residual).max(-1, keepdims=True) / 128  # 8-bit codes: error <= one step (clamped maximum)
        assert (np.abs(got[:, 2:] - want[:, 2:]) <= step + 1e-5).all()
        assert np.abs(got[:, 2:] - want[:, 2:]).max() > 0  # lossy indeed


def test_writer_refuses_what_the_format_cannot_hold(tmp_path):
    store = _random_store(tmp_path / "store", top_k=4)
    with pytest.raises(TD.TeacherStoreError, match="top_k 4 < the compressor's k 8"):
        TD.store_to_distillkit(store, tmp_path / "a", compressor={**EXACT_ONLY, "d": 1000})
    with pytest.raises(TD.TeacherStoreError, match="d 300"):
        TD.store_to_distillkit(store, tmp_path / "b", compressor={**EXACT_ONLY, "k": 4, "exact_k": 4})
    short = TD.dataset_to_store([{"input_ids": [1, 2, 3], "teacher_token_ids": [[5, 6, 7, 8], [9]],
                                  "teacher_logprobs": [[-1, -2, -3, -4], [-0.1]]}],
                                tmp_path / "short", vocab_size=1000, top_k=4)  # fmt: skip
    with pytest.raises(TD.TeacherStoreError, match="position 1: fewer than k = 4 slots"):
        TD.store_to_distillkit(short, tmp_path / "c", compressor={**EXACT_ONLY, "d": 1000, "k": 4, "exact_k": 4})


def test_export_never_writes_over_files_it_did_not_write(tmp_path):
    store = _random_store(tmp_path / "store", top_k=10)
    for name in ("data_0.parquet", "compression_config.yaml"):
        out = tmp_path / name
        out.mkdir()
        (out / name).write_bytes(b"USER DATA")
        with pytest.raises(FileExistsError, match=f"--out {out} already holds {name}"):
            TD.store_to_distillkit(store, out, compressor={**EXACT_ONLY, "d": 1000})
        assert [p.name for p in out.iterdir()] == [name] and (out / name).read_bytes() == b"USER DATA"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"foo": 1}, "unknown keys \\['foo'\\]"),
        ({"exact_dtype": "float8"}, "exact_dtype = 'float8'"),
        ({"polynomial_terms": [0, "log"]}, "polynomial term 'log'"),
        ({"polynomial_degree": 8}, "legacy_logit_compression"),
        ({"residual_bins": [{"scale_dtype": "float32", "element_bits": 4, "num_elements": 99}]}, "at most k - exact_k"),
        ({"residual_bins": [{"scale_dtype": "float32", "element_bits": 0, "num_elements": 2}]}, "element_bits"),
        ({"polynomial_terms": None}, "no polynomial_terms and no residual_bins"),
    ],
)
def test_unknown_or_invalid_compressor_settings_are_refused(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        TD.distillkit_to_store([], tmp_path / "s", compressor={**RECOMMENDED, **change})


def test_bad_input_is_refused_with_a_clear_error(tmp_path):
    table, _ = _write_capture(tmp_path / "capture", RECOMMENDED, lengths=[5])
    rows = [{name: column[0] for name, column in table.items()}]
    with pytest.raises(ValueError, match="missing keys \\['d'\\]"):
        TD.distillkit_to_store(rows, tmp_path / "a", compressor={k: v for k, v in RECOMMENDED.items() if k != "d"})
    with pytest.raises(ValueError, match="compressor=None"):
        TD.distillkit_to_store(rows, tmp_path / "b")
    with pytest.raises(TD.TeacherStoreError, match="lacks columns \\['bytepacked_indices'\\]"):
        no_ids = {k: v for k, v in rows[0].items() if k != "bytepacked_indices"}
        TD.distillkit_to_store([no_ids], tmp_path / "c", compressor=RECOMMENDED)
    pq.write_table(pa.table({"input_ids": [[1]], "packed_indices": [[[1]]], "exact_values": [[[0.5]]],
                             "coeffs": [[[0.1]]]}), tmp_path / "legacy.parquet")  # fmt: skip
    with pytest.raises(TD.TeacherStoreError, match="legacy layout"):
        TD.distillkit_to_store(tmp_path / "legacy.parquet", tmp_path / "d", compressor=RECOMMENDED)
    # settings that are not the data's: another index width (d 300: 9 bits) or ids beyond d / vocab_size
    with pytest.raises(TD.TeacherStoreError, match="bytepacked_indices rows are 20 bytes.*write 18"):
        TD.distillkit_to_store(rows, tmp_path / "e", compressor={**RECOMMENDED, "d": 300})
    with pytest.raises(TD.TeacherStoreError, match=r"input_ids: token id \d+ at index \d+ is outside \[0, 520\)"):
        TD.distillkit_to_store(rows, tmp_path / "f", compressor={**RECOMMENDED, "d": 520})
    small = [{**rows[0], "input_ids": [int(i) % 500 for i in rows[0]["input_ids"]]}]  # only the top-k ids reach d
    with pytest.raises(TD.TeacherStoreError, match=">= d 520"):
        TD.distillkit_to_store(small, tmp_path / "f2", compressor={**RECOMMENDED, "d": 520})
    with pytest.raises(TD.TeacherStoreError, match="vocab_size 10"):
        TD.distillkit_to_store(rows, tmp_path / "g", compressor=RECOMMENDED, vocab_size=10)
    for count in (2, 5):  # one row per token or per token but the last; anything else is refused
        bad = {**rows[0], "compressed_logprobs": rows[0]["compressed_logprobs"][:count - 3 or None],
               "bytepacked_indices": rows[0]["bytepacked_indices"][:count - 3 or None]}  # fmt: skip
        bad["input_ids"] = bad["input_ids"] + [1] * (count == 5)
        with pytest.raises(TD.TeacherStoreError, match="expected one row per token"):
            TD.distillkit_to_store([bad], tmp_path / f"h{count}", compressor=RECOMMENDED)


def test_command_line(tmp_path, capsys):
    _, truth = _write_capture(tmp_path / "capture", BINNED, lengths=[4, 7])
    main(["convert", "--from", "distillkit", "--to", "store", "--input", str(tmp_path / "capture"),
          "--out", str(tmp_path / "store")])  # fmt: skip
    data = TD.TeacherLogprobsDataset(tmp_path / "store")
    assert [len(d["input_ids"]) for d in data] == [4, 7] and data.top_k == BINNED["k"]
    np.testing.assert_allclose(data[1]["teacher_logprobs"][:-1].double().numpy(), truth[1][2], rtol=2e-6, atol=2e-6)
    config = tmp_path / "exact.yaml"
    config.write_text(yaml.safe_dump({**EXACT_ONLY, "d": 1000, "k": 16, "exact_k": 16, "exact_dtype": "float32"}))
    main(["convert", "--from", "store", "--to", "distillkit", "--input", str(tmp_path / "store"),
          "--out", str(tmp_path / "dk"), "--compressor", str(config)])  # fmt: skip
    main(["convert", "--from", "distillkit", "--to", "store", "--input", str(tmp_path / "dk"),
          "--compressor", str(config), "--top-k", "5", "--out", str(tmp_path / "back")])  # fmt: skip
    back = TD.TeacherLogprobsDataset(tmp_path / "back")
    assert back.top_k == 5
    for x, y in zip(data, back, strict=True):
        assert torch.equal(x["teacher_token_ids"][:, :5], y["teacher_token_ids"])
        assert torch.equal(x["teacher_logprobs"][:, :5], y["teacher_logprobs"])
    assert main(["convert", "--from", "store", "--to", "distillkit", "--input", str(tmp_path / "store"),
                 "--out", str(tmp_path / "x")]) == 2  # fmt: skip
    assert "--to distillkit needs --compressor" in capsys.readouterr().err
