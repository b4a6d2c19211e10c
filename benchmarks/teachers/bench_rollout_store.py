"""How fast a rollout store is built (precompute_rollouts, what `liger-kd precompute --rollouts-from` runs) against
how fast the live on-policy trainer generates, for the same models: completions/s, with the store's time split.

    python -m benchmarks.teachers.bench_rollout_store --out runs/bench_rollout_store.json   # a GPU
    python -m benchmarks.teachers.bench_rollout_store --smoke                               # CPU, tiny, no figures

The models and data of the time-to-accuracy benchmark (benchmarks/accuracy): liger_patch_kd.demo.arithmetic's
task (3 two-digit operands) and BPE tokenizer (264 ids), a Llama student (`--student-shape`, default 96 x 2: about
0.25M parameters) and teacher (`--teacher-shape`, default 320 x 8: about 10M), random weights in float32, so the
completions run to about `--max-new-tokens` (random weights rarely sample EOS). The store holds `--prompts`
completions (one per prompt), generated in calls of `--prompts-per-call` prompts (with `--cache`), scored by the
teacher's top `--top-k`, in shards of `--shard-size`. Rows:

  store                  precompute_rollouts end to end (generation, the teacher's and the student's scoring, the
                         rows' assembly, the shards and manifests written), into a temporary folder removed after
  store, split           the same run again with each phase timed apart (the device's queue drained around each):
                         generate_s (generate_rollouts), teacher_s (the teacher's forward, top-k and log-probs of
                         the sampled tokens), student_s (the student's forward for the behaviour log-probs),
                         assembly_s (the rest of score_rollouts: the rows as the store holds them), write_s
                         (StoreWriter.write_shard: checks, checksums, the file) and other_s (the rest: concatenation,
                         fingerprints, the manifest)
  live generation        generate_rollouts as an on-policy step calls it (KDTrainingArguments' defaults: every
                         prompt of the step in one call, cache "auto") on `--live-batch` prompts, `--live-steps`
                         steps after one warm-up step
  live scoring           the teacher's forward over those rows as the live step scores them (plain logits, no
                         top-k), a reference for the scoring's model work

Columns: seconds, completions_per_s, and for the split rows seconds per 1,000 completions.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import time

import torch

from ..common import environment, print_table, write_json

SMOKE = dict(prompts=96, prompts_per_call=32, shard_size=64, live_batch=16, live_steps=2, student_shape=[32, 2],
             teacher_shape=[48, 2], max_new_tokens=12)  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16384, help="completions in the store (one per prompt)")
    p.add_argument("--prompts-per-call", type=int, default=1024)
    p.add_argument("--shard-size", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=30)
    p.add_argument("--student-shape", type=int, nargs=2, default=[96, 2], metavar=("HIDDEN", "LAYERS"))
    p.add_argument("--teacher-shape", type=int, nargs=2, default=[320, 8], metavar=("HIDDEN", "LAYERS"))
    p.add_argument("--cache", default="auto", help="the store's generation cache (RolloutSettings.cache; 'auto' "
                   "takes the dynamic cache above 256 rows on CUDA, 'graph' the decode engine at any size)")
    p.add_argument("--live-batch", type=int, default=256, help="prompts per live on-policy step")
    p.add_argument("--live-steps", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on a CPU: checks the script runs")
    p.add_argument("--out", default=None, help="write the rows and the environment here (JSON)")
    return p


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def phase_timers(device: torch.device, totals: dict):
    """Times the store's phases into `totals` (seconds), by wrapping the functions precompute_rollouts calls."""
    from liger_patch_kd.teacher.store import StoreWriter
    from liger_patch_kd.trainer.offline_onpolicy import scoring, store

    wrapped = [(store, "generate_rollouts", "generate_s"), (store, "score_rollouts", "scoring_s"),
               (scoring, "teacher_rows", "teacher_s"), (scoring, "student_next_logprobs", "student_s"),
               (StoreWriter, "write_shard", "write_s")]  # fmt: skip
    saved = []
    for owner, name, key in wrapped:
        real = owner.__dict__[name]
        totals[key] = 0.0

        def timed(*args, _real=real, _key=key, **kwargs):
            sync(device)
            began = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                sync(device)
                totals[_key] += time.perf_counter() - began

        saved.append((owner, name, real))
        setattr(owner, name, timed)
    try:
        yield
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)


def build_store(student, teacher, prompts, tok, a, device) -> float:
    from liger_patch_kd.trainer.offline_onpolicy import RolloutSettings, ScoreOptions, precompute_rollouts

    folder = tempfile.mkdtemp(prefix="bench_rollout_store_")
    try:
        settings = RolloutSettings(max_new_tokens=a.max_new_tokens, cache=a.cache, seed=0)
        sync(device)
        began = time.perf_counter()
        precompute_rollouts(student, teacher, prompts, f"{folder}/store", settings=settings,
                            score=ScoreOptions(top_k=a.top_k), prompts_per_call=a.prompts_per_call,
                            shard_size=a.shard_size, tokenizer=tok, progress=False)  # fmt: skip
        sync(device)
        return time.perf_counter() - began
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def live_rows(student, teacher, prompts, tok, a, device) -> list[dict]:
    """The live on-policy step's generation (and the teacher's plain forward over its rows) at --live-batch."""
    from liger_patch_kd.trainer.rollouts.generate import RolloutSettings, generate_rollouts, rollout_batch
    from liger_patch_kd.trainer.rollouts.onpolicy import special_ids

    pad, eos_ids, start = special_ids(student, tok)
    settings = RolloutSettings(max_new_tokens=a.max_new_tokens, seed=0)
    generate_s = score_s = 0.0
    made = 0
    for step in range(a.live_steps + 1):
        batch = prompts[step * a.live_batch : (step + 1) * a.live_batch]
        sync(device)
        began = time.perf_counter()
        rollouts = generate_rollouts(student, batch, settings, pad_id=pad, eos_ids=eos_ids, start_id=start,
                                     step=step)  # fmt: skip
        sync(device)
        middle = time.perf_counter()
        rows = rollout_batch(rollouts, pad)
        with torch.no_grad():
            teacher(input_ids=rows["input_ids"].to(device), attention_mask=rows["attention_mask"].to(device))
        sync(device)
        if step:  # the first step warms up (the engine captures its graphs)
            generate_s += middle - began
            score_s += time.perf_counter() - middle
            made += len(rollouts)
    return [dict(row="live generation", completions=made, seconds=generate_s, completions_per_s=made / generate_s),
            dict(row="live scoring", completions=made, seconds=score_s, completions_per_s=made / score_s)]


def main(argv: list[str] | None = None) -> dict:
    a = parser().parse_args(argv)
    if a.smoke:
        for key, value in SMOKE.items():
            setattr(a, key, value)
    from liger_patch_kd.demo.arithmetic import ArithmeticTask, ModelShape, build_tokenizer, tokenized

    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    problems = ArithmeticTask(operands=3, digits=2).problems(max(a.prompts, a.live_batch * (a.live_steps + 1)), 0)
    tok = build_tokenizer(problems)
    prompts, _ = tokenized(tok, problems)
    student = ModelShape(*a.student_shape).build(len(tok), seed=1, device=device)
    teacher = ModelShape(*a.teacher_shape).build(len(tok), seed=0, device=device)
    store_prompts = prompts[: a.prompts]
    rows = live_rows(student, teacher, prompts, tok, a, device)
    build_store(student, teacher, store_prompts[: a.prompts_per_call], tok, a, device)  # warm-up: one call
    seconds = build_store(student, teacher, store_prompts, tok, a, device)
    rows.append(dict(row="store", completions=a.prompts, seconds=seconds, completions_per_s=a.prompts / seconds,
                     s_per_1k=1000 * seconds / a.prompts))  # fmt: skip
    totals: dict = {}
    with phase_timers(device, totals):
        seconds = build_store(student, teacher, store_prompts, tok, a, device)
    split = dict(row="store, split", completions=a.prompts, seconds=seconds, completions_per_s=a.prompts / seconds)
    totals["assembly_s"] = totals.pop("scoring_s") - totals["teacher_s"] - totals["student_s"]
    totals["other_s"] = seconds - totals["generate_s"] - totals["teacher_s"] - totals["student_s"] - totals[
        "assembly_s"] - totals["write_s"]  # fmt: skip
    split.update({k: 1000 * v / a.prompts for k, v in totals.items()})
    rows.append(split)
    print_table(rows, ["row", "completions", "seconds", "completions_per_s", "generate_s", "teacher_s", "student_s",
                       "assembly_s", "write_s", "other_s"])  # fmt: skip
    print("(split columns: seconds per 1,000 completions)")
    ratio = rows[2]["completions_per_s"] / rows[0]["completions_per_s"]
    print(f"store build rate / live generation rate: {ratio:.2f}")
    payload = dict(environment=environment(), device=str(device), args=vars(a), rows=rows)
    if a.out:
        write_json(a.out, payload)
    return payload


if __name__ == "__main__":
    main()
