"""Where `liger-kd train` writes: --output_dir checked before any model loads (it must not be a model's own folder
nor hold model files another run or a download left there, unless --overwrite_output_dir), the record of the files
a run saved there (so the next run into the same folder may replace them), and --resume_from_checkpoint checked to
be a checkpoint (`latest`, or `true` as the Trainer's own True means: the newest one in --output_dir)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from ..utils.paths import file_in_the_way

RECORD = "liger_kd_train.json"  # the files the last `liger-kd train` run saved in its --output_dir
MODEL_FILES = ("config.json", "generation_config.json", "adapter_config.json", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
               "tokenizer.model", "chat_template.jinja", "training_args.bin")  # fmt: skip
MODEL_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "adapter_model*.bin")
CHECKPOINT_STATE = "trainer_state.json"  # every checkpoint the Trainer saves holds it
LATEST = ("latest", "true")  # --resume_from_checkpoint words for the newest checkpoint in --output_dir
AFRESH = ("false", "none", "")  # and for none: the Trainer's own False / None


def model_files(folder: Path) -> list[str]:
    """The model / tokenizer files directly in `folder`, sorted by name."""
    if not folder.is_dir():
        return []
    found = {name for name in MODEL_FILES if (folder / name).is_file()}
    found |= {p.name for pattern in MODEL_PATTERNS for p in folder.glob(pattern) if p.is_file()}
    return sorted(found)


def _written_before(folder: Path) -> set[str]:
    try:
        return set(json.loads((folder / RECORD).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):  # no record (or not ours): nothing counts as written by us
        return set()


def check_output_dir(output_dir: str, models: dict[str, str | None], overwrite: bool) -> None:
    """Refuse an --output_dir the save would overwrite files in that this tool did not write: a model's own folder
    (`models`: option -> name or path), or a folder holding model or tokenizer files no `liger-kd train` run saved.
    A path that is a file (or under one) is no folder at all, overwrite or not: the save would fail after the run."""
    out = Path(output_dir).expanduser()
    blocking = file_in_the_way(out)
    if blocking is not None:
        what = "is a file" if blocking == out else f"is under {blocking}, a file"
        raise ValueError(f"--output_dir {output_dir}: {what}, not a folder; give a folder's path (made if missing) "
                         f"where the student and its checkpoints are saved")  # fmt: skip
    if overwrite:
        return
    fix = "give another --output_dir, or pass --overwrite_output_dir to overwrite them"
    for option, name in models.items():
        if name is not None and out.is_dir() and Path(name).expanduser().is_dir() and out.samefile(name):
            raise ValueError(f"--output_dir {output_dir}: is the folder of {option} {name}; saving there would "
                             f"overwrite that model's own files ({', '.join(model_files(out)) or 'none yet'}): "
                             f"{fix}")  # fmt: skip
    foreign = [name for name in model_files(out) if name not in _written_before(out)]
    if foreign:
        raise ValueError(f"--output_dir {output_dir}: already holds {', '.join(foreign)}, which no earlier "
                         f"`liger-kd train` run saved there (no {RECORD} lists them); saving would overwrite them: "
                         f"{fix}")  # fmt: skip


def earlier_saves(output_dir: str) -> dict[str, int]:
    """The files an earlier `liger-kd train` run saved in --output_dir (its record) -> their modification times: what
    drop_stale compares after this run's save."""
    out = Path(output_dir)
    return {name: (out / name).stat().st_mtime_ns for name in _written_before(out) if (out / name).is_file()}


def drop_stale(output_dir: str, earlier: dict[str, int]) -> list[str]:
    """Delete the files an earlier run of ours saved (`earlier`, from earlier_saves) that this run's save did not
    rewrite: a full model's weights beside this run's LoRA adapter, or an adapter beside a full model, would load
    instead of (or on top of) what this run trained. Files of no run of ours are never touched. Returns their
    names."""
    out = Path(output_dir)
    stale = sorted(name for name, mtime in earlier.items()
                   if (out / name).is_file() and (out / name).stat().st_mtime_ns == mtime)  # fmt: skip
    for name in stale:
        (out / name).unlink()
    return stale


def record_saved(output_dir: str) -> None:
    """Note the model and tokenizer files now in --output_dir as this tool's, for the next run's check."""
    out = Path(output_dir)
    (out / RECORD).write_text(json.dumps({"written_by": "liger-kd train", "files": model_files(out)}, indent=1))


def checked_resume(value: Any, output_dir: str) -> Any:
    """--resume_from_checkpoint as the Trainer takes it: a checkpoint folder, checked here (the Trainer's own message
    comes only after the models load); `latest` or `true` (any case) the newest checkpoint in --output_dir, which
    must hold one (a newer folder without trainer_state.json, a save cut short, is passed over with a warning);
    `false`, `none` or nothing: None (start afresh); None or a bool unchanged."""
    if value is None or isinstance(value, bool):
        return value
    if str(value).strip().lower() in AFRESH:
        return None
    if str(value).strip().lower() in LATEST:
        numbered = {int(p.name.removeprefix("checkpoint-")): p for p in Path(output_dir).glob("checkpoint-*")
                    if p.name.removeprefix("checkpoint-").isdigit()}  # fmt: skip
        saved = sorted(step for step, p in numbered.items() if (p / CHECKPOINT_STATE).is_file())
        if not saved:
            raise ValueError(f"--resume_from_checkpoint {value}: --output_dir {output_dir} holds no checkpoint "
                             "(checkpoint-STEP with trainer_state.json) to resume from; leave the option out to start "
                             "afresh, or name the checkpoint folder")  # fmt: skip
        newest = numbered[saved[-1]]
        unfinished = [numbered[step].name for step in sorted(numbered) if step > saved[-1]]
        if unfinished:  # a save cut short (a killed run) is passed over, and the user hears which one
            warnings.warn(f"--resume_from_checkpoint {value}: resuming from {newest.name}; the newer "
                          f"{', '.join(unfinished)} has no {CHECKPOINT_STATE} (a save that did not finish) and is "
                          "passed over", stacklevel=2)  # fmt: skip
        return str(newest)
    path = Path(str(value)).expanduser()
    if not path.is_dir():
        raise ValueError(f"--resume_from_checkpoint {value}: no such folder; name a checkpoint folder a run saved "
                         "(OUTPUT_DIR/checkpoint-STEP) or `latest` (the newest in --output_dir), or leave the option "
                         "out to start afresh")  # fmt: skip
    if not (path / CHECKPOINT_STATE).is_file():
        inside = sorted(p.name for p in path.glob("checkpoint-*") if (p / CHECKPOINT_STATE).is_file())
        hint = f" (it holds {', '.join(inside)}: name one of them, or `latest`)" if inside else ""
        raise ValueError(f"--resume_from_checkpoint {value}: not a checkpoint, it has no {CHECKPOINT_STATE}{hint}; "
                         "name a checkpoint folder a run saved (OUTPUT_DIR/checkpoint-STEP)")  # fmt: skip
    return value


def resume_note(checkpoint: str, max_steps: int) -> str:
    """The line saying which checkpoint a run resumes from; where --max_steps is not the length of the checkpoint's
    run, also what the Trainer then does with its restored learning-rate schedule."""
    note = f"liger-kd train: resuming from {checkpoint}"
    try:
        state = json.loads((Path(checkpoint) / CHECKPOINT_STATE).read_text())
    except (OSError, ValueError):
        return note
    was, step = state.get("max_steps"), state.get("global_step")
    if max_steps > 0 and isinstance(was, int) and was != max_steps:
        note += (f" (step {step} of a run of {was} steps); --max_steps {max_steps} is another length: the restored "
                 f"scheduler's first step keeps the learning rate that run had reached (0 at the end of a linear "
                 f"schedule), then the schedule of {max_steps} steps takes over; --max_steps {was} continues the run "
                 f"as it was")  # fmt: skip
    return note
