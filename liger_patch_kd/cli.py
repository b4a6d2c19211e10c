"""`liger-kd`: demo, precompute, convert, serve, bench, train (train_cli/: its parser is transformers' own).

Every mistake is one line, `liger-kd <command>: error: <the option, what is wrong, the fix>`, exit status 2 and no
traceback (`--debug` or LIGER_KD_DEBUG=1 shows it). Each command's options are checked
(`cli_checks.check_<command>`) before any work, and nothing is imported here at module level beyond the standard
library: `liger-kd --help` and argument errors answer without importing torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import cli_checks
from .cli_checks import (
    ENCODINGS,
    FORMATS,
    Parser,
    option_names,
    suggestions,
)
from .utils.errors import reason_of


def _demo(args) -> None:
    if args.write_tiny_pair:  # a pair and a dataset on disk for `liger-kd train` (demo/tiny_pair.py)
        from .demo.tiny_pair import train_command, write_tiny_pair

        paths = write_tiny_pair(args.write_tiny_pair)
        print(f"wrote a tiny student, teacher (random weights) and chat dataset to {Path(args.write_tiny_pair)}; "
              f"distil it with:\n"
              f"{train_command(paths)}")  # fmt: skip
        return
    if args.several_teachers:  # one student routed between two specialist teachers (demo/multi_teacher.py)
        from .demo.multi_teacher import run_multi_teacher_demo

        run_multi_teacher_demo(quick=args.quick, device=args.device)
        return
    if args.context:  # context distillation alone (demo/context_distill.py)
        from .demo.context_distill import ContextDemoSizes, run_context_demo

        run_context_demo(args.device, ContextDemoSizes.quick() if args.quick else None)
        return
    from .demo import run_demo

    run_demo(quick=not args.full, device=args.device, arithmetic=not args.no_arithmetic)


def _precompute(args) -> None:
    if args.rollouts_from:
        _precompute_rollouts(args)
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .teacher import precompute, tokenizer_fingerprint
    from .teacher.precompute import check_precompute_args, file_fingerprint, read_jsonl_rows
    from .teacher.store import check_store_folder

    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.teacher)
    except (OSError, ValueError):
        if args.tokenizer:
            raise ValueError(f"--tokenizer {args.tokenizer}: no tokenizer loads from there") from None
    # the options and the data are checked against the config's vocabulary before the weights load (minutes for a
    # large teacher); precompute checks the ids again against the loaded head's rows
    vocab = AutoConfig.from_pretrained(args.teacher).get_text_config().vocab_size
    check_precompute_args(vocab, top_k=args.top_k, temperature=args.temperature, batch_size=args.batch_size,
                          shard_size=args.shard_size, logprob_dtype=args.dtype, encoding=args.encoding,
                          max_length=args.max_length, samples=args.samples)  # fmt: skip
    check_store_folder(args.out)  # someone else's files in --out, or a damaged manifest: refused before the weights
    rows = read_jsonl_rows(args.data, tokenizer=tokenizer, max_length=args.max_length, vocab_size=vocab,
                           skip_bad_lines=args.skip_bad_lines, max_prompt_length=args.max_prompt_length)  # fmt: skip
    sequences, skipped = rows.sequences, rows.skipped
    if not sequences:
        why = ", ".join(f"{n} {why}" for why, n in skipped.items())
        raise ValueError(f"{args.data}: no usable lines" + (f" (skipped: {why}; rerun without --skip-bad-lines to "
                                                            f"see the first, with its fix)" if skipped else ""))
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype="auto")
    teacher.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shaping = {"data file": file_fingerprint(args.data), "max_length": args.max_length,
               "skip_bad_lines": args.skip_bad_lines}  # fmt: skip
    if args.max_prompt_length is not None:
        shaping["max_prompt_length"] = args.max_prompt_length
    out = precompute(
        teacher, sequences, args.out, top_k=args.top_k, batch_size=args.batch_size, shard_size=args.shard_size,
        logprob_dtype=args.dtype, temperature=args.temperature, teacher_name=args.teacher, encoding=args.encoding,
        samples=args.samples, seed=args.seed, labels=rows.labels,
        tokenizer_fp=tokenizer_fingerprint(tokenizer) if tokenizer is not None else None, inputs=shaping,
    )  # fmt: skip
    if skipped:
        print(f"skipped {sum(skipped.values())} bad lines: " + ", ".join(f"{n} {why}" for why, n in skipped.items()))
    scored = "; labels on the completions only, as training on the rows scores them" if rows.labels else ""
    print(f"wrote {out} ({len(sequences)} sequences{scored})")


def _precompute_rollouts(args) -> None:
    """--rollouts-from: the student's rollouts, scored by the teacher (trainer/offline_onpolicy/store.py). The
    student runs here or is served (an engine URL), the teacher runs here or is served (--teacher-url). Every input
    is checked against the tokenizers, the configs and what the servers list before any model's weights load."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from .cli_checks import is_url
    from .teacher import tokenizer_fingerprint
    from .teacher.precompute import check_precompute_args, file_fingerprint
    from .teacher.store import check_store_folder
    from .teacher.store.writer import check_resumable
    from .trainer.offline_onpolicy import ScoreOptions, precompute_rollouts
    from .trainer.offline_onpolicy.engine_student import EngineStudent
    from .trainer.offline_onpolicy.served_teacher import ServedTeacher
    from .trainer.offline_onpolicy.store import (
        check_rollout_inputs,
        check_vocabularies,
        read_prompt_lines,
        rollout_section,
    )
    from .trainer.rollouts.generate import RolloutSettings

    connection = {"timeout": 600.0 if args.url_timeout is None else args.url_timeout,
                  "retries": 3 if args.url_retries is None else args.url_retries}  # fmt: skip
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    engine = EngineStudent(args.rollouts_from, **connection) if is_url(args.rollouts_from) else None
    served = None
    if args.teacher_url:
        served = ServedTeacher(args.teacher_url, args.teacher_protocol or "auto", device=device, **connection)
    student_flag = f"--rollouts-from {args.rollouts_from}"
    tokenizer_from = args.tokenizer or (args.teacher if engine is not None else args.rollouts_from)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    if engine is None and args.tokenizer:  # an in-process student's folder may hold its own: that one is the truth
        try:
            own = AutoTokenizer.from_pretrained(args.rollouts_from)
        except (OSError, ValueError):
            own = None  # a student folder without one: --tokenizer is its tokenizer
        if own is not None and tokenizer_fingerprint(own) != tokenizer_fingerprint(tokenizer):
            raise ValueError(
                f"--tokenizer {args.tokenizer} is not the tokenizer in {student_flag}'s folder ({len(tokenizer)} and "
                f"{len(own)} tokens, other ids): the prompts would be encoded in another vocabulary than the student "
                f"reads; leave --tokenizer out (the student's own is used), or point it at the student's tokenizer"
            )
    if args.teacher:
        try:
            teacher_tokenizer = AutoTokenizer.from_pretrained(args.teacher)
        except (OSError, ValueError):
            teacher_tokenizer = None  # a teacher folder without one: it is taken to share the student's
        if teacher_tokenizer is not None and tokenizer_fingerprint(teacher_tokenizer) != tokenizer_fingerprint(
            tokenizer
        ):
            raise ValueError(
                f"--teacher {args.teacher} has another tokenizer than {student_flag}"
                f"{f' (--tokenizer {args.tokenizer})' if args.tokenizer else ''}: a rollout store pairs the teacher's "
                f"log-probs with the student's tokens one for one; score with a teacher of the student's tokenizer "
                f"(across tokenizers, train on-policy online with kd_teacher_tokenizer)"
            )
    local = [m for m in (None if engine else args.rollouts_from, args.teacher) if m]
    configs = {m: AutoConfig.from_pretrained(m).get_text_config() for m in local}
    student_vocab = engine.vocab_size if engine else configs[args.rollouts_from].vocab_size
    teacher_vocab = served.vocab_size if served else configs[args.teacher].vocab_size
    check_vocabularies(student_vocab, teacher_vocab, tokenizer, student_flag,
                       f"--teacher-url {served.url}" if served else f"--teacher {args.teacher}")  # fmt: skip
    store_vocab = teacher_vocab or student_vocab or len(tokenizer)
    score = ScoreOptions(top_k=args.top_k, samples=args.samples, temperature=args.temperature, seed=args.seed)
    check_precompute_args(store_vocab, top_k=args.top_k, temperature=args.temperature, shard_size=args.shard_size,
                          logprob_dtype=args.dtype, encoding=args.encoding, samples=args.samples)  # fmt: skip
    if served is not None:
        served.check(score, store_vocab)
    check_store_folder(args.out)
    settings = RolloutSettings(
        max_new_tokens=args.max_new_tokens, temperature=args.generation_temperature, top_p=args.top_p,
        top_k=args.generation_top_k, num_generations=args.num_generations, seed=args.seed,
    )  # fmt: skip
    prompts, lines = read_prompt_lines(args.data, tokenizer)
    shaping = {"data file": file_fingerprint(args.data)}
    if args.max_prompt_length is not None:  # each prompt's last tokens, as kd_max_prompt_length keeps them
        prompts = [p[-args.max_prompt_length :] for p in prompts]
        shaping["max_prompt_length"] = args.max_prompt_length
    contexts = [getattr(cfg, "max_position_embeddings", None) for cfg in configs.values()]
    contexts += [m.context for m in (engine, served) if m is not None]
    vocabs = [v for v in (student_vocab, teacher_vocab) if v is not None] or [store_vocab]
    check_rollout_inputs(prompts, settings, prompts_per_call=args.batch_size,
                         context=min((c for c in contexts if isinstance(c, int)), default=None),
                         vocab_size=min(vocabs), names=[f"{args.data}:{n}" for n in lines])  # fmt: skip
    # a resume with other sampling, scoring or data is refused now, from its manifest, before any model loads
    section = rollout_section(settings, {}, {}, args.batch_size, score, len(prompts))
    check_resumable(args.out, {"rollouts": {k: v for k, v in section.items() if not k.endswith("_fingerprint")},
                               "inputs": shaping})  # fmt: skip
    generation_config = None
    if engine is not None:
        try:  # the student's EOS ids, as the in-process path reads them (else the tokenizer's)
            generation_config = GenerationConfig.from_pretrained(tokenizer_from)
        except (OSError, ValueError):
            generation_config = None
    student = engine or AutoModelForCausalLM.from_pretrained(args.rollouts_from, dtype="auto").to(device)
    teacher = served or AutoModelForCausalLM.from_pretrained(args.teacher, dtype="auto").to(device)
    try:
        out = precompute_rollouts(
            student, teacher, prompts, args.out, settings=settings, prompts_per_call=args.batch_size, score=score,
            shard_size=args.shard_size, logprob_dtype=args.dtype, encoding=args.encoding, tokenizer=tokenizer,
            student_name=engine.url if engine else args.rollouts_from,
            teacher_name=served.url if served else args.teacher, tokenizer_fp=tokenizer_fingerprint(tokenizer),
            inputs=shaping, generation_config=generation_config,
        )  # fmt: skip
    finally:
        if served is not None:
            served.close()
    print(f"wrote {out} ({len(prompts) * args.num_generations} rollouts of {len(prompts)} prompts)")


def _convert(args) -> None:
    from .teacher.formats import ConvertOptions, convert

    options = ConvertOptions(
        vocab_size=args.vocab_size, top_k=args.top_k, compressor=args.compressor, temperature=args.temperature,
        keep_temperature=args.keep_temperature, logprobs_field=args.logprobs_field, encoding=args.encoding,
        dtype=args.dtype, shard_size=args.shard_size,
    )  # fmt: skip
    out, existed = Path(args.out), Path(args.out).exists()
    try:
        convert(args.from_format, args.to_format, args.input, args.out, options)
    except BaseException:
        if not existed:  # only what this run created: a failed conversion leaves no half store behind
            _remove(out)
        raise
    print(f"wrote {args.out}")


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def _serve(args) -> None:
    from .server.app import serve

    serve(args.teacher, top_k=args.top_k, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
          max_batch_tokens=args.max_batch_tokens, log_level=args.log_level,
          attn_implementation=args.attn_implementation, random_weights=args.random_weights,
          precision=args.precision, max_request_tokens=args.max_request_tokens, api_key=args.api_key,
          batch_invariant=args.batch_invariant, sample_temperature=args.sample_temperature,
          fuse_projections=args.fuse_projections)  # fmt: skip


def _bench(args) -> None:
    import torch

    from .demo import loss_memory_demo

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    loss_memory_demo(device, heading="liger-kd bench, the loss alone")


def _is_user_error(e: BaseException) -> bool:
    """A mistake in the options or inputs (reported in one line), not a bug (a traceback)."""
    return isinstance(e, (ValueError, OSError, ImportError)) or type(e).__module__.startswith("liger_patch_kd.")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="liger-kd", description="Knowledge distillation without materialised logits.")
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = cli_checks.DefaultsHelpFormatter

    demo = sub.add_parser(
        "demo", help="train a tiny teacher and distil it four ways; print a table", formatter_class=fmt
    )
    demo.add_argument("--full", action="store_true",
                      help="the three-seed table at full sizes, then across tokenizers (several times the short run); "
                           "default: the short run, one seed")  # fmt: skip
    demo.add_argument("--quick", action="store_true",
                      help="--several-teachers / --context: fewer steps, one seed (CI); the plain demo is short "
                           "already (this flag changes nothing there)")  # fmt: skip
    demo.add_argument("--no-arithmetic", action="store_true",
                      help="skip the step that scores students on held-out arithmetic problems")  # fmt: skip
    demo.add_argument("--device", default=None, help="torch device; None: cuda when available, else cpu")
    demo.add_argument("--several-teachers", action="store_true",
                      help="instead: two specialist teachers, one student routed between them")  # fmt: skip
    demo.add_argument("--context", action="store_true",
                      help="instead: context distillation, a teacher that reads the previous sentence")  # fmt: skip
    demo.add_argument("--write-tiny-pair", metavar="DIR", default=None,
                      help="instead: write a tiny student, teacher (random weights) and chat dataset to the new "
                           "folder DIR, and print the `liger-kd train` command that distils them (no hub)")  # fmt: skip
    demo.set_defaults(func=_demo)

    pre = sub.add_parser("precompute", help="write a teacher's top-k log-probs to a store (resumable)",
                         formatter_class=fmt)  # fmt: skip
    pre.add_argument("--teacher", default=None,
                     help="HF model path or name; with --rollouts-from, --teacher-url instead scores with a served "
                          "teacher (one of the two is required)")  # fmt: skip
    pre.add_argument("--data", required=True,
                     help="JSONL, a row a line: 'text', 'input_ids', or TRL's 'prompt' + 'completion' (text or "
                          "messages) or 'messages' rows, tokenized as KDTrainer tokenizes them (the chat template; "
                          "the store scores the completions only) (required)")  # fmt: skip
    pre.add_argument("--out", required=True, help="store folder; rerun with the same inputs to resume (required)")
    pre.add_argument("--top-k", type=int, default=64, help="slots kept per token")
    pre.add_argument("--temperature", type=float, default=1.0, help="> 0; keep 1: tempering later is exact")
    pre.add_argument("--max-length", type=int, default=None,
                     help="truncate sequences to this many tokens (>= 1), as kd_max_length does; None: keep them "
                          "whole")  # fmt: skip
    pre.add_argument("--max-prompt-length", type=int, default=None,
                     help="prompt rows (and --rollouts-from's prompts): keep a prompt's last this many tokens (>= 1), "
                          "as kd_max_prompt_length does; None: whole prompts")  # fmt: skip
    pre.add_argument("--batch-size", type=int, default=8,
                     help="sequences per teacher forward (--rollouts-from: prompts per generation call)")
    pre.add_argument("--shard-size", type=int, default=1024, help="sequences per shard file")
    pre.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                     help="log-prob dtype of a plain store")  # fmt: skip
    pre.add_argument(
        "--encoding",
        default="plain",
        help="plain (int32 ids + --dtype log-probs) or packed<bits>, e.g. packed10: ids in the fewest "
        "bits, log-probs quantised to <bits> bits per row (about 3.6 bytes per slot at 152k vocab)",
    )
    pre.add_argument("--samples", type=int, default=0,
                     help="m > 0: also m tokens per position drawn from the teacher at --temperature (with counts and "
                     "log-probs; --top-k 0: the draws alone), for the unbiased sampled loss")  # fmt: skip
    pre.add_argument("--seed", type=int, default=0,
                     help="seed of the --samples draws and of the --rollouts-from sampling (reproducible)")
    pre.add_argument("--tokenizer", default=None, help="tokenizer path; None: the teacher's")
    pre.add_argument("--device", default=None, help="torch device; None: cuda when available, else cpu")
    pre.add_argument("--skip-bad-lines", action="store_true",
                     help="skip lines with no tokens, ids outside the teacher's vocabulary or invalid JSON (counted "
                          "at the end) instead of stopping at the first")  # fmt: skip
    roll = pre.add_argument_group(
        "rollouts (offline on-policy)", "--rollouts-from STUDENT: --data holds prompts ('prompt' or 'messages' rows, "
        "TRL's formats); the student samples completions once, the teacher scores them (top-k / --samples, and its "
        "log-prob of every sampled token), and the store keeps the student's log-prob of each sampled token too")
    roll.add_argument("--rollouts-from", default=None,
                      help="HF model path or name of the student that samples the completions, or the http(s) URL "
                           "of an engine serving it (vLLM, SGLang, liger-kd serve: /v1/completions; its log-probs of "
                           "the sampled tokens are the behaviour log-probs); None: a store of the --data "
                           "sequences")  # fmt: skip
    roll.add_argument("--num-generations", type=int, default=None, help="completions per prompt; None: 1")
    roll.add_argument("--max-new-tokens", type=int, default=None,
                      help="the longest completion (it ends at EOS or here); None: 128")  # fmt: skip
    roll.add_argument("--generation-temperature", type=float, default=None,
                      help="sampling temperature; None: 1, the student's own distribution, which the k1 / pg "
                           "losses assume (--temperature is the teacher's)")  # fmt: skip
    roll.add_argument("--top-p", type=float, default=None, help="nucleus sampling, in (0, 1]; None: 1 (off)")
    roll.add_argument("--generation-top-k", type=int, default=None,
                      help="sample from the student's k most likely tokens; None: 0 (off; --top-k is the "
                           "teacher's slots)")  # fmt: skip
    roll.add_argument("--teacher-url", default=None,
                      help="score the rollouts with the teacher served at this http(s) URL instead of a --teacher "
                           "run here")  # fmt: skip
    roll.add_argument("--teacher-protocol", default=None, choices=["auto", "topk", "sampled", "hidden"],
                      help="how --teacher-url is asked: topk (vLLM, SGLang, liger-kd serve), sampled (--samples, "
                           "liger-kd serve), hidden (liger-kd serve's hidden states and head: the exact teacher), or "
                           "auto (sampled with --samples on liger-kd serve, else topk); None: auto")  # fmt: skip
    roll.add_argument("--url-timeout", type=float, default=None,
                      help="seconds a served student or teacher may take to answer one request; None: 600")
    roll.add_argument("--url-retries", type=int, default=None,
                      help="retries of a request to a served student or teacher on a connection error or a 5xx "
                           "(waits from 0.5 s, doubling); None: 3")  # fmt: skip
    pre.set_defaults(func=_precompute)

    conv = sub.add_parser("convert", help="teacher data between a store and other tools' formats", formatter_class=fmt)
    conv.add_argument(
        "--from",
        dest="from_format",
        required=True,
        choices=FORMATS,
        help="input format; hf: columns input_ids, teacher_token_ids, teacher_logprobs; distillkit: its compressed "
        "parquet (input_ids, compressed_logprobs, bytepacked_indices) (required)",
    )
    conv.add_argument(
        "--to",
        dest="to_format",
        required=True,
        choices=FORMATS,
        help="output format; store -> store re-encodes (e.g. --encoding packed10) (required)",
    )
    conv.add_argument(
        "--input",
        required=True,
        help="a store folder, a save_to_disk folder, or .parquet / .jsonl / .arrow file(s) (required)",
    )
    conv.add_argument(
        "--out",
        required=True,
        help="a store folder; for axolotl / hf a .parquet, .jsonl or save_to_disk folder (required)",
    )
    conv.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="the teacher's vocabulary (needed --to store; from distillkit: default the settings' d)",
    )
    conv.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="slots per token in the store (needed --to store; from distillkit: default the settings' k)",
    )
    conv.add_argument("--compressor", default=None,
                      help="DistillKit compression_config.yaml (.json) the data was written with; None: the one in "
                           "the --input folder (a capture's)")  # fmt: skip
    conv.add_argument("--temperature", type=float, default=1.0, help="temperature the axolotl data was made at")
    conv.add_argument(
        "--keep-temperature",
        action="store_true",
        help="store log-probs made at --temperature != 1 as they are (top-k cannot be undone exactly)",
    )
    conv.add_argument(
        "--logprobs-field",
        default="logprobs",
        help="column of axolotl's older per-position [{'token': 'token_id:N', 'logprob': x}] layout",
    )
    conv.add_argument("--encoding", default="plain", help=f"for --to store: {ENCODINGS}")
    conv.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                      help="log-prob dtype of a plain output store; None: the input store's, else float32")  # fmt: skip
    conv.add_argument("--shard-size", type=int, default=1024, help="sequences per shard of the output store")
    conv.set_defaults(func=_convert)

    srv = sub.add_parser(
        "serve", help="serve a model's prompt log-probs and completions (vLLM's /v1/completions protocol)",
        formatter_class=fmt,
    )
    srv.add_argument("--teacher", required=True,
                     help="HF model path or name (required): the teacher, or the student's base for a rollout engine")
    srv.add_argument("--top-k", type=int, default=64, help="the most log-probs per position a request may ask")
    srv.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    srv.add_argument("--port", type=int, default=8000, help="TCP port")
    srv.add_argument("--device", default=None, help="torch device; None: cuda when available, else cpu")
    srv.add_argument("--dtype", default="auto", help="auto (the checkpoint's), bfloat16, float32, ...")
    srv.add_argument("--max-batch-tokens", type=int, default=16384, help="padded tokens per teacher forward")
    srv.add_argument("--max-request-tokens", type=int, default=262144,
                     help="prompt tokens one request may hold (more: HTTP 413)")  # fmt: skip
    srv.add_argument("--batch-invariant", action="store_true",
                     help="run every prompt in a forward of its own: replies bit-identical however requests meet")
    srv.add_argument("--sample-temperature", type=float, default=1.0,
                     help="temperature of sampled teacher tokens for requests that name none (liger protocol)")
    srv.add_argument("--api-key", default=None,
                     help="require `Authorization: Bearer KEY` on every endpoint but /health; default: "
                          "$LIGER_KD_API_KEY")  # fmt: skip
    srv.add_argument("--no-fused-projections", dest="fuse_projections", action="store_false",
                     help="sample without the fused copy of the q/k/v and gate/up weights, saving those weights' "
                          "bytes of GPU memory for slower decode steps (default: fused, one product each per "
                          "step)")  # fmt: skip
    srv.add_argument("--attn-implementation", default=None, help="sdpa, eager, flash_attention_2, ...")
    srv.add_argument("--log-level", default="warning", help="uvicorn log level")
    srv.add_argument(
        "--precision",
        default="bf16",
        choices=["bf16", "fp8", "fp8_fast_accum"],
        help="fp8: the teacher's decoder products in FP8 (Ada / Hopper GPUs; emulated on a CPU: no speed-up), half "
        "the memory; fp8_fast_accum: the same without the periodic fp32 promotion of their sums (faster)",
    )
    srv.add_argument("--random-weights", action="store_true", help="the config's model, random weights (benchmarks)")
    srv.set_defaults(func=_serve)

    bench = sub.add_parser(
        "bench", help="the fused loss against materialised logits on this device", formatter_class=fmt
    )
    bench.add_argument("--device", default=None, help="torch device; None: cuda when available, else cpu")
    bench.set_defaults(func=_bench)

    # `liger-kd train ...` is parsed by train_cli (HfArgumentParser over KDTrainingArguments, which imports torch);
    # main() hands it over before this parser runs. Listed here for `liger-kd --help`.
    train = sub.add_parser("train", help="distil a teacher into a student: every KDTrainingArguments option is a flag "
                           "(liger-kd train --help lists them)", add_help=False)  # fmt: skip
    train.add_argument("options", nargs=argparse.REMAINDER, help="see liger-kd train --help")
    train.set_defaults(func=None)

    for name, command in sub.choices.items():
        if name == "train":
            continue
        command.set_defaults(check=getattr(cli_checks, f"check_{name}"), parser=command)
        command.add_argument("--debug", action="store_true",
                             help="a failure shows its traceback (also LIGER_KD_DEBUG=1)")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    """`liger-kd ...`: 0 on success, 2 (one line on stderr) on a mistake in the options or inputs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        from .train_cli.run import main as train

        return _guarded("train", lambda: train(argv[1:]), False)  # --debug is TrainingArguments' own there
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the command's parser: "liger-kd demo: error: unrecognized arguments: ..."
        prog, hint = args.parser.prog, suggestions(unknown, option_names(args.parser))
        args.parser.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(unknown)} ({hint}see {prog} --help)\n")

    def run() -> int:
        args.check(args)  # every option before any work
        args.func(args)
        return 0

    return _guarded(args.command, run, args.debug)


# what a command stopped part-way kept, and how to go on from it
AFTER_INTERRUPT = {
    "precompute": "; any shard finished so far is kept: rerun the same command to resume",
    "train": "; the checkpoints saved so far are in --output_dir: rerun with --resume_from_checkpoint to go on",
}


def _guarded(command: str, run, debug: bool) -> int:
    """run()'s status; a user's mistake is one line and status 2 (its traceback with --debug or LIGER_KD_DEBUG)."""
    debug = debug or os.environ.get("LIGER_KD_DEBUG", "") not in ("", "0")
    try:
        return run()
    except Exception as e:
        if debug or not _is_user_error(e):
            raise
        message = reason_of(e, limit=None)  # one line
        print(f"liger-kd {command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"liger-kd {command}: interrupted{AFTER_INTERRUPT.get(command, '')}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
