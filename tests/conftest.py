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
