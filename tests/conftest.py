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
