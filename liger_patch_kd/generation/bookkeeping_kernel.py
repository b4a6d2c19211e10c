"""The decode step's bookkeeping after its draw, as one Triton kernel: what `DecodeSession._advance` and the step
do with torch ops once a token per row is drawn.

With torch ops it is a dozen tiny kernels a step (where, all, isin, an or, two index copies, three counters), as
many graph nodes as a layer of a small model: in a captured step each costs a node's launch latency, whatever its
size. One program does them all, in this order, exactly as the torch ops:

    going  = any row not done (before this token)
    tokens = pad_id where the row is done (with eos ids), else the drawn token
    out[:, count] = tokens;  next_input[:, 0] = tokens
    done  |= tokens in eos_ids
    used   = count + 1 if going (or there are no eos ids) else used
    count += 1;  slot += 1 (a decode step's; the prefill's draw leaves the slot where the prefill set it)
    and with the slot moved, the next step's inputs: its mask sees the new slot's column where the row may
    (step_mask[:, slot] = valid[:, slot]: step_mask stays valid & (columns <= slot)), positions += 1 (base + slot)

The counters are one-element device tensors, read and written by the kernel (a captured graph replays with the
values they hold). One program: `going` is a reduction over every row, and the counters are written after it;
a step has at most a few thousand rows, a few loop trips.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..ops.backend import triton_available


class NextColumn(NamedTuple):
    """What a decode step's slot move updates besides the slot: (1,) int64 slot; (rows, length) bool valid (the
    columns a row may attend to) and step_mask (those of them up to the slot); (rows, 1) int64 positions."""

    slot: torch.Tensor
    valid: torch.Tensor
    step_mask: torch.Tensor
    positions: torch.Tensor


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _bookkeeping_kernel(
        # pointers
        tokens_ptr, done_ptr, eos_ptr, out_ptr, next_ptr, count_ptr, used_ptr, slot_ptr, valid_ptr, step_mask_ptr,
        positions_ptr,
        # sizes and values
        n_rows, n_eos, pad_id, stride_out, length, stride_valid, stride_mask,
        # meta-parameters
        BLOCK: tl.constexpr, EOS_BLOCK: tl.constexpr, BUMP_SLOT: tl.constexpr,
    ):  # fmt: skip
        count = tl.load(count_ptr)
        if BUMP_SLOT:
            new_slot = tl.load(slot_ptr) + 1
        eos_live = tl.arange(0, EOS_BLOCK) < n_eos
        eos = tl.load(eos_ptr + tl.arange(0, EOS_BLOCK), mask=eos_live, other=0)
        going = tl.full((), 0, tl.int32)
        for start in range(0, n_rows, BLOCK):
            rows = start + tl.arange(0, BLOCK)
            live = rows < n_rows
            was_done = tl.load(done_ptr + rows, mask=live, other=1).to(tl.int32)
            drawn = tl.load(tokens_ptr + rows, mask=live, other=0)
            token = tl.where((was_done != 0) & (n_eos > 0), pad_id, drawn)  # without eos ids no row ends
            tl.store(out_ptr + rows.to(tl.int64) * stride_out + count, token, mask=live)
            tl.store(next_ptr + rows, token, mask=live)
            hit = tl.max(((token[:, None] == eos[None, :]) & eos_live[None, :]).to(tl.int32), axis=1)
            tl.store(done_ptr + rows, ((was_done | hit) != 0).to(tl.int1), mask=live)
            going = tl.maximum(going, tl.max(tl.where(live, 1 - was_done, 0), axis=0))
            if BUMP_SLOT:  # the next step's inputs (a slot past the cache's end opens no column)
                wide = rows.to(tl.int64)
                opens = live & ((wide * 0 + new_slot) < length)  # a block mask (the interpreter wants one)
                seen = tl.load(valid_ptr + wide * stride_valid + new_slot, mask=opens, other=0)
                tl.store(step_mask_ptr + wide * stride_mask + new_slot, seen, mask=opens)
                tl.store(positions_ptr + rows, tl.load(positions_ptr + rows, mask=live, other=0) + 1, mask=live)
        used = tl.load(used_ptr)
        tl.store(used_ptr, tl.where((going != 0) | (n_eos == 0), count + 1, used))
        tl.store(count_ptr, count + 1)
        if BUMP_SLOT:
            tl.store(slot_ptr, new_slot)


def advance_in_one_kernel(
    tokens: torch.Tensor,
    done: torch.Tensor,
    eos: torch.Tensor,
    out: torch.Tensor,
    next_input: torch.Tensor,
    count: torch.Tensor,
    used: torch.Tensor,
    pad_id: int,
    next_column: NextColumn | None = None,
) -> None:
    """The module docstring's updates, in place: tokens (rows,) int64 drawn; done (rows,) bool; eos (E,) int64 (E
    may be 0); out (rows, length) int64; next_input (rows, 1) int64; count and used one-element int64;
    next_column: a decode step's slot and the next step's inputs (None: the prefill's draw, nothing of them
    moves). The callers are the decode sessions, which own these buffers: contiguous, on one device, rows >= 1."""
    rows = tokens.shape[0]
    eos_ids = eos if eos.numel() else count  # never read (n_eos = 0): any int64 pointer will do
    bump = next_column is not None
    slot, valid, step_mask, positions = next_column if bump else (count, done, done, count)  # never read unless bump
    _bookkeeping_kernel[(1,)](
        tokens, done, eos_ids, out, next_input, count, used, slot, valid, step_mask, positions,
        rows, eos.numel(), pad_id, out.stride(0), valid.shape[-1], valid.stride(0), step_mask.stride(0),
        BLOCK=min(1024, triton.next_power_of_2(rows)), EOS_BLOCK=max(2, triton.next_power_of_2(eos.numel())),
        BUMP_SLOT=bump,
    )  # fmt: skip
