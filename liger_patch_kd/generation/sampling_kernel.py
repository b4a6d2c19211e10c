"""A Gumbel-max draw fused into one pass over the logits: the decode engine's sampling step as a Triton kernel.

`sampling.draw` draws argmax(scores - log E), E ~ Exp(1) in float64, with torch ops (a float copy, exponential_,
clamp, log, subtract, argmax): at 64 rows x V=128256 a noticeable share of a decode step. `gumbel_argmax` reads
the (bf16) logits once, makes the noise in registers and writes one id per row.

Random numbers: Philox-4x32-10 keyed by the call's seed (64 bits), with the 128-bit counter
(column pair, row, step low 32 bits, step high 32 bits). Every (seed, step, row, column) thus has its own counter
under one key: no two draws of a decode call share random numbers, across steps, rows or columns, for any
rows < 2**32 and V < 2**31 (no packing into a 32-bit offset, so nothing can wrap or collide). Seed and step are
loaded from device tensors, so a captured CUDA graph replays with the values they hold at replay time.
One Philox call gives four 32-bit words: two columns (j and j + HALF of a block) take 52 bits m each, the uniform
u = (m + 0.5) * 2**-52 in [2**-53, 1 - 2**-53], so E = -log u is never 0 or inf and the noise -log E reaches ~36.7,
as sampling.draw's float64 does: a token trailing the top score by d < ~36 nats is drawn at its softmax rate
(float32 uniforms would stop at d ~ 21).

The noise is computed in float32 from the distance of u to its nearer end of (0, 1), which float32 holds to 24
bits at either end: E = -log u below 1/2, E = -log(1 - t) by its series in t = 1 - u above, so neither end rounds
away (`_gumbel_noise`). The noise is within 2**-21 + 2**-22 |noise| nats of the float64 formula's (a few 1e-7
near 0, under 1e-5 at its largest, 36.7), which moves a draw's probabilities by about 1e-6 relative at most, where
float64 logarithms run at a small fraction of float32's rate on a GPU (docs/benchmarks.md times the draw).

Per row the draw is argmax over ids < vocab_limit of logit / temperature - log E (the key in float64; 1 / temperature
is passed to the kernel as a float32 scalar, a relative change below 6e-8). Ties go to the lowest id, as torch.argmax.
A -inf or NaN logit is never drawn; a row with nothing drawable (all -inf / NaN) returns 0. +inf logits are
drawn first (the lowest such id).
Work: a 2-D grid (row tiles, column blocks) writes each tile row's best (key, id), and a small second kernel picks
each row's best block, so 1-8 rows at V=128256 still spread over ~1000 programs (short rows share a program).
"""

from __future__ import annotations

import math

import torch

from ..ops.backend import triton_available, triton_interpreted

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _gumbel_block_kernel(
        # pointers
        logits_ptr, seed_ptr, step_ptr, part_key_ptr, part_id_ptr,
        # shapes
        n_rows, limit, n_blocks, inv_temp,
        # strides
        stride_row, stride_col,
        # meta-parameters
        ROWS: tl.constexpr, HALF: tl.constexpr,
    ):  # fmt: skip
        """A tile of ROWS rows x 2 * HALF columns: each row's best (key, id) in the tile, to the scratch."""
        block = tl.program_id(1)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        j = tl.arange(0, HALF)[None, :]
        cols_a = block * (2 * HALF) + j
        seed = tl.load(seed_ptr)
        step = tl.load(step_ptr)
        # every counter word a full tile (Philox's rounds mix them); the first word is unique per column pair
        zero = (rows[:, None] * 0 + j * 0).to(tl.uint32)
        r0, r1, r2, r3 = tl.philox(
            seed, zero + (block * HALF + j).to(tl.uint32), zero + rows[:, None].to(tl.uint32),
            zero + (step & 0xFFFFFFFF).to(tl.uint32), zero + (step >> 32).to(tl.uint32),
        )  # fmt: skip
        base = logits_ptr + rows[:, None].to(tl.int64) * stride_row
        live = rows[:, None] < n_rows
        key_a, id_a = _tile_best(base, cols_a, live, r0, r1, limit, inv_temp, stride_col)
        key_b, id_b = _tile_best(base, cols_a + HALF, live, r2, r3, limit, inv_temp, stride_col)
        take_b = key_b > key_a  # equal keys: the a half, whose ids are lower
        out = rows * n_blocks + block
        tl.store(part_key_ptr + out, tl.where(take_b, key_b, key_a), mask=rows < n_rows)
        tl.store(part_id_ptr + out, tl.where(take_b, id_b, id_a), mask=rows < n_rows)

    @triton.jit
    def _tile_best(base, cols, live, hi, lo, limit, inv_temp, stride_col):
        """Per row, (max key, its id) over `cols`: key = logit / T - log E, E = -log u, u from 52 bits of hi, lo."""
        mask = live & (cols < limit)
        x = tl.load(base + cols.to(tl.int64) * stride_col, mask=mask, other=float("-inf")).to(tl.float64)
        key = x * inv_temp + _gumbel_noise(hi, lo).to(tl.float64)  # a multiplication: a division costs more
        key = tl.where(mask & (key == key), key, float("-inf"))  # NaN (key != key) and ids past the limit: never
        top = tl.max(key, axis=1)
        return top, tl.min(tl.where(key == top[:, None], cols, 2147483647), axis=1)  # ties: the lowest id

    @triton.jit
    def _gumbel_noise(hi, lo):
        """-log(-log u) in float32 for u = (m + 0.5) * 2**-52, m the 52 bits of hi and lo's top 20, within 2**-21 +
        2**-22 |noise| nats of the float64 formula at both ends of (0, 1). t = (k + 0.5) * 2**-52 is u itself below
        1/2 (k = m) and 1 - u above (k = 2**52 - 1 - m), exact in integers and held by float32 to 24 bits however
        small: E = -log t below, and above E = -log(1 - t) = 2 atanh(s) = 2 (s + s**3/3 + s**5/5 + ...),
        s = t / (2 - t) <= 1/3, whose terms past the eighth fall under 2**-28 of the first (a float32 log of 1 - t
        would lose small t's digits)."""
        m = (hi.to(tl.int64) << 20) | (lo >> 12).to(tl.int64)
        low = m < (1 << 51)
        k = tl.where(low, m, (1 << 52) - 1 - m)
        t = (k.to(tl.float32) + 0.5) * 2.220446049250313e-16
        s = t / (2.0 - t)
        q = s * s
        series = 1.0 / 15.0
        series = series * q + 1.0 / 13.0
        series = series * q + 1.0 / 11.0
        series = series * q + 1.0 / 9.0
        series = series * q + 1.0 / 7.0
        series = series * q + 1.0 / 5.0
        series = series * q + 1.0 / 3.0
        series = series * q + 1.0
        e = tl.where(low, -tl.log(t), 2.0 * s * series)
        return -tl.log(e)

    @triton.jit
    def _gumbel_finish_kernel(
        # pointers
        part_key_ptr, part_id_ptr, out_ptr,
        # shapes
        n_rows, n_blocks,
        # meta-parameters
        ROWS: tl.constexpr, BLOCKS: tl.constexpr,
    ):  # fmt: skip
        """Per row, the block with the largest key (ties: the first, so the lowest id) gives the id."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        idx = tl.arange(0, BLOCKS)[None, :]
        at = rows[:, None] * n_blocks + idx
        keys = tl.load(part_key_ptr + at, mask=(rows[:, None] < n_rows) & (idx < n_blocks), other=float("-inf"))
        best = tl.argmax(keys, axis=1, tie_break_left=True)
        ids = tl.load(part_id_ptr + rows * n_blocks + best, mask=rows < n_rows)
        tl.store(out_ptr + rows, ids.to(tl.int64), mask=rows < n_rows)


def _check_counter(name: str, t: object, device: torch.device) -> None:
    if not (isinstance(t, torch.Tensor) and t.numel() == 1 and t.dtype == torch.int64):
        got = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a one-element int64 tensor; got {got}")
    if t.device != device:
        raise ValueError(f"{name} must be on the logits' device {device}; got {t.device}")


def gumbel_argmax(
    logits: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_limit: int | None = None,
) -> torch.Tensor:
    """(rows,) int64: for each row, a draw from softmax(logits[row, :limit] / temperature), limit = vocab_limit
    (None: V). seed, step: one-element int64 tensors on the logits' device, read by the kernel (graph-safe).
    No host sync; CUDA tensors, or any under TRITON_INTERPRET=1."""
    if not (isinstance(logits, torch.Tensor) and logits.dim() == 2 and logits.is_floating_point()):
        got = f"{logits.dtype} tensor of shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor) else logits
        raise ValueError(f"logits must be a 2-D (rows, V) floating-point tensor; got {got}")
    rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("logits must have at least one column; got V=0")
    _check_counter("seed", seed, logits.device)
    _check_counter("step", step, logits.device)
    if isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0; got {temperature!r}")
    if not temperature >= 1e-30:  # 1 / temperature goes to the kernel as a float32
        raise ValueError(f"temperature must be a finite number > 0 (at least 1e-30); got {temperature!r}")
    if vocab_limit is not None and not (type(vocab_limit) is int and vocab_limit >= 1):  # a bool is no limit
        raise ValueError(f"vocab_limit must be None or an int >= 1; got {vocab_limit!r}")
    if not triton_available():
        raise ValueError("gumbel_argmax needs triton; pip install triton")
    if logits.device.type != "cuda" and not triton_interpreted():
        raise ValueError(
            f"gumbel_argmax needs CUDA tensors, or TRITON_INTERPRET=1 set before import for {logits.device.type} ones"
        )
    limit = vocab if vocab_limit is None else min(vocab_limit, vocab)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    # Columns per program: enough programs (~1024) to fill a GPU at one row, 256 to 4096 (at most 16 float64 keys a
    # thread at 8 warps, in registers), no more than the row holds; rows per program: to fill ~4096 keys when the
    # rows are short (the interpreter's cost is per program, so the tests' many short rows run in few).
    block = min(max(256, min(4096, triton.next_power_of_2(rows * limit // 1024))), triton.next_power_of_2(limit))
    block = max(block, 2)  # two halves of at least one column
    tile_rows = max(1, min(triton.next_power_of_2(rows), 4096 // block))
    n_blocks = triton.cdiv(limit, block)
    part_key = torch.empty((rows, n_blocks), dtype=torch.float64, device=logits.device)
    part_id = torch.empty((rows, n_blocks), dtype=torch.int32, device=logits.device)
    _gumbel_block_kernel[(triton.cdiv(rows, tile_rows), n_blocks)](
        logits, seed, step, part_key, part_id,
        rows, limit, n_blocks, 1.0 / temperature,
        logits.stride(0), logits.stride(1),
        ROWS=tile_rows, HALF=block // 2, num_warps=8 if tile_rows * block >= 4096 else 4,
    )  # fmt: skip
    blocks_p2 = triton.next_power_of_2(n_blocks)
    finish_rows = max(1, min(triton.next_power_of_2(rows), 1024 // blocks_p2))
    _gumbel_finish_kernel[(triton.cdiv(rows, finish_rows),)](
        part_key, part_id, out, rows, n_blocks, ROWS=finish_rows, BLOCKS=blocks_p2
    )
    return out
