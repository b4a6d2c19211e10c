"""A rollout store's rows are assembled a call at a time as whole tensors (no work per row): each piece is checked
here against the one-row-at-a-time definition it replaces, on uneven lengths, EOS anywhere, samples, an engine's
log-probs and a served teacher's rows, so the store's bytes cannot drift."""

import hashlib
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from liger_patch_kd.generation import left_padded
from liger_patch_kd.teacher import StoreWriter
from liger_patch_kd.teacher.precompute import sequences_fingerprint, teacher_topk_and_next
from liger_patch_kd.teacher.store.rollouts import IGNORE_INDEX
from liger_patch_kd.teacher.store.shard import sequence_checksums
from liger_patch_kd.trainer.offline_onpolicy import ScoreOptions, score_rollouts
from liger_patch_kd.trainer.offline_onpolicy.scoring import RowScores, TeacherScores, teacher_rows
from liger_patch_kd.trainer.rollouts.generate import Rollout, eos_cuts

from .tiny_models import tiny_model

VOCAB = 64


def _rollouts(seed: int, rows: int = 7, logprobs: bool = False) -> list[Rollout]:
    """Prompts of 1-6 tokens, completions of 1-9 (uneven, so the padding and each row's end matter)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 7))]
        completion = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 10))]
        lp = tuple(-rng.random() * 5 for _ in completion) if logprobs else None
        out.append(Rollout(prompt, completion, False, lp))
    return out


def _label_aligned(next_lp: torch.Tensor) -> torch.Tensor:
    return F.pad(next_lp[:-1], (1, 0), value=0.0)


def _row_by_row(student, teacher, rollouts, options):
    """The rows as the store held them when each was assembled on its own (labels, behaviour and teacher token
    log-probs, top-k / samples with the last position empty)."""
    sequences = [r.prompt + r.completion for r in rollouts]
    scores = teacher_rows(teacher, sequences, options)
    lengths = [len(s) for s in sequences]
    cuts = np.cumsum([0, *lengths])
    if student is not None:
        width = max(lengths)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
        mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
        _, _, student_next, _ = teacher_topk_and_next(student, ids, mask, 1)
    out = []
    for row, (r, seq) in enumerate(zip(rollouts, sequences)):
        n, p, at = len(seq), len(r.prompt), slice(cuts[row], cuts[row + 1])
        labels = torch.tensor([IGNORE_INDEX] * p + r.completion, dtype=torch.int32)
        completion = labels != IGNORE_INDEX
        if student is not None:
            behaviour = _label_aligned(student_next[row])[:n]
        else:
            behaviour = torch.tensor([0.0] * p + list(r.logprobs), dtype=torch.float64)
        top_i, top_v = scores.topk_ids[at].clone(), scores.topk_logprobs[at].float().clone()
        top_i[-1], top_v[-1] = -1, -math.inf
        samples = None
        if options.samples:
            samples = tuple(d[at].clone() for d in scores.samples)
            samples[0][-1], samples[1][-1], samples[2][-1] = -1, 0, -math.inf
        out.append(dict(input_ids=torch.tensor(seq), topk_ids=top_i, topk_logprobs=top_v, samples=samples,
                        labels=labels, behaviour=torch.where(completion, behaviour, 0.0).float(),
                        teacher=torch.where(completion, _label_aligned(scores.next_logprobs[at]), 0.0).float()))
    return out


def _assert_same(got, want):
    for name in ("input_ids", "topk_ids", "topk_logprobs"):
        assert torch.equal(getattr(got, name), want[name]), name
        assert getattr(got, name).dtype == want[name].dtype, name
    for name, key in (("labels", "labels"), ("behaviour_logprobs", "behaviour"), ("teacher_token_logprobs", "teacher")):
        assert torch.equal(got.columns[name], want[key]), name  # bit for bit, zeros' signs included
        assert got.columns[name].dtype == want[key].dtype, name
    assert (got.samples is None) == (want["samples"] is None)
    for a, b in zip(got.samples or (), want["samples"] or ()):
        assert torch.equal(a, b) and a.dtype == b.dtype


@pytest.fixture(scope="module")
def models():
    return tiny_model("llama", dtype=torch.float32, seed=1), tiny_model("llama", dtype=torch.float32, seed=2)


@pytest.mark.parametrize("options", [ScoreOptions(top_k=4), ScoreOptions(top_k=3, samples=2, seed=5),
                                     ScoreOptions(top_k=4, temperature=2.0)], ids=["topk", "samples", "tempered"])
def test_a_calls_rows_are_the_rows_assembled_one_at_a_time(models, options):
    student, teacher = models
    rollouts = _rollouts(0)
    scored = score_rollouts(student, teacher, rollouts, options)
    want = _row_by_row(student, teacher, rollouts, options)
    assert len(scored) == len(rollouts) and scored.lengths == [len(r.prompt) + len(r.completion) for r in rollouts]
    for got, expected in zip(scored, want):
        _assert_same(got, expected)
    _assert_same(scored[-1], want[-1])
    with pytest.raises(IndexError):
        scored[len(rollouts)]


def test_an_engines_log_probs_are_the_behaviour_and_a_missing_one_is_named(models):
    _, teacher = models
    rollouts = _rollouts(1, logprobs=True)
    scored = score_rollouts(None, teacher, rollouts, ScoreOptions(top_k=4))
    for got, expected in zip(scored, _row_by_row(None, teacher, rollouts, ScoreOptions(top_k=4))):
        _assert_same(got, expected)
    short = [*rollouts[:3], Rollout(rollouts[3].prompt, rollouts[3].completion, False, rollouts[3].logprobs[:-1])]
    with pytest.raises(ValueError, match="rollout 3 carries no log-prob of each of its"):
        score_rollouts(None, teacher, short, ScoreOptions(top_k=4))


def test_a_served_teachers_rows_joined_are_the_in_process_scores(models):
    _, teacher = models
    rollouts = _rollouts(2)
    sequences = [r.prompt + r.completion for r in rollouts]
    whole = teacher_rows(teacher, sequences, ScoreOptions(top_k=4))
    cuts = np.cumsum([0, *map(len, sequences)])
    parts = [RowScores(whole.topk_ids[a:b], whole.topk_logprobs[a:b], None, whole.next_logprobs[a:b])
             for a, b in zip(cuts[:-1], cuts[1:])]  # fmt: skip

    class Served:
        def rows(self, sequences, options):
            return TeacherScores.of_rows(parts)

    served = score_rollouts(None, Served(), [Rollout(r.prompt, r.completion, False, (-1.0,) * len(r.completion))
                                             for r in rollouts], ScoreOptions(top_k=4))  # fmt: skip
    local = score_rollouts(None, teacher, [Rollout(r.prompt, r.completion, False, (-1.0,) * len(r.completion))
                                           for r in rollouts], ScoreOptions(top_k=4))  # fmt: skip
    for a, b in zip(served, local):
        assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.topk_logprobs, b.topk_logprobs)
        assert all(torch.equal(a.columns[k], b.columns[k]) for k in a.columns)


def test_eos_cuts_are_the_first_eos_of_each_row():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (200, 9), generator=g)
    eos = {2, 5}
    ends, finished = eos_cuts(tokens, eos)
    for row, (end, done) in enumerate(zip(ends, finished)):
        seq = tokens[row].tolist()
        first = next((i for i, t in enumerate(seq) if t in eos), None)
        assert (end, done) == ((first + 1, True) if first is not None else (len(seq), False))
    assert eos_cuts(tokens, set()) == ([9] * 200, [False] * 200)  # no EOS id: every row runs to the limit
    assert eos_cuts(tokens[:, :0], eos) == ([0] * 200, [False] * 200)


def test_left_padded_puts_each_prompt_at_the_right_end():
    prompts = [[5, 6, 7], [], [9], [3, 4, 5, 6]]
    ids, mask = left_padded(prompts, 0, 6)
    for row, p in enumerate(prompts):
        assert ids[row].tolist() == [0] * (6 - len(p)) + p and mask[row].tolist() == [0] * (6 - len(p)) + [1] * len(p)
    assert ids.dtype == mask.dtype == torch.long
    assert left_padded(prompts, 1)[0].shape == (4, 4) and left_padded([], 0)[0].shape == (0, 0)
    with pytest.raises(ValueError, match="does not fit width 3"):
        left_padded(prompts, 0, 3)


def test_the_prompts_fingerprint_is_the_per_sequence_hash():
    def per_sequence(sequences):
        digest = hashlib.sha256()
        for seq in sequences:
            ids = torch.as_tensor(seq, dtype=torch.int64)
            digest.update(len(ids).to_bytes(8, "little"))
            digest.update(ids.numpy().tobytes())
        return digest.hexdigest()[:16]

    rng = random.Random(0)
    many = [[rng.randrange(2**40) for _ in range(rng.randrange(0, 12))] for _ in range(300)]
    for case in ([[1, 2, 3], [], [4]], [[]], [], many, [torch.tensor([1, 2]), [3]]):
        assert sequences_fingerprint(case) == per_sequence(case)
    assert sequences_fingerprint([[1, 2], [3]]) != sequences_fingerprint([[1], [2, 3]])  # lengths count


def test_sequence_checksums_are_each_sequences_crc32():
    import zlib

    rng = np.random.default_rng(0)
    offsets = np.array([0, 3, 3, 10, 11])
    arrays = {"input_ids": rng.integers(0, 9, (11, 4), dtype=np.int32).view(np.uint8).reshape(11, -1),
              "topk_logprobs": rng.random((11, 3), dtype=np.float32).view(np.uint8).reshape(11, -1)}  # fmt: skip
    got = sequence_checksums(offsets, arrays)
    for j in range(4):
        crc = zlib.crc32(arrays["topk_logprobs"][offsets[j] : offsets[j + 1]].tobytes(),
                         zlib.crc32(arrays["input_ids"][offsets[j] : offsets[j + 1]].tobytes()))  # fmt: skip
        assert got[j] == crc


def test_a_bad_id_among_tensor_sequences_names_its_sequence(tmp_path):
    writer = StoreWriter.open(tmp_path / "s", vocab_size=10, top_k=1, logprob_dtype="float32")
    good = [torch.tensor([1, 2]), torch.tensor([3])]
    with pytest.raises(ValueError, match=r"shard 0, sequence 1: input_ids: token id 10 at index 0 is outside"):
        writer.write_shard([good[0], torch.tensor([10])], torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, 1))
    writer.write_shard(good, torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, 1))
    assert writer.finish().is_dir() and writer.done_shards() == 1


def test_the_store_benchmark_runs_and_reports_every_phase(tmp_path):
    """benchmarks/teachers/bench_rollout_store --smoke: the live rows, the store and its split, in the JSON."""
    import json

    from benchmarks.teachers import bench_rollout_store

    bench_rollout_store.main(["--smoke", "--out", str(tmp_path / "r.json")])
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["row"] for r in rows] == ["live generation", "live scoring", "store", "store, split"]
    split = rows[-1]
    phases = ("generate_s", "teacher_s", "student_s", "assembly_s", "write_s", "other_s")
    assert all(split[k] >= 0 for k in phases[:-1]) and all(r["completions_per_s"] > 0 for r in rows)
    assert sum(split[k] for k in phases) == pytest.approx(1000 * split["seconds"] / split["completions"])


def test_the_rollout_collator_takes_log_probs_as_lists_arrays_and_tensors_of_any_float_dtype():
    """RolloutStoreCollator pads behaviour / teacher-token log-probs given as lists, numpy arrays, or tensors in
    bfloat16 or needing grad (numpy has no bfloat16) to what float32 tensors give: 0 past each row."""
    from liger_patch_kd.batch.columns import BEHAVIOUR, BEHAVIOUR_LOGPROBS, TEACHER_TOKEN, TEACHER_TOKEN_LOGPROBS
    from liger_patch_kd.batch.rollout_store import RolloutStoreCollator

    g = torch.Generator().manual_seed(0)
    rows = []
    for n in (0, 1, 5):
        lp = -torch.rand(2, n, generator=g).bfloat16().float()  # exact in bfloat16
        rows.append({"input_ids": list(range(3, 3 + n)), "labels": [-100] * (n // 2) + list(range(3 + n // 2, 3 + n)),
                     BEHAVIOUR_LOGPROBS: lp[0], TEACHER_TOKEN_LOGPROBS: lp[1]})  # fmt: skip
    want = RolloutStoreCollator()(rows)
    for convert in (lambda t: t.tolist(), lambda t: t.numpy(), lambda t: t.bfloat16(), lambda t: t.double(),
                    lambda t: t.clone().requires_grad_()):  # fmt: skip
        given = [{**r, BEHAVIOUR_LOGPROBS: convert(r[BEHAVIOUR_LOGPROBS]),
                  TEACHER_TOKEN_LOGPROBS: convert(r[TEACHER_TOKEN_LOGPROBS])} for r in rows]  # fmt: skip
        got = RolloutStoreCollator()(given)
        for key in (BEHAVIOUR, TEACHER_TOKEN):
            assert got[key].dtype == torch.float32 and torch.equal(got[key], want[key])
    mixed = [{**r, BEHAVIOUR_LOGPROBS: r[BEHAVIOUR_LOGPROBS].bfloat16() if i % 2 else r[BEHAVIOUR_LOGPROBS].tolist()}
             for i, r in enumerate(rows)]  # fmt: skip
    assert torch.equal(RolloutStoreCollator()(mixed)[BEHAVIOUR], want[BEHAVIOUR])  # row by row, each as it comes
    assert want[BEHAVIOUR].shape == (3, 5) and not want[BEHAVIOUR][:2, 1:].any()


def test_reading_and_collating_a_rollout_store_costs_a_few_torch_dispatches_a_row(tmp_path):
    """A training step reads hundreds of store rows on the host: the reader builds each column in numpy and hands it
    to torch once, and the collator takes tensor columns out of torch in one concatenation, so a row costs a few
    dispatched torch ops (one per column it returns), not several per column (37 a row when each column went
    tensor -> numpy alone). Counted with torch's profiler: a count, not a time."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    from liger_patch_kd.batch.rollout_store import RolloutStoreCollator
    from liger_patch_kd.teacher import TeacherLogprobsDataset
    from liger_patch_kd.trainer.offline_onpolicy import precompute_rollouts
    from liger_patch_kd.trainer.rollouts.generate import RolloutSettings

    student, teacher = (tiny_model("llama", dtype=torch.float32, seed=seed) for seed in (1, 2))
    prompts = [[5 + i % 7, 9, 11 + i % 3] for i in range(48)]
    path = precompute_rollouts(student, teacher, prompts, tmp_path / "s", settings=RolloutSettings(max_new_tokens=6,
                               seed=3), score=ScoreOptions(top_k=4), prompts_per_call=48, progress=False)  # fmt: skip
    store, collate = TeacherLogprobsDataset(path), RolloutStoreCollator()
    collate([store[i] for i in range(len(store))])  # warm: shards opened
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        batch = collate([store[i] for i in range(len(store))])
    ops = collections.Counter()
    for event in prof.events():  # dispatches from Python: aten ops not called by another aten op
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if event.name.startswith("aten::") and parent is None:
            ops[event.name] += 1
    columns = sum(1 for _ in store[0])
    assert batch["input_ids"].shape[0] == len(store) == 48
    assert sum(ops.values()) <= (columns + 1) * len(store) + 64, ops.most_common(8)  # + per batch: the collation
