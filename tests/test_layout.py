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


def test_files_run_over_both_backends_build_their_data_on_the_device():
    """A test file parametrised over helpers.backends() must put its tensors on helpers.DEVICE. On a GPU machine
    the interpreter is off, so CPU tensors with backend="triton" are refused and the compiled kernel is never
    tested: the sampled loss's first GPU run failed that way (benchmarks/results/sampled_gpu_tests.log, in git at
    f966e27), which no CPU run can show, as DEVICE is the CPU there."""
    offenders = [
        path.name
        for path in sorted((ROOT / "tests").glob("test_*.py"))
        if "backends()" in (text := path.read_text()) and "DEVICE" not in text
    ]
    assert not offenders, f"run over backends() without helpers.DEVICE: {offenders}"


def _check_layout():
    spec = importlib.util.spec_from_file_location("check_layout", ROOT / "tools" / "check_layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_between_files_of_one_package_is_reported(tmp_path):
    """Files of one room importing each other (one only for its type, one through its package's re-export) form a
    cycle; the check used to see none of these (issue 39: arguments -> served -> arguments)."""
    _write(tmp_path, {
        "liger_patch_kd/__init__.py": "",
        "liger_patch_kd/trainer/__init__.py": "from .settings import Settings\n",
        "liger_patch_kd/trainer/settings.py": "from .served import check\n\nclass Settings:\n    pass\n",
        "liger_patch_kd/trainer/served.py": (
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .settings import Settings\n\n"
            "def check(args: 'Settings') -> None:\n    pass\n"
        ),
        "liger_patch_kd/models/__init__.py": "from .heads import head\n",
        "liger_patch_kd/models/heads.py": "from .state import unwrap\n\ndef head():\n    return unwrap\n",
        "liger_patch_kd/models/state.py": "def unwrap():\n    from ..models import head\n    return head\n",
        "liger_patch_kd/models/fine.py": "from .state import unwrap\n",
    })  # fmt: skip
    problems = _check_layout().check(tmp_path, benchmarks=None)
    assert problems == [
        "import cycle: liger_patch_kd.models.heads -> liger_patch_kd.models.state",
        "import cycle: liger_patch_kd.trainer.served -> liger_patch_kd.trainer.settings",
    ], problems


def test_the_client_and_the_server_importing_each_other_are_reported(tmp_path):
    """The server sits above teacher/, so the layers alone let it import the client; APART refuses that, and the
    client importing the server, even for a type only (which the layer rules skip)."""
    _write(tmp_path, {
        "liger_patch_kd/__init__.py": "",
        "liger_patch_kd/wire/__init__.py": "",
        "liger_patch_kd/wire/formats.py": "",
        "liger_patch_kd/teacher/__init__.py": "",
        "liger_patch_kd/teacher/client/__init__.py": "",
        "liger_patch_kd/teacher/client/client.py": "from ...wire import formats\n",
        "liger_patch_kd/teacher/client/hints.py": (
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from ...server.limits import Limits\n"
        ),
        "liger_patch_kd/server/__init__.py": "",
        "liger_patch_kd/server/limits.py": "from ..wire.formats import *\n",
        "liger_patch_kd/server/app.py": "from ..teacher.client.client import API_KEY_ENV\nfrom .limits import *\n",
    })  # fmt: skip
    problems = _check_layout().check(tmp_path, benchmarks=None)
    assert problems == [
        "liger_patch_kd/server/app.py:1: imports liger_patch_kd.teacher.client.client: server and teacher.client "
        "never import each other (they meet in wire/)",
        "liger_patch_kd/teacher/client/hints.py:4: imports liger_patch_kd.server.limits: teacher.client and server "
        "never import each other (they meet in wire/)",
    ], problems


def test_benchmarks_importing_each_other_and_a_crowded_folder_are_reported(tmp_path):
    check_layout = _check_layout()
    _write(tmp_path, {
        "liger_patch_kd/__init__.py": "",
        **{f"liger_patch_kd/ops/op{i}.py": "" for i in range(check_layout.MAX_MODULES + 1)},
        "benchmarks/__init__.py": "",
        "benchmarks/common.py": "",
        "benchmarks/bench_a.py": "from .bench_b import run\nfrom .common import *\n",
        "benchmarks/bench_b.py": "def run():\n    from benchmarks import bench_a\n",
        "benchmarks/bench_c.py": "from .common.steps import step\n",
        "benchmarks/common/steps.py": "from . import cuda_time\n",
        "benchmarks/loss/__init__.py": "",
        "benchmarks/loss/bench_d.py": "from ..training.bench_e import run\n",  # a room's benchmark is one too
        "benchmarks/training/__init__.py": "",
        "benchmarks/training/bench_e.py": "def run():\n    pass\n",
        **{f"benchmarks/teachers/bench_t{i}.py": "" for i in range(check_layout.MAX_MODULES + 1)},
    })  # fmt: skip
    problems = check_layout.check(tmp_path)
    assert problems == [
        f"liger_patch_kd/ops/: {check_layout.MAX_MODULES + 1} modules (limit {check_layout.MAX_MODULES}): give its "
        f"jobs rooms",
        f"benchmarks/teachers/: {check_layout.MAX_MODULES + 1} modules (limit {check_layout.MAX_MODULES}): give its "
        f"jobs rooms",
        "benchmarks/bench_a.py:1: imports the benchmark benchmarks.bench_b: move what they share to benchmarks/common",
        "benchmarks/bench_b.py:2: imports the benchmark benchmarks.bench_a: move what they share to benchmarks/common",
        "benchmarks/loss/bench_d.py:1: imports the benchmark benchmarks.training.bench_e: move what they share to "
        "benchmarks/common",
        "import cycle between benchmarks: benchmarks.bench_a -> benchmarks.bench_b",
    ], problems
