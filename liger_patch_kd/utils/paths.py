"""Where a folder can be made: the one check a writer makes before any long work, so that a path blocked by a file
fails in one line at the start rather than at the first save."""

from __future__ import annotations

from pathlib import Path


def file_in_the_way(folder: Path) -> Path | None:
    """`folder` itself, or the nearest of its parents, where it exists as something other than a folder (no folder
    can then be made at `folder`); None where the path is clear."""
    return next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
