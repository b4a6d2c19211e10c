"""utils.seeding.seeded: inside, the CPU's (and the given CUDA devices') generators are where torch.manual_seed puts
them, so a seeded sampling call draws what it drew under manual_seed; outside, the caller's state is as it was."""

import torch

from liger_patch_kd.utils.seeding import seeded

from .helpers import DEVICE


def test_inside_the_generators_are_manual_seeds_and_outside_the_callers():
    devices = [DEVICE] if DEVICE.type == "cuda" else []
    torch.manual_seed(123)
    torch.rand(3)  # the caller's state: somewhere past its seed
    before = torch.get_rng_state()
    with seeded(7, devices):
        got = (torch.rand(4), torch.rand(2, device=DEVICE))
    assert torch.equal(torch.get_rng_state(), before)
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(7)
        want = (torch.rand(4), torch.rand(2, device=DEVICE))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_an_exception_inside_puts_the_state_back():
    before = torch.get_rng_state()
    try:
        with seeded(3):
            torch.rand(5)
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert torch.equal(torch.get_rng_state(), before)


def test_a_numpy_integer_seeds_as_the_int_does():
    import numpy as np

    with seeded(np.int64(11)):
        got = torch.rand(3)
    with seeded(11):
        want = torch.rand(3)
    assert torch.equal(got, want)
