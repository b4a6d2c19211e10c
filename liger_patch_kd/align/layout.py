"""The chunk layout of the fused cross-tokenizer loss.

A merged group couples its rows (the group's loss depends on every row's probability of its actual token, and
each of those rows' gradients on the group's loss), so a group must not straddle two chunks: the student rows
that matter (those in a group or with a label; prompt rows are skipped entirely) are packed group by group into
chunks of `chunk_size` rows, padding a chunk's end with ignored rows when the next group does not fit. The
layout is planned on the host from the group ids (one small copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .offsets import group_ids_consistent

__all__ = ["ChunkMeta", "group_ranges", "plan_layout", "to_meta"]


@dataclass
class ChunkMeta:
    """One chunk's groups, in chunk-local indices (all on the loss's device)."""

    row_group: torch.Tensor  # (C,) local group of each chunk row, -1 for none
    first_row: torch.Tensor  # (G_c,) chunk row predicting each group's first token
    last_row: torch.Tensor  # (G_c,) chunk row predicting each group's last token
    teacher_rows: torch.Tensor  # (R,) flat teacher rows of the chunk's groups
    teacher_group: torch.Tensor  # (R,) local group of each
    teacher_first: torch.Tensor  # (G_c,) index into teacher_rows of each group's first row
    teacher_last: torch.Tensor  # (G_c,) index into teacher_rows of each group's last row
    exact_ok: torch.Tensor  # (G_c,) bool


def group_ranges(groups: torch.Tensor, n_groups: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last row of every group, checking that each group is one run of consecutive rows."""
    rows = torch.arange(groups.numel())
    member = groups >= 0
    first = torch.full((n_groups,), groups.numel()).scatter_reduce(0, groups[member], rows[member], "amin")
    last = torch.full((n_groups,), -1).scatter_reduce(0, groups[member], rows[member], "amax")
    count = torch.zeros(n_groups, dtype=torch.long).index_add(0, groups[member], torch.ones_like(rows[member]))
    if not torch.equal(last - first + 1, count):
        raise ValueError(f"{side}_groups: every group must be one run of consecutive rows (the aligner's output)")
    return first, last


def plan_layout(
    s_groups: torch.Tensor,
    s_valid: torch.Tensor,
    t_groups: torch.Tensor,
    exact_ok: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, list[dict], int]:
    """Host-side: (layout (N',): the student row of each chunk row, -1 for padding; per-chunk index lists; the
    chunk size, raised to the longest group when one is longer)."""
    n_groups = group_ids_consistent(s_groups, t_groups)
    s_first, s_last = group_ranges(s_groups, n_groups, "student")
    t_first, t_last = group_ranges(t_groups, n_groups, "teacher")
    if n_groups and not bool(s_valid[s_groups >= 0].all()):
        raise ValueError("student_labels must not be ignore_index on rows that are in a group (the aligned tokens)")
    longest = int((s_last - s_first).max()) + 1 if n_groups else 1
    chunk_size = max(chunk_size, longest)
    units = []  # (first row, last row, group or -1), in row order
    row = 0
    keep = s_valid | (s_groups >= 0)
    for r in torch.nonzero(keep).flatten().tolist():
        if r < row:
            continue
        g = int(s_groups[r])
        end = int(s_last[g]) if g >= 0 else r
        units.append((r, end, g))
        row = end + 1
    layout: list[int] = []
    chunks: list[dict] = []
    current = None
    for first, last, g in units:
        length = last - first + 1
        if current is None or len(layout) - current["start"] + length > chunk_size:
            layout.extend([-1] * (-len(layout) % chunk_size))  # pad to the chunk boundary
            current = dict(start=len(layout), groups=[])
            chunks.append(current)
        if g >= 0:
            current["groups"].append((g, len(layout) - current["start"], length))
        layout.extend(range(first, last + 1))
    metas = []
    for chunk in chunks:
        row_group, first_row, last_row, t_rows, t_group, t_first_local, t_last_local, ok = (
            [],
            [],
            [],
            [],
            [],
            [],
            [],
            [],
        )
        for local, (g, offset, length) in enumerate(chunk["groups"]):
            row_group.append((offset, length, local))
            first_row.append(offset)
            last_row.append(offset + length - 1)
            t_first_local.append(len(t_rows))
            t_rows.extend(range(int(t_first[g]), int(t_last[g]) + 1))
            t_group.extend([local] * (int(t_last[g]) - int(t_first[g]) + 1))
            t_last_local.append(len(t_rows) - 1)
            ok.append(True if exact_ok is None else bool(exact_ok[int(s_last[g])]))
        metas.append(dict(row_group=row_group, first_row=first_row, last_row=last_row, teacher_rows=t_rows,
                          teacher_group=t_group, teacher_first=t_first_local, teacher_last=t_last_local,
                          exact_ok=ok))  # fmt: skip
    return torch.tensor(layout, dtype=torch.long), metas, chunk_size


def to_meta(raw: dict, rows: int, device) -> ChunkMeta:
    row_group = torch.full((rows,), -1, dtype=torch.long)
    for offset, length, local in raw["row_group"]:
        row_group[offset : offset + length] = local
    tensor = lambda x, dt=torch.long: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    return ChunkMeta(row_group.to(device), tensor(raw["first_row"]), tensor(raw["last_row"]),
                      tensor(raw["teacher_rows"]), tensor(raw["teacher_group"]), tensor(raw["teacher_first"]),
                      tensor(raw["teacher_last"]), tensor(raw["exact_ok"], torch.bool))  # fmt: skip
