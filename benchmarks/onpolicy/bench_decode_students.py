"""The decode engine's speed for a patched and an unpatched student: generate_rollouts through the captured step
(kd_generation_cache "graph"), ms per decode step at 8 and 64 rows, in one table.

    python -m benchmarks.onpolicy.bench_decode_students --out runs/bench_decode_students.json   # a GPU
    python -m benchmarks.onpolicy.bench_decode_students --smoke                                 # CPU, no figures

The student of bench_onpolicy (Llama-3.2-1B-shaped, random weights, bf16, sdpa) generates `--completion` new tokens
after `--prompt`-token prompts, in eval mode between calls with a parameter update in place between them (what an
optimizer step does to the captured graph). Rows, each over --rows:

  unpatched                 the student as loaded (KDTrainingArguments' use_kd_patch=False): the engine runs its
                            twin of the model through the project's kernels (generation/kernel_twin.py)
  unpatched, kernels off    the same call with the engine's kernels off (decode(kernels=False)): transformers'
                            RMSNorm / RoPE / MLP ops in the captured step, what the engine ran before it had a twin
  patched                   apply_kd_patch(model=...) on the same student (what use_kd_patch=True does)

The target: "unpatched" within noise of "patched". Columns: ms_per_step (the last of --calls calls, its prefill
included: call seconds / new tokens), decode_step_ms (the captured step alone, CUDA events around its replays; CUDA
only), tokens_per_s. The unpatched rows run first: apply_kd_patch swaps transformers' RoPE function module-wide.
"""

from __future__ import annotations

import argparse
import time

import torch

from ..common import environment, print_table, write_json
from ..common.onpolicy import SHAPES, build
from .compiled_decode import time_steps

STUDENTS = ("unpatched", "unpatched, kernels off", "patched")


def random_prompts(rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`rows` prompts of `length` random ids above the special ones (0 pad, 1 start, 2 EOS)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(rows)]


def generate(student, prompts: list[list[int]], a: argparse.Namespace, kernels: bool, call: int) -> int:
    """One call as generate_rollouts makes it through the captured step (kernels off: decode() with the arguments
    generate_rollouts' engine_sequences passes, kernels=False); the tokens made."""
    from liger_patch_kd.generation import Sampling, decode, left_padded
    from liger_patch_kd.trainer.rollouts.generate import RolloutSettings, generate_rollouts

    if kernels:
        settings = RolloutSettings(max_new_tokens=a.completion, cache="graph", seed=0)
        out = generate_rollouts(student, prompts, settings, pad_id=0, eos_ids={2}, start_id=1, step=call)
        return sum(len(r.completion) for r in out)
    device = next(student.parameters()).device
    ids, mask = left_padded(prompts, 0, device=device)
    torch.manual_seed(call)
    tokens, _ = decode(student, ids, mask, max_new_tokens=a.completion, sampling=Sampling(), pad_id=0, eos_ids=(2,),
                       capture="graph", fuse_projections=True, kernels=False)  # fmt: skip
    return tokens.numel()


def step_ms(student, prompts: list[list[int]], a: argparse.Namespace) -> float | None:
    """ms per captured step alone, in the session the last call left (CUDA only; None where it was released)."""
    from liger_patch_kd.generation.engine import session_of

    session = session_of(student)
    if student.device.type != "cuda" or session is None or session.key.rows != len(prompts):
        return None
    ids = torch.tensor(prompts, device=student.device)
    steps = min(a.completion, session.key.length - ids.shape[1]) - 1
    return time_steps(session, ids, torch.ones_like(ids), steps)


def run_cell(student, name: str, rows: int, a: argparse.Namespace, vocab: int) -> dict:
    prompts = random_prompts(rows, a.prompt, vocab, seed=rows)
    seconds, tokens = [], 0
    student.eval()
    for call in range(a.calls):
        with torch.no_grad():  # an optimizer step between calls changes the weights in place
            for p in student.parameters():
                p.mul_(1.0)
        if student.device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        tokens = generate(student, prompts, a, kernels=name != "unpatched, kernels off", call=call)
        if student.device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - began)
    alone = step_ms(student, prompts, a)
    from liger_patch_kd.generation import release_sessions

    release_sessions(student)  # the next cell's session is its own (another bucket or another kernel setting)
    row = {
        "student": name,
        "rows": rows,
        "ms_per_step": seconds[-1] / a.completion * 1e3,
        "decode_step_ms": alone,
        "tokens_per_s": tokens / seconds[-1],
        "first_call_s": seconds[0],
    }
    print(f"{name}, {rows} rows: {row['ms_per_step']:.3f} ms a step with the prefill, {alone} alone")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_decode_students.json")
    parser.add_argument("--rows", type=int, nargs="*", default=[8, 64])
    parser.add_argument("--students", nargs="*", default=list(STUDENTS), choices=STUDENTS)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--completion", type=int, default=512)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on a CPU: checks the script runs")
    a = parser.parse_args()
    if a.smoke:
        a.prompt, a.completion, a.calls = 8, 6, 2
    from liger_patch_kd import apply_kd_patch, revert_kd_patch

    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    s_kw, _, vocab = SHAPES["tiny" if a.smoke else "llama"]
    student = build(s_kw, vocab, device, dtype, seed=0)
    results = []
    order = sorted(a.students, key=STUDENTS.index)  # the unpatched rows before the patch
    try:
        for name in order:
            if name == "patched":
                apply_kd_patch(model=student)
            results += [run_cell(student, name, rows, a, vocab) for rows in a.rows]
    finally:
        revert_kd_patch()
    by_cell = {(r["student"], r["rows"]): r for r in results}
    for r in results:  # the target: the unpatched student's step within noise of the patched one's
        patched = by_cell.get(("patched", r["rows"]))
        r["of_patched"] = r["ms_per_step"] / patched["ms_per_step"] if patched else None
    print_table(results, ["student", "rows", "ms_per_step", "decode_step_ms", "of_patched", "tokens_per_s",
                          "first_call_s"])  # fmt: skip
    write_json(a.out, {"environment": environment(), "args": vars(a), "rows": results})


if __name__ == "__main__":
    main()
