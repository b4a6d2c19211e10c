"""Split-KV decode attention (flash-decoding) for the decode engine's one-token steps, in Triton.

cuDNN's flash kernel, reached through SDPA with the engine's boolean mask, took about a quarter of a decode step at 64
rows, reading every column of the cache whether a row may attend to it or not, after two kernels a layer that turn the
mask into an additive one. This kernel reads the boolean mask itself and reads keys and values only between the first
and the last column its row attends to in its split (not the columns not written yet: on average a quarter of the cache
over a completion; nor a prompt's left padding), and splits the columns of each (row, key/value head) over several
programs so that 8 rows fill the GPU as 64 do.

The attended extent comes from a first pass over the split's mask (1 byte a column, against 4 x head size bytes of
keys and values), so that the main loop has no branch: a loop whose loads sit under an `if` (an earlier version
skipped unattended blocks that way) is not software-pipelined, and its loads wait one after another. Of the block,
warp, stage and split variants timed as CUDA-graph replays, the branch-free loop with 128-column blocks, 4 warps and
2 stages was the fastest at 64 rows and at 8, and faster than the branching one.

Grid: (rows x key/value heads, splits). A program holds the G query heads of one key/value head (padded to 16 rows:
tensor-core products need 16) and runs the online softmax over its split's columns; a second kernel merges the
splits' (running max, sum, weighted values); with one split the program writes the output itself and no merge is
launched. Products accumulate in float32 (float64 for float64 inputs, so the CPU tests compare against float64 SDPA at
float64 rounding); the probabilities are cast to the values' dtype before their product, as flash attention does.
"""

from __future__ import annotations

import functools
import math

import torch

from ..ops.backend import triton_available, triton_interpreted

QUERY_ROWS = 16  # the padded query rows of a program: the least M of a tensor-core product
BLOCK_N = 128  # cache columns per inner step, at most (block_columns)
# ... and where each (row, key/value head) is one program's (many rows: no split, no merge), fewer: the tile sweep
# (benchmarks/onpolicy/probe_decode_attention.py) ranked 64 above 128 there, and 128 above 64 with splits
DIRECT_BLOCK_N = 64
# Bytes of one key (or value) tile: the software-pipelined loop keeps stages of both in shared memory. At 32 KiB a
# tile every head up to 256 wide, in any dtype, asks for at most 84 KiB, within the smallest multiprocessor since
# Ampere (99 KiB; tests/test_kernel_resources.py compiles it for sm_80 and sm_90); 128 columns of a 256-wide float32
# head asked for 280 KiB and did not launch
TILE_BYTES = 32 << 10
MASK_BLOCK = 1024  # mask columns per step of the first pass
PROGRAMS_WANTED = 2  # per SM: enough programs in flight to keep the memory system busy
NUM_WARPS, NUM_STAGES = 4, 2  # of the split kernel (benchmarks/onpolicy/probe_decode_attention.py sweeps them)


if triton_available():
    import triton
    import triton.language as tl

    from ..ops.triton_utils import acc_type, await_prior_grids, dependent_launch_options

    @triton.jit
    def _split_kernel(
        # pointers
        q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, max_ptr, sum_ptr, out_ptr,
        # the new position's (FUSED): its key and value, cos / sin, the cache column they go to
        new_k_ptr, new_v_ptr, cos_ptr, sin_ptr, slot_ptr,
        # shapes
        kv_heads, length, split_len, scale,
        # strides
        stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_mb, stride_mn,
        stride_ob, stride_oh, stride_nkb, stride_nkh, stride_nvb, stride_nvh, stride_cb, stride_sb,
        # meta-parameters
        GROUP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK: tl.constexpr, MASK_BLOCK: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, DIRECT: tl.constexpr,
        FUSED: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        await_prior_grids(PDL)
        pair, split = tl.program_id(0), tl.program_id(1)
        splits = tl.num_programs(1)
        b, h = pair // kv_heads, pair % kv_heads
        g = tl.arange(0, ROWS)
        d = tl.arange(0, BLOCK_D)
        g_ok, d_ok = g < GROUP, d < DIM
        q_at = q_ptr + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh
        q = tl.load(q_at + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        running_max = tl.full((ROWS,), float("-inf"), ACC)
        total = tl.zeros((ROWS,), ACC)
        acc = tl.zeros((ROWS, BLOCK_D), ACC)
        first = split * split_len
        last = tl.minimum(first + split_len, length)
        slot = first - 1  # no column of the cache is left out of the loop below unless FUSED
        if FUSED:
            # RoPE (rotate-half) of the query heads and the new key, computed in ACC and rounded to the inputs' dtype
            # as ops/rope.py's kernel does: out[i] = x[i] cos[i] - x[i + D/2] sin[i] for i < D/2, and
            # x[i] cos[i] + x[i - D/2] sin[i] above
            half = DIM // 2
            partner = tl.where(d < half, d + half, d - half)
            sign = tl.where(d < half, -1.0, 1.0).to(ACC)
            cos = tl.load(cos_ptr + b * stride_cb + d, mask=d_ok, other=0.0).to(ACC)
            sin = tl.load(sin_ptr + b * stride_sb + d, mask=d_ok, other=0.0).to(ACC) * sign
            q_pair = tl.load(q_at + partner[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
            q = (q.to(ACC) * cos[None, :] + q_pair.to(ACC) * sin[None, :]).to(q_ptr.dtype.element_ty)
            k_at = new_k_ptr + b * stride_nkb + h * stride_nkh
            key = tl.load(k_at + d, mask=d_ok, other=0.0).to(ACC) * cos + tl.load(k_at + partner, mask=d_ok,
                                                                                  other=0.0).to(ACC) * sin
            key = key.to(k_ptr.dtype.element_ty)
            value = tl.load(new_v_ptr + b * stride_nvb + h * stride_nvh + d, mask=d_ok, other=0.0)
            # the program whose split holds the slot writes the new column and starts its softmax with it (from
            # registers: the column is left out of every program's loop, so no program reads it before the write)
            slot = tl.load(slot_ptr).to(tl.int32)
            holds = (slot >= first) & (slot < last)
            slot_at = tl.where(holds, slot, first).to(tl.int64)
            written = d < tl.where(holds, DIM, 0)  # (a scalar condition and'ed with a block: the interpreter refuses)
            tl.store(k_ptr + b * stride_kb + h * stride_kh + slot_at * stride_kn + d, key, mask=written)
            tl.store(v_ptr + b * stride_vb + h * stride_vh + slot_at * stride_vn + d, value, mask=written)
            seeded = holds & (tl.load(mask_ptr + b * stride_mb + slot_at * stride_mn) != 0)
            score = tl.sum(q.to(ACC) * key.to(ACC)[None, :], axis=1) * scale
            running_max = tl.where(seeded, score, running_max)
            total = tl.where(seeded, total + 1.0, total)  # its p is exp(0) = 1
            acc = tl.where(seeded, acc + value.to(ACC)[None, :], acc)
        if UPCAST:
            q = q.to(ACC)
        # the attended extent [lo, hi) of this split's columns (an empty one, lo >= hi, when nobody attends here)
        lo = last
        hi = first
        for start in range(first, last, MASK_BLOCK):
            n = start + tl.arange(0, MASK_BLOCK)
            attends = tl.load(mask_ptr + b * stride_mb + n * stride_mn, mask=n < last, other=0) != 0
            lo = tl.minimum(lo, tl.min(tl.where(attends, n, last), axis=0))
            hi = tl.maximum(hi, tl.max(tl.where(attends, n + 1, first), axis=0))
        # from lo's block: the first block read holds an attended column (or the slot's, whose score seeded the
        # running max), so every running max is finite after it and a later block with none gives p = 0, alpha = 1
        for start in range(first + (lo - first) // BLOCK * BLOCK, hi, BLOCK):
            n = start + tl.arange(0, BLOCK)
            attends = (tl.load(mask_ptr + b * stride_mb + n * stride_mn, mask=n < hi, other=0) != 0) & (n != slot)
            k = tl.load(k_ptr + b * stride_kb + h * stride_kh + n[:, None] * stride_kn + d[None, :],
                        mask=attends[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
            if UPCAST:  # the interpreter's bf16 products are wrong: the same roundings, products in float32
                k = k.to(ACC)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=ACC) * scale
            scores = tl.where(attends[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            # rows of padding (g >= GROUP) see finite scores of 0: harmless, never stored
            p = tl.exp(scores - new_max[:, None])
            alpha = tl.exp(running_max - new_max)
            total = total * alpha + tl.sum(p, axis=1)
            # masked loads, not the cache's contents: a column nobody attends to never reaches the sum (0 * NaN)
            v = tl.load(v_ptr + b * stride_vb + h * stride_vh + n[:, None] * stride_vn + d[None, :],
                        mask=attends[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
            p = p.to(v.dtype)  # rounded to the values' dtype, as flash attention does
            if UPCAST:
                p, v = p.to(ACC), v.to(ACC)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee", out_dtype=ACC)
            running_max = new_max
        if DIRECT:  # one split: the output itself, what the merge would compute from it (its weight is 1)
            out = acc / total[:, None]
            tl.store(out_ptr + b * stride_ob + (h * GROUP + g)[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])  # fmt: skip
            return
        row = (pair * splits + split) * GROUP + g
        tl.store(max_ptr + row, running_max, mask=g_ok)
        tl.store(sum_ptr + row, total, mask=g_ok)
        tl.store(acc_ptr + row[:, None] * DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _merge_kernel(
        # pointers
        acc_ptr, max_ptr, sum_ptr, out_ptr,
        # shapes
        kv_heads, splits,
        # strides
        stride_ob, stride_oh,
        # meta-parameters
        GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        await_prior_grids(PDL)
        pair, g = tl.program_id(0), tl.program_id(1)
        b, h = pair // kv_heads, pair % kv_heads
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        s_ok, d_ok = s < splits, d < DIM
        row = (pair * splits + s) * GROUP + g
        maxima = tl.load(max_ptr + row, mask=s_ok, other=float("-inf"))
        top = tl.max(maxima, axis=0)
        weight = tl.where(s_ok & (maxima > float("-inf")), tl.exp(maxima - top), 0.0)  # a split nobody read: 0
        total = tl.sum(weight * tl.load(sum_ptr + row, mask=s_ok, other=0.0), axis=0)
        acc = tl.load(acc_ptr + row[:, None] * DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        out = tl.sum(weight[:, None] * acc, axis=0) / total
        tl.store(out_ptr + b * stride_ob + (h * GROUP + g) * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def block_columns(dim: int, dtype: torch.dtype) -> int:
    """Cache columns per inner step: BLOCK_N, fewer where a tile of that many would pass TILE_BYTES (head dims
    past 128 in bf16, past 64 in float32); at least 16, the least N of a tensor-core product (enough for the head
    dims up to 256 that decode_attention.kernel_takes passes, in any dtype)."""
    row_bytes = max(16, 1 << (dim - 1).bit_length()) * torch.empty((), dtype=dtype).element_size()
    return max(16, min(BLOCK_N, 1 << (TILE_BYTES // row_bytes).bit_length() - 1))


def split_count(pairs: int, length: int, device: torch.device, block: int = BLOCK_N) -> int:
    """Splits of the columns per (row, key/value head): enough programs for every SM to hold PROGRAMS_WANTED, at
    least `block` columns a split: a GPU of 132 SMs gives 8 rows x 8 heads 5 splits, and 64 rows 1."""
    sms = 4  # the interpreter's (CPU tests): a few splits, so that the merge is exercised
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(math.ceil(PROGRAMS_WANTED * sms / pairs), math.ceil(length / block)))


def layout_refusal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why decode_attention cannot take these tensors as they are, or None: a head dim that is not contiguous (it
    reads it as if it were), float64 on CUDA (Triton does not lower that product). The engine asks first
    (decode_attention.kernel_takes) and attends through SDPA instead."""
    strides = [t.stride(-1) for t in (query, key, value)]
    if strides != [1, 1, 1]:
        return (f"reads the head dim as contiguous: query, key and value need stride 1 in their last dim; got "
                f"{strides} (call .contiguous() first)")  # fmt: skip
    if query.dtype == torch.float64 and query.is_cuda:
        return (f"takes no float64 CUDA tensors: Triton does not lower a float64 product of {BLOCK_N} columns for "
                f"the GPU; attend through SDPA (the engine does for float64 models)")  # fmt: skip
    return None


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of one query position per row over a key/value cache, the query heads of each key/value head together.

    Args:
        query: (batch, H, 1, d); its last dim contiguous.
        key, value: (batch, H_kv, length, d), H a multiple of H_kv; last dim contiguous.
        mask: (batch, length) boolean, True where the row attends, any strides (an expanded mask too). A row that
            attends nowhere comes out NaN (0 / 0); the engine never makes one.
        scale: the scores' factor (1 / sqrt(d) for most models).

    Returns:
        (batch, 1, H, d) in the query's dtype: transformers' attention-function layout.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or heads % kv_heads or key.shape != value.shape or key.shape[::3] != (batch, dim):
        raise ValueError(f"decode_attention takes query (batch, H, 1, d) and key / value (batch, H_kv, length, d), "
                         f"H a multiple of H_kv; got query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)}")  # fmt: skip
    _check_mask_and_layout("decode_attention", query, key, value, mask)
    return _attend(query[:, :, 0], key, value, mask, scale, None)


def rope_write_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    dependent: bool = False,
) -> torch.Tensor:
    """A decode step's attention for a new position not in the cache yet, in one launch (two with split merging):
    the query and the new key rotated by RoPE (rotate-half, transformers' `apply_rotary_pos_emb`), the rotated key
    and the value written into column `slot` of the cache, and the query's attention over the cache with them,
    what rope + `kv_cache.write_slot` + `decode_attention` compute in three.

    Args:
        query: (batch, H, d), not rotated; its last dim contiguous (a view of a fused q/k/v product's output is).
        key, value: (batch, H_kv, d), the new position's, the key not rotated; last dims contiguous.
        keys, values: the cache, (batch, H_kv, length, d), last dim contiguous; written at column `slot`.
        slot: one-element int64 device tensor (read by the kernel: one captured graph serves every step); a slot
            outside [0, length) writes nothing and attends to the cache alone.
        cos, sin: (batch or 1, d), the new position's, in any float dtype (the rotation is computed in float32, in
            float64 for float64 inputs).
        mask: (batch, length) boolean, True where the row attends; column `slot` is the new position's.
        scale: the scores' factor.
        dependent: launched as programmatic dependents of the kernel before (generation/dependent_launch.py).

    Returns:
        (batch, 1, H, d) in the query's dtype.
    """
    tensors = dict(query=query, key=key, value=value, keys=keys, values=values, cos=cos, sin=sin, mask=mask, slot=slot)
    elsewhere = {name: str(t.device) for name, t in tensors.items() if t.device != query.device}
    if elsewhere:
        raise ValueError(f"rope_write_attend takes every tensor on the query's device {query.device}; got {elsewhere}")
    if query.dim() != 3 or keys.dim() != 4 or not query.is_floating_point():
        raise ValueError(f"rope_write_attend takes a floating-point query (batch, H, d) and keys (batch, H_kv, length, "
                         f"d); got query {query.dtype} {tuple(query.shape)}, keys {tuple(keys.shape)}")  # fmt: skip
    batch, heads, dim = query.shape
    kv_heads = keys.shape[1]
    if not (key.shape == value.shape == (batch, kv_heads, dim) and keys.shape == values.shape
            and keys.shape[::3] == (batch, dim) and heads % kv_heads == 0 and dim % 2 == 0):  # fmt: skip
        raise ValueError(f"rope_write_attend takes query (batch, H, d), key / value (batch, H_kv, d) and keys / values "
                         f"(batch, H_kv, length, d), H a multiple of H_kv, d even; got query {tuple(query.shape)}, "
                         f"key {tuple(key.shape)}, value {tuple(value.shape)}, keys {tuple(keys.shape)}, values "
                         f"{tuple(values.shape)}")  # fmt: skip
    if not query.dtype == key.dtype == value.dtype == keys.dtype == values.dtype:
        raise ValueError(f"rope_write_attend takes one dtype for query, key, value and the cache; got "
                         f"{query.dtype}, {key.dtype}, {value.dtype}, {keys.dtype}, {values.dtype}")  # fmt: skip
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] not in (1, batch) or cos.shape[1] != dim \
            or cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.dtype != sin.dtype or not cos.is_floating_point():
        raise ValueError(f"rope_write_attend takes cos / sin (batch or 1, d) = ({batch} or 1, {dim}) of one float "
                         f"dtype, last dim contiguous; got cos {cos.dtype} {tuple(cos.shape)}, sin {sin.dtype} "
                         f"{tuple(sin.shape)}")  # fmt: skip
    if not (slot.numel() == 1 and slot.dtype == torch.int64):
        raise ValueError(f"rope_write_attend takes slot as a one-element int64 tensor; got {slot.dtype} "
                         f"{tuple(slot.shape)}")  # fmt: skip
    _check_mask_and_layout("rope_write_attend", query, keys, values, mask)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError(f"rope_write_attend reads the head dim as contiguous: key and value need stride 1 in their "
                         f"last dim; got {key.stride(-1)}, {value.stride(-1)} (call .contiguous() first)")  # fmt: skip
    return _attend(query, keys, values, mask, scale, (key, value, cos, sin, slot), dependent)


def _check_mask_and_layout(name: str, query, key, value, mask) -> None:
    batch, length = key.shape[0], key.shape[2]
    if mask.shape != (batch, length) or mask.dtype != torch.bool or not query.dtype == key.dtype == value.dtype:
        raise ValueError(f"{name} takes a boolean mask (batch, length) = {(batch, length)} and one dtype; "
                         f"got mask {mask.dtype} {tuple(mask.shape)}, query {query.dtype}, key {key.dtype}, value "
                         f"{value.dtype}")  # fmt: skip
    if (reason := layout_refusal(query, key, value)) is not None:
        raise ValueError(f"{name} {reason}")


def _attend(query, key, value, mask, scale, new, dependent=False) -> torch.Tensor:
    """The launch: query (batch, H, d) over key / value (batch, H_kv, length, d); `new` None, or the new
    position's (key, value, cos, sin, slot) for rope_write_attend."""
    batch, heads, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    pairs = batch * kv_heads
    block = block_columns(dim, query.dtype)
    splits = split_count(pairs, length, query.device, block)
    if splits == 1:
        block = min(block, DIRECT_BLOCK_N)
    split_len = math.ceil(math.ceil(length / splits) / block) * block
    splits = math.ceil(length / split_len)
    out = torch.empty(batch, 1, heads, dim, dtype=query.dtype, device=query.device)
    direct = splits == 1  # a split per (row, head), as many rows on a large GPU: it writes the output, no merge
    acc_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    scratch = 0 if direct else pairs * splits * group
    acc = torch.empty(scratch, dim, dtype=acc_dtype, device=query.device)
    maxima = torch.empty(scratch, dtype=acc_dtype, device=query.device)
    sums = torch.empty_like(maxima)
    block_d = max(16, triton.next_power_of_2(dim))
    if new is None:  # the pointers FUSED reads: any tensor stands in
        new_key = new_value = cos = sin = slot = query
    else:
        new_key, new_value, cos, sin, slot = new
    table_stride = [0 if t.shape[0] == 1 else t.stride(0) for t in (cos, sin)] if new is not None else [0, 0]
    _split_kernel[(pairs, splits)](
        query, key, value, mask, acc, maxima, sums, out,
        new_key, new_value, cos, sin, slot,
        kv_heads, length, split_len, scale,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), mask.stride(0), mask.stride(1), out.stride(0), out.stride(2),
        new_key.stride(0), new_key.stride(1), new_value.stride(0), new_value.stride(1), *table_stride,
        GROUP=group, ROWS=max(QUERY_ROWS, triton.next_power_of_2(group)), DIM=dim, BLOCK_D=block_d, BLOCK=block,
        MASK_BLOCK=MASK_BLOCK, ACC=acc_type(query.dtype), UPCAST=triton_interpreted(), DIRECT=direct,
        FUSED=new is not None, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        **dependent_launch_options(dependent, query.device),
    )  # fmt: skip
    if direct:
        return out
    _merge_kernel[(pairs, group)](
        acc, maxima, sums, out,
        kv_heads, splits,
        out.stride(0), out.stride(2),
        GROUP=group, DIM=dim, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(splits)),
        **dependent_launch_options(dependent, query.device),
    )  # fmt: skip
    return out
