"""The several-teachers demo: the corpus split, and (slow) the quick demo's table."""

import pytest

import liger_patch_kd.models as M
from liger_patch_kd.demo.multi_teacher import HALVES, run_multi_teacher_demo, split_corpus
from liger_patch_kd.demo.toys import load_corpus


def test_the_corpus_splits_into_two_halves_by_the_clause_marker():
    text = load_corpus()
    halves = split_corpus(text)
    assert set(halves) == set(HALVES)
    assert all(s.split()[0] in ("When", "At", "After", "In", "Before", "Under") for s in halves["clauses"].split(". "))
    sizes = [len(halves[h]) for h in HALVES]
    assert min(sizes) > 0.3 * sum(sizes)  # two halves, not a sliver
    assert sum(sizes) >= len(text.replace("\n", " ")) - text.count("\n") - 1  # no sentence lost


@pytest.mark.slow  # trains three teachers and five students (about 3 minutes on one core)
def test_quick_demo_routed_student_learns_both_halves():
    try:
        rows = {r["recipe"]: r for r in run_multi_teacher_demo(quick=True, device="cpu")}
    finally:
        M.revert_kd_patch()
    routed, ce_only = rows["routed to its half's teacher"], rows["CE only"]
    for half in HALVES:  # distilled from its half's teacher: closer to it than CE alone gets
        assert routed[f"kl_{half}"] < ce_only[f"kl_{half}"], (half, routed, ce_only)
