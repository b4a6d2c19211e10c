"""The context-distillation demo (demo/context_distill.py) at a toy size: its rows, its evaluation, its choice."""

import tempfile

import pytest
import torch

import liger_patch_kd.models as M
from liger_patch_kd.cli import build_parser
from liger_patch_kd.demo import CharTokenizer, build_model, load_corpus
from liger_patch_kd.demo.context_distill import (
    GRID,
    ContextDemoSizes,
    evaluate,
    rows_of,
    run_context_demo,
    sentences,
    teacher_side,
)  # fmt: skip

pytestmark = pytest.mark.usefixtures("clean_patches")


def test_rows_give_the_teacher_the_previous_sentence_and_evaluate_pairs_them():
    text = load_corpus()
    tok, sents = CharTokenizer(text), sentences(text)[:6]
    rows, plain = rows_of(tok, sents), rows_of(tok, sents, hint=False)
    assert len(rows) == 5
    completion = tok.encode(sents[1]) + [2]
    assert rows[0]["labels"] == [-100] + completion
    assert rows[0]["teacher_input_ids"] == [1] + tok.encode(sents[0] + " ") + completion
    assert plain[0]["teacher_input_ids"] == rows[0]["input_ids"]
    model = build_model(len(tok), 32, 1, seed=0, device=torch.device("cpu"))
    other = build_model(len(tok), 32, 1, seed=1, device=torch.device("cpu"))
    # a model against itself reading the same rows: KL 0 exactly where the pairing is right
    assert evaluate(model, model, plain, "cpu")[1] == pytest.approx(0, abs=1e-6)
    assert evaluate(model, model, rows, "cpu")[1] > 1e-6  # the hint changes the teacher's predictions
    ce, kl = evaluate(model, other, rows, "cpu")
    assert 0 < ce < 10 and kl > 0
    own = teacher_side(rows)  # the teacher's rows scored: the same completion tokens, after the hint
    assert [[t for t in r["labels"] if t != -100] for r in own] == [r["labels"][1:] for r in rows]
    assert evaluate(model, model, own, "cpu")[0] != ce


@pytest.mark.slow  # trains a teacher and seven students, if for a few steps each
def test_the_demo_runs_chooses_on_validation_and_cleans_up(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sizes = ContextDemoSizes(teacher_steps=3, student_steps=2, batch=4, seeds=(1,), grid=GRID[:2])
    out = run_context_demo("cpu", sizes)
    M.revert_kd_patch()
    assert out["chosen"] == min(out["validation"], key=out["validation"].get)
    assert list(out["rows"])[0] == "CE only" and len(out["rows"]) == 3
    assert all(0 < r["held_out_ce_by_seed"][0] < 10 for r in out["rows"].values())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("liger_kd_context_")]
    assert build_parser().parse_args(["demo", "--context", "--quick"]).context
