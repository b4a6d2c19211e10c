"""The decode step's bookkeeping in one kernel (generation/bookkeeping_kernel.py) against the torch ops it replaces
(the engine's own path on a CPU), through the Triton interpreter (compiled on a GPU machine): the same buffers
after every step, with and without EOS ids, rows already done, the prefill's draw (slot left) and a decode step's
(slot moved); and the engine decoding through it (engine.BOOKKEEPING_KERNEL on) samples what it samples through
the torch ops."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from liger_patch_kd.generation import Sampling, decode, release_sessions  # noqa: E402
from liger_patch_kd.generation import engine as engine_module  # noqa: E402
from liger_patch_kd.generation.bookkeeping_kernel import NextColumn, advance_in_one_kernel  # noqa: E402

from .helpers import DEVICE  # noqa: E402
from .test_generation import _model, _prompts  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_patches")


def torch_bookkeeping(tokens, done, eos, out, next_input, count, used, pad_id, next_column=None):
    """DecodeSession._advance's torch ops after the draw (and the step's slot increment, with the next step's mask
    and positions as the session defines them)."""
    if eos.numel():
        tokens = torch.where(done, pad_id, tokens)
        used.copy_(torch.where(done.all(), used, count + 1))
        done |= torch.isin(tokens, eos)
    else:
        used.copy_(count + 1)
    out.index_copy_(1, count, tokens[:, None])
    next_input.copy_(tokens[:, None])
    count.add_(1)
    if next_column is not None:
        slot, valid, step_mask, positions = next_column
        slot.add_(1)
        columns = torch.arange(valid.shape[1], device=valid.device)
        torch.logical_and(valid, columns <= slot, out=step_mask)
        positions.add_(1)


def _state(rows, length, eos, generator):
    long = dict(dtype=torch.long, device=DEVICE)
    return dict(
        done=(torch.rand(rows, generator=generator) < 0.3).to(DEVICE),
        eos=torch.tensor(eos, **long),
        out=torch.randint(0, 50, (rows, length), generator=generator).to(DEVICE),
        next_input=torch.zeros(rows, 1, **long),
        count=torch.tensor([3], **long),
        used=torch.tensor([2], **long),
        slot=torch.tensor([length - 5], **long),
        # a row's prompt columns (some padding), the decode columns after them; the mask through the slot
        valid=((torch.rand(rows, length, generator=generator) < 0.8) | (torch.arange(length) >= 4)).to(DEVICE),
        positions=torch.randint(0, 30, (rows, 1), generator=generator).to(DEVICE),
    )


def _next_column(state):
    columns = torch.arange(state["valid"].shape[1], device=DEVICE)
    state.setdefault("step_mask", state["valid"] & (columns <= state["slot"]))
    return NextColumn(state["slot"], state["valid"], state["step_mask"], state["positions"])


@pytest.mark.parametrize("rows", [1, 5, 1030])  # one block, a partial block, more rows than one block holds
@pytest.mark.parametrize("eos", [(), (4,), (4, 9, 11)])
@pytest.mark.parametrize("bump_slot", [True, False])
def test_one_kernel_books_what_the_torch_ops_book(rows, eos, bump_slot):
    generator = torch.Generator().manual_seed(rows + len(eos))
    want = _state(rows, 9, eos, generator)
    _next_column(want)
    got = {k: v.clone() for k, v in want.items()}
    for step in range(6):  # the counters and flags carry from step to step; the slot runs past the cache's end
        tokens = torch.randint(0, 12, (rows,), generator=generator).to(DEVICE)
        torch_bookkeeping(tokens, want["done"], want["eos"], want["out"], want["next_input"], want["count"],
                          want["used"], 0, _next_column(want) if bump_slot else None)  # fmt: skip
        advance_in_one_kernel(tokens, got["done"], got["eos"], got["out"], got["next_input"], got["count"],
                              got["used"], 0, _next_column(got) if bump_slot else None)  # fmt: skip
        for name in want:
            assert torch.equal(got[name], want[name]), (name, step)


def test_every_row_done_keeps_used_and_pads():
    long = dict(dtype=torch.long, device=DEVICE)
    done = torch.ones(3, dtype=torch.bool, device=DEVICE)
    out, next_input = torch.zeros(3, 4, **long), torch.zeros(3, 1, **long)
    count, used, slot = torch.tensor([2], **long), torch.tensor([1], **long), torch.tensor([2], **long)
    flags = dict(dtype=torch.bool, device=DEVICE)
    valid, step_mask = torch.ones(3, 4, **flags), torch.zeros(3, 4, **flags)
    positions = torch.tensor([[4], [5], [6]], **long)
    advance_in_one_kernel(torch.tensor([7, 8, 9], **long), done, torch.tensor([9], **long), out, next_input, count,
                          used, 6, NextColumn(slot, valid, step_mask, positions))  # fmt: skip
    assert out[:, 2].tolist() == [6, 6, 6] and next_input[:, 0].tolist() == [6, 6, 6]
    assert (int(count), int(used), int(slot)) == (3, 1, 3) and bool(done.all())
    assert step_mask[:, 3].all() and not step_mask[:, :3].any() and positions[:, 0].tolist() == [5, 6, 7]


@pytest.mark.parametrize("capture", ["eager", pytest.param("graph", marks=pytest.mark.gpu)])
def test_the_engine_through_the_kernel_samples_what_it_samples_through_the_torch_ops(monkeypatch, capture):
    """decode() on the Triton backend (the fused draw and this kernel) against the same decode with the torch ops
    in the kernel's place: the same tokens and log-probs, EOS ids included (rows end and pad); on a GPU also with
    the step captured as a CUDA graph (the kernel launched once at capture, replayed at every step)."""
    if capture == "graph" and DEVICE.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    monkeypatch.setattr(engine_module, "BOOKKEEPING_KERNEL", True)
    model = _model("llama", torch.float32, seed=6).to(DEVICE)
    ids, mask = _prompts(DEVICE)
    torch.manual_seed(1)
    free, _ = decode(model, ids, mask, max_new_tokens=8, sampling=Sampling(), pad_id=0, capture="eager")
    eos = (int(free[0, 2]), int(free[3, 4]))  # rows 0 and 3 end early
    runs, calls = [], []
    for kernel in (True, False):
        book = advance_in_one_kernel if kernel else torch_bookkeeping
        monkeypatch.setattr(engine_module, "advance_in_one_kernel",
                            lambda *a, book=book, kernel=kernel: calls.append(kernel) or book(*a))  # fmt: skip
        release_sessions(model)
        torch.manual_seed(1)
        runs.append(decode(model, ids, mask, max_new_tokens=8, sampling=Sampling(), pad_id=0, eos_ids=eos,
                           capture=capture, logprobs=True))  # fmt: skip
    # the prefill's draw and 7 steps each run (a captured step calls it at its warm-ups and capture, then replays)
    assert calls.count(True) == calls.count(False) and (capture == "graph" or calls.count(True) == 8)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert (runs[0][0][0, 3:] == 0).all() and runs[0][0].shape[1] == 8
    release_sessions(model)
