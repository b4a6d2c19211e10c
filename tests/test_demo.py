"""The demo in its reduced mode: it runs, distillation beats CE alone on KL to the teacher, and it leaves no
temporary folder behind."""

import tempfile

import pytest

import liger_patch_kd.models as M
from liger_patch_kd.demo import run_demo


@pytest.mark.slow  # trains a teacher and six students: the suite's longest test on a CPU
def test_quick_demo_distilled_students_beat_ce_only(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the demo's temporary folder goes
    try:
        rows = run_demo(quick=True, device="cpu")
    finally:
        M.revert_kd_patch()
    # torch's own caches (torchinductor_<user>) may appear under the temporary directory too: not the demo's
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("liger_kd_demo_"))
    assert left == [], f"the demo removes the temporary folder it made: {left}"
    assert all(r["seeds"] == [1] and len(r["held_out_ce_by_seed"]) == 1 for r in rows if not r.get("cross_tokenizer"))
    results = {r["recipe"]: r for r in rows if not r.get("cross_tokenizer")}
    across = {r["recipe"]: r for r in rows if r.get("cross_tokenizer")}
    assert set(across) == {"BPE student: CE only", "BPE student: CE + 2 x byte-chain KD"}
    assert all(0 < r["held_out_ce"] < 5 and len(r["held_out_ce_by_seed"]) == 1 for r in across.values())
    ce_only = results.pop("CE only")
    on_policy = next(r for name, r in results.items() if name.startswith("on-policy"))
    for name, r in results.items():
        if r is on_policy:  # trains on its own samples: judged there
            assert r["kl_own_samples"] < ce_only["kl_own_samples"], (name, r, ce_only)
        else:
            assert r["kl_to_teacher"] < ce_only["kl_to_teacher"], (name, r, ce_only)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_demo_onpolicy_benchmark_tiny(tmp_path, monkeypatch, accumulation):
    """benchmarks/bench_demo_onpolicy --tiny: every row trains, the on-policy rows generate once per generated step,
    the online floor never, and the JSON holds the speedup it prints."""
    import json
    import sys

    from benchmarks import bench_demo_onpolicy

    out = tmp_path / "bench.json"
    argv = ["bench", "--tiny", "--out", str(out), "--accumulation", str(accumulation)]
    monkeypatch.setattr(sys, "argv", argv)
    bench_demo_onpolicy.main()
    payload = json.loads(out.read_text())
    rows = {r["name"]: r for r in payload["rows"]}
    assert set(rows) == {"0.2's way", "batched (default)", "online (floor)"}
    assert rows["online (floor)"]["generate_calls"] == 0 and rows["0.2's way"]["generate_calls"] > 0
    assert rows["0.2's way"]["generate_calls"] == rows["batched (default)"]["generate_calls"]  # one micro-batch a step
    assert payload["speedup"] == rows["0.2's way"]["train_s"] / rows["batched (default)"]["train_s"]
    assert payload["accumulation"] == accumulation
    if accumulation == 1:  # one call each, one seed: generate() (0.2's way) and the lean loop sample the same tokens
        assert rows["0.2's way"]["train_loss"] == rows["batched (default)"]["train_loss"]
