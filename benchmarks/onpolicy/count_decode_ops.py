"""What one captured decode step launches: every op that does work (aten ops that are not views or allocations, and
Triton kernels), with the line of the model or engine that asks for it. On a small student a decode step is bound by
how many kernels it launches, and a CUDA graph replays exactly these; this census runs on a CPU through the Triton
interpreter, so it can be read without a GPU.

    python -m benchmarks.onpolicy.count_decode_ops                    # the accuracy benchmark's student
    python -m benchmarks.onpolicy.count_decode_ops --weights bf16 --json runs/count_decode_ops.json

Counts only: an op's cost on a GPU is another matter (bench_rollouts, bench_time_to_accuracy --phases).
"""

from __future__ import annotations

import argparse
import collections
import os
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels run on the CPU

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# ops that launch no kernel of their own: views, allocations, dtype queries
NO_KERNEL = {
    "view", "_unsafe_view", "as_strided", "t", "transpose", "unsqueeze", "squeeze", "expand", "slice", "select",
    "split_with_sizes", "split", "narrow", "alias", "reshape", "permute", "detach", "_reshape_alias", "unbind",
    "lift_fresh", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "view_as",
    "promote_types", "result_type", "set_", "is_same_size",
}  # fmt: skip


class _Census(TorchDispatchMode):
    """Records each aten op that does work, with the last project or transformers line on the stack."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, str]] = []
        self.inside_kernel = False  # the interpreter's own tensor copies while it runs a Triton kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in NO_KERNEL and not self.inside_kernel:
            frames = [f for f in traceback.extract_stack()
                      if ("liger_patch_kd" in f.filename or "transformers" in f.filename)
                      and "triton" not in f.filename]  # fmt: skip
            where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"
            self.ops.append((name, where))
        return func(*args, **(kwargs or {}))


def decode_step_ops(model: torch.nn.Module, rows: int = 16, prompt: int = 14, autocast: bool = False):
    """(aten ops, Triton kernels) of one decode step of `model` (a session made by a short decode call first, with
    fused projections as the Trainer's rollouts run it): two lists of (name, where) and of kernel names."""
    ids = torch.randint(5, 200, (rows, prompt), generator=torch.Generator().manual_seed(0))
    backend = os.environ.get("LIGER_KD_BACKEND")
    os.environ["LIGER_KD_BACKEND"] = "triton"  # the engine's GPU path: its Triton kernels, not torch stand-ins
    try:
        return _census_of_a_step(model, ids, autocast)
    finally:
        if backend is None:
            os.environ.pop("LIGER_KD_BACKEND")
        else:
            os.environ["LIGER_KD_BACKEND"] = backend


def _census_of_a_step(model: torch.nn.Module, ids: torch.Tensor, autocast: bool):
    import triton.runtime.interpreter as interpreter

    from liger_patch_kd.generation import Sampling, decode
    from liger_patch_kd.generation.decode_attention import decode_kernel, packed_decode_attention
    from liger_patch_kd.generation.engine import session_of

    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        decode(model, ids, torch.ones_like(ids), max_new_tokens=4, sampling=Sampling(), pad_id=0, eos_ids=(2,),
               capture="eager", fuse_projections=True)  # fmt: skip
        session = session_of(model)
        kernels: list[str] = []
        run = interpreter.InterpretedFunction.run
        census = _Census()

        def counted(self, *args, **kwargs):
            kernels.append(self.fn.__name__)
            census.inside_kernel = True
            try:
                return run(self, *args, **kwargs)
            finally:
                census.inside_kernel = False

        interpreter.InterpretedFunction.run = counted
        try:
            with torch.no_grad(), packed_decode_attention(), decode_kernel(), session.projections(), census:
                session.step()
        finally:
            interpreter.InterpretedFunction.run = run
    return census.ops, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--student", choices=("arithmetic", "llama-1b"), default="arithmetic",
                        help="the accuracy benchmark's student (--shape, --vocab), or bench_rollouts' Llama-1B-shaped "
                             "one (random weights; a few GB of memory and minutes through the interpreter)")
    parser.add_argument("--shape", type=int, nargs=2, default=(96, 2), metavar=("HIDDEN", "LAYERS"),
                        help="the arithmetic student's hidden size and layers (the benchmark's: 96 2, head size 24)")
    parser.add_argument("--vocab", type=int, default=264)
    parser.add_argument("--weights", choices=("fp32-autocast", "bf16"), default="fp32-autocast",
                        help="fp32 weights under bf16 autocast (the benchmark's bf16=True), or bf16 weights")
    parser.add_argument("--json", default=None, help="write the census here")
    a = parser.parse_args()
    from benchmarks.common import environment, print_table, write_json
    from liger_patch_kd.demo.arithmetic import ModelShape

    if a.student == "llama-1b":
        from benchmarks.common.onpolicy import SHAPES, build

        student, _, vocab = SHAPES["llama"]
        model = build(student, vocab, "cpu", torch.float32, seed=0).eval()
    else:
        model = ModelShape(*a.shape).build(a.vocab, seed=0, device="cpu").eval()
    if a.weights == "bf16":
        model = model.to(torch.bfloat16)
    ops, kernels = decode_step_ops(model, autocast=a.weights == "fp32-autocast")
    counts = collections.Counter(ops)
    rows = [{"op": name, "where": where, "per_step": n} for (name, where), n in counts.most_common()]
    rows += [{"op": name, "where": "Triton", "per_step": n} for name, n in collections.Counter(kernels).most_common()]
    print_table(rows, ["op", "where", "per_step"])
    print(f"{len(ops)} aten ops and {len(kernels)} Triton kernels a step: {len(ops) + len(kernels)}")
    if a.json:
        write_json(a.json, {"environment": environment(), "args": vars(a), "ops": rows,
                            "total": len(ops) + len(kernels)})  # fmt: skip


if __name__ == "__main__":
    main()
