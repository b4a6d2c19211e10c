"""generation.decode_kernel.rope_write_attend: RoPE of the query and the new key, the new key and value written into
the cache at the slot, and attention over the cache with them, in one launch, equal the three steps it replaces
(ops.rope's rotation, the slot write, decode_attention) and attention in float64: for one split and several, a slot
in any split (its first or last column, a split boundary), a slot the row does not attend to, a slot outside the
cache (nothing written), grouped and plain heads, a head size whose half is no power of two, cos / sin per row or
shared, a query that is a strided view of a fused q/k/v output, and NaN in cache columns nobody attends to."""

import re

import pytest
import torch

from liger_patch_kd.generation.decode_kernel import BLOCK_N, rope_write_attend, split_count
from liger_patch_kd.ops.rope import rope_torch

from .helpers import DEVICE
from .test_decode_attention import _reference

pytestmark = pytest.mark.usefixtures("clean_patches")

ON_GPU = DEVICE.type == "cuda"
EXACT = torch.float32 if ON_GPU else torch.float64  # Triton lowers no float64 product of 128 columns on a GPU
TIGHT = dict(rtol=2e-5, atol=2e-5) if ON_GPU else dict(rtol=1e-12, atol=1e-12)


def _case(batch, heads, kv_heads, dim, length, slot, *, shared_table=False, dtype=EXACT, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a fused q/k/v output (batch, (H + 2 H_kv) d): the query, key and value are strided views of it
    fused = torch.randn(batch, (heads + 2 * kv_heads) * dim, generator=g, dtype=torch.float64)
    keys, values = (torch.randn(batch, kv_heads, length, dim, generator=g, dtype=torch.float64) for _ in range(2))
    angle = torch.rand(1 if shared_table else batch, dim // 2, generator=g, dtype=torch.float64) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    attend = torch.rand(batch, length, generator=g) < 0.7
    attend[:, length // 3] = True
    if 0 <= slot < length:
        attend[:, slot] = True
    attend[0, : max(0, slot - 2)] = False  # a long left padding: the first blocks unread
    if 0 <= slot < length:
        keys[:, :, slot] = float("nan")  # the slot's column before the write: never read
    keys[~attend[:, None, :, None].expand_as(keys)] = float("nan")  # columns nobody attends to: never read
    fused, keys, values, cos, sin = (t.to(dtype=dtype, device=DEVICE) for t in (fused, keys, values, cos, sin))
    q, k, v = fused.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    q, k, v = (t.view(batch, -1, dim) for t in (q, k, v))
    return q, k, v, keys, values, cos, sin, attend.to(DEVICE), torch.tensor([slot], device=DEVICE)


def _three_steps(q, k, v, keys, values, cos, sin, attend, slot, scale):
    """What the fused launch replaces: the rotation (ops.rope's torch path), the slot write, attention in float64."""
    q_rot, k_rot = rope_torch(q[:, :, None], k[:, :, None], cos[:, None], sin[:, None])
    keys, values = keys.clone(), values.clone()
    if 0 <= slot < keys.shape[2]:
        keys[:, :, slot], values[:, :, slot] = k_rot[:, :, 0], v
    seen = attend[:, None, None, :]
    out = _reference(q_rot.double(), keys.nan_to_num().double(), values.nan_to_num().double(), seen, scale)
    return out, keys, values


@pytest.mark.parametrize(
    "batch, heads, kv_heads, dim, length, slot",
    [
        (3, 8, 2, 16, 11, 7),  # one split
        (2, 4, 4, 8, 3 * BLOCK_N + 5, 3 * BLOCK_N + 4),  # plain heads, the slot in the last column
        (2, 6, 2, 24, 3 * BLOCK_N, BLOCK_N),  # a split boundary; half of 24 is no power of two
        (2, 8, 2, 16, 2 * BLOCK_N + 7, 0),  # the first column
        (1, 4, 2, 64, 300, 150),
        (5, 32, 8, 64, 200, 120),
    ],
)
@pytest.mark.parametrize("shared_table", [False, True])
def test_one_launch_is_rope_then_the_slot_write_then_attention(batch, heads, kv_heads, dim, length, slot,
                                                              shared_table):  # fmt: skip
    q, k, v, keys, values, cos, sin, attend, slot_t = _case(batch, heads, kv_heads, dim, length, slot,
                                                            shared_table=shared_table)  # fmt: skip
    want, want_keys, want_values = _three_steps(q, k, v, keys, values, cos, sin, attend, slot, 0.3)
    out = rope_write_attend(q, k, v, keys, values, slot_t, cos, sin, attend, 0.3)
    assert out.shape == (batch, 1, heads, dim) and out.dtype == EXACT
    torch.testing.assert_close(out.double(), want, **TIGHT)
    # the new column as the rotation writes it; every other column as it was (NaN included)
    torch.testing.assert_close(keys[:, :, slot], want_keys[:, :, slot], **TIGHT)
    assert torch.equal(values, want_values)
    others = torch.arange(length, device=DEVICE) != slot
    assert torch.equal(keys[:, :, others].isnan(), want_keys[:, :, others].isnan())
    assert torch.equal(keys[:, :, others].nan_to_num(), want_keys[:, :, others].nan_to_num())


def test_the_splits_are_several_where_the_cache_is_long():
    """The cases above reach the merge: several splits on this device for the long caches."""
    assert split_count(2 * 2, 3 * BLOCK_N, DEVICE) > 1


def test_a_slot_the_row_does_not_attend_to_is_written_and_not_attended():
    q, k, v, keys, values, cos, sin, attend, slot_t = _case(2, 8, 2, 16, 2 * BLOCK_N, 40, seed=3)
    attend[1, 40] = False
    want, want_keys, _ = _three_steps(q, k, v, keys, values, cos, sin, attend, 40, 0.25)
    out = rope_write_attend(q, k, v, keys, values, slot_t, cos, sin, attend, 0.25)
    torch.testing.assert_close(out.double(), want, **TIGHT)
    torch.testing.assert_close(keys[:, :, 40], want_keys[:, :, 40], **TIGHT)


@pytest.mark.parametrize("slot", [-1, 2 * BLOCK_N])
def test_a_slot_outside_the_cache_writes_nothing(slot):
    q, k, v, keys, values, cos, sin, attend, slot_t = _case(2, 8, 2, 16, 2 * BLOCK_N, slot, seed=4)
    before = keys.clone(), values.clone()
    out = rope_write_attend(q, k, v, keys, values, slot_t, cos, sin, attend, 0.25)
    assert torch.equal(keys.nan_to_num(), before[0].nan_to_num()) and torch.equal(values, before[1])
    want, _, _ = _three_steps(q, k, v, keys, values, cos, sin, attend, slot, 0.25)
    torch.testing.assert_close(out.double(), want, **TIGHT)


def test_bf16_is_the_three_steps_at_bf16_rounding():
    """bf16 inputs: the rotation rounded to bf16 once (as ops.rope's kernel), products accumulated in float32."""
    q, k, v, keys, values, cos, sin, attend, slot_t = _case(3, 8, 2, 64, 2 * BLOCK_N, 77, dtype=torch.bfloat16)
    want, want_keys, _ = _three_steps(*(t.double() if t.is_floating_point() else t
                                        for t in (q, k, v, keys, values, cos, sin, attend)), 77, 0.125)  # fmt: skip
    out = rope_write_attend(q, k, v, keys, values, slot_t, cos, sin, attend, 0.125)
    assert out.dtype == torch.bfloat16
    # one bf16 rounding of the rotation, of the probabilities and of the output: a few 2^-8 relative
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(keys[:, :, 77].double(), want_keys[:, :, 77], rtol=2**-8, atol=1e-2)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "key": a["key"][:, :1]}, "key / value (batch, H_kv, d)"),
        (lambda a: {**a, "cos": a["cos"][:, :4]}, "cos / sin (batch or 1, d)"),
        (lambda a: {**a, "slot": a["slot"].int()}, "slot as a one-element int64"),
        (lambda a: {**a, "mask": a["mask"].long()}, "boolean mask"),
        (lambda a: {**a, "value": a["value"].float()}, "one dtype"),
        (lambda a: {**a, "cos": a["cos"].long()}, "of one float dtype"),
        (lambda a: {**a, "sin": a["sin"].float()}, "of one float dtype"),
        (lambda a: {**a, "query": a["query"][None]}, "a floating-point query (batch, H, d)"),
        (lambda a: {k: v.long() if k in ("query", "key", "value", "keys", "values") else v for k, v in a.items()},
         "a floating-point query"),
        (lambda a: {**a, "mask": a["mask"].to("meta")}, "on the query's device"),
    ],
)
def test_bad_inputs_are_one_line_naming_them(change, message):
    q, k, v, keys, values, cos, sin, attend, slot_t = _case(2, 8, 2, 16, 40, 7, dtype=torch.float64)
    args = dict(query=q, key=k, value=v, keys=keys, values=values, slot=slot_t, cos=cos, sin=sin, mask=attend,
                scale=0.5)  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(message)):
        rope_write_attend(**change(args))
