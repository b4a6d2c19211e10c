"""CrossTokenizerConfig: every option of the cross-tokenizer distillation loss, validated once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import check_shared_options, check_weight, merge_options
from ..losses.checks import check_num_items as losses_check_num_items

KINDS = ("hybrid", "uld", "exact", "next_byte", "chain")
UNMATCHED = ("bucket", "ignore")


@dataclass(frozen=True)
class CrossTokenizerConfig:
    """Options of `align.loss.fused_linear_cross_tokenizer_kd` and its reference.

    Per aligned group g (see align.offsets) with merged student / teacher distributions q_g, p_g:
      kind="uld":    ULD(q_g, p_g) = sum_i |sort(q_g)_i - sort(p_g)_i| (the shorter vector padded with zeros)
      kind="exact":  generalized JSD(beta) between q_g and p_g on the token strings both vocabularies hold
      kind="hybrid": exact_weight * exact + uld_weight * ULD over the tokens outside the vocabulary map
      kind="next_byte": generalized JSD(beta) between the two models' distributions of the next byte of text at
                     the group's start (a boundary both share, so both condition on the same text): each side's
                     next-token probabilities summed by the first UTF-8 byte of the token (257 classes, one
                     for special tokens). No merging and no vocabulary overlap needed; VocabMap.build fills in
                     the byte classes.
      kind="chain":  next_byte at every depth of the group's first student token where a teacher token starts
                     (a character teacher: every byte of it), the student's side being its next-byte
                     distribution given the token's text so far, both restricted to the bytes its tokens can
                     go on with there (align.chain says why: a BPE student's first byte is mostly a space).
    exact / hybrid apply the exact term only to one-to-one groups (the collator's align_exact_ok; in a merged
    group the two merged distributions are over continuations of different text, see align.offsets.Group);
    other groups get ULD over all tokens (hybrid) or nothing (exact). Without align_exact_ok every group
    counts as exact-eligible, as in TRL's GOLD.
    unmatched: mass outside the map in the exact term: "bucket" (one extra class on both sides) or "ignore"
        (terms on the mapped tokens only; TRL GOLD's hybrid).
    uld_top_k: None for the full sort; k for the sorted top-k of both sides plus one tail bucket each
        (a lower bound of the full ULD, below it by at most 2 * min(tail_q, tail_p)).
    temperature: both softmaxes, including the probabilities of the tokens a merged span multiplies in.
    reduction "batchmean" divides the sum over groups (and the CE sum) by the number of student tokens with a
        label, or by num_items_in_batch; "sum"; "none" (each group's loss on the row predicting its last token).
    soft_weight * KD + hard_weight * CE(student, labels), as in KDLossConfig.
    """

    kind: str = "hybrid"
    exact_weight: float = 1.0
    uld_weight: float = 1.0
    beta: float = 0.0
    unmatched: str = "bucket"
    uld_top_k: int | None = None
    temperature: float = 1.0
    ignore_index: int = -100
    reduction: str = "batchmean"
    soft_weight: float = 1.0
    hard_weight: float = 0.0
    softcap: float | None = None
    teacher_softcap: float | None = None
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}; got kind={self.kind!r}")
        if self.unmatched not in UNMATCHED:
            raise ValueError(f"unmatched must be one of {UNMATCHED}; got unmatched={self.unmatched!r}")
        check_shared_options(self)
        for name in ("exact_weight", "uld_weight"):
            check_weight(self, name)
        if self.uld_top_k is not None and not (isinstance(self.uld_top_k, int) and self.uld_top_k > 0):
            raise ValueError(f"uld_top_k must be None (full sort) or an int > 0; got uld_top_k={self.uld_top_k!r}")

    def replace(self, **changes) -> CrossTokenizerConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def build(cls, config: CrossTokenizerConfig | None = None, **given) -> CrossTokenizerConfig:
        """`config` and / or keyword options merged by KDLossConfig.build's rule: None is "not given", a keyword
        that conflicts with `config` is a ValueError naming both values, no config means the defaults."""
        return merge_options(cls, config, given)


def check_num_items(num_items_in_batch) -> None:
    """num_items_in_batch is a count: None, or >= 0 (0, a micro-batch without items, gives loss 0 and zero
    gradients, as fused_linear_jsd). A negative count is a ValueError (a tensor on any device too: the
    cross-tokenizer loss reads its layout on the host anyway)."""
    losses_check_num_items(num_items_in_batch, read_device=True)
