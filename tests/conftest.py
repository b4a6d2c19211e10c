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
    appends "seconds phase:outcome nodeid" to that file as it ends, from every xdist worker: a suite cut short by a
    time limit still says where its time went."""
    path = os.environ.get("KD_TEST_TIMES")
    if path and (report.duration > 0.5 or report.outcome != "passed"):
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f} {report.when}:{report.outcome} {report.nodeid}\n")
