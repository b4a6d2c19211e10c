"""On-policy rollouts in process against rollouts from an engine (`liger-kd serve` at kd_generation_url), waited
for or asynchronous (kd_async_rollouts), through KDTrainer, against off-policy training on the same rows: step
time, time the trainer spent on rollouts, push time, staleness, the engine's agreement with the student.

    python -m benchmarks.onpolicy.bench_engine --out runs/bench_engine.json  # the engine on cuda:1 if there is one
    python -m benchmarks.onpolicy.bench_engine --engine-device cuda:0 \
        --only off-policy "engine, sync 1" "engine, async 1"                 # one GPU: engine and trainer share it
    python -m benchmarks.onpolicy.bench_engine --tiny                        # CPU smoke test, no figures

bench_onpolicy's shapes (a Llama-3.2-1B-shaped student, a Llama-3.1-8B-shaped teacher, random weights, bf16) and
data (prompt + completion rows: off-policy trains on the completions, on-policy generates from the prompts). An
engine row starts `liger-kd serve --random-weights` from the student's config (on --engine-device) and
lets the first push give it the student's weights; full weights travel as a safetensors file
(/update_weights_from_disk) every kd_sync_steps. Rows (each in its own process):

  off-policy                 kd_lmbda=0: the rows' own completions, no generation (the target's reference)
  in process                 kd_generation_url unset: the student generates (kd_generation_cache auto)
  engine, sync 1             liger-kd serve samples, the student pushed before every step, the trainer waits
  engine, sync 4             pushed every 4th step: staleness 0-3, pg importance-corrected
  engine, async 1            kd_async_rollouts=1: step s + 1's rollouts generated while step s trains, pushed every
                             step: staleness 1, pg importance-corrected
  engine, async 2, sync 2    two steps ahead, pushed every 2nd step: staleness 2-3

Each row: step_s (mean over the timed steps after one warm-up), rollout_s (the trainer's time on rollouts per step:
pushes and requests when it waits, the wait alone when asynchronous), push_s (mean per push in the trainer's
thread: the whole push when it waits, the CPU copy of the weights when asynchronous), staleness (mean over the
timed steps), scored_tokens_per_s (one student GPU), of_off_policy (its fraction of the off-policy row's; issue
31's target for the asynchronous engine on its own GPU: >= 0.8), max_logprob_gap (the largest |engine log-prob -
the student's own| of a sampled token right after a push, bf16 on both sides: rounding, not a bug, below ~0.1;
waited-for rows only).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

from ..common.onpolicy import drive_rows, models_and_rows, step_parser

ROWS = {  # name -> KDTrainingArguments overrides (engine: liger-kd serve at kd_generation_url)
    "off-policy": dict(kd_lmbda=0.0),
    "in process": dict(),
    "engine, sync 1": dict(kd_sync_steps=1, engine=True),
    "engine, sync 4": dict(kd_sync_steps=4, kd_onpolicy_loss="pg", engine=True),
    "engine, async 1": dict(kd_sync_steps=1, kd_async_rollouts=1, kd_onpolicy_loss="pg", engine=True),
    "engine, async 2, sync 2": dict(kd_sync_steps=2, kd_async_rollouts=2, kd_onpolicy_loss="pg", engine=True),
}


def start_engine(config_dir: str, device: str, dtype: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "liger_patch_kd.cli", "serve", "--teacher", config_dir, "--random-weights",
           "--device", device, "--dtype", dtype, "--port", str(port), "--top-k", "8"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    from liger_patch_kd.teacher.client import TeacherClient

    TeacherClient(url, top_k=8, vocab_size=8, timeout=600, retries=30).wait_until_ready()  # refused until it binds
    return proc, url


def run_row(name: str, a: argparse.Namespace) -> dict:
    from transformers import TrainerCallback

    from liger_patch_kd import KDTrainer, KDTrainingArguments

    device, student, teacher, _, rows = models_and_rows(a)
    steps = a.steps + 1
    overrides = {"kd_lmbda": 1.0, **ROWS[name]}
    proc = None
    if overrides.pop("engine", False):
        config_dir = tempfile.mkdtemp()
        student.config.save_pretrained(config_dir)
        engine_device = a.engine_device or (
            "cpu" if device == "cpu" else f"cuda:{min(1, torch.cuda.device_count() - 1)}"
        )
        proc, url = start_engine(config_dir, engine_device, "bfloat16" if device == "cuda" else "float32")
        overrides["kd_generation_url"] = url
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())

    try:
        args = KDTrainingArguments(
            output_dir=tempfile.mkdtemp(), use_kd_patch=True, bf16=device == "cuda", use_cpu=device == "cpu",
            kd_max_new_tokens=a.completion, per_device_train_batch_size=a.micro_batch,
            gradient_accumulation_steps=a.accumulation, max_steps=steps, report_to=[], save_strategy="no",
            logging_steps=1, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
            learning_rate=1e-5, dataloader_num_workers=0, remove_unused_columns=False, **overrides,
        )  # fmt: skip
        trainer = KDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows, callbacks=[Clock()])
        source, pushes, gaps = trainer.onpolicy.source, [], []
        if "kd_generation_url" in overrides:
            # the trainer's thread's share of a push: all of it when it waits, the CPU copy when asynchronous
            method = "stage" if overrides.get("kd_async_rollouts") else "push"
            inner = getattr(source.sync, method)

            def timed_push(model, step):
                began = time.perf_counter()
                out = inner(model, step)
                pushes.append(time.perf_counter() - began)
                return out

            setattr(source.sync, method, timed_push)
        if "kd_generation_url" in overrides and not overrides.get("kd_async_rollouts"):

            def measured(generator, prompts, settings, **kw):
                out = source(generator, prompts, settings, **kw)
                if source.staleness[-1] == 0:
                    r = out[0]
                    ids = torch.tensor([r.prompt + r.completion], device=device)
                    with torch.no_grad():
                        logp = type(student).forward(student, input_ids=ids).logits.float().log_softmax(-1)[0]
                    own = logp[len(r.prompt) - 1 : -1].gather(-1, ids[0, len(r.prompt) :, None]).squeeze(-1)
                    gaps.append(float((own.cpu() - torch.tensor(r.logprobs)).abs().max()))
                return out

            trainer.onpolicy.source = measured
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    finally:
        if proc is not None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    step_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    # per generated step trained; a waited-for row's source was wrapped by `measured` above
    stale = (trainer.onpolicy.staleness if trainer.onpolicy.pipeline else getattr(source, "staleness", []))[1:]
    timed = trainer.kd_rollout_seconds[1:]
    return {
        "name": name,
        "step_s": step_s,
        "rollout_s": sum(timed) / len(timed) if timed else 0.0,
        "push_s": sum(pushes) / len(pushes) if pushes else None,
        "staleness": sum(stale) / len(stale) if stale else None,
        "scored_tokens_per_s": a.micro_batch * a.accumulation * a.completion / step_s,
        "max_logprob_gap": max(gaps) if gaps else None,
        "peak_GiB": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
    }


def main() -> None:
    parser = step_parser(__doc__, "runs/bench_engine.json", ROWS, steps=4)
    parser.add_argument("--engine-device", default=None, help="the engine's device; default cuda:1 when there is one")
    columns = ["name", "step_s", "rollout_s", "push_s", "staleness", "scored_tokens_per_s", "of_off_policy",
               "max_logprob_gap", "peak_GiB", "error"]  # fmt: skip
    drive_rows(
        "benchmarks.onpolicy.bench_engine", parser.parse_args(), ROWS, run_row, columns, extra=("engine_device",)
    )


if __name__ == "__main__":
    main()
