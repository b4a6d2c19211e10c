"""generation.rotary_table: a decode session's cos / sin looked up from a table its rotary module made once. The
table holds, to the bit, what the module computes for any positions (every rope type whose frequencies do not
follow the length, every dtype); length-dependent types and modules that compute anything else keep their own
forward; decode through the table samples what it samples through the module; the user's module is untouched."""

import pytest
import torch

from liger_patch_kd.generation import Sampling, decode, release_sessions
from liger_patch_kd.generation import engine as engine_module
from liger_patch_kd.generation.rotary_table import RotaryTable, install_rotary_tables

from .helpers import DEVICE
from .test_generation import _model, _prompts
from .tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")
ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},  # attention scaling != 1
}  # fmt: skip


def _rotary(rope: dict):
    model = tiny_model("llama", seed=2, hidden=96, rope_scaling={**rope, "rope_theta": 10000.0})
    return model.model.rotary_emb


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_table_holds_what_the_module_computes_for_any_positions(rope, dtype):
    module = _rotary(ROPES[rope])
    table = RotaryTable(module, length=200)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 96, dtype=dtype, generator=g).to(dtype)
    for positions in (torch.arange(5).expand(3, 5), torch.randint(0, 200, (3, 5), generator=g), torch.tensor([[7]])):
        got, want = table.forward(x, positions), module(x, positions)
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype == dtype
            assert torch.equal(a, b)
    assert not table.refused and set(table.tables) == {dtype}


def test_rope_types_that_follow_the_length_keep_their_forward():
    """"dynamic" rescales its frequencies past the trained length: one table could not hold every step's."""
    model = tiny_model("llama", seed=2, hidden=96, rope_scaling={"rope_type": "dynamic", "factor": 2.0,
                                                                   "rope_theta": 10000.0})  # fmt: skip
    assert install_rotary_tables(model, 64) == []
    assert "forward" not in model.model.rotary_emb.__dict__


def test_a_module_that_computes_otherwise_keeps_its_own_values():
    """A forward whose values depend on more than the position (here on the batch) fails the check at the first
    forward: every call, that one included, gets the module's own values."""
    module = _rotary(ROPES["default"])
    plain = module.forward

    def batch_dependent(x, position_ids):
        cos, sin = plain(x, position_ids)
        return cos + x.shape[0], sin

    module.forward = batch_dependent
    table = RotaryTable(module, length=32)
    x, positions = torch.randn(2, 4, 96, dtype=torch.float64), torch.arange(4).expand(2, 4)
    for _ in range(2):
        got = table.forward(x, positions)
        assert torch.equal(got[0], batch_dependent(x, positions)[0])
    assert table.refused and not table.tables


def test_positions_of_another_layout_and_extra_arguments_go_to_the_module():
    module = _rotary(ROPES["default"])
    calls = []
    module.forward = lambda *a, **k: calls.append((a, k)) or (a[0], a[0])  # takes any layout
    table = RotaryTable(module, length=32)
    x = torch.randn(2, 4, 96, dtype=torch.float64)
    table.forward(x, torch.arange(4).expand(3, 2, 4))  # (3, rows, T): Qwen-VL's multimodal positions
    table.forward(x, torch.arange(4).expand(2, 4), "full_attention")  # a per-layer-type argument (Gemma-3)
    assert len(calls) == 2 and not table.tables


def test_decode_through_the_table_samples_what_it_samples_through_the_module(monkeypatch):
    """The same tokens and log-probs with and without the tables, EOS ids included; the module's own forward runs
    only to make and check the table (the prefill), never at a step; the user's module is left as it was."""
    model = _model("llama", torch.float64, seed=4).to(DEVICE)
    ids, mask = _prompts(DEVICE)
    calls = []
    own = type(model.model.rotary_emb).forward
    def counted(self, x, position_ids):
        calls.append(position_ids.shape)
        return own(self, x, position_ids)

    monkeypatch.setattr(type(model.model.rotary_emb), "forward", counted)
    runs = []
    for tables in (True, False):
        if not tables:
            monkeypatch.setattr(engine_module, "install_rotary_tables", lambda *a: [])
        release_sessions(model)
        calls.clear()
        torch.manual_seed(5)
        runs.append(decode(model, ids, mask, max_new_tokens=7, sampling=Sampling(), pad_id=0, eos_ids=(3,),
                           capture="eager", logprobs=True))  # fmt: skip
        if tables:
            # the table over the cache's columns, the prefill's own values to check it; nothing per step
            assert len(calls) == 2 and calls[1] == ids.shape
        else:
            assert len(calls) == runs[-1][0].shape[1]  # the prefill and every step
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert "forward" not in model.model.rotary_emb.__dict__
    release_sessions(model)


def _greedy(model, ids, mask):
    return decode(model, ids, mask, max_new_tokens=4, sampling=Sampling(temperature=0.0), pad_id=0, eos_ids=(3,),
                  capture="eager", logprobs=True)  # fmt: skip


def test_a_rotary_module_with_a_rope_type_per_layer_type_decodes_as_before(monkeypatch):
    """Gemma-3's rotary module keeps rope_type as a dict per layer type (and takes the layer type at each call):
    no table, and the engine decodes what it decoded without tables (the install once failed on the dict)."""
    model = _model("gemma3_text", torch.float64, seed=4, layer_types=["full_attention"] * 2, sliding_window=None)
    assert engine_module.decode_applies(model) is None and isinstance(model.model.rotary_emb.rope_type, dict)
    ids, mask = _prompts()
    got = _greedy(model, ids, mask)
    release_sessions(model)
    monkeypatch.setattr(engine_module, "install_rotary_tables", lambda *a: [])
    want = _greedy(model, ids, mask)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    release_sessions(model)


def test_inverse_frequencies_changed_in_place_are_what_a_kept_session_rotates_by_next_call():
    """The twin shares the model's buffers: an in-place change of inv_freq between calls is in the kept session's
    table at the next call (refreshed in place, as a captured step reads it), as in a fresh session's."""
    model = _model("llama", torch.float64, seed=4)
    ids, mask = _prompts()
    _greedy(model, ids, mask)
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.mul_(0.25)
    kept = _greedy(model, ids, mask)
    release_sessions(model)
    fresh = _greedy(model, ids, mask)
    assert torch.equal(kept[0], fresh[0]) and torch.equal(kept[1], fresh[1])
    release_sessions(model)
