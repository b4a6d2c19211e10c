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
from transformers.hf_argparser import string_to_bool

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
    # allow_abbrev off: a shortened name (--kd_lmb) is a mistake, not silently one of several options
    return TrainParser((ScriptArguments, ModelArguments, KDTrainingArguments), prog=PROG, description=DESCRIPTION,
                       allow_abbrev=False)  # fmt: skip


def one_value_options(parser: TrainParser) -> frozenset[str]:
    """The options followed by exactly one value (not a bool's optional one, not a list's)."""
    return frozenset(o[2:] for a in parser._actions if a.nargs is None and a.option_strings
                     for o in a.option_strings if o.startswith("--"))  # fmt: skip


def check_yaml_booleans(config: dict[str, Any], actions: dict[str, list[Any]], path: str) -> None:
    """YAML reads an unquoted no / yes / off / on as a boolean: given to an option that takes a word (save_strategy,
    report_to, ...) it is a mistake to name, not a value for the option to refuse in its own words."""
    for key, value in config.items():
        boolean = any(a.type is string_to_bool or a.const in (True, False) for a in actions.get(key, ()))
        if isinstance(value, bool) and key in actions and not boolean:
            raise ValueError(f"--config {path}: {key}: {str(value).lower()} is read by YAML as the boolean {value}, "
                             f"and {key} takes a word: quote it ({key}: \"no\", or whichever word you meant)")


def _flag_name(word: str) -> str | None:
    """`--name` or `--name=value` -> name; anything else None."""
    return word[2:].split("=", 1)[0] if word.startswith("--") and len(word) > 2 else None


def with_our_names(argv: list[str], where: str = "the command line", takes_value: frozenset[str] = frozenset()
                   ) -> list[str]:  # fmt: skip
    """argv with TRL's names (--lmbda) as ours (--kd_lmbda); an ambiguous TRL name, or a TRL name beside ours, is
    a ValueError. A word right after an option of `takes_value` (without `=`) is that option's value, never read as
    a name (`--run_name --temperature`)."""
    values = {i + 1 for i, w in enumerate(argv) if "=" not in w and _flag_name(w) in takes_value}
    flags = [(i, w) for i, w in enumerate(argv) if i not in values]
    out, given = list(argv), {_flag_name(w) for _, w in flags} - {None}
    for i, word in flags:
        name = _flag_name(word)
        if name in TRL_AMBIGUOUS:
            raise ValueError(f"--{name} ({where}): {TRL_AMBIGUOUS[name]}")
        if name in TRL_ALIASES:
            ours = TRL_ALIASES[name]
            if ours in given or sum(TRL_ALIASES.get(g) == ours for g in given) > 1:
                raise ValueError(f"--{name} and --{ours} ({where}) set one option twice: give --{ours} alone")
            out[i] = f"--{ours}{word[len(name) + 2 :]}"
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
        known: dict[str, list[Any]] = {}  # a bool defaulting to True has two actions: --x and --no_x
        for action in parser._actions:
            known.setdefault(action.dest, []).append(action)
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ValueError(f"--config {config_path}: no option {', '.join(unknown)} (see {PROG} --help)")
        check_yaml_booleans(config, known, config_path)
        for key, value in config.items():  # defaults, so the command line wins (TRL's TrlParser does the same)
            for action in known[key]:  # argparse takes a dest's default from its first action: set them all
                action.default, action.required = value, False
    script, model, training, unknown = parser.parse_args_into_dataclasses(
        args=with_our_names(argv, takes_value=one_value_options(parser)), return_remaining_strings=True
    )
    if unknown:
        raise ValueError(f"unrecognized arguments: {' '.join(unknown)} (see {PROG} --help)")
    return script, model, training
