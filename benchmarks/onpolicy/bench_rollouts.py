"""Rollout generation alone: tokens/s of trainer.rollouts.generate.generate_rollouts by batch size and KV cache.

    python -m benchmarks.onpolicy.bench_rollouts --out runs/bench_rollouts.json
    python -m benchmarks.onpolicy.bench_rollouts --tiny                      # CPU smoke test, no figures

The student of bench_onpolicy (Llama-3.2-1B-shaped, random weights, bf16, sdpa), patched as KDTrainer patches it
(every kernel, gradient checkpointing on, train mode between calls, as between training steps), generating
`--completion` new tokens after `--prompt`-token prompts. Each (rows, cache) cell calls generate_rollouts
`--calls` times with a parameter update between calls (what an optimizer step does to a compiled graph) and
reports the last call's tokens/s, the first call's seconds (compilation) and how many frames torch.compile
compiled over all calls: a count that grows with the calls means recompilation per call. The cache "engine" times
`liger-kd serve`'s own sampler instead (server/generation.py: GenerationEngine.complete on the same model,
in eval mode, as the server holds it; no HTTP), what the engine rows of bench_engine wait for.

`--profile N` adds, per cell, a call of N new tokens under torch.profiler: ms per decode step, the GPU's busy share
and the kernels that took the most (what found the per-head KV-cache copy generation/decode_attention.py removes).

Measured 2026-12-01 on one H200, 64 rows, 512 + 512 tokens, second call (`--rows 64 --caches static dynamic engine
--calls 2 --profile 32`, benchmarks/results/bench_rollouts.json): the static cache 11,961 tokens/s,
the dynamic one 5,708, the server's sampler 4,560 (before the packed decode attention: 6,951-7,331 / 4,973 /
3,201). For asynchronous rollouts to reach 80 % of off-policy (~9,300 generated tokens/s at bench_onpolicy's
shapes) the engine must be
vLLM, or sample as generate_rollouts does with the static, compiled cache.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from ..common import environment, print_table, write_json
from ..common.onpolicy import SHAPES, build


def random_prompts(rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`rows` prompts of `length` random ids above the special ones (0 pad, 1 start, 2 EOS)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(rows)]


@contextlib.contextmanager
def step_setting(products: str, launch: str, fused_rows: int | None, student):
    """The decode step's products as `products` says, its kernels launched as `launch` says and its gated MLPs fused
    up to `fused_rows` rows (None: as shipped; main's --products, --launch, --fused-rows), each setting in sessions
    of its own."""
    from liger_patch_kd.generation import dependent_launch, few_row_linear, mlp_fusion, release_sessions

    shipped = few_row_linear.MIN_OUT_FEATURES, dependent_launch.ENABLED, mlp_fusion.FUSED_ROWS
    few_row_linear.MIN_OUT_FEATURES = {"default": shipped[0], "cublas": 1 << 62, "all": 0}[products]
    dependent_launch.ENABLED = {"default": shipped[1], "plain": False, "dependent": True}[launch]
    mlp_fusion.FUSED_ROWS = shipped[2] if fused_rows is None else fused_rows
    release_sessions(student)  # a captured step keeps the kernels it was captured with
    try:
        yield
    finally:
        few_row_linear.MIN_OUT_FEATURES, dependent_launch.ENABLED, mlp_fusion.FUSED_ROWS = shipped
        release_sessions(student)


def run_cell(rows: int, cache: str, a: argparse.Namespace, student, vocab: int, device) -> dict:
    from torch._dynamo.utils import counters

    from liger_patch_kd.trainer.rollouts.generate import RolloutSettings, generate_rollouts

    direct = cache.startswith("engine-")  # engine-<capture>[-fused]: decode() with that capture
    settings = RolloutSettings(
        max_new_tokens=a.completion, cache="auto" if cache == "engine" or direct else cache, seed=0
    )
    prompts = random_prompts(rows, a.prompt, vocab, seed=rows)
    if cache == "engine":
        from liger_patch_kd.server.generation import GenerationEngine, GenerationRequest

        engine = GenerationEngine(student, "student")
        request = GenerationRequest(prompts=prompts, n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=a.completion,
                                    seed=0, logprobs=0, stop_ids=(), return_token_ids=True, model=None)  # fmt: skip
    frames_before = counters["frames"]["ok"]
    seconds = []
    for call in range(a.calls):
        with torch.no_grad():  # an optimizer step between calls changes the weights in place
            for p in student.parameters():
                p.mul_(1.0)
        student.train()
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        if direct:
            tokens = engine_call(student, prompts, cache.removeprefix("engine-"), a, device)
        elif cache == "engine":
            student.eval()  # as the server holds it (train mode with checkpointing would turn the KV cache off)
            choices = engine.complete(request)["choices"]
            tokens = sum(len(c["token_ids"]) for c in choices)
        else:
            out = generate_rollouts(student, prompts, settings, pad_id=0, eos_ids={2}, start_id=1, step=call)
            tokens = sum(len(r.completion) for r in out)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - began)
    bandwidth = hbm_bytes_per_s(device)  # every weight read once per step (in bf16 under autocast)
    floor_s = weight_bytes(student) / bandwidth if bandwidth else None
    step_ms = replay_ms(student, prompts, cache, a, device) if direct or cache == "graph" else None
    print(f"{rows} rows, {cache}: {seconds[-1] / a.completion * 1e3:.3f} ms a step with the prefill, {step_ms} alone")
    return {
        "rows": rows,
        "cache": cache,
        "first_call_s": seconds[0],
        "last_call_s": seconds[-1],
        "tokens_per_s": tokens / seconds[-1],
        "ms_per_step": seconds[-1] / a.completion * 1e3,  # the prompt's prefill included, as the table
        "decode_step_ms": step_ms,  # the captured step alone (CUDA events around its replays)
        "floor_ms": floor_s * 1e3 if floor_s else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0,
        "frames_compiled": counters["frames"]["ok"] - frames_before,
    }


# Peak memory bandwidth by the device's name (the vendors' data sheets); a floor is reported only for these
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12}


def hbm_bytes_per_s(device) -> float | None:
    """The data-sheet memory bandwidth of `device` (the first name of HBM_BYTES_PER_S in its name), or None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((speed for key, speed in HBM_BYTES_PER_S.items() if key in name), None)


def weight_bytes(model) -> int:
    """The bytes a step reads of the weights: in the autocast dtype where it is on (what the products read)."""
    cast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    return sum(p.numel() * (cast.itemsize if cast and p.is_floating_point() else p.element_size())
               for p in model.parameters())  # fmt: skip


def replay_ms(student, prompts: list[list[int]], cache: str, a: argparse.Namespace, device) -> float | None:
    """ms per decode step alone: the session the last call left, prefilled again and stepped a.completion - 1
    times between CUDA events (no prefill, no EOS checks), in the mode and code the call ran it."""
    from liger_patch_kd.generation.engine import session_of
    from liger_patch_kd.models import original_forward, transformers_code

    from .compiled_decode import COMPILED_CAPTURES, compiled_session_of, time_steps

    if device.type != "cuda":
        return None
    ids = torch.tensor(prompts, device=device)
    student.eval()
    code = (lambda: original_forward(student)) if cache == "graph" else (lambda: transformers_code(student))
    if session_of(student) is None and cache == "graph":  # released after the call (release_if_large): the call's
        from liger_patch_kd.generation import Sampling, decode  # session again, as engine_sequences makes it

        with code():
            decode(student, ids, torch.ones_like(ids), max_new_tokens=a.completion, sampling=Sampling(), pad_id=0,
                   eos_ids=(2,), capture="graph", fuse_projections=True)  # fmt: skip
    compiled = cache.removeprefix("engine-").removesuffix("-fused") in COMPILED_CAPTURES
    session = compiled_session_of(student) if compiled else session_of(student)
    if session is None or session.key.rows != ids.shape[0]:
        student.train()
        return None
    with code():
        ms = time_steps(session, ids, torch.ones_like(ids), min(a.completion, session.key.length - ids.shape[1]) - 1)
    student.train()
    return ms


def engine_call(student, prompts: list[list[int]], capture: str, a: argparse.Namespace, device) -> int:
    """generation.decode directly (the capture named; a torch.compile one through compiled_decode), in eval mode, as
    generate_rollouts calls it: tokens made."""
    from liger_patch_kd.generation import Sampling, decode
    from liger_patch_kd.models import transformers_code

    from .compiled_decode import COMPILED_CAPTURES, compiled_decode

    ids = torch.tensor(prompts, device=device)
    fuse, capture = capture.endswith("-fused"), capture.removesuffix("-fused")
    student.eval()
    with transformers_code(student):
        if capture in COMPILED_CAPTURES and device.type == "cuda":
            tokens = compiled_decode(student, ids, torch.ones_like(ids), capture=capture, max_new_tokens=a.completion,
                                     pad_id=0, eos_ids=(2,), check_every=a.check_every, fuse_projections=fuse)
        else:
            tokens, _ = decode(student, ids, torch.ones_like(ids), max_new_tokens=a.completion, sampling=Sampling(),
                               pad_id=0, eos_ids=(2,), check_every=a.check_every,
                               capture="eager" if capture in COMPILED_CAPTURES else capture,  # a CPU runs eager
                               fuse_projections=fuse)  # fmt: skip
    student.train()
    return tokens.numel()


def profile_call(rows: int, cache: str, a: argparse.Namespace, student, vocab: int) -> dict:
    """One more generate_rollouts call of `--profile` new tokens under torch.profiler (after the timed cells: warm
    and compiled): wall seconds per decode step, the GPU's busy share of it (kernel time summed) and the kernels
    that took the most, which says whether a decode step waits for the GPU or for the host."""
    from torch.profiler import ProfilerActivity, profile

    from liger_patch_kd.trainer.rollouts.generate import RolloutSettings, generate_rollouts

    settings = RolloutSettings(max_new_tokens=a.profile, cache=cache, seed=1)
    prompts = random_prompts(rows, a.prompt, vocab, seed=rows + 1)
    generate_rollouts(student, prompts, settings, pad_id=0, eos_ids=set(), start_id=1, step=0)  # this shape, warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        generate_rollouts(student, prompts, settings, pad_id=0, eos_ids=set(), start_id=1, step=1)
        torch.cuda.synchronize()
        wall = time.perf_counter() - began
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    busy_s = sum(e.self_device_time_total for e in kernels) / 1e6
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]
    result = {
        "rows": rows, "cache": cache, "new_tokens": a.profile, "wall_s": wall, "ms_per_step": wall / a.profile * 1e3,
        "gpu_busy_s": busy_s, "gpu_busy_share": busy_s / wall,
        "top_kernels": [{"name": e.key[:90], "ms": e.self_device_time_total / 1e3, "calls": e.count} for e in top],
    }  # fmt: skip
    share = result["gpu_busy_share"]
    print(f"profile {rows} rows, {cache}: {result['ms_per_step']:.2f} ms a step, GPU busy {share:.0%}")
    for k in result["top_kernels"]:
        print(f"  {k['ms']:9.2f} ms  {k['calls']:6d}  {k['name']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_rollouts.json")
    parser.add_argument("--rows", type=int, nargs="*", default=[8, 32, 64, 128])
    parser.add_argument(
        "--caches",
        nargs="*",
        default=["dynamic", "static"],
        help="dynamic, static, graph, auto (generate_rollouts); engine (liger-kd serve's sampler); "
        "engine-graph, engine-eager (generation.decode with that capture), engine-compile, engine-reduce-overhead "
        "(the engine's step under torch.compile: compiled_decode.py); a -fused suffix fuses q/k/v and gate/up",
    )
    parser.add_argument("--check-every", type=int, default=16, help="engine-*: decode steps between EOS checks")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--completion", type=int, default=512)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0, help="new tokens of a profiled call (CUDA) after the cells")
    parser.add_argument("--no-cudnn-sdpa", action="store_true", help="SDPA without its cuDNN backend (CUDA)")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--products", nargs="+", choices=("default", "cublas", "all"), default=["default"],
                        help="the decode step's products, one set of cells each: as shipped (the few-row kernel on "
                             "the wide ones: generation/few_row_linear.py MIN_OUT_FEATURES), all through cuBLAS (the "
                             "tree before the kernel), or all through the kernel")  # fmt: skip
    parser.add_argument("--launch", nargs="+", choices=("default", "plain", "dependent"), default=["default"],
                        help="the decode step's kernels, one set of cells each (times each --products): as shipped "
                             "(generation/dependent_launch.py ENABLED), launched one after another, or as "
                             "programmatic dependents of the kernel before (Hopper)")  # fmt: skip
    parser.add_argument("--fused-rows", type=int, nargs="+", default=[None],
                        help="the most rows whose gated MLP takes gate/up and the activation in one launch, one set "
                             "of cells each (times each --products and --launch); as shipped "
                             "(generation/mlp_fusion.py FUSED_ROWS) unless given")  # fmt: skip
    parser.add_argument("--weights", choices=("bf16", "fp32-autocast"), default="bf16",
                        help="the student's weights: bf16, or fp32 decoded under bf16 autocast (mixed-precision "
                             "training's student, bf16=True in the Trainer); fp32 either way on a CPU")  # fmt: skip
    a = parser.parse_args()
    if a.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if a.tiny:
        a.rows, a.prompt, a.completion, a.calls = [2, 4], 8, 8, 2
    from liger_patch_kd import apply_kd_patch

    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    mixed = a.weights == "fp32-autocast" and device.type == "cuda"
    dtype = torch.bfloat16 if device.type == "cuda" and not mixed else torch.float32
    s_kw, _, vocab = SHAPES["tiny" if a.tiny else "llama"]
    student = build(s_kw, vocab, device, dtype, seed=0)
    apply_kd_patch(model=student)
    student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # fp32 weights compute in bf16 under autocast, as the Trainer's bf16=True runs its rollouts
    precision = torch.autocast("cuda", torch.bfloat16) if mixed else contextlib.nullcontext()
    with precision:
        results = []
        for products in a.products:
            for launch in a.launch:
                for fused_rows in a.fused_rows:
                    with step_setting(products, launch, fused_rows, student):
                        cells = [run_cell(rows, cache, a, student, vocab, device)
                                 for cache in a.caches for rows in a.rows]  # fmt: skip
                    rows_fused = "shipped" if fused_rows is None else fused_rows  # 0 is a setting: fuse none
                    results += [{**cell, "products": products, "launch": launch, "fused_rows": rows_fused}
                                for cell in cells]  # fmt: skip
    columns = ["rows", "cache", "products", "launch", "fused_rows", "tokens_per_s", "ms_per_step", "decode_step_ms",
               "floor_ms"]  # fmt: skip
    print_table(results, [*columns, "first_call_s", "last_call_s", "peak_gib", "frames_compiled"])
    profiled = []
    if a.profile and device.type == "cuda":
        profiled = [profile_call(r["rows"], r["cache"], a, student, vocab) for r in results
                    if not r["cache"].startswith("engine")]  # fmt: skip
    write_json(a.out, {"environment": environment(), "args": vars(a), "rows": results, "profiles": profiled})


if __name__ == "__main__":
    main()
