"""kind="chain": the teacher's next-byte distributions along the text of the student's next token.

Why: at a student boundary the next byte of a byte-level BPE student is nearly always the space before a word,
so comparing first bytes only (kind="next_byte") says almost nothing about which word comes; that decision
sits at the token's second byte and later. The chain rule over bytes splits the student's choice of its next
token y (text y_1..y_k) into one decision per byte: at depth j (0 <= j < k) the student, having committed to a
token whose text starts with y_1..y_j and goes on, picks the next byte c with probability

    q_j(c) = sum(S(v) for v whose text starts with y_1..y_j c) / sum(S(v) for v whose text starts with y_1..y_j
             and is longer than j bytes).

Where the teacher has a token boundary at that depth (a character-level teacher: at every depth) its next-byte
distribution p_j (next-token probabilities summed by first byte, as in next_byte) conditions on the same text.
Both are restricted to the bytes the student can continue with at that depth (its token trie's children of
y_1..y_j) and renormalised: teacher mass on other bytes is where the student's token would end instead (the
next token carries it), so it is left out rather than forced onto bytes the student cannot emit there. The
loss of a group is sum_j D(p_j || q_j), D the generalized JSD(beta), over the depths of the group's first
student token at which a teacher token starts.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import torch

from ..conventions import TAIL_FLOOR

NO_BYTE = 256  # the class of special tokens (and of tokens with no text): 257 next-byte classes in all

CLASSES = NO_BYTE + 1


@dataclass(frozen=True)
class TokenTrie:
    """The student's token texts as a byte trie, in tensors: for token y and depth j, the tokens whose text
    starts with y's first j bytes are those of rank in [prefix_lo[y, j], prefix_hi[y, j]) (byte order)."""

    token_bytes: torch.Tensor  # (V, D) int64: byte j of each token's text, -1 past its end
    length: torch.Tensor  # (V,) int64: bytes of text (0 for special tokens)
    rank: torch.Tensor  # (V,) int64: position in byte-lexicographic order
    prefix_lo: torch.Tensor  # (V, D) int64
    prefix_hi: torch.Tensor  # (V, D) int64

    @classmethod
    def build(cls, texts: list[bytes], max_depth: int = 32) -> TokenTrie:
        """`texts[i]`: the text of id i (b"" for special tokens). Depths beyond `max_depth` bytes are not scored."""
        depth = max(1, min(max_depth, max((len(t) for t in texts), default=1)))
        order = sorted(range(len(texts)), key=lambda i: texts[i])
        keys = [texts[i] for i in order]
        rank = torch.empty(len(texts), dtype=torch.long)
        rank[torch.tensor(order, dtype=torch.long)] = torch.arange(len(texts))
        token_bytes = torch.full((len(texts), depth), -1, dtype=torch.long)
        lo = torch.zeros(len(texts), depth, dtype=torch.long)
        hi = torch.zeros(len(texts), depth, dtype=torch.long)
        for i, text in enumerate(texts):
            for j in range(min(len(text), depth)):
                token_bytes[i, j] = text[j]
                prefix = text[:j]
                lo[i, j] = bisect_left(keys, prefix)
                hi[i, j] = _prefix_end(keys, prefix)
        length = torch.tensor([len(t) for t in texts], dtype=torch.long)
        return cls(token_bytes, length, rank, lo, hi)

    @property
    def depth(self) -> int:
        return self.token_bytes.shape[1]

    def to(self, device: torch.device | str) -> TokenTrie:
        return TokenTrie(*(t.to(device) for t in (self.token_bytes, self.length, self.rank, self.prefix_lo,
                                                   self.prefix_hi)))  # fmt: skip


def _prefix_end(keys: list[bytes], prefix: bytes) -> int:
    """One past the last of the sorted `keys` that start with `prefix`: where the least string above all of
    them (the prefix with its last non-0xff byte raised by one) would go."""
    stripped = prefix.rstrip(b"\xff")
    return bisect_left(keys, stripped[:-1] + bytes([stripped[-1] + 1])) if stripped else len(keys)


def continuation_masses(
    probs: torch.Tensor, labels: torch.Tensor, depth: int, trie: TokenTrie
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows whose next token is `labels` (P,), at one `depth`: (mass (P, CLASSES) of the tokens continuing
    labels' first `depth` bytes with each byte, member (P, V) the tokens counted, the byte class (V,) of each)."""
    lo = trie.prefix_lo[labels, depth][:, None]
    hi = trie.prefix_hi[labels, depth][:, None]
    member = (trie.rank >= lo) & (trie.rank < hi) & (trie.length > depth)
    byte = trie.token_bytes[:, depth].clamp(min=0)
    mass = torch.zeros(labels.numel(), CLASSES, dtype=probs.dtype, device=probs.device)
    return mass.index_add_(1, byte, probs * member), member, byte


def allowed_classes(member: torch.Tensor, byte: torch.Tensor, teacher_bytes: torch.Tensor) -> torch.Tensor:
    """(P, CLASSES) the bytes the student's token can go on with (some counted token has it), none at all where
    the teacher puts no mass on any of them (nothing to compare: that pair is skipped)."""
    allowed = torch.zeros_like(teacher_bytes).index_add_(1, byte, member.to(teacher_bytes.dtype)) > 0
    covered = torch.where(allowed, teacher_bytes, torch.zeros_like(teacher_bytes)).sum(-1, keepdim=True)
    return allowed & (covered > TAIL_FLOOR)


def restricted_log(mass: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """log of `mass` restricted to the allowed classes and renormalised (floored at TAIL_FLOOR)."""
    kept = torch.where(allowed, mass, torch.zeros_like(mass))
    return (kept / kept.sum(-1, keepdim=True).clamp(min=TAIL_FLOOR)).clamp(min=TAIL_FLOOR).log()


def chain_pairs(
    group_of_row: torch.Tensor, group_first_label_len: torch.Tensor, teacher_byte_len: torch.Tensor, depth_limit: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For teacher rows listed in order with their group (R,) and the byte length of the token each predicts
    (R,): (the byte depth of each row's token start inside its group, whether it is scored: a depth inside the
    group's first student token, of length `group_first_label_len[group]`, and below the trie's depth)."""
    ends = teacher_byte_len.cumsum(0)
    starts = ends - teacher_byte_len
    rows = torch.arange(group_of_row.numel(), device=group_of_row.device)
    n = group_first_label_len.numel()
    first = torch.full((n,), group_of_row.numel(), device=rows.device).scatter_reduce(0, group_of_row, rows, "amin")
    depth = starts - starts[first[group_of_row]]
    scored = (depth < group_first_label_len[group_of_row]) & (depth < depth_limit)
    return depth, scored
