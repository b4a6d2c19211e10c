"""The package's log lines at the level a Trainer run asks for.

The package logs under the `liger_patch_kd` logger, which is not one of transformers' (`transformers.*`), so the
Trainer's `log_level` (`--log_level info` on `liger-kd train`) and `transformers.logging.set_verbosity` do not reach
it: without this, its INFO lines (how rollouts are made, store refreshes, a teacher's captured graphs) show only to
a user who configured Python's logging.
"""

from __future__ import annotations

import logging
import sys

PACKAGE_LOGGER = "liger_patch_kd"
FORMAT = f"[{PACKAGE_LOGGER}] %(message)s"  # transformers' own handler writes "[transformers] message"


def follow_log_level(level: int, explicit: bool) -> None:
    """The package's lines at a Trainer's log level `level` (TrainingArguments.get_process_log_level()): always when
    the user set it (`explicit`: log_level, or log_level_replica on other processes), else only where it shows more
    than the package would (transformers' verbosity raised by TRANSFORMERS_VERBOSITY or set_verbosity_info), so a
    user's logging.basicConfig(level=logging.INFO) is never quietened. A handler of the package's own writes to
    stderr only where nothing else would (the root logger has no handler), so a user who configured logging keeps
    their handlers and format, and no line is written twice."""
    package = logging.getLogger(PACKAGE_LOGGER)
    if not explicit and level >= package.getEffectiveLevel():
        return
    package.setLevel(level)
    if logging.getLogger().handlers or any(getattr(h, "liger_patch_kd", False) for h in package.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.liger_patch_kd = True  # ours: added once, whatever the number of trainers
    package.addHandler(handler)
