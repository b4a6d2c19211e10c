"""precompute -> store -> dataset -> collator -> patched forward, and the store's failure modes."""

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import liger_patch_kd.models as M
from liger_patch_kd import KDLossConfig
from liger_patch_kd import teacher as TD

from .helpers import random_sequences
from .tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")


def _sequences(n=7, seed=0):
    return random_sequences(VOCAB, n, seed)


@pytest.mark.parametrize("tail", ["bucket", "renormalize", "none"])
def test_round_trip_full_vocab_equals_online_loss(tmp_path, tail):
    teacher = tiny_model("llama", seed=3)
    seqs = _sequences()
    TD.precompute(
        teacher, seqs, tmp_path, top_k=VOCAB, batch_size=3, shard_size=4, logprob_dtype="float32", progress=False
    )
    data = TD.TeacherLogprobsDataset(tmp_path, vocab_size=VOCAB)
    assert len(data) == len(seqs) and data.top_k == VOCAB
    batch = next(iter(DataLoader(data, batch_size=len(seqs), collate_fn=TD.TeacherDataCollator())))
    student = M.apply_kd_patch_to_llama(model=tiny_model("llama", seed=1), kd_config=KDLossConfig(beta=0.3, tail=tail))
    common = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    offline = student(
        **common, teacher_token_ids=batch["teacher_token_ids"], teacher_logprobs=batch["teacher_logprobs"]
    )
    online = student(**common, teacher_model=teacher)
    # the store keeps fp32 log-probs of the fp64 teacher: agreement to fp32 rounding
    torch.testing.assert_close(offline.loss, online.loss, rtol=1e-6, atol=1e-7)


def test_topk_store_trains_the_patched_forward(tmp_path):
    teacher = tiny_model("qwen2", seed=3)
    TD.precompute(teacher, _sequences(), tmp_path, top_k=8, batch_size=4, shard_size=3, progress=False)
    data = TD.TeacherLogprobsDataset(tmp_path, vocab_size=VOCAB)
    item = data[5]
    assert item["teacher_token_ids"].dtype == torch.int32 and item["teacher_logprobs"].dtype == torch.bfloat16
    assert (item["teacher_token_ids"][-1] == -1).all()  # the last position has no target
    batch = TD.TeacherDataCollator()([data[i] for i in range(4)])
    student = M.apply_kd_patch_to_qwen2(model=tiny_model("qwen2", seed=1))
    out = student(**batch)
    assert torch.isfinite(out.loss) and out.loss > 0
    out.loss.backward()


def test_interrupted_precompute_resumes_to_identical_shards(tmp_path, monkeypatch):
    teacher = tiny_model("llama", seed=3, dtype=torch.float32)
    seqs = _sequences(10)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    TD.precompute(teacher, seqs, full, top_k=5, shard_size=3, progress=False)

    original = TD.StoreWriter.write_shard
    calls = {"n": 0}

    def crash_on_third(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            (self.out_dir / "shard-00002.safetensors.tmp").write_bytes(b"half a shard")
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TD.StoreWriter, "write_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        TD.precompute(teacher, seqs, resumed, top_k=5, shard_size=3, progress=False)
    with pytest.raises(TD.TeacherStoreError, match="interrupted"):
        TD.TeacherLogprobsDataset(resumed)
    monkeypatch.setattr(TD.StoreWriter, "write_shard", original)
    TD.precompute(teacher, seqs, resumed, top_k=5, shard_size=3, progress=False)
    names = sorted(p.name for p in full.glob("shard-*"))
    assert names == sorted(p.name for p in resumed.glob("*") if p.name != TD.MANIFEST)
    for name in names:
        assert (full / name).read_bytes() == (resumed / name).read_bytes()
    with pytest.raises(TD.TeacherStoreError, match=r"other inputs: top_k \(store: 5, now: 6\)"):
        TD.precompute(teacher, seqs, resumed, top_k=6, shard_size=3, progress=False)
    with pytest.raises(TD.TeacherStoreError, match="sequences"):
        TD.precompute(teacher, seqs[:-1] + [seqs[-1][:-1]], resumed, top_k=5, shard_size=3, progress=False)
    with pytest.raises(TD.TeacherStoreError, match="teacher"):
        TD.precompute(tiny_model("llama", seed=4, dtype=torch.float32), seqs, resumed, top_k=5, shard_size=3,
                      progress=False)  # fmt: skip


def test_damaged_or_mismatched_store_is_refused(tmp_path):
    teacher = tiny_model("llama", seed=3, dtype=torch.float32)
    TD.precompute(teacher, _sequences(6), tmp_path, top_k=4, shard_size=3, progress=False)
    shard = tmp_path / "shard-00001.safetensors"
    blob = bytearray(shard.read_bytes())
    blob[-3] ^= 0xFF  # a byte of the last sequence's log-probs
    shard.write_bytes(bytes(blob))
    data = TD.TeacherLogprobsDataset(tmp_path)
    data[0], data[3], data[4]  # shard 0 and the intact sequences of shard 1 read fine
    with pytest.raises(TD.TeacherStoreError, match="sequence 2 fails its checksum"):
        data[5]
    with pytest.raises(TD.TeacherStoreError, match="fails its checksum"):
        TD.verify_store(tmp_path)
    shard.write_bytes(bytes(blob[: len(blob) // 2]))
    with pytest.raises(TD.TeacherStoreError, match="cut short"):
        TD.TeacherLogprobsDataset(tmp_path)[4]
    shard.unlink()
    with pytest.raises(TD.TeacherStoreError, match="missing"):
        TD.TeacherLogprobsDataset(tmp_path)[4]
    with pytest.raises(TD.TeacherStoreError, match="not a teacher store"):
        TD.TeacherLogprobsDataset(tmp_path / "nowhere")
    manifest = tmp_path / TD.MANIFEST
    manifest.write_text(manifest.read_text()[:-40])
    with pytest.raises(TD.TeacherStoreError, match="truncated or damaged"):
        TD.TeacherLogprobsDataset(tmp_path)


def test_tokenizer_fingerprint_is_checked(tmp_path):
    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    a, b = Tok({"a": 0, "b": 1}), Tok({"a": 1, "b": 0})
    assert TD.tokenizer_fingerprint(a) != TD.tokenizer_fingerprint(b)
    teacher = tiny_model("llama", seed=3, dtype=torch.float32)
    TD.precompute(teacher, _sequences(2), tmp_path, top_k=4, tokenizer_fp=TD.tokenizer_fingerprint(a), progress=False)
    TD.TeacherLogprobsDataset(tmp_path, tokenizer=a)
    with pytest.raises(TD.TeacherStoreError, match="fingerprint"):
        TD.TeacherLogprobsDataset(tmp_path, tokenizer=b)


def test_vllm_import(tmp_path):
    records = [
        {
            "prompt_token_ids": [5, 9, 2],
            "prompt_logprobs": [None, {"9": {"logprob": -0.1, "rank": 1}, "3": {"logprob": -2.5, "rank": 2}},
                                {"2": -0.7, "7": -1.0, "8": -9999.0}],
            "output_token_ids": [4],
            "output_logprobs": [{"4": {"logprob": -0.2}}],
        }
    ]  # fmt: skip
    TD.import_vllm_logprobs(records, tmp_path, vocab_size=10, top_k=2)
    item = TD.TeacherLogprobsDataset(tmp_path, vocab_size=10)[0]
    assert item["input_ids"].tolist() == [5, 9, 2, 4]
    assert item["teacher_token_ids"].tolist() == [[9, 3], [2, 7], [4, -1], [-1, -1]]
    lp = item["teacher_logprobs"]
    assert lp[0].tolist() == pytest.approx([-0.1, -2.5]) and lp[2, 1] == float("-inf")
    with pytest.raises(TD.TeacherStoreError, match="outside vocab_size"):
        TD.import_vllm_logprobs(
            [{"prompt_token_ids": [1, 2], "prompt_logprobs": [None, {"12": -0.1}]}],
            tmp_path / "b",
            vocab_size=10,
            top_k=2,
        )
    manifest = json.loads((tmp_path / TD.MANIFEST).read_text())
    assert manifest["top_k"] == 2 and manifest["shards"][0]["sha256"]


def test_precompute_command_line(tmp_path):
    from liger_patch_kd.cli import main

    tiny_model("llama", seed=3, dtype=torch.float32).save_pretrained(tmp_path / "teacher")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": s}) for s in _sequences(5)) + "\n")
    main(["precompute", "--teacher", str(tmp_path / "teacher"), "--data", str(data), "--top-k", "4",
          "--out", str(tmp_path / "store"), "--shard-size", "2", "--device", "cpu"])  # fmt: skip
    store = TD.TeacherLogprobsDataset(tmp_path / "store", vocab_size=VOCAB)
    assert len(store) == 5 and store.top_k == 4
    assert json.loads((tmp_path / "store" / TD.MANIFEST).read_text())["teacher"] == str(tmp_path / "teacher")


def test_teacher_topk_under_bf16_autocast_normalises_fp32_logits_of_bf16_products():
    """teacher.teacher_topk (and precompute, the server, rollout scoring: one head_chunks) called inside a bf16
    autocast block with an fp32 teacher: the products run on the bf16-rounded inputs, as the fused losses take them
    under autocast, but the log-softmax must see their fp32 output. Under autocast the fp32 product came back in bf16
    and the stored log-probs were bf16 too (2^-9 of each logit and of each log-prob: ~1e-2 nats). Reference: the
    model's own hidden states (its backbone under the same autocast) and head rounded to bf16, multiplied and
    normalised in float64; fp32 rounding of logits of size ~10 leaves 1e-5."""
    teacher = tiny_model("llama", seed=2, dtype=torch.float32)
    ids = torch.tensor(random_sequences(VOCAB, n=2, seed=3, lengths=(9, 10))[:1] * 2)
    mask = torch.ones_like(ids)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        top_ids, top_lp = TD.teacher_topk(teacher, ids, mask, k=8)
        hidden = teacher.model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert top_lp.dtype == torch.float32
    weight = teacher.lm_head.weight.detach().bfloat16().double()
    want = torch.log_softmax(hidden.bfloat16().double() @ weight.T, -1).gather(-1, top_ids)
    torch.testing.assert_close(top_lp.double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_collator_reads_tensor_rows_together_as_it_reads_lists_row_by_row(dtype):
    """TeacherDataCollator and RolloutStoreCollator over items whose columns are tensors (a store's: one
    concatenation per column) give exactly what they give for the same rows as lists (row by row): lengths 0, 1
    and more, bf16's -inf padding, labels on every row or on some, behaviour log-probs as tensors or lists."""
    from liger_patch_kd.batch.columns import TEACHER_LOGPROBS, TEACHER_TOKEN_IDS
    from liger_patch_kd.batch.rollout_store import RolloutStoreCollator
    from liger_patch_kd.batch.teacher_data import TeacherDataCollator

    g = torch.Generator().manual_seed(3)
    lengths, k = [3, 0, 1, 5], 4
    items = []
    for n in lengths:
        items.append({"input_ids": torch.randint(0, 50, (n,), generator=g),
                      "labels": torch.where(torch.rand(n, generator=g) < 0.5, -100, torch.randint(0, 50, (n,))),
                      TEACHER_TOKEN_IDS: torch.randint(0, 50, (n, k), generator=g, dtype=torch.int32),
                      TEACHER_LOGPROBS: torch.randn(n, k, generator=g).to(dtype),
                      "behaviour_logprobs": -torch.rand(n, generator=g),
                      "teacher_token_logprobs": -torch.rand(n, generator=g)})  # fmt: skip
    as_lists = [{key: value.float().tolist() if value.is_floating_point() else value.tolist()
                 for key, value in item.items()} for item in items]  # fmt: skip
    for collate in (TeacherDataCollator(pad_token_id=7), RolloutStoreCollator(pad_token_id=7)):
        together, by_row = collate(items), collate(as_lists)
        assert together.keys() == by_row.keys()
        for key, value in together.items():
            if torch.is_tensor(value):  # lists of floats are float32: the same values, exactly
                assert torch.equal(value, by_row[key].to(value.dtype)), key
        assert together[TEACHER_LOGPROBS].dtype == dtype and torch.isneginf(together[TEACHER_LOGPROBS][1]).all()
    some_labelled = [dict(item) for item in items]
    del some_labelled[0]["labels"]  # a row without labels trains on its input ids
    batch = TeacherDataCollator()(some_labelled)
    assert torch.equal(batch["labels"][0, :3], items[0]["input_ids"])
    assert torch.equal(batch["labels"][3, :5], items[3]["labels"])
    with pytest.raises(ValueError, match="row 1 of this batch: input_ids holds 2.5"):
        TeacherDataCollator()([{"input_ids": torch.tensor([1.0, 2.0])}, {"input_ids": torch.tensor([2.5])}])


@pytest.mark.parametrize("given", ["tensor", "list"])
def test_teacher_ids_past_int32_or_fractional_are_refused_not_wrapped(given):
    """A teacher id that int32 cannot hold (a cast wraps 2**32 + 5 to 5, a valid-looking id) or a fraction (a cast
    truncates 5.5 to 5) is a one-line error naming the column; whole numbers stored as floats are taken exactly."""
    from liger_patch_kd.batch.columns import TEACHER_LOGPROBS, TEACHER_TOKEN_IDS
    from liger_patch_kd.batch.teacher_data import TeacherDataCollator

    def rows(ids):
        ids = torch.tensor(ids)
        value = ids if given == "tensor" else ids.tolist()
        return [{"input_ids": [1, 2], TEACHER_TOKEN_IDS: value, TEACHER_LOGPROBS: torch.zeros(2, 2)}]

    with pytest.raises(ValueError, match=f"{TEACHER_TOKEN_IDS} holds {2**32 + 5}, outside int32"):
        TeacherDataCollator()(rows([[3, 2**32 + 5], [1, -1]]))
    with pytest.raises(ValueError, match="5.5"):
        TeacherDataCollator()(rows([[3.0, 5.5], [1.0, -1.0]]))
    batch = TeacherDataCollator()(rows([[3.0, 5.0], [1.0, -1.0]]))
    assert batch[TEACHER_TOKEN_IDS].dtype == torch.int32 and batch[TEACHER_TOKEN_IDS].tolist() == [[[3, 5], [1, -1]]]


@pytest.mark.parametrize("logprob_dtype", [torch.float32, torch.bfloat16])
def test_tensor_rows_collate_in_one_pass_as_row_by_row_lists(logprob_dtype):
    """A store's items (tensors) are padded column by column in one masked assignment; the same rows given as
    lists take the row-by-row path: every column is equal, empty rows and rows of other lengths included."""
    from liger_patch_kd.batch.columns import TEACHER_LOGPROBS, TEACHER_TOKEN_IDS
    from liger_patch_kd.batch.rollout_store import RolloutStoreCollator

    g = torch.Generator().manual_seed(0)
    rows = []
    for n in (5, 0, 9, 1, 9, 3):
        rows.append({
            "input_ids": torch.randint(0, 50, (n,), generator=g),
            "labels": torch.where(torch.rand(n, generator=g) < 0.3, -100, torch.randint(0, 50, (n,), generator=g)),
            TEACHER_TOKEN_IDS: torch.randint(0, 50, (n, 4), generator=g, dtype=torch.int32),
            TEACHER_LOGPROBS: torch.randn(n, 4, generator=g).to(logprob_dtype),
            "behaviour_logprobs": -torch.rand(n, generator=g),
            "teacher_token_logprobs": -torch.rand(n, generator=g),
        })  # fmt: skip
    as_lists = [{k: v.tolist() if k in ("input_ids", "labels") else v.numpy() if v.dtype != torch.bfloat16 else
                 v.float().numpy() for k, v in r.items()} for r in rows]  # fmt: skip
    for collator in (TD.TeacherDataCollator(pad_token_id=7), RolloutStoreCollator(pad_token_id=7)):
        fast, slow = collator(rows), collator(as_lists)
        assert fast.keys() == slow.keys()
        for key, value in fast.items():
            if torch.is_tensor(value):
                other = slow[key].to(value.dtype) if key == TEACHER_LOGPROBS else slow[key]
                assert torch.equal(value, other), key
        assert fast["input_ids"].shape == (6, 9) and (fast["input_ids"][1] == 7).all()
        assert fast["attention_mask"].sum(1).tolist() == [5, 0, 9, 1, 9, 3]
        assert torch.isneginf(fast[TEACHER_LOGPROBS][0, 5:]).all()
        assert (fast[TEACHER_TOKEN_IDS][0, 5:] == -1).all()
    # labels of another length than their ids would sit beside the wrong positions: refused, naming the row
    rows[0] = {**rows[0], "labels": rows[0]["labels"][:3]}
    with pytest.raises(ValueError, match="row 0 of this batch: labels has 3 positions and input_ids 5"):
        TD.TeacherDataCollator()(rows)


@pytest.mark.parametrize("given", ["tensor", "list"])
def test_a_row_whose_labels_or_teacher_columns_have_another_length_than_its_ids_is_refused(given):
    """Padded as given, a row's labels or teacher columns of another length than its input_ids would sit beside
    the wrong positions (labels of the completion alone score the prompt's positions; a teacher row one short
    scores each position against a neighbour's top-k; a longer one scores padding): a one-line error naming the
    row, the column and both lengths, whether the rows are a store's tensors or lists, all rows labelled or some."""
    from liger_patch_kd.batch.columns import (
        TEACHER_LOGPROBS,
        TEACHER_SAMPLE_COUNTS,
        TEACHER_SAMPLE_IDS,
        TEACHER_SAMPLE_LOGPROBS,
        TEACHER_TOKEN_IDS,
    )
    from liger_patch_kd.batch.rollout_store import RolloutStoreCollator

    def item(n, **lengths):
        most = 8  # each column drawn this long, then cut to its row's length (or the length under test)
        columns = {"input_ids": torch.randint(0, 50, (most,)), "labels": torch.randint(0, 50, (most,)),
                   TEACHER_TOKEN_IDS: torch.randint(0, 50, (most, 2), dtype=torch.int32),
                   TEACHER_LOGPROBS: -torch.rand(most, 2),
                   TEACHER_SAMPLE_IDS: torch.randint(0, 50, (most, 3)),
                   TEACHER_SAMPLE_COUNTS: torch.ones(most, 3, dtype=torch.int32),
                   TEACHER_SAMPLE_LOGPROBS: -torch.rand(most, 3), "behaviour_logprobs": -torch.rand(most),
                   "teacher_token_logprobs": -torch.rand(most)}  # fmt: skip
        cut = {key: value[: lengths.get(key, n)] for key, value in columns.items()}
        return cut if given == "tensor" else {key: value.tolist() for key, value in cut.items()}

    collate = RolloutStoreCollator()
    collate([item(4), item(0), item(6)])  # every column as long as its ids
    for column in ("labels", TEACHER_TOKEN_IDS, TEACHER_LOGPROBS, TEACHER_SAMPLE_IDS, TEACHER_SAMPLE_COUNTS,
                   TEACHER_SAMPLE_LOGPROBS, "behaviour_logprobs", "teacher_token_logprobs"):  # fmt: skip
        for other in (3, 5, 1):  # shorter, longer but within the batch's width, one (numpy would broadcast it)
            # the other rows' lengths add up to the same total: joined, only each row's own length tells
            rows = [item(6), item(4, **{column: other}), item(2, **{column: 6 - other})]
            with pytest.raises(ValueError, match=f"row 1 of this batch: {column} has {other} positions and "
                                                 f"input_ids 4"):  # fmt: skip
                collate(rows)
    some_labelled = [item(4), item(3, labels=1)]
    del some_labelled[0]["labels"]
    with pytest.raises(ValueError, match="row 1 of this batch: labels has 1 positions and input_ids 3"):
        TD.TeacherDataCollator()(some_labelled)


def test_uint64_teacher_ids_past_int32_are_refused_not_wrapped_to_padding():
    """A uint64 tensor's 2**64 - 1 cast to int64 is -1, the padding id (the position would silently lose its
    teacher): refused naming the row, as a numpy uint64 row is; smaller unsigned ids are read together."""
    from liger_patch_kd.batch.columns import TEACHER_LOGPROBS, TEACHER_TOKEN_IDS

    def rows(ids, dtype):
        return [{"input_ids": [1], TEACHER_TOKEN_IDS: torch.tensor(ids, dtype=dtype),
                 TEACHER_LOGPROBS: torch.zeros(1, 2)}]  # fmt: skip

    with pytest.raises(ValueError, match=f"row 0 of this batch: {TEACHER_TOKEN_IDS} holds {2**64 - 1}"):
        TD.TeacherDataCollator()(rows([[2**64 - 1, 3]], torch.uint64))
    for dtype in (torch.uint8, torch.uint32, torch.uint64):
        assert TD.TeacherDataCollator()(rows([[5, 3]], dtype))[TEACHER_TOKEN_IDS].tolist() == [[[5, 3]]]


def _reference_collation(rows, pad, ignore):
    """Each column padded row by row in plain Python (float64 values, bf16 / fp16 log-probs widened exactly)."""
    width = max(len(r["input_ids"]) for r in rows)
    out = {"input_ids": [], "attention_mask": [], "labels": []}
    for r in rows:
        ids = [int(t) for t in torch.as_tensor(r["input_ids"]).tolist()]
        labels = [int(t) for t in torch.as_tensor(r["labels"]).tolist()] if "labels" in r else ids
        fill = width - len(ids)
        out["input_ids"].append(ids + [pad] * fill)
        out["attention_mask"].append([1] * len(ids) + [0] * fill)
        out["labels"].append(labels + [ignore] * fill)
    for key, fill in (("teacher_token_ids", -1), ("teacher_logprobs", -math.inf)):
        if key in rows[0]:
            k = rows[0][key].shape[1]  # the reference reads the tensor rows: (n, k) even when n is 0
            out[key] = [torch.as_tensor(r[key]).double().tolist() + [[fill] * k] * (width - len(r["input_ids"]))
                        for r in rows]  # fmt: skip
    return out




@st.composite
def _batches(draw):
    """Rows of 0..6 positions: ids of an integer / whole-float dtype, labels on all / some / no rows, a teacher's
    top-k of any log-prob dtype; each column a tensor (contiguous, a strided view, requiring grad), numpy or a list."""
    k = draw(st.integers(1, 3))
    id_dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.float64]))
    teacher_id_dtype = draw(st.sampled_from([torch.int32, torch.int64, torch.uint8, torch.float32]))
    lp_dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64]))
    labelled = draw(st.sampled_from(["all", "some", "none"]))
    teacher = draw(st.booleans())
    rows = []
    for n in draw(st.lists(st.integers(0, 6), min_size=1, max_size=5)):
        ids = draw(st.lists(st.integers(0, 120), min_size=n, max_size=n))
        row = {"input_ids": torch.tensor(ids, dtype=torch.int64).to(id_dtype)}
        if labelled == "all" or (labelled == "some" and draw(st.booleans())):
            row["labels"] = torch.tensor(draw(st.lists(st.sampled_from([-100, 3, 77]), min_size=n, max_size=n)),
                                         dtype=torch.int64)  # fmt: skip
        if teacher:
            row["teacher_token_ids"] = (
                torch.tensor(
                    draw(st.lists(st.lists(st.integers(-1, 120), min_size=k, max_size=k), min_size=n, max_size=n)),
                    dtype=torch.int64,
                )
                .view(n, k)
                .to(teacher_id_dtype if teacher_id_dtype != torch.uint8 else torch.int64)
            )
            values = draw(st.lists(st.floats(-30, 0, width=16), min_size=n * k, max_size=n * k))
            row["teacher_logprobs"] = torch.tensor(values, dtype=torch.float64).view(n, k).to(lp_dtype)
        rows.append(row)
    if teacher and teacher_id_dtype == torch.uint8:  # unsigned ids cannot hold the -1 of an empty slot
        for row in rows:
            row["teacher_token_ids"] = row["teacher_token_ids"].clamp(min=0).to(torch.uint8)
    forms = {
        key: draw(st.sampled_from(["tensor", "strided", "grad", "numpy", "list"]))
        for key in ("input_ids", "labels", "teacher_token_ids", "teacher_logprobs")
    }

    def as_form(value, how):
        if how == "strided":
            return torch.stack([value, value], -1)[..., 0]
        if how == "grad":
            return value.clone().requires_grad_(True) if value.is_floating_point() else value
        if how == "numpy":
            return (value.float() if value.dtype == torch.bfloat16 else value).numpy()
        if how == "list":
            return (value.float() if value.dtype == torch.bfloat16 else value).tolist()
        return value

    mixed = [{key: as_form(value, forms[key] if draw(st.booleans()) else "tensor") for key, value in row.items()}
             for row in rows]  # fmt: skip
    return rows, mixed


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(_batches())
def test_collation_of_any_row_kinds_equals_padding_each_row_in_python(batch):
    """Property: a store's tensor rows (joined, one masked assignment a column) and the same rows as strided views,
    tensors requiring grad, numpy arrays, lists or a mix (row by row) collate to the plain Python padding of each
    row, the log-probs bit for bit in the first row's dtype."""
    rows, mixed = batch
    for given_rows in (rows, mixed):
        got = TD.TeacherDataCollator(pad_token_id=5, ignore_index=-9)(given_rows)
        want = _reference_collation(rows, 5, -9)
        assert got.keys() == want.keys()
        for key in ("input_ids", "attention_mask", "labels"):
            assert got[key].dtype == torch.int64 and got[key].tolist() == want[key], key
        if "teacher_token_ids" in got:
            assert got["teacher_token_ids"].dtype == torch.int32
            assert got["teacher_token_ids"].tolist() == [
                [[int(v) for v in p] for p in r] for r in want["teacher_token_ids"]
            ]
            first = given_rows[0]["teacher_logprobs"]
            dtype = first.dtype if torch.is_tensor(first) else torch.as_tensor(first).dtype
            assert got["teacher_logprobs"].dtype == dtype
            assert (
                got["teacher_logprobs"].double().tolist()
                == torch.tensor(want["teacher_logprobs"]).to(dtype).double().tolist()
            )


def test_rows_packed_with_position_ids_are_refused_not_padded_as_one_sequence():
    """A row holding several sequences (its position_ids restart at each) padded as one sequence would let every
    token attend to the sequences before it: a different objective, silently. One line names the collator that
    packs instead."""
    rows = [{"input_ids": torch.tensor([5, 6, 7, 8]), "labels": torch.tensor([5, 6, 7, 8]),
             "position_ids": torch.tensor([0, 1, 0, 1])}]  # fmt: skip
    with pytest.raises(ValueError, match="carry position_ids.*DataCollatorWithFlattening"):
        TD.TeacherDataCollator()(rows)
