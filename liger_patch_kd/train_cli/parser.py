"""One parser over the script's options and KDTrainingArguments, as TRL's TrlParser: `--config FILE.yaml` sets
defaults (its keys are the flags' names without `--`; an `env:` mapping sets environment variables), the command
line overrides them. TRL's unambiguous option names (arguments.TRL_ALIASES) are read as ours; its ambiguous ones
and those with no option here (TRL_WITHOUT_OPTION) are refused, all of them in one line, each with its fix."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool

from ..cli_checks import option_names, suggestions
from ..trainer import KDTrainingArguments
from .arguments import TRL_ALIASES, TRL_AMBIGUOUS, TRL_WITHOUT_OPTION, ModelArguments, ScriptArguments

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
    parser = TrainParser((ScriptArguments, ModelArguments, KDTrainingArguments), prog=PROG, description=DESCRIPTION,
                         allow_abbrev=False)  # fmt: skip
    # read by split_config before the dataclasses are parsed; here so that usage and --help show it (SUPPRESS: no
    # attribute is left over for HfArgumentParser to return beside the dataclasses)
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="a YAML file of options (the flags' names without --, TRL's names too; an `env:` mapping "
                             "sets environment variables); the command line overrides it")  # fmt: skip
    for action in parser._actions:  # fields of KDTrainingArguments this command has flags of its own for (refused
        if action.dest in TRL_WITHOUT_OPTION:  # by name with those flags, trl_problem): not offered in --help
            action.help = argparse.SUPPRESS
    return parser


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


NUMBER_TYPES = {int: "an integer", float: "a number"}


def typed_yaml_values(config: dict[str, Any], actions: dict[str, list[Any]], path: str) -> dict[str, Any]:
    """The file's values as the command line would give them: argparse converts only string defaults, so a YAML
    1.5 for an integer option, or a list for a number, would reach the arguments unchecked. A number option's value
    is converted (1e-5, which YAML reads as a string, becomes 1e-05) or refused naming the key; a list option's
    scalar becomes a list of one, as one word after its flag does."""
    out = dict(config)
    for key, value in config.items():
        action = actions[key][0]
        if value is None:
            continue
        if action.nargs in ("+", "*"):
            out[key] = value if isinstance(value, list) else [value]
            if action.type is str and not all(isinstance(v, str) for v in out[key]):
                raise ValueError(f"--config {path}: {key}: {value!r} is not a list of words; give words (e.g. "
                                 f"{key}: [a, b])")  # fmt: skip
        elif action.type in NUMBER_TYPES:
            numeric = isinstance(value, (int, float, str)) and not isinstance(value, bool)
            if action.type is int and isinstance(value, float) and value.is_integer():
                value = int(value)  # 2.0 is the integer 2
            try:
                converted = action.type(value if isinstance(value, str) else str(value)) if numeric else None
            except ValueError:
                converted = None
            if converted is None:
                raise ValueError(f"--config {path}: {key}: {value!r} is not {NUMBER_TYPES[action.type]}; give "
                                 f"{key}: {'2' if action.type is int else '0.5'}, say")  # fmt: skip
            out[key] = converted
    return out


def _flag_name(word: str) -> str | None:
    """`--name` or `--name=value` -> name; anything else None."""
    return word[2:].split("=", 1)[0] if word.startswith("--") and len(word) > 2 else None


def trl_problem(name: str) -> str | None:
    """What to give instead of TRL's option `name` when it is not one of ours (ambiguous, or without an option
    here), or None."""
    return TRL_AMBIGUOUS.get(name) or TRL_WITHOUT_OPTION.get(name)


def refuse_trl_names(problems: dict[str, str], where: str, others: list[str] = (), hint: str = "") -> None:
    """One ValueError naming every TRL-only name (with what to give instead) and any other unknown name (`hint`:
    the options those most likely misspell, cli_checks.suggestions)."""
    if not problems and not others:
        return
    parts = [f"--{name}: {fix}" for name, fix in problems.items()]
    if others:
        parts.append(f"no option {', '.join(others)} ({hint}see {PROG} --help)")
    what = "TRL names that are not options here" if problems else "unknown names"
    raise ValueError(f"{where} holds {what}: " + "; ".join(parts))


def with_our_names(argv: list[str], where: str = "the command line", takes_value: frozenset[str] = frozenset()
                   ) -> list[str]:  # fmt: skip
    """argv with TRL's names (--lmbda) as ours (--kd_lmbda); TRL names that are ambiguous or have no option here,
    or a TRL name beside ours, are one ValueError naming all of them. A word right after an option of `takes_value`
    (without `=`) is that option's value, never read as a name (`--run_name --temperature`)."""
    out, problems = renamed_trl_names(argv, where, takes_value)
    refuse_trl_names(problems, where)
    return out


def renamed_trl_names(argv: list[str], where: str, takes_value: frozenset[str] = frozenset()
                      ) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """(argv with TRL's aliases as ours, {TRL-only name: what to give instead}); a TRL name beside ours is a
    ValueError."""
    values = {i + 1 for i, w in enumerate(argv) if "=" not in w and _flag_name(w) in takes_value}
    flags = [(i, w) for i, w in enumerate(argv) if i not in values]
    out, given = list(argv), {_flag_name(w) for _, w in flags} - {None}
    problems: dict[str, str] = {}
    for i, word in flags:
        name = _flag_name(word)
        if trl_problem(name):
            problems[name] = trl_problem(name)
        if name in TRL_ALIASES:
            ours = TRL_ALIASES[name]
            if ours in given or sum(TRL_ALIASES.get(g) == ours for g in given) > 1:
                raise ValueError(f"--{name} and --{ours} ({where}) set one option twice: give --{ours} alone")
            out[i] = f"--{ours}{word[len(name) + 2 :]}"
    return out, problems


def read_config(path: str, known: frozenset[str] | None = None) -> dict[str, Any]:
    """The YAML file's mapping, TRL names read as ours; its `env:` mapping is set in the environment. TRL-only keys
    and (given `known`, the options' names) unknown ones are one ValueError naming all of them; TRL's
    `disable_dropout: false` is what happens here (dropout as the model's config says) and is dropped."""
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
    if config.get("disable_dropout") is False:
        del config["disable_dropout"]
    renamed, problems = renamed_trl_names([f"--{key}" for key in config], where=f"--config {path}")
    others = sorted(k for k in config if known is not None and k not in known and not trl_problem(str(k)))
    others = [str(k) for k in others if TRL_ALIASES.get(str(k)) not in (known or ())]
    refuse_trl_names(problems, f"--config {path}", others, suggestions(others, sorted(known or ()), dashes=""))
    for key, value in env.items():
        os.environ[str(key)] = str(value)
    return {name[2:]: value for name, value in zip(renamed, config.values())}


def split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the --config path or None, argv without it). A second --config is refused: one file sets the defaults."""
    path, rest = None, list(argv)
    for i, word in enumerate(argv):
        if word == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config: give the YAML file's path")
            path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
            break
        if word.startswith("--config="):
            path, rest = word.split("=", 1)[1], argv[:i] + argv[i + 1 :]
            break
    if path is not None:
        again, _ = split_config(rest)
        if again is not None:
            raise ValueError(f"--config is given twice ({path}, {again}): give one file, and the options that differ "
                             f"from it on the command line (they override the file's)")  # fmt: skip
    return path, rest


def parse(argv: list[str] | None = None) -> tuple[ScriptArguments, ModelArguments, KDTrainingArguments]:
    """The three argument sets of one `liger-kd train` command line (`argv`, or sys.argv[2:]'s)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path, argv = split_config(argv)
    parser = build_parser()
    if config_path is not None:
        known: dict[str, list[Any]] = {}  # a bool defaulting to True has two actions: --x and --no_x
        for action in parser._actions:
            known.setdefault(action.dest, []).append(action)
        known.pop("config", None)  # a file does not name another file
        config = read_config(config_path, frozenset(known))
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ValueError(f"--config {config_path}: no option {', '.join(unknown)} (see {PROG} --help)")
        check_yaml_booleans(config, known, config_path)
        config = typed_yaml_values(config, known, config_path)
        for key, value in config.items():  # defaults, so the command line wins (TRL's TrlParser does the same)
            for action in known[key]:  # argparse takes a dest's default from its first action: set them all
                action.default, action.required = value, False
    script, model, training, unknown = parser.parse_args_into_dataclasses(
        args=with_our_names(argv, takes_value=one_value_options(parser)), return_remaining_strings=True
    )
    if unknown:
        raise ValueError(f"unrecognized arguments: {' '.join(unknown)} ({suggestions(unknown, option_names(parser))}"
                         f"see {PROG} --help)")  # fmt: skip
    return script, model, training
