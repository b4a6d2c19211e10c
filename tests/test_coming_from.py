"""The pages for users of TRL and Liger-Kernel keep up with them: every field TRL's GKDConfig and DistillationConfig
add to TrainingArguments (and the SFTConfig fields GKDConfig inherits) has a row in docs/coming-from-trl.md, so a
field TRL adds fails here until the page says what it maps to; every option named as ours exists."""

import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "coming-from-trl.md"


def table_rows(text: str, heading: str) -> dict[str, str]:
    """{first-column name: second column} of the table under `### heading`."""
    section = text.split(f"### {heading}", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`(\w+)`", cells[0]) if len(cells) >= 2 else None
        if match:
            rows[match.group(1)] = cells[1]
    return rows


def own_fields(cls, base) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} - {f.name for f in dataclasses.fields(base)}


def test_every_trl_distillation_field_has_a_row():
    pytest.importorskip("trl")
    from transformers import TrainingArguments
    from trl import DistillationConfig, SFTConfig
    from trl.experimental.gkd import GKDConfig

    text = PAGE.read_text()
    expected = {
        "`GKDConfig` (its own fields)": own_fields(GKDConfig, SFTConfig),
        "`SFTConfig` fields (inherited by `GKDConfig`)": own_fields(SFTConfig, TrainingArguments),
        "`DistillationConfig` fields": own_fields(DistillationConfig, TrainingArguments),
    }
    for heading, fields in expected.items():
        rows = table_rows(text, heading)
        assert fields, heading
        inherited = {f.name for f in dataclasses.fields(TrainingArguments)}  # rows for defaults TRL overrides
        missing, stale = sorted(fields - set(rows)), sorted(set(rows) - fields - inherited)
        assert not missing, f"{heading}: TRL's fields {missing} have no row in {PAGE.name}"
        assert not stale, f"{heading}: rows {stale} are not TRL fields (any more)"


def test_the_options_named_as_ours_exist():
    from liger_patch_kd.train_cli.parser import build_parser

    flags = {s for action in build_parser()._actions for s in action.option_strings}
    named = set(re.findall(r"`(kd_\w+)", PAGE.read_text())) | set(re.findall(r"`(--[\w]+)", PAGE.read_text()))
    unknown = sorted(n for n in named if (n if n.startswith("--") else f"--{n}") not in flags
                     and n not in ("--lmbda", "--beta", "--seq_kd", "--max_new_tokens", "--max_completion_length",
                                   "--temperature", "--max_length", "--config"))  # fmt: skip
    assert not unknown, f"{PAGE.name} names options that do not exist: {unknown}"
