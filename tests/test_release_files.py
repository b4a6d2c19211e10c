"""The release files: `python -m build` makes an sdist and a wheel that hold the package data (the demo's corpus)
and the license, declare the `liger-kd` command, and pass `twine check` (the long description renders on PyPI).

The build runs on a copy of the files a build reads, so nothing (build/, *.egg-info) is written into the checkout;
without network access (--no-isolation: the installed setuptools)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ("liger_patch_kd", "README.md", "LICENSE", "setup.cfg", "setup.py", "pyproject.toml")


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    for tool in ("build", "twine"):
        if importlib.util.find_spec(tool) is None:
            pytest.skip(f"`{tool}` is not installed (pip install -e '.[test]' installs it)")
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in BUILD_INPUTS:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--skip-dependency-check", "--outdir",
                           str(out), str(src)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _wheel(dist: Path) -> Path:
    (wheel,) = dist.glob("liger_patch_kd-*.whl")
    return wheel


def test_the_wheel_holds_the_package_data_and_the_license(dist):
    with zipfile.ZipFile(_wheel(dist)) as whl:
        names = whl.namelist()
        corpus = [n for n in names if n.startswith("liger_patch_kd/data/")]
        assert corpus and all(whl.getinfo(n).file_size > 0 for n in corpus), corpus
        assert (ROOT / "liger_patch_kd" / "data" / "corpus.txt").stat().st_size == whl.getinfo(
            "liger_patch_kd/data/corpus.txt"
        ).file_size
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "the license file"
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(whl.read(info).decode())
        entry_points = whl.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "liger-kd = liger_patch_kd.cli:main" in entry_points
    assert meta["Name"] == "liger_patch_kd" and meta["License"] == "Apache-2.0"
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta["Requires-Python"] == ">=3.10"
    classifiers = meta.get_all("Classifier")
    assert any(c.startswith("Programming Language :: Python :: 3.1") for c in classifiers), classifiers
    required = [r.split(";")[0] for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert sorted(r.split("<")[0].split(">")[0] for r in required) == ["accelerate", "torch", "transformers", "triton"]
    assert "# liger_patch_kd" in meta.get_payload()  # the README is the long description


def test_the_sdist_holds_the_package_data(dist):
    (sdist,) = dist.glob("liger_patch_kd-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    assert any(n.endswith("/liger_patch_kd/data/corpus.txt") for n in names)
    assert any(n.endswith("/LICENSE") for n in names)


def test_twine_check_passes(dist):
    files = [str(p) for p in sorted(dist.iterdir())]
    done = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *files], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
