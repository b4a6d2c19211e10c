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
    tested: the sampled loss's first GPU run failed that way (benchmarks/results/sampled_gpu_tests.log), which
    no CPU run can show, as DEVICE is the CPU there."""
    offenders = [
        path.name
        for path in sorted((ROOT / "tests").glob("test_*.py"))
        if "backends()" in (text := path.read_text()) and "DEVICE" not in text
    ]
    assert not offenders, f"run over backends() without helpers.DEVICE: {offenders}"
