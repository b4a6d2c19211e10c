"""Aligning two tokenizations of one text by character offsets.

Each tokenization gives (start, end) character offsets per token. Where both tokenizers put a boundary at the
same character the two sequences can be cut; between two consecutive shared boundaries lies one *group*: one
or more student tokens and one or more teacher tokens covering the same text (one-to-one, many-to-one,
one-to-many, many-to-many), the merged spans of TRL's GOLD trainer.

Offsets are made canonical first, because tokenizers report them loosely:
* a token's boundary is its end; whitespace its offsets leave out (ByteLevel `trim_offsets`) belongs to the
  next token, so "Ġworld" (6, 11) and " world" (5, 11) end at the same place;
* tokens that overlap the next one (byte-level pieces of one multi-byte character, which all report the
  whole character) end where the last overlapping piece ends: no boundary inside a character;
* zero-width tokens (special tokens, offsets (k, k) or (0, 0)) cover no text and join the previous token.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass

import torch


def encode_with_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of `text`, no special tokens added: an HF fast tokenizer, a
    `tokenizers.Tokenizer`, or any object with `encode_with_offsets(text)`."""
    if hasattr(tokenizer, "encode_with_offsets"):
        ids, offsets = tokenizer.encode_with_offsets(text)
        return list(ids), [tuple(o) for o in offsets]
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers ships with transformers
        Tokenizer = ()
    if isinstance(tokenizer, Tokenizer):
        enc = tokenizer.encode(text, add_special_tokens=False)
        return list(enc.ids), [tuple(o) for o in enc.offsets]
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    raise ValueError(
        f"cannot get character offsets from a {type(tokenizer).__name__}: cross-tokenizer alignment needs a fast "
        f"(Rust) Hugging Face tokenizer, a tokenizers.Tokenizer, or an object with encode_with_offsets(text)"
    )


def canonical_ends(offsets: list[tuple[int, int]]) -> list[int]:
    """Each token's boundary (see the module docstring); non-decreasing."""
    n = len(offsets)
    ends = [0] * n
    next_start, next_end = None, None
    for j in range(n - 1, -1, -1):  # right to left: overlapping pieces take the end of the last piece
        start, end = offsets[j]
        if end <= start:
            continue
        ends[j] = next_end if next_start is not None and next_start < end else end
        next_start, next_end = start, ends[j]
    prev = None
    for j in range(n):  # left to right: zero-width tokens join the previous token; never go backwards
        start, end = offsets[j]
        if end <= start:
            ends[j] = prev if prev is not None else start
        elif prev is not None and ends[j] < prev:
            ends[j] = prev
        prev = ends[j]
    return ends


@dataclass(frozen=True)
class Group:
    """Student tokens [s_first, s_last] and teacher tokens [t_first, t_last] covering the same text.

    `one_to_one`: one token on each side. Only then are the two merged distributions (see
    `align.reference.merged_log_probs`) over continuations of the same text, so that an exact-token comparison
    means something: the last tokens of a group start at one character only if that character is a shared
    boundary, which would have ended the group before them."""

    s_first: int
    s_last: int
    t_first: int
    t_last: int
    one_to_one: bool


def align_tokens(
    student_offsets: list[tuple[int, int]],
    teacher_offsets: list[tuple[int, int]],
    start_char: int = 0,
    end_char: int | None = None,
) -> list[Group]:
    """Groups covering text between the first shared boundary >= start_char and the last <= end_char.

    A group that holds the first token of either sequence is dropped: no position predicts that token. Token
    indices are positions in the given sequences (the rows predicting them are one less)."""
    e_s, e_t = canonical_ends(student_offsets), canonical_ends(teacher_offsets)
    if not e_s or not e_t:
        return []
    end_char = max(e_s[-1], e_t[-1]) if end_char is None else end_char
    shared = sorted(x for x in set(e_s) & set(e_t) if start_char <= x <= end_char)
    groups = []
    for lo, hi in zip(shared, shared[1:]):
        s0, s1 = bisect_right(e_s, lo), bisect_right(e_s, hi) - 1
        t0, t1 = bisect_right(e_t, lo), bisect_right(e_t, hi) - 1
        if s0 == 0 or t0 == 0:
            continue
        groups.append(Group(s0, s1, t0, t1, s0 == s1 and t0 == t1))
    return groups


def first_token_at_or_after(offsets: list[tuple[int, int]], char: int) -> int:
    """Index of the first token that lies after `char` (canonically: the token before it ends at or before)."""
    ends = canonical_ends(offsets)
    return bisect_left([-1] + ends[:-1], char) if ends else 0


def group_ids_consistent(student_groups: torch.Tensor, teacher_groups: torch.Tensor) -> int:
    """The number of groups, after checking both sides name the same groups 0..G-1 (this module's output).
    Shared by the fused loss and its reference."""
    s = torch.unique(student_groups[student_groups >= 0])
    t = torch.unique(teacher_groups[teacher_groups >= 0])
    if not torch.equal(s, t) or (s.numel() and not torch.equal(s, torch.arange(s.numel(), device=s.device))):
        raise ValueError(
            f"student_groups and teacher_groups must name the same groups 0..G-1 (the aligner's output); got "
            f"{s.numel()} student groups and {t.numel()} teacher groups"
        )
    return int(s.numel())
