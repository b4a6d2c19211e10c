"""The house rules of tools/check_layout.py hold for the whole package."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_layout_has_no_problem():
    spec = importlib.util.spec_from_file_location("check_layout", ROOT / "tools" / "check_layout.py")
    check_layout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_layout)
    problems = check_layout.check(ROOT)
    assert not problems, "\n".join(problems)
