"""Checkpoint rotation that deletes only this run's checkpoints. The Trainer's save_total_limit rotation deletes
every `checkpoint-*` folder in output_dir beyond the limit, whoever wrote it; so a run that rotates refuses to start
in an output_dir already holding checkpoints it does not resume from (they would be another run's, and go)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR


def existing_checkpoints(output_dir: str | Path) -> list[Path]:
    """The checkpoint folders directly in `output_dir`, by step."""
    folder = Path(output_dir)
    found = [p for p in folder.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir()] if folder.is_dir() else []
    return sorted(found, key=lambda p: (len(p.name), p.name))


def check_rotation_spares_others(args: Any, resume_from_checkpoint: Any) -> None:
    """Refuse to train with save_total_limit into an output_dir holding checkpoints this run does not continue:
    resume_from_checkpoint=True (the latest there) or one of them continues them; anything else would delete them."""
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    if not args.save_total_limit or args.save_total_limit <= 0 or strategy == "no":
        return
    found = existing_checkpoints(args.output_dir)
    if not found or resume_from_checkpoint is True:
        return
    if isinstance(resume_from_checkpoint, (str, Path)):
        resumed = Path(resume_from_checkpoint).expanduser()
        if resumed.is_dir() and any(resumed.samefile(p) for p in found):
            return
    names = ", ".join(p.name for p in found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
    raise ValueError(
        f"output_dir {args.output_dir} already holds {names}, and save_total_limit={args.save_total_limit} rotation "
        f"deletes checkpoints there whoever wrote them: give another output_dir, resume from them "
        f"(train(resume_from_checkpoint=True), or --resume_from_checkpoint {found[-1]}), or remove them"
    )
