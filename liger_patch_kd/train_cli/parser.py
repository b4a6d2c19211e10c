"""One parser over the script's options and KDTrainingArguments, as TRL's TrlParser: `--config FILE.yaml` sets
defaults (its keys are the flags' names without `--`; an `env:` mapping sets environment variables), the command
line overrides them. TRL's unambiguous option names (arguments.TRL_ALIASES) are read as ours; its ambiguous ones
are refused with the two options they could mean."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from transformers import HfArgumentParser

from ..trainer import KDTrainingArguments
from .arguments import TRL_ALIASES, TRL_AMBIGUOUS, ModelArguments, ScriptArguments

PROG = "liger-kd train"
DESCRIPTION = (
    "Distil a teacher into a student: every KDTrainingArguments (and TrainingArguments) option is a flag; "
    "--config FILE.yaml gives them as keys, the command line overrides the file. Example: liger-kd train "
    "--model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --teacher_model_name_or_path Qwen/Qwen2.5-1.5B-Instruct "
    "--dataset_name trl-lib/Capybara --output_dir out --use_kd_patch"
)


class TrainParser(HfArgumentParser):
    """HfArgumentParser whose usage errors are the CLI's one line (no usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> TrainParser:
    return TrainParser((ScriptArguments, ModelArguments, KDTrainingArguments), prog=PROG, description=DESCRIPTION)


def _flag_name(word: str) -> str | None:
    """`--name` or `--name=value` -> name; anything else None."""
    return word[2:].split("=", 1)[0] if word.startswith("--") and len(word) > 2 else None


def with_our_names(argv: list[str], where: str = "the command line") -> list[str]:
    """argv with TRL's names (--lmbda) as ours (--kd_lmbda); an ambiguous TRL name, or a TRL name beside ours, is
    a ValueError."""
    out, given = [], {_flag_name(w) for w in argv} - {None}
    for word in argv:
        name = _flag_name(word)
        if name in TRL_AMBIGUOUS:
            raise ValueError(f"--{name} ({where}): {TRL_AMBIGUOUS[name]}")
        if name in TRL_ALIASES:
            ours = TRL_ALIASES[name]
            if ours in given or sum(TRL_ALIASES.get(g) == ours for g in given) > 1:
                raise ValueError(f"--{name} and --{ours} ({where}) set one option twice: give --{ours} alone")
            word = f"--{ours}{word[len(name) + 2 :]}"
        out.append(word)
    return out


def read_config(path: str) -> dict[str, Any]:
    """The YAML file's mapping, TRL names read as ours; its `env:` mapping is set in the environment."""
    import yaml  # a dependency of transformers

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path}: no such file (a YAML mapping of option names to values)")
    try:
        config = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({' '.join(str(e).split())})") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError(f"--config {path}: holds a {type(config).__name__}, not a mapping of option names to values")
    env = config.pop("env", None) or {}
    if not isinstance(env, dict):
        raise ValueError(f"--config {path}: `env` must be a mapping of variable names to values")
    for key, value in env.items():
        os.environ[str(key)] = str(value)
    renamed = with_our_names([f"--{key}" for key in config], where=path)
    return {name[2:]: value for name, value in zip(renamed, config.values())}


def split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the --config path or None, argv without it)."""
    for i, word in enumerate(argv):
        if word == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config: give the YAML file's path")
            return argv[i + 1], argv[:i] + argv[i + 2 :]
        if word.startswith("--config="):
            return word.split("=", 1)[1], argv[:i] + argv[i + 1 :]
    return None, argv


def parse(argv: list[str] | None = None) -> tuple[ScriptArguments, ModelArguments, KDTrainingArguments]:
    """The three argument sets of one `liger-kd train` command line (`argv`, or sys.argv[2:]'s)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path, argv = split_config(argv)
    parser = build_parser()
    if config_path is not None:
        config = read_config(config_path)
        known = {action.dest: action for action in parser._actions}
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ValueError(f"--config {config_path}: no option {', '.join(unknown)} (see {PROG} --help)")
        for key, value in config.items():  # defaults, so the command line wins (TRL's TrlParser does the same)
            known[key].default, known[key].required = value, False
    script, model, training, unknown = parser.parse_args_into_dataclasses(
        args=with_our_names(argv), return_remaining_strings=True
    )
    if unknown:
        raise ValueError(f"unrecognized arguments: {' '.join(unknown)} (see {PROG} --help)")
    return script, model, training
