"""What a fresh environment gets from the README's install command is enough for the test suite.

CI builds a new virtual environment and installs `-e ".[test]"`; a module the tests import that neither the
package's requirements nor the `test` extra pulls in (directly or through another requirement) passes on a machine
where someone installed it by hand and fails on a fresh one. This check walks the declared requirement graph, so it
fails here, on the machine that has the module, before CI does.
"""

import ast
import configparser
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
LOCAL = {"tests", "liger_patch_kd", "benchmarks"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared_requirements() -> list[Requirement]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config.get("options", "install_requires").splitlines()
    lines += config.get("options.extras_require", "test").splitlines()
    return [Requirement(line.strip()) for line in lines if line.strip()]


def _reachable_distributions() -> set[str]:
    """Every distribution the declared requirements pull in, following each installed distribution's own
    requirements with the extras asked for (markers evaluated for this interpreter)."""
    reached: set[str] = set()
    pending = [(req, frozenset(req.extras)) for req in _declared_requirements()]
    while pending:
        req, extras = pending.pop()
        name = _canonical(req.name)
        if name in reached:
            continue
        reached.add(name)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue  # declared but not installed here: nothing below it can be followed
        for line in requires:
            child = Requirement(line)
            if child.marker is not None:
                if not any(child.marker.evaluate({**default_environment(), "extra": extra}) for extra in extras | {""}):
                    continue
            pending.append((child, frozenset(child.extras)))
    return reached


def _imported_top_level_modules() -> dict[str, str]:
    seen: dict[str, str] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in LOCAL:
                    seen.setdefault(top, path.name)
    return seen


def test_every_module_the_tests_import_comes_with_the_test_extra():
    providers = metadata.packages_distributions()
    reachable = _reachable_distributions()
    missing = []
    for module, first_file in sorted(_imported_top_level_modules().items()):
        distributions = {_canonical(d) for d in providers.get(module, [])}
        if not distributions & reachable:
            missing.append(f"{module} (imported by tests/{first_file}; provided by {sorted(distributions) or '?'})")
    assert not missing, "add to the test extra in setup.cfg, or skip the test naming its extra: " + "; ".join(missing)


def test_the_check_sees_a_module_nothing_declares(tmp_path, monkeypatch):
    """The walk is not vacuous: a module provided by no declared distribution is reported."""
    (tmp_path / "setup.cfg").write_text((ROOT / "setup.cfg").read_text())
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("import surely_not_a_declared_module\nimport torch\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert set(_imported_top_level_modules()) == {"surely_not_a_declared_module", "torch"}
    assert "torch" in _reachable_distributions()
    assert "surely-not-a-declared-module" not in _reachable_distributions()
