"""The options of `liger-kd`, checked before any work (one line naming the option and the fix each), and the
tables --help shows. Standard library only: --help and argument errors import no torch."""

from __future__ import annotations

import argparse
import difflib
import math
import os
from pathlib import Path

# the keys of teacher.formats.CONVERTERS, spelt out so that --help needs no torch (tests/test_cli.py keeps them equal)
FORMATS = ("store", "axolotl", "hf", "distillkit")
PACKED_BITS = range(4, 17)  # the log-prob bits teacher.store.compact.PackedCodec accepts (tests/test_cli.py checks)
ENCODINGS = f"plain, packed{PACKED_BITS[0]} .. packed{PACKED_BITS[-1]} (e.g. packed10)"


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except a flag's: `--no-x` stores False when given, so its "default: True"
    read as if the flag were on by default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.nargs == 0:  # store_true / store_false: off unless given
            return action.help or ""
        return super()._get_help_string(action)


# a --out that names a file by its suffix, for an output that is always a folder (a store, a DistillKit capture)
FILE_SUFFIXES = (".parquet", ".jsonl", ".json", ".arrow", ".safetensors")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is the CLI's one line (no usage block), and a shortened option is a mistake
    (`liger-kd demo --ful` names --full instead of starting the full demo's minutes; `liger-kd train` does the same)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def at_least(args, dest: str, low: int, high: int | None = None) -> None:
    value = getattr(args, dest, None)
    if value is None:
        return
    if value < low or (high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{option(dest)} {value}: must be {bound}")


def check_temperature(value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"--temperature {value:g}: must be a finite number > 0 (1 keeps the teacher's distribution)")


def check_encoding(spec: str) -> None:
    if spec == "plain":
        return
    bits = spec[len("packed") :] if spec.startswith("packed") else ""
    if not (bits.isdigit() and int(bits) in PACKED_BITS):
        raise ValueError(f"--encoding {spec}: not an encoding; valid: {ENCODINGS}")


def option_names(parser: argparse.ArgumentParser) -> list[str]:
    """Every --name the parser takes, without the dashes (both spellings where it has two: kd_beta, kd-beta)."""
    return sorted({o[2:] for a in parser._actions for o in a.option_strings if o.startswith("--")})


def suggestions(words: list[str], names: list[str], dashes: str = "--") -> str:
    """For unknown option names (or a command line's leftover words, values among them), "did you mean --kd_beta? "
    naming the option each most likely misspells, when one is close; else "". `dashes`: the prefix of a name in
    `words` and in the answer ("" for a YAML file's keys)."""
    close = []
    for word in words:
        name = word[len(dashes) :].split("=", 1)[0] if word.startswith(dashes) else None
        close += [dashes + c for c in (difflib.get_close_matches(name, names, n=1, cutoff=0.8) if name else ())]
    return f"did you mean {', '.join(close)}? " if close else ""


def looks_like_path(name: str) -> bool:
    """A local path rather than a hub name (org/name has at most one slash)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def check_model(args, dest: str) -> None:
    """A model (or tokenizer) given as a path must exist: say so instead of the hub's 'Repo id must be ...'."""
    name = getattr(args, dest, None)
    if name is None or not looks_like_path(name):
        return
    path = Path(name).expanduser()
    if not path.exists():
        raise ValueError(f"{option(dest)} {name}: no such file or directory (a local model folder, or a hub name "
                         "such as org/model)")  # fmt: skip
    setattr(args, dest, str(path))  # "~/models/x" quoted past the shell


def check_exists(args, dest: str, what: str = "file or folder") -> None:
    name = getattr(args, dest, None)
    if name is not None and not Path(name).exists():
        raise ValueError(f"{option(dest)} {name}: no such {what}")


def check_device(device: str | None) -> None:
    """`device` names a torch device this build can use (imports torch: call it after the cheap checks)."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device}: not a torch device; use cpu, cuda, cuda:1, mps, ... or leave "
                         "--device out (cuda when available, else cpu)") from None  # fmt: skip
    if dev.type == "cpu":
        return
    backend = getattr(torch, dev.type, None)
    if dev.type == "mps":
        available, count = torch.backends.mps.is_available(), 1
    else:
        available = backend is not None and hasattr(backend, "is_available") and backend.is_available()
        count = backend.device_count() if available and hasattr(backend, "device_count") else 0
    if not available:
        raise ValueError(f"--device {device}: this torch build ({torch.__version__}) sees no {dev.type} device; use "
                         "--device cpu or leave --device out")  # fmt: skip
    if dev.index is not None and count and dev.index >= count:
        raise ValueError(f"--device {device}: there are {count} {dev.type} device(s), {dev.type}:0 .. "
                         f"{dev.type}:{count - 1}")  # fmt: skip


def check_demo(args) -> None:
    check_device(args.device)
    if args.quick and args.full:
        raise ValueError("--quick and --full ask for the short and the long run: give one (the plain demo is short "
                         "without either)")  # fmt: skip
    other = "--several-teachers" if args.several_teachers else "--context" if args.context else None
    if args.no_arithmetic and other:
        raise ValueError(f"--no-arithmetic skips a step of the plain demo, and {other} runs another demo that has "
                         f"no such step: drop one of the two")  # fmt: skip


ROLLOUT_OPTIONS = {"num_generations": 1, "max_new_tokens": 128, "generation_temperature": 1.0, "top_p": 1.0,
                   "generation_top_k": 0}  # --rollouts-from's sampling options and their defaults


def check_rollout_options(args) -> None:
    """--rollouts-from's options: given without it they would be ignored (refused); with it, defaults filled in."""
    given = [option(dest) for dest in ROLLOUT_OPTIONS if getattr(args, dest, None) is not None]
    if not getattr(args, "rollouts_from", None):
        if given:
            raise ValueError(f"{given[0]} samples rollouts, which only --rollouts-from STUDENT does: add it, or drop "
                             f"{given[0]}")  # fmt: skip
        return
    text_only = [flag for flag, given in (("--max-length", getattr(args, "max_length", None) is not None),
                                          ("--skip-bad-lines", getattr(args, "skip_bad_lines", False)))
                 if given]  # fmt: skip
    if text_only:  # they shape how text lines are read; a prompt file is read whole, every line checked
        raise ValueError(f"{text_only[0]} applies to --data of text sequences (precompute without --rollouts-from); "
                         f"--rollouts-from reads --data as prompts, every line checked (--max-prompt-length "
                         f"keeps a prompt's last tokens, --max-new-tokens bounds the rollouts): "
                         f"drop {text_only[0]}")  # fmt: skip
    for dest, default in ROLLOUT_OPTIONS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    at_least(args, "num_generations", 1)
    at_least(args, "max_new_tokens", 1)
    at_least(args, "generation_top_k", 0)
    if not (math.isfinite(args.generation_temperature) and args.generation_temperature > 0):
        raise ValueError(f"--generation-temperature {args.generation_temperature:g}: must be a finite number > 0")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p {args.top_p:g}: must be in (0, 1] (1: no nucleus truncation)")
    if not is_url(args.rollouts_from):  # a URL is checked when its engine is asked what it serves
        check_model(args, "rollouts_from")


def is_url(name: str | None) -> bool:
    """An engine's or a server's address rather than a model's path or hub name."""
    return isinstance(name, str) and name.lower().startswith(("http://", "https://"))


def check_served_options(args) -> None:
    """Who generates and who scores (--rollouts-from a model or a URL, --teacher or --teacher-url), and the
    connection options, before any model loads or any request."""
    teacher, url = getattr(args, "teacher", None), getattr(args, "teacher_url", None)
    if teacher and url:
        raise ValueError(f"--teacher {teacher} and --teacher-url {url} both name the teacher: give one (--teacher: "
                         f"a model run here; --teacher-url: a served one)")  # fmt: skip
    if not teacher and not url:
        raise ValueError("no teacher: give --teacher (a model path or hub name), or with --rollouts-from a served "
                         "one, --teacher-url")  # fmt: skip
    if url and not getattr(args, "rollouts_from", None):
        raise ValueError(f"--teacher-url {url} scores rollouts (--rollouts-from STUDENT); a store of --data "
                         f"sequences is scored by a --teacher in this process")  # fmt: skip
    if getattr(args, "teacher_protocol", None) is not None and not url:
        raise ValueError(f"--teacher-protocol {args.teacher_protocol} says how to ask a served teacher, and none is "
                         f"given: add --teacher-url, or drop --teacher-protocol")  # fmt: skip
    if url and is_url(args.rollouts_from) and not args.tokenizer:
        raise ValueError("--rollouts-from and --teacher-url are both served, and the prompts are tokenized here: "
                         "give --tokenizer (the student's tokenizer, e.g. its model folder)")  # fmt: skip
    served = url or is_url(getattr(args, "rollouts_from", None))
    for dest in ("url_timeout", "url_retries"):
        if getattr(args, dest, None) is not None and not served:
            raise ValueError(f"{option(dest)} applies to a served student or teacher (--rollouts-from URL, "
                             f"--teacher-url): drop it")  # fmt: skip
    timeout = getattr(args, "url_timeout", None)
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"--url-timeout {args.url_timeout:g}: must be a finite number of seconds > 0")
    at_least(args, "url_retries", 0)


def check_precompute(args) -> None:
    check_rollout_options(args)
    check_served_options(args)
    check_exists(args, "data", "file")
    check_folder_out(args.out, "precompute writes a store folder")
    at_least(args, "samples", 0, 255)
    at_least(args, "top_k", 0 if args.samples else 1)  # with --samples, --top-k 0 is the draws alone
    at_least(args, "seed", 0)
    check_temperature(args.temperature)
    if args.max_length is not None and args.max_length < 1:  # 0 is not "no limit"
        raise ValueError(
            f"--max-length {args.max_length}: must be >= 1 (leave --max-length out to keep whole sequences)"
        )
    if getattr(args, "max_prompt_length", None) is not None and args.max_prompt_length < 1:
        raise ValueError(f"--max-prompt-length {args.max_prompt_length}: must be >= 1 (leave it out to keep whole "
                         f"prompts)")  # fmt: skip
    at_least(args, "batch_size", 1)
    at_least(args, "shard_size", 1)
    check_encoding(args.encoding)
    check_model(args, "teacher")
    check_model(args, "tokenizer")
    check_device(args.device)


def check_convert(args) -> None:
    check_exists(args, "input")
    check_exists(args, "compressor", "file")
    at_least(args, "vocab_size", 1)
    at_least(args, "top_k", 1)
    at_least(args, "shard_size", 1)
    check_temperature(args.temperature)
    check_encoding(args.encoding)
    if args.to_format == "store":
        check_folder_out(args.out, "--to store writes a store folder")
    elif args.to_format == "distillkit":
        check_folder_out(args.out, "--to distillkit writes a folder (data_0.parquet and compression_config.yaml)")
    if args.from_format == "hf":
        from .teacher.formats.hf_datasets import COLUMNS, load_table

        try:
            names = load_table(args.input).column_names
        except ValueError as e:
            raise ValueError(f"--input {e}") from e
        names = names if isinstance(names, list) else sorted({c for cols in names.values() for c in cols})
        missing = [c for c in COLUMNS if c not in names]
        if missing:
            raise ValueError(f"--input {args.input}: no column {', '.join(missing)} (--from hf reads "
                             f"{', '.join(COLUMNS)}; found {', '.join(names) or 'none'})")  # fmt: skip


def check_folder_out(out: str, writes: str) -> None:
    """An output that is always a folder (a store, a DistillKit capture) refuses a --out named like a file, which
    would otherwise become a folder of that name."""
    if out.rstrip("/").lower().endswith(FILE_SUFFIXES):
        folder = Path(out.rstrip("/")).with_suffix("").name or "out"
        raise ValueError(f"--out {out}: {writes}, not a file; name a folder, e.g. --out {folder}/")


def check_serve(args) -> None:
    at_least(args, "port", 1, 65535)
    at_least(args, "top_k", 1)
    at_least(args, "max_batch_tokens", 1)
    check_model(args, "teacher")
    check_device(args.device)


def check_bench(args) -> None:
    check_device(args.device)
