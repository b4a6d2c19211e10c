"""The dataset of `liger-kd train` and its splits, read and checked before any model loads.

--dataset_name is, in this order: a local file (.jsonl, .json, .parquet: the split 'train'), a local folder (a
teacher store when it holds `liger-kd precompute`'s manifest; else one file or several shards per split, named
<split>.jsonl or <split>-00000-of-00002.parquet, directly or under data/, as Hugging Face names them), or a hub
dataset (read with the datasets package, imported only then). JSON and JSON lines are read with the standard
library; parquet needs pyarrow.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cli_checks import looks_like_path
from ..teacher.store import MANIFEST, store_meta
from ..teacher.store.rollouts import rollouts_of
from ..trainer.text_rows import TRAINED_COLUMNS
from ..utils.errors import reason_of
from ..utils.text_files import read_utf8
from .arguments import NO_SPLIT, ScriptArguments

EXTENSIONS = (".jsonl", ".json", ".parquet")
SHARD = re.compile(r"(.+?)-\d+(?:-of-\d+)?")  # train-00000-of-00002, train-00001: shards of the split 'train'
DEFAULT_TEST_SPLIT = "test"
FORMATS_EXTRA = "pip install 'liger_patch_kd[formats]'"


@dataclass
class Splits:
    train: Any
    evaluation: Any  # None: no evaluation
    store: Path | None  # a teacher store: rows carry the teacher's top-k
    description: str  # where the evaluation rows come from, for the run's first lines


def read_file(path: Path) -> list[dict]:
    """The rows of one .jsonl / .json / .parquet file; a bad line is a ValueError naming it."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"--dataset_name {path}: reading parquet needs pyarrow: {FORMATS_EXTRA}") from None
        return pq.read_table(path).to_pylist()
    text = read_utf8(path, "--dataset_name")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        rows = json.loads(text)
    else:  # JSON lines (HF's "json" builder reads a .json file of lines too)
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as e:
                    raise ValueError(f"--dataset_name {path}: line {number} is not JSON ({e})") from None
    bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
    if bad is not None:
        raise ValueError(f"--dataset_name {path}: row {bad} is a {type(rows[bad]).__name__}, not an object of columns")
    return rows


def split_files(folder: Path) -> dict[str, list[Path]]:
    """split name -> its files in `folder` (or folder/data): <split>.<ext> or <split>-<shard>.<ext> (Hugging Face's
    <split>-00000-of-00002.parquet), sorted. A split in two formats or two places (train.jsonl beside train.parquet,
    or beside data/train.jsonl) is refused: most likely one copy of the other, and reading both doubles its rows."""
    found: dict[str, list[Path]] = {}
    for place in (folder, folder / "data"):
        for path in sorted(place.glob("*")) if place.is_dir() else ():
            if path.is_file() and path.suffix in EXTENSIONS:
                shard = SHARD.fullmatch(path.stem)  # any other name is a split of its own (train-old-backup)
                found.setdefault(shard.group(1) if shard else path.stem, []).append(path)
    for split, paths in found.items():
        copies = {(path.parent, path.suffix): path for path in paths}
        if len(copies) > 1:
            first, second = list(copies.values())[:2]
            raise ValueError(f"--dataset_name {folder}: the split '{split}' is in both {first} and {second}; "
                             "reading both would count its rows twice: keep one format and one place per split "
                             "(move the other file out of the folder)")  # fmt: skip
    return found


def _local_splits(path: Path, config: str | None) -> dict[str, Any]:
    if config is not None:
        raise ValueError(f"--dataset_config {config}: names a configuration of a hub dataset; {path} is local")
    if path.is_file():
        if path.suffix not in EXTENSIONS:
            raise ValueError(f"--dataset_name {path}: not a {' / '.join(EXTENSIONS)} file")
        return {"train": read_file(path)}  # one file is one split, 'train', as Hugging Face reads it
    files = split_files(path)
    if not files:
        raise ValueError(f"--dataset_name {path}: no {' / '.join(EXTENSIONS)} files in this folder (one per split, "
                         f"e.g. train.jsonl and test.jsonl) and no teacher store ({MANIFEST})")  # fmt: skip
    return {split: _Lazy(paths) for split, paths in files.items()}


class _Lazy:
    """A split's files, read when the split is used (a folder may hold large splits this run does not train on)."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    def rows(self) -> list[dict]:
        return [row for path in self.paths for row in read_file(path)]


def _hub_splits(name: str, config: str | None) -> dict[str, Any]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"--dataset_name {name}: reading a hub dataset needs the datasets package: {FORMATS_EXTRA} "
                         "(or give a local .jsonl / .json / .parquet file or folder)") from None  # fmt: skip
    try:
        return dict(datasets.load_dataset(name, config))
    except (OSError, ValueError) as e:  # not found, or not reachable (ConnectionError is an OSError)
        raise ValueError(f"--dataset_name {name}: no local file or folder of that name, and the hub dataset did not "
                         f"load ({reason_of(e)}); check the name, or give a local .jsonl / .json / "
                         f".parquet file or folder") from None  # fmt: skip


def _rows(split: Any) -> Any:
    return split.rows() if isinstance(split, _Lazy) else split


def check_columns(rows: Any, name: str) -> None:
    """The first row has a column KDTrainer trains on (or teacher data): said before any model loads."""
    try:
        row = rows[0]
    except (IndexError, KeyError):
        raise ValueError(f"{name} has no rows") from None
    if isinstance(row, dict) and not any(c in row for c in TRAINED_COLUMNS):
        raise ValueError(f"{name}'s rows have the columns {sorted(row)}, none of which KDTrainer trains on: give "
                         "'text', 'prompt' (+ 'completion'), 'messages' (TRL's formats) or 'input_ids'")  # fmt: skip


def check_dataset_name(script: ScriptArguments) -> None:
    """What can be said of --dataset_name before the tokenizers load: given, and there when it is a path."""
    name = script.dataset_name
    if name is None:
        raise ValueError("--dataset_name is required: a local .jsonl / .json / .parquet file or folder, a teacher "
                         "store, or a hub dataset")  # fmt: skip
    if (looks_like_path(name) or name.endswith(EXTENSIONS)) and not Path(name).expanduser().exists():
        raise ValueError(f"--dataset_name {name}: no such file or folder (a local file or folder, or a hub dataset "
                         "such as org/name)")  # fmt: skip


def load_splits(script: ScriptArguments, seed: int, store_dataset: Callable[[Path], Any]) -> Splits:
    """The train rows and the evaluation rows (or None), as ScriptArguments name them. `store_dataset(path)` opens
    a teacher store (given by the caller, who has the student's tokenizer to check it against)."""
    check_dataset_name(script)
    name = script.dataset_name
    fraction = script.eval_fraction
    if fraction is not None and not 0 < fraction < 1:
        raise ValueError(f"--eval_fraction {fraction}: must be in (0, 1), the share of the train split held out")
    path = Path(name).expanduser()
    store = path if path.is_dir() and (path / MANIFEST).exists() else None
    if store is not None:  # the rows carry the teacher's top-k: one split
        splits = {"train": store_dataset(store)}
    elif path.exists():
        splits = _local_splits(path, script.dataset_config)
    else:
        splits = _hub_splits(name, script.dataset_config)
    where = f"--dataset_name {name}"
    if script.dataset_train_split not in splits:
        raise ValueError(f"--dataset_train_split {script.dataset_train_split}: {name} has no such split (it has "
                         f"{', '.join(sorted(splits))})")  # fmt: skip
    test = script.dataset_test_split
    dropped = test is not None and test.lower() == NO_SPLIT  # no test split; --eval_fraction may still hold out
    if dropped:
        test = None
    else:
        if test is not None and test not in splits:
            raise ValueError(f"--dataset_test_split {test}: {name} has no such split (it has "
                             f"{', '.join(sorted(splits))}; leave the option out to evaluate on 'test' when there is "
                             f"one)")  # fmt: skip
        if test is None and DEFAULT_TEST_SPLIT in splits and DEFAULT_TEST_SPLIT != script.dataset_train_split:
            test = DEFAULT_TEST_SPLIT
    if test is not None and fraction is not None:
        raise ValueError(f"--eval_fraction {fraction} holds out part of the train split, and {name} has the split "
                         f"'{test}' to evaluate on: give one (--dataset_test_split none drops the split)")  # fmt: skip
    train = _rows(splits[script.dataset_train_split])
    check_columns(train, f"{where} (split {script.dataset_train_split})")
    if test is not None:
        evaluation = _rows(splits[test])
        check_columns(evaluation, f"{where} (split {test})")
        description = f"evaluating on the split '{test}' ({len(evaluation)} rows)"
    elif fraction is not None:
        # a rollout store's completions of one prompt are adjacent rows: held out together, or the evaluation
        # would score completions of prompts the student trains on
        section = rollouts_of(store_meta(train) or {})
        group = int(section.get("num_generations", 1)) if section else 1
        train, evaluation = _hold_out(train, fraction, seed, group=group)
        description = f"evaluating on {len(evaluation)} rows held out of '{script.dataset_train_split}'"
        if group > 1:  # whole prompts are held out, so the share of rows is a multiple of a prompt's
            description += (f" ({len(evaluation) // group} of {(len(train) + len(evaluation)) // group} prompts, "
                            f"their {group} completions each)")  # fmt: skip
    elif dropped:
        evaluation, description = None, f"no evaluation (--dataset_test_split {NO_SPLIT})"
    else:
        evaluation, description = None, "no evaluation (no test split; --eval_fraction holds out part of train)"
    return Splits(train, evaluation, store, description)


def _hold_out(rows: Any, fraction: float, seed: int, group: int = 1) -> tuple[Any, Any]:
    """(train, held out): a seeded share of the rows, at least one each side; `group` adjacent rows (a prompt's
    completions) go to the same side."""
    n = len(rows)
    groups = -(-n // group)
    held = max(1, round(groups * fraction))
    if held >= groups:
        what = "rows" if group == 1 else f"prompts ({group} completions each)"
        raise ValueError(f"--eval_fraction {fraction}: holds out {held} of the train split's {groups} {what}, none "
                         "left to train on")  # fmt: skip
    order = list(range(groups))
    random.Random(seed).shuffle(order)

    def rows_of(chosen: list[int]) -> list[int]:
        return sorted(i for g in chosen for i in range(g * group, min(n, (g + 1) * group)))

    train_idx, eval_idx = rows_of(order[held:]), rows_of(order[:held])
    if hasattr(rows, "select"):  # a datasets.Dataset
        return rows.select(train_idx), rows.select(eval_idx)
    if isinstance(rows, list):
        return [rows[i] for i in train_idx], [rows[i] for i in eval_idx]
    from torch.utils.data import Subset  # a teacher store

    return Subset(rows, train_idx), Subset(rows, eval_idx)
