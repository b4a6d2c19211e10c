"""torch.compile of a patched model: the fused loss is a clean graph break, shapes may change between calls,
and mixed precision (autocast) does not trip it."""

import copy

import pytest
import torch

import liger_patch_kd.models as M

from .tiny_models import VOCAB, tiny_model


@pytest.fixture(autouse=True)
def _clean_patches():
    yield
    M.revert_kd_patch()
    torch._dynamo.reset()


def _batch(batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return ids, ids.clone()


def test_compiled_patched_model_matches_eager_with_changing_shapes_under_autocast():
    teacher = tiny_model("llama", dtype=torch.float32, seed=2)
    eager = M.apply_kd_patch_to_llama(model=tiny_model("llama", dtype=torch.float32, seed=1))
    compiled_model = M.apply_kd_patch_to_llama(model=copy.deepcopy(eager))
    compiled = torch.compile(compiled_model, backend="aot_eager")
    for batch, seq, seed in ((2, 13, 0), (3, 9, 1), (1, 17, 2)):  # a new micro-batch shape each call
        ids, labels = _batch(batch, seq, seed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = eager(input_ids=ids, labels=labels, teacher_model=teacher).loss
            got = compiled(input_ids=ids, labels=labels, teacher_model=teacher).loss
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=1e-3)
        got.backward()
        expected.backward()
    for p, q in zip(compiled_model.parameters(), eager.parameters()):
        assert torch.isfinite(p.grad).all()
        assert float((p.grad - q.grad).norm() / q.grad.norm().clamp(min=1e-12)) < 5e-2
