"""What the multi-GPU benchmarks share (bench_multi_gpu, bench_multi_gpu_xtok): the per-step probe and its Trainer
callback, FSDP on CPU for the tiny runs."""

from __future__ import annotations

import os
import sys
import time

import torch


# -------------------------------------------------------------------------------------------- measuring
class StepProbe:
    """Step times, peak memory and the fused loss's own memory on this process. The loss probe resets the
    peak counter around the loss, so the step's peak is kept as the max of the parts."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.step_s: list[float] = []
        self.logs: list[dict] = []
        self.loss_calls: list[dict] = []
        self._peak = 0
        self._t0 = 0.0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self._peak = 0

    def peak_bytes(self) -> int:
        return max(self._peak, torch.cuda.max_memory_allocated()) if self.cuda else 0

    def wrap_loss(self, fn):
        from torch.distributed.tensor import DTensor

        def probed(hidden, weight, teacher_hidden, teacher_weight, *args, **kwargs):
            record = dict(
                rows=hidden.numel() // hidden.shape[-1],
                student_weight=list(weight.shape),
                teacher_weight=list(teacher_weight.shape),
                sharded=isinstance(weight, DTensor) or isinstance(teacher_weight, DTensor),
            )
            if self.cuda:
                self.sync()
                before = torch.cuda.memory_allocated()
                self._peak = max(self._peak, torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
            out = fn(hidden, weight, teacher_hidden, teacher_weight, *args, **kwargs)
            if self.cuda:
                self.sync()
                # gradients every method must return: d hidden (N x H) and d weight (V x H), in the input dtype
                grads = (hidden.numel() + weight.numel()) * hidden.element_size()
                extra = torch.cuda.max_memory_allocated() - before
                record.update(ms=1e3 * (time.perf_counter() - t0), extra_GiB=extra / 2**30,
                              extra_beyond_grads_GiB=(extra - grads) / 2**30)  # fmt: skip
            self.loss_calls.append(record)
            return out

        return probed


def make_callback(probe: StepProbe):
    from transformers import TrainerCallback

    class Timing(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            probe.sync()
            probe.reset_peak()

        def on_step_begin(self, args, state, control, **kwargs):
            probe.sync()
            probe._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            probe.sync()
            probe.step_s.append(time.perf_counter() - probe._t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                probe.logs.append({"step": state.global_step, "loss": logs["loss"], "grad_norm": logs.get("grad_norm")})

    return Timing()


# ------------------------------------------------------------------------------------------------- tiny CPU
def allow_fsdp_on_cpu() -> None:
    """accelerate only turns FSDP / DeepSpeed on for GPU-like devices; for the CPU smoke test, let it believe
    the gloo processes are GPUs and keep the device on the CPU. Tiny mode only."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        found, kind = original(self, cpu=True, sagemaker_dp=sagemaker_dp, backend="gloo")
        return ("gloo", DistributedType.MULTI_GPU) if kind == DistributedType.MULTI_CPU else (found, kind)

    def set_device(self):
        if self.device is None:
            self.device = torch.device("cpu")

    PartialState._prepare_backend = _prepare_backend
    PartialState.set_device = set_device


def end_distributed() -> None:
    """The end of a run that torch.distributed joined: every rank past the results, the group destroyed, then, in a
    launched worker (WORLD_SIZE > 1), the process left at once. Why: at interpreter exit gloo's threads can still be
    joinable, and their destructors abort the process ("terminate called without an active exception", exit -6)
    after the results were written; about one run in four on a loaded 2-core CPU. Nothing is left to run then."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
