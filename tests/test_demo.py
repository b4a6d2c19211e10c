"""The demo in its reduced mode: it runs, and distillation beats CE alone on KL to the teacher."""

import liger_patch_kd.models as M
from liger_patch_kd.demo import run_demo


def test_quick_demo_distilled_students_beat_ce_only():
    try:
        results = {r["recipe"]: r for r in run_demo(quick=True, device="cpu")}
    finally:
        M.revert_kd_patch()
    ce_only = results.pop("CE only")
    on_policy = next(r for name, r in results.items() if name.startswith("on-policy"))
    for name, r in results.items():
        if r is on_policy:  # trains on its own samples: judged there
            assert r["kl_own_samples"] < ce_only["kl_own_samples"], (name, r, ce_only)
        else:
            assert r["kl_to_teacher"] < ce_only["kl_to_teacher"], (name, r, ce_only)
