"""Sessions are kept in a WeakKeyDictionary keyed by the model, so that a model's sessions (KV caches, cast weight
copies) go with it. A session with kernels=False ran the model itself and held it strongly: the value kept its key
alive, and neither the model nor its sessions were ever freed."""

import gc
import weakref

import pytest
import torch

from liger_patch_kd.generation import Sampling, decode, release_sessions
from liger_patch_kd.generation import engine

from ..test_generation import _model, _prompts

pytestmark = pytest.mark.usefixtures("clean_patches")


@pytest.mark.parametrize("kernels", [True, False])
def test_a_dropped_model_takes_its_sessions_with_it(kernels):
    release_sessions()
    model = _model("llama", torch.float32, seed=2)
    ids, mask = _prompts()
    decode(model, ids, mask, max_new_tokens=2, sampling=Sampling(), pad_id=0, capture="eager", kernels=kernels)
    assert len(engine.sessions_of(model)) == 1
    alive = weakref.ref(model)
    del model
    gc.collect()
    try:
        assert alive() is None, "the kept session keeps the model alive"
        assert len(engine._SESSIONS) == 0
    finally:
        release_sessions()
