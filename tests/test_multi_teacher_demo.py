"""The several-teachers demo's corpus split (the demo itself runs through KDTrainer's routed path, which
tests/test_multi_teacher_trainer.py checks against the reference; a run takes minutes, too long for the suite)."""

from liger_patch_kd.demo.multi_teacher import HALVES, split_corpus
from liger_patch_kd.demo.toys import load_corpus


def test_the_corpus_splits_into_two_halves_by_the_clause_marker():
    text = load_corpus()
    halves = split_corpus(text)
    assert set(halves) == set(HALVES)
    assert all(s.split()[0] in ("When", "At", "After", "In", "Before", "Under") for s in halves["clauses"].split(". "))
    sizes = [len(halves[h]) for h in HALVES]
    assert min(sizes) > 0.3 * sum(sizes)  # two halves, not a sliver
    assert sum(sizes) >= len(text.replace("\n", " ")) - text.count("\n") - 1  # no sentence lost
