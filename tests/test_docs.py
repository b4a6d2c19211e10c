"""The documentation site: its reference pages are what the code gives, and `mkdocs build --strict` passes (every
page in the nav, every link and anchor resolves). The code blocks of the pages run in tests/test_readme.py."""

import difflib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_reference_pages_are_generated_from_the_code():
    """docs/reference/{options,architectures,cli}.md equal what tools/gen_reference.py writes today."""
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "tools" / "gen_reference.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for name, make in tool.PAGES.items():
        committed, generated = (ROOT / "docs" / "reference" / name).read_text(), make()
        diff = "".join(list(difflib.unified_diff(committed.splitlines(True), generated.splitlines(True)))[:20])
        fix = "run python tools/gen_reference.py"
        assert committed == generated, f"docs/reference/{name} is out of date: {fix}\n{diff}"


def test_every_option_is_in_the_options_reference():
    """Belt and braces: each field KDTrainingArguments adds has its own heading (the anchor the guides link to)."""
    import dataclasses

    from transformers import TrainingArguments

    from liger_patch_kd.trainer import KDTrainingArguments

    page = (ROOT / "docs" / "reference" / "options.md").read_text()
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    for f in dataclasses.fields(KDTrainingArguments):
        if f.name not in inherited:
            assert f"\n### `{f.name}`\n" in page, f.name


# `mkdocs build` with torch (and this package) made unimportable: the site must build from docs/requirements.txt alone
MKDOCS_WITHOUT_TORCH = (
    "import sys; sys.modules['torch'] = None; sys.modules['liger_patch_kd'] = None; "
    "from mkdocs.__main__ import cli; sys.exit(cli())"
)


def test_mkdocs_build_strict_without_torch(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs / mkdocs-material not installed (pip install -r docs/requirements.txt)")
    done = subprocess.run(
        [sys.executable, "-c", MKDOCS_WITHOUT_TORCH, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "troubleshooting" / "index.html").exists()


def test_the_docs_requirements_are_the_docs_extra():
    """docs/requirements.txt (the site without the package) and setup.cfg's `docs` extra name the same packages."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extra = {line.strip() for line in cfg["options.extras_require"]["docs"].splitlines() if line.strip()}
    lines = (ROOT / "docs" / "requirements.txt").read_text().splitlines()
    assert {line.strip() for line in lines if line.strip() and not line.startswith("#")} == extra


def test_the_install_steps_put_the_cpu_wheel_first():
    """README and Getting started name the CPU-only torch before the first command that installs the package."""
    for page in (ROOT / "README.md", ROOT / "docs" / "getting-started.md"):
        text = page.read_text()
        cpu = text.find("--index-url https://download.pytorch.org/whl/cpu")
        first_install = min(i for i in (text.find("pip install -e"), text.find("pip install torch==2.13.0 -e"),
                                        text.find('pip install "liger_patch_kd')) if i >= 0)  # fmt: skip
        assert 0 <= cpu < first_install, page.name


def test_the_readme_quick_start_is_what_ci_runs():
    """.ci/run says it installs and tests as the README's quick start does: the two must not drift apart."""
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    install = next(line for line in ci.splitlines() if "pip install torch==" in line)
    install = install.replace("python -m pip", "pip").strip()
    test = next(line for line in ci.splitlines() if line.startswith("python -m pytest")).strip()
    assert f"{install} && {test}" in readme, (install, test)
