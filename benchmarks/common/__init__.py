"""What every benchmark here shares: timing with CUDA events, peak memory, a printed table and a JSON file.

What some of them share is beside it, one module per family: train_step.py (the one-GPU step), offline.py (rows
of teacher top-k from a server or a store), onpolicy.py (KDTrainer's generated steps, a row per process),
losses.py (the loss benchmarks' inputs), multi_gpu.py (the per-step probe), fp8_teacher.py (a teacher trained on
a corpus), accuracy.py (scoring at checkpoints on a clock that stops while it scores). A benchmark imports these,
never another benchmark (tools/check_layout.py)."""

from __future__ import annotations

import json
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch


def cuda_time_ms(
    fn: Callable[[], object], *, warmup: int = 2, reps: int = 8, host_ahead: bool = False, after_spin: bool = False
) -> float:
    """Median wall time of fn() on the GPU, in ms, measured with CUDA events after `warmup` calls.

    Each rep is synchronised, so by default the time includes the host's work before fn's first kernel (the GPU
    waits for it). `host_ahead`: the GPU is first held by a sleep kernel long enough for the host to queue the
    whole call, as it is queued behind the model's forward in a training step; the time is then the GPU's alone:
    its kernels and the gaps between them. `after_spin`: the same sleep kernel runs before each rep, but the host
    waits for it before it calls fn, so the host is not ahead: against the default it tells what the sleep itself
    changes (a GPU kept busy, clocks) from what the host's lead changes."""
    if host_ahead and after_spin:
        raise ValueError("cuda_time_ms: host_ahead and after_spin are two ways to time fn; pass one of them")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    hold = _sleep_cycles_covering(fn) if host_ahead or after_spin else 0
    times = []
    for _ in range(reps):
        if hold:
            torch.cuda._sleep(hold)
            if after_spin:
                torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_us_per_call(step: Callable[[], object], calls: int, reps: int = 50) -> float:
    """µs a call of a CUDA graph holding `step()`, which makes `calls` calls: the graph is captured once (after one
    eager step, which compiles), replayed 3 times, then `reps` times between two events. What a decode step's
    graph does: no launch gaps of the host's, and each call's inputs where step() put them (give each call its own
    weights or cache when they should come from memory, not L2)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps / calls


def _sleep_cycles_covering(fn: Callable[[], object]) -> int:
    """Cycles of torch.cuda._sleep that outlast twice the host's time to queue fn(), plus 5 ms."""
    import time

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    torch.cuda.synchronize()
    cycles_per_ms = probe / max(start.elapsed_time(end), 1e-3)
    return int(cycles_per_ms * (2 * host_ms + 5))


def peak_extra_gib(fn: Callable[[], object], exclude_bytes: int = 0) -> float:
    """Peak memory fn() allocates beyond what existed before it, minus `exclude_bytes` (e.g. the gradients
    any method must return), in GiB."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before - exclude_bytes) / 2**30


def environment() -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": " ".join(["python"] + sys.argv),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        info["liger_kernel"] = version("liger-kernel")
    except Exception:
        info["liger_kernel"] = None
    return info


def print_table(rows: list[dict], columns: list[str]) -> str:
    """A GitHub-markdown table of `rows` (missing cells print as '-'); printed and returned."""

    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_json(path: str | Path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")


def run_row_in_child(module: str, name: str, args, keys: tuple[str, ...]) -> dict:
    """Run `python -m <module> --row <name>` with the options `keys` of `args` (and --tiny) in its own process, so
    one row's compiled graphs and allocator state cannot help another; the child prints `ROW <json>`. A row that
    fails comes back as {"name", "error"} with the child's output on stderr, and the other rows still run."""
    import subprocess

    options = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in keys and v is not None]
    cmd = [sys.executable, "-m", module, "--row", name, *options, *(["--tiny"] if args.tiny else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ROW ")), None)
    if line is None:
        print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
        return {"name": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    row = json.loads(line[4:])
    print(f"{name}: {row}", flush=True)
    return row


TOKENIZERS = ("char", "bpe")


def corpus_token_ids(tokenizer: str, vocab: int = 2048) -> tuple[list[int], int, float]:
    """(the packaged corpus as token ids, the vocabulary size, characters per token) for the benchmarks that train
    a teacher on it. "char": the demo's character tokenizer (V = 48). "bpe": a byte-level BPE (GPT-2 style, the
    demo's `train_bpe_tokenizer`) trained here on the corpus's first 90 % (the benchmarks' training
    split) with the tokenizers library, for up to `vocab` tokens: offline, and deterministic (the same text and
    size give the same merges; checked across processes). <pad> <s> </s> are ids 0 1 2 in both. The corpus holds
    100 distinct words and BPE merges within words, so it stops at 464 tokens whatever `vocab` asks (merging
    across words reaches ~1000 only by making whole sentences tokens); the size reached is returned."""
    from liger_patch_kd.demo.toys import CharTokenizer, load_corpus, train_bpe_tokenizer

    text = load_corpus()
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}; got tokenizer={tokenizer!r}")
    if tokenizer == "char":
        tok = CharTokenizer(text)
        ids, size = tok.encode(text), len(tok)
    else:
        tok = train_bpe_tokenizer(text[: int(0.9 * len(text))], vocab_size=vocab)
        ids, size = tok.encode(text).ids, tok.get_vocab_size()
    return ids, size, len(text) / len(ids)
