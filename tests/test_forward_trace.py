"""How far the batch's labels travel through the patched forward: every call into a liger_patch_kd function that
receives them (the labels, their row-aligned targets, or a dict / sequence / dataclass holding one), for one
forward of a tiny patched Llama, against a live teacher and against a top-k batch.

The forward reads the labels once, parses the teacher signal once, runs the backbone, gathers the head and calls
the signal's loss; a path that wanders (back and forth between modules, the same check in three places) shows
here as more calls, or as a module entered again after the labels left it."""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.nn.functional as F

import liger_patch_kd
from liger_patch_kd import models as M
from tests.tiny_models import tiny_model

PACKAGE = os.path.dirname(liger_patch_kd.__file__) + os.sep
MAX_CALLS = 20  # calls that receive the labels, in one forward
MAX_ENTRIES = 2  # times the labels enter any one module


class LabelTrace:
    """sys.setprofile tracer: the liger_patch_kd functions (module, name) whose arguments carry the labels."""

    def __init__(self, labels: torch.Tensor, ignore_index: int = -100) -> None:
        shifted = F.pad(labels[..., 1:], (0, 1), value=ignore_index)
        self.values = [labels, shifted]
        self.calls: list[tuple[str, str]] = []

    def _is_labels(self, value) -> bool:
        if not isinstance(value, torch.Tensor) or value.dtype != torch.long:
            return False
        return any(value.numel() == v.numel() and torch.equal(value.reshape(-1), v.reshape(-1)) for v in self.values)

    def _carries(self, value, depth: int = 0) -> bool:
        if self._is_labels(value):
            return True
        if depth > 0:
            return False
        if isinstance(value, dict):
            return any(self._carries(v, depth + 1) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(self._carries(v, depth + 1) for v in value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return any(self._carries(getattr(value, f.name, None), depth + 1) for f in dataclasses.fields(value))
        return False

    def _profile(self, frame, event, arg) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        code = frame.f_code
        n = code.co_argcount + code.co_kwonlyargcount
        n += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)  # *args, **kwargs
        f_locals = frame.f_locals
        if any(self._carries(f_locals.get(name)) for name in code.co_varnames[:n]):
            module = os.path.relpath(code.co_filename, PACKAGE)
            self.calls.append((module, code.co_name))

    def __enter__(self) -> LabelTrace:
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)

    def entries(self) -> dict[str, int]:
        """module -> how many times the labels came into it from another module (or from outside)."""
        counts: dict[str, int] = {}
        previous = None
        for module, _ in self.calls:
            if module != previous:
                counts[module] = counts.get(module, 0) + 1
            previous = module
        return counts


def _batch(vocab: int = 128):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, 9), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, torch.ones_like(ids), labels


def _trace(**teacher) -> LabelTrace:
    student = tiny_model("llama", seed=1, vocab=128)
    M.apply_kd_patch(model=student, beta=0.5)
    ids, mask, labels = _batch()
    for name, value in teacher.items():  # a teacher model needs the KD forward before the trace starts
        if isinstance(value, torch.nn.Module):
            M.kd_forward.install_kd_forward(value)
    student(input_ids=ids, attention_mask=mask, labels=labels, **teacher)  # warm: first-call set-up is not a path
    with LabelTrace(labels) as trace:
        out = student(input_ids=ids, attention_mask=mask, labels=labels, **teacher)
    assert torch.isfinite(out.loss)
    return trace


def _topk_signal(k: int = 4, vocab: int = 128):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 9, vocab, generator=g, dtype=torch.float64)
    logprobs, token_ids = torch.log_softmax(logits, -1).topk(k, dim=-1)
    return {"teacher_token_ids": token_ids, "teacher_logprobs": logprobs}


def _report(trace: LabelTrace) -> str:
    return f"{len(trace.calls)} calls, entries {trace.entries()}: {trace.calls}"


def test_labels_through_a_live_teacher_forward():
    trace = _trace(teacher_model=tiny_model("llama", seed=2, vocab=128, hidden=48))
    assert 0 < len(trace.calls) < MAX_CALLS, _report(trace)
    assert max(trace.entries().values()) <= MAX_ENTRIES, _report(trace)


def test_labels_through_a_topk_forward():
    trace = _trace(**_topk_signal())
    assert 0 < len(trace.calls) < MAX_CALLS, _report(trace)
    assert max(trace.entries().values()) <= MAX_ENTRIES, _report(trace)


def test_the_tracer_sees_the_labels():
    """The tracer itself: a liger_patch_kd function given the labels is counted, one given other ids is not."""
    ids, _, labels = _batch()
    with LabelTrace(labels) as trace:
        M.kd_io.shift_labels(labels, -100)
        M.kd_io.shift_labels(ids, -100)
    assert trace.calls == [("models/kd_io.py", "shift_labels")]
