"""The demo in its short mode: it runs, distillation beats CE alone on KL to the teacher, the Trainer's own printing
stays quiet, and it leaves no temporary folder behind; `liger-kd demo` is the short run, `--full` the long one."""

import tempfile

import pytest

import liger_patch_kd.models as M
from liger_patch_kd import cli
from liger_patch_kd.demo import run_demo


@pytest.mark.slow  # trains a teacher and six students: the suite's longest test on a CPU
def test_quick_demo_distilled_students_beat_ce_only(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the demo's temporary folder goes
    try:
        rows = run_demo(quick=True, device="cpu", cross_tokenizer=True)
    finally:
        M.revert_kd_patch()
    printed = capsys.readouterr().out
    assert "{'loss'" not in printed and "train_runtime" not in printed and "it/s]" not in printed, printed
    assert all(f"[{k}/5]" in printed for k in range(1, 6))
    # torch's own caches (torchinductor_<user>) may appear under the temporary directory too: not the demo's
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("liger_kd_demo_"))
    assert left == [], f"the demo removes the temporary folder it made: {left}"
    assert all(r["seeds"] == [1] and len(r["held_out_ce_by_seed"]) == 1 for r in rows if not r.get("cross_tokenizer"))
    results = {r["recipe"]: r for r in rows if not r.get("cross_tokenizer")}
    across = {r["recipe"]: r for r in rows if r.get("cross_tokenizer")}
    assert set(across) == {"BPE student: CE only", "BPE student: CE + 2 x byte-chain KD"}
    assert all(0 < r["held_out_ce"] < 5 and len(r["held_out_ce_by_seed"]) == 1 for r in across.values())
    assert all(0 < r["teacher_nll"] < 10 and r["kl_samples"] > 0 for r in results.values())
    ce_only = results.pop("CE only")
    on_policy = next(r for name, r in results.items() if name.startswith("on-policy"))
    for name, r in results.items():
        if r is on_policy:  # trains on sampled text: judged there (every student's samples, pooled)
            assert r["kl_samples"] < ce_only["kl_samples"], (name, r, ce_only)
        else:
            assert r["kl_to_teacher"] < ce_only["kl_to_teacher"], (name, r, ce_only)


def test_the_command_runs_the_short_demo_and_full_the_long_one(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr("liger_patch_kd.demo.run_demo", lambda **kw: calls.append(kw))
    assert cli.main(["demo", "--device", "cpu"]) == 0 and cli.main(["demo", "--full", "--device", "cpu"]) == 0
    assert cli.main(["demo", "--quick", "--device", "cpu"]) == 0  # the short run too: scripts that pass it still run
    assert [c["quick"] for c in calls] == [True, False, True]
    assert cli.main(["demo", "--quick", "--full"]) == 2
    assert "--quick and --full" in capsys.readouterr().err


@pytest.mark.parametrize("accumulation", [1, 2])
def test_demo_onpolicy_benchmark_tiny(tmp_path, monkeypatch, accumulation):
    """benchmarks/onpolicy/bench_demo_onpolicy --tiny: every row trains, the on-policy rows generate once per
    generated step, the online floor never, and the JSON holds the speedup it prints."""
    import json
    import sys

    from benchmarks.onpolicy import bench_demo_onpolicy

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
