"""The path a labelled batch takes through the patched forward, traced: every call into a liger_patch_kd function
(comprehensions aside) from the forward's own code, down to the loss's front door, for one forward of a tiny
patched Llama (kernels off: the backbone is transformers' own), against a live teacher and against a top-k batch.
Inside the loss (losses/, ops/, reference/, config, conventions, distributed) the path is not followed: that is
the loss's own work, tested against the reference elsewhere.

The forward parses the teacher signal once (models/signals/), runs the backbone, gathers the head and calls the
signal's loss; a path that wanders (back and forth between modules, the same check in several places) shows here
as more calls, or as a module the batch enters again after leaving it. The bounds are what the path takes today,
so a change that lengthens it fails here and says where."""

from __future__ import annotations

import os
import sys

import torch

import liger_patch_kd
from liger_patch_kd import models as M
from tests.tiny_models import tiny_model

PACKAGE = os.path.dirname(liger_patch_kd.__file__) + os.sep
LOSS_ROOMS = ("losses/", "ops/", "reference/", "config.py", "conventions.py", "distributed.py", "utils")
# (calls, entries of the most entered module). Before the typed signal the path took (76, 9) with a live teacher
# and (40, 4) with a top-k batch, and (72, 8) and (38, 4) with it, most of them lookups of the model's facts
# (backbone.py, registry.py, spec.py, state.py, each entered several times). With the facts found once per model
# (models/facts.py) each forward is: facts, backbone, head, the signal's loss; a live teacher's forward runs inside
# the student's, so each of those modules is entered twice there
LIVE_BOUNDS = (20, 2)
TOPK_BOUNDS = (12, 2)


class PathTrace:
    """sys.setprofile tracer: (module, function) of each liger_patch_kd call on the forward's path."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def _profile(self, frame, event, arg) -> None:
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(PACKAGE) or code.co_name.startswith("<"):
            return
        caller = frame.f_back
        if caller is not None and caller.f_code.co_filename.startswith(PACKAGE):
            if os.path.relpath(caller.f_code.co_filename, PACKAGE).startswith(LOSS_ROOMS):
                return  # inside the loss
        self.calls.append((os.path.relpath(code.co_filename, PACKAGE), code.co_name))

    def __enter__(self) -> PathTrace:
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)

    def entries(self) -> dict[str, int]:
        """module -> how many times the path came into it from another module."""
        counts: dict[str, int] = {}
        previous = None
        for module, _ in self.calls:
            if module != previous:
                counts[module] = counts.get(module, 0) + 1
            previous = module
        return counts

    def report(self) -> str:
        return f"{len(self.calls)} calls, entries {self.entries()}: {self.calls}"


def _batch(vocab: int = 128):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, 9), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, torch.ones_like(ids), labels


def _topk_signal(k: int = 4, vocab: int = 128):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 9, vocab, generator=g, dtype=torch.float64)
    logprobs, token_ids = torch.log_softmax(logits, -1).topk(k, dim=-1)
    return {"teacher_token_ids": token_ids, "teacher_logprobs": logprobs}


def _trace(**teacher) -> PathTrace:
    student = tiny_model("llama", seed=1, vocab=128)
    M.apply_kd_patch(model=student, beta=0.5, rope=False, swiglu=False, rms_norm=False)
    ids, mask, labels = _batch()
    student(input_ids=ids, attention_mask=mask, labels=labels, **teacher)  # warm: first-call set-up is not the path
    with PathTrace() as trace:
        out = student(input_ids=ids, attention_mask=mask, labels=labels, **teacher)
    assert torch.isfinite(out.loss) and out.loss > 0
    return trace


def _check(trace: PathTrace, bounds: tuple[int, int]) -> None:
    calls, entries = bounds
    assert len(trace.calls) <= calls, trace.report()
    assert max(trace.entries().values()) <= entries, trace.report()
    # the forward dispatches through the typed signal: parsed once, paired once
    assert [c for c in trace.calls if c[0] == "models/signals/parse.py"] == [
        ("models/signals/parse.py", "parse_signal"), ("models/signals/parse.py", "bind_rows"),
    ], trace.report()  # fmt: skip


def test_path_of_a_live_teacher_forward():
    trace = _trace(teacher_model=tiny_model("llama", seed=2, vocab=128, hidden=48))
    _check(trace, LIVE_BOUNDS)
    assert ("models/signals/live.py", "fused") in trace.calls, trace.report()


def test_path_of_a_topk_forward():
    trace = _trace(**_topk_signal())
    _check(trace, TOPK_BOUNDS)
    assert ("models/signals/stored.py", "fused") in trace.calls, trace.report()


def test_the_tracer_counts_entries():
    """The tracer itself: calls from outside are counted, a module left and entered again counts twice, and calls
    made inside the loss rooms are not followed."""
    _, _, labels = _batch()
    with PathTrace() as trace:
        M.kd_io.shift_labels(labels, -100)
        M.backbone.trailing_padding_only(None, labels, -100, {})
        M.kd_io.shift_labels(labels, -100)
        liger_patch_kd.config.KDLossConfig(beta=0.5)  # its __post_init__ is called from config.py: not followed
    assert trace.entries() == {"models/kd_io.py": 2, "models/backbone.py": 1, "config.py": 1}, trace.report()
