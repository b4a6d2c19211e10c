"""Where a Trainer's optimizer step spends its wall time, by phase, for any Trainer (ours or TRL's).

`PhaseTimer(trainer, device).install()` wraps the trainer's own methods on the instance (get_batch_samples: the
batch, where our on-policy rollouts are sampled; training_step; compute_loss within it), our rollout sampler, the
teacher's backbone and the student's `generate` (TRL samples there), each timed with the device drained before and
after (a launch-bound step's phases are host time, which only a drain makes visible). Nested phases are reported as they
nest: compute_loss is part of training_step. After `skip` warm steps it records `steps` steps, then puts a
torch.profiler over `profiled` more: kernels launched per step, the GPU's busy share, the kernels taking most time.
`summary()` is plain JSON."""

from __future__ import annotations

import functools
import time
from collections import defaultdict

import torch


def drain(device: torch.device) -> None:
    """Wait for the device, except inside a CUDA graph's capture (a teacher's, models.captured_backbone), where waiting
    is not allowed: a phase there is timed undrained."""
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize(device)


class PhaseTimer:
    def __init__(self, trainer, device: torch.device, *, skip: int = 5, steps: int = 10, profiled: int = 3):
        self.trainer, self.device = trainer, device
        self.skip, self.steps, self.profiled = skip, steps, profiled
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.step_seconds: list[float] = []
        self.kernels: dict | None = None
        self._step, self._began, self._prof = 0, None, None

    def recording(self) -> bool:
        return self.skip <= self._step < self.skip + self.steps

    def _timed(self, name: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not self.recording():
                return fn(*args, **kwargs)
            drain(self.device)
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                drain(self.device)
                self.seconds[name] += time.perf_counter() - began
                self.calls[name] += 1

        return wrapper

    def install(self):
        from transformers import TrainerCallback

        t = self.trainer
        if t.args.max_steps > 0:  # a short run (a smoke check) still records some steps
            self.skip = min(self.skip, t.args.max_steps // 4)
            self.steps = min(self.steps, max(1, t.args.max_steps // 2))
            self.profiled = min(self.profiled, max(1, t.args.max_steps - self.skip - self.steps))
        for name in ("get_batch_samples", "training_step", "compute_loss"):
            setattr(t, name, self._timed(name, getattr(t, name)))
        onpolicy = getattr(t, "onpolicy", None)  # ours: the sampler get_batch_samples calls (engine or eager)
        if onpolicy is not None and callable(getattr(onpolicy, "source", None)):
            onpolicy.source = self._timed("rollouts (sampling)", onpolicy.source)
        student = t.accelerator.unwrap_model(t.model)
        student.generate = self._timed("student generate", student.generate)
        teacher = getattr(t, "teacher_model", None)
        backbone = getattr(teacher, "model", teacher) if teacher is not None else None
        if isinstance(backbone, torch.nn.Module):  # the teacher's layers, however its caller reaches them
            backbone.forward = self._timed("teacher backbone forward", backbone.forward)
        timer = self

        class StepEnd(TrainerCallback):  # first of the step's callbacks: before any scoring callback runs
            def on_step_end(self, args, state, control, **kwargs):
                timer.step_ended()

        class NextStepBegins(TrainerCallback):  # last of them: the next step's clock starts after their work
            def on_step_end(self, args, state, control, **kwargs):
                drain(timer.device)
                timer._began = time.perf_counter()

        t.callback_handler.callbacks.insert(0, StepEnd())
        t.add_callback(NextStepBegins())
        return self

    def step_ended(self) -> None:
        drain(self.device)
        now = time.perf_counter()
        if self.recording() and self._began is not None:
            self.step_seconds.append(now - self._began)
        self._step += 1
        first_profiled = self.skip + self.steps
        if self._step == first_profiled:
            from torch.profiler import ProfilerActivity, profile

            cuda = [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
            self._prof = profile(activities=[ProfilerActivity.CPU, *cuda])
            self._prof.__enter__()
            self._prof_began = time.perf_counter()
        elif self._prof is not None and self._step == first_profiled + self.profiled:
            wall = time.perf_counter() - self._prof_began
            self._prof.__exit__(None, None, None)
            self.kernels = kernel_summary(self._prof, self.profiled, wall)
            self._prof = None

    def summary(self) -> dict:
        n = max(1, len(self.step_seconds))
        step_ms = sum(self.step_seconds) / n * 1e3
        phases = {k: dict(ms_per_step=v / n * 1e3, calls_per_step=self.calls[k] / n) for k, v in self.seconds.items()}
        return dict(steps=len(self.step_seconds), step_ms=step_ms, phases=phases, kernels=self.kernels)


def kernel_summary(prof, steps: int, wall: float, top: int = 15) -> dict:
    """Per step: kernels launched, their summed time, the wall time (under the profiler, which slows the host), the
    kernels taking most time and the host ops taking most of the host's own time."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            entry = totals[e.name[:80]]
            entry[0] += 1
            entry[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    host: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.key_averages():
        if e.device_type.name == "CPU":
            host[e.key[:80]] = [e.count, e.self_cpu_time_total]
    launched = sum(v[0] for v in totals.values())
    busy_us = sum(v[1] for v in totals.values())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return dict(kernels_per_step=launched / steps, kernel_ms_per_step=busy_us / steps / 1e3,
                wall_ms_per_step=wall / steps * 1e3,
                top=[dict(name=k, per_step=c / steps, ms_per_step=us / steps / 1e3) for k, (c, us) in ranked],
                host_top=[dict(name=k, per_step=c / steps, self_ms_per_step=us / steps / 1e3)
                          for k, (c, us) in sorted(host.items(), key=lambda kv: -kv[1][1])[:top]])  # fmt: skip


def print_summary(label: str, s: dict) -> None:
    print(f"phases of {label}: {s['step_ms']:.1f} ms a step over {s['steps']} steps")
    for name, p in sorted(s["phases"].items(), key=lambda kv: -kv[1]["ms_per_step"]):
        print(f"  {name:28s} {p['ms_per_step']:8.2f} ms  ({p['calls_per_step']:.1f} calls)")
    k = s.get("kernels")
    if k:
        print(f"  profiled: {k['kernels_per_step']:.0f} kernels, {k['kernel_ms_per_step']:.2f} ms of kernels in "
              f"{k['wall_ms_per_step']:.1f} ms a step")  # fmt: skip
        for row in k["top"][:10]:
            print(f"    {row['ms_per_step']:7.3f} ms  x{row['per_step']:6.1f}  {row['name']}")
        print("  host ops by their own time:")
        for row in k["host_top"][:10]:
            print(f"    {row['self_ms_per_step']:7.3f} ms  x{row['per_step']:6.1f}  {row['name']}")
