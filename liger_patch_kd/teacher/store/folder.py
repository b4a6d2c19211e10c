"""Which files of a store's folder a writer may replace or remove: only those a run of this tool left there.

A shard's name proves nothing, and neither does the mark every shard carries in its safetensors metadata (MARK): a
shard copied from another store, or a store whose manifest was lost, has both. So a writer records each shard's
name and sha256 in the folder's PENDING file before renaming the shard into place, and drops the record once the
manifest lists the shard. A rerun after a kill then starts over exactly the bytes a run recorded there (a shard
renamed before its manifest was written, a converter's shards before its manifest comes last) and refuses any
other shard name, naming the file. The record lives beside the shards rather than in them, so a resumed store's
shards stay byte-identical to an uninterrupted run's. Temporaries (NAME.tmp) are a writer's by their name and mark:
they hold nothing finished."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ...utils.paths import file_in_the_way
from .manifest import MANIFEST, TeacherStoreError, read_manifest
from .shard import sha256_file

# Every shard's safetensors metadata, and the first key of the PENDING file.
MARK = {"written_by": "liger_patch_kd teacher store"}
_MARK_BYTES = b'"written_by":"liger_patch_kd teacher store"'  # as safetensors writes it into the header's JSON
PENDING = "shards-in-progress.json"
_SHARD = re.compile(r"^shard-\d{5}\.safetensors$")
_TEMPORARY = re.compile(r"^(shard-\d{5}\.safetensors|manifest\.json|shards-in-progress\.json)\.tmp$")


def read_pending(out_dir: Path) -> dict[str, str] | None:
    """The shards a run recorded in `out_dir` and no manifest lists yet ({file: sha256}); {} when there is no
    PENDING file, None when there is one this tool did not write."""
    try:
        record = json.loads((out_dir / PENDING).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("written_by") != MARK["written_by"]:
        return None
    shards = record.get("shards")
    ok = isinstance(shards, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in shards.items())
    return dict(shards) if ok else None


def write_pending(out_dir: Path, shards: dict[str, str]) -> None:
    """Record `shards` ({file: sha256}) atomically, or remove the record when there are none."""
    path = out_dir / PENDING
    if not shards:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(PENDING + ".tmp")
    tmp.write_text(json.dumps({**MARK, "shards": shards}))
    os.replace(tmp, path)


def _temporary_is_ours(path: Path, in_store: bool) -> bool:
    """A temporary: in a store's folder (it has a manifest) a writer's by its name; elsewhere one cut short anywhere
    after the start of its header (safetensors writes the header first, its metadata first in it) whose metadata
    holds MARK, an empty one (nothing in it to lose), or a manifest / PENDING temporary, which starts with its key."""
    if in_store:
        return True
    try:
        if path.stat().st_size == 0:
            return True
        with open(path, "rb") as f:
            start = f.read(4096)
    except OSError:
        return False
    if path.name.startswith(MANIFEST):
        return b'"format_version"' in start[:64]
    if path.name.startswith(PENDING):
        return start.startswith(b'{"written_by"')
    return _MARK_BYTES in start[8:]


def leftovers(out_dir: Path) -> tuple[list[Path], list[str]]:
    """(the files a run of this tool left in `out_dir` that no manifest lists: its recorded shards, temporaries and
    PENDING, which a writer removes before it starts; the names a writer writes that are someone else's)."""
    in_store = (out_dir / MANIFEST).exists()
    listed = {s["file"] for s in read_manifest(out_dir)["shards"]} if in_store else set()
    pending = read_pending(out_dir)
    ours, taken = [], []
    for path in sorted(out_dir.iterdir()):
        name = path.name
        if name == PENDING:
            mine = pending is not None
        elif _TEMPORARY.match(name):
            mine = _temporary_is_ours(path, in_store)
        elif _SHARD.match(name) and name not in listed:
            mine = bool(pending) and pending.get(name) == sha256_file(path)
        else:
            continue  # the manifest, its listed shards, and files a writer never names
        (ours if mine else taken).append(path if mine else name)
    return ours, taken


def check_store_folder(out_dir: str | Path) -> None:
    """Refuse, before any work, an `out_dir` a writer would write into without having started a store there: a
    file (or a path under one), or a folder holding names it writes (shard-NNNNN.safetensors, temporaries, PENDING)
    that no run of this tool left there and its manifest does not list: writing a shard would overwrite them.
    Recorded ones are an interrupted run's, which a rerun starts over. A folder with a manifest is a store to resume:
    its manifest is read here (a damaged one fails now). A model's folder (a config.json) is refused too: a store
    there mixes with the model's files, and a later save_pretrained into it would leave the store's beside them."""
    out_dir = Path(out_dir)
    blocking = file_in_the_way(out_dir)  # the folder could never be made: found now, not at the first shard
    if blocking == out_dir:
        raise TeacherStoreError(f"--out {out_dir} is a file, not a folder: pass a folder for the store")
    if blocking is not None:
        raise TeacherStoreError(f"--out {out_dir} is under {blocking}, a file, so no folder can be made there: pass "
                                f"a folder for the store")  # fmt: skip
    if not out_dir.is_dir():
        return
    if (out_dir / "config.json").is_file() and not (out_dir / MANIFEST).exists():
        raise TeacherStoreError(f"--out {out_dir} holds a config.json: a model's folder, not a store's; pass a "
                                f"folder of its own for the store")  # fmt: skip
    _, taken = leftovers(out_dir)
    if not taken:
        return
    names = f"{', '.join(taken[:3])}{' ...' if len(taken) > 3 else ''}"
    if (out_dir / MANIFEST).exists():
        raise TeacherStoreError(
            f"--out {out_dir} holds {names}, which its {MANIFEST} does not list and no run of this tool left there (a "
            f"shard copied from another store?): resuming would overwrite it; move it out of --out, or pass another "
            f"--out"
        )
    raise TeacherStoreError(
        f"--out {out_dir} holds {names} but no {MANIFEST}: files no run of this tool left there (a shard copied from "
        f"another store, or a store whose manifest was lost), which writing a store would overwrite; pass an empty "
        f"or new folder, or the --out of a store this tool wrote to resume it"
    )
