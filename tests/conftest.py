"""Test setup. Without a GPU the Triton kernels run through the Triton interpreter, which reads
TRITON_INTERPRET when the kernels are defined: set it before anything imports liger_patch_kd."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def clean_patches():
    """Undo every patch a test made (classes, instances, teachers), so the next test starts from plain models.
    Test files that patch opt in with `pytestmark = pytest.mark.usefixtures("clean_patches")`."""
    yield
    from liger_patch_kd.models import revert_kd_patch  # imported late: TRITON_INTERPRET is set above first

    revert_kd_patch()


def pytest_runtest_logreport(report):
    """With KD_TEST_TIMES=path, each test phase (setup / call / teardown) that fails or takes over half a second
    appends "seconds phase:outcome nodeid" to that file as it ends, and a failure's last lines to path.failures: a
    suite cut short by a time limit (a GPU run) still says where its time went and why tests failed. Written once,
    by xdist's controller (or the only process)."""
    path = os.environ.get("KD_TEST_TIMES")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.duration > 0.5 or report.outcome != "passed":
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f} {report.when}:{report.outcome} {report.nodeid}\n")
    if report.failed:
        tail = "\n".join(report.longreprtext.splitlines()[-40:])
        with open(path + ".failures", "a") as f:
            f.write(f"=== {report.when} {report.nodeid}\n{tail}\n")


def pytest_collection_modifyitems(items):
    """With KD_TEST_ORDER=path (a KD_TEST_TIMES file of an earlier run), the slowest tests run first, so that
    parallel workers end together instead of waiting on one long test at the end."""
    path = os.environ.get("KD_TEST_ORDER")
    if not path or not os.path.exists(path):
        return
    seconds: dict[str, float] = {}
    for line in open(path):
        duration, _, nodeid = line.rstrip("\n").split(" ", 2)
        seconds[nodeid] = seconds.get(nodeid, 0.0) + float(duration)
    items.sort(key=lambda item: -seconds.get(item.nodeid, 0.0))
