"""Cross-tokenizer rows for completions the student generated (on-policy distillation across tokenizers).

The student sampled token ids; the teacher reads another tokenizer's. Each row keeps the student's own ids (its
prompt as the collator tokenized it, then the sampled completion: what the student is scored on) and gives the
teacher its own tokens for the same text: the teacher's prompt tokens as the collator made them (its rendering,
chat template and prefix), then the completion's text re-tokenized with character offsets. That text is the
student tokens' text concatenated (each id's UTF-8 bytes as its vocabulary spells them, `vocab.token_texts`;
special tokens stand for no text), so both sides' offsets refer to one string and `align_tokens` groups them as
the collator does for a dataset's completion. A completion that ended at EOS gets one more group, the student's
EOS with the teacher's EOS (appended to the teacher's sequence), one to one: stopping is scored by the KD term as
well as by CE (by every kind but "chain", which compares bytes of text and EOS has none: there CE scores it).
Only completion tokens carry labels; padding never does. The completion's text is tokenized for the teacher on
its own, after its prompt tokens: a tokenizer that adds a prefix space to a text's start (SentencePiece's dummy
prefix) gives the teacher one there, as it would for any text it tokenizes alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .collator import CrossTokenizerCollator, aligned_row, pad_rows
from .offsets import Group, align_tokens, encode_with_offsets
from .vocab import token_texts

REPLACEMENT = "\ufffd"  # what a byte that is not valid UTF-8 in its place decodes to


def _char_length(data: bytes, i: int) -> int:
    """Bytes of the UTF-8 character starting at data[i], or 0 when none valid starts there."""
    lead = data[i]
    n = 1 if lead < 0x80 else 2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF else 4 if lead <= 0xF4 else 0
    if n == 0 or i + n > len(data):
        return 0
    try:
        data[i : i + n].decode("utf-8")
    except UnicodeDecodeError:  # a stray continuation byte, an overlong form, a surrogate
        return 0
    return n


def decode_with_offsets(pieces: list[bytes]) -> tuple[str, list[tuple[int, int]]]:
    """The text of consecutive tokens' bytes and each token's character span.

    A token holding part of a multi-byte character spans that whole character (as fast tokenizers report such
    byte-level pieces, which `offsets.canonical_ends` expects); a byte that starts no valid character decodes to
    one U+FFFD; a token of no bytes is zero-width where the previous one ends."""
    data = b"".join(pieces)
    chars: list[str] = []
    char_of: list[int] = []  # the character each byte belongs to
    i = 0
    while i < len(data):
        n = _char_length(data, i)
        chars.append(data[i : i + n].decode("utf-8") if n else REPLACEMENT)
        char_of.extend([len(chars) - 1] * max(n, 1))
        i += max(n, 1)
    offsets, first = [], 0
    for piece in pieces:
        if piece:
            offsets.append((char_of[first], char_of[first + len(piece) - 1] + 1))
        else:
            end = offsets[-1][1] if offsets else 0
            offsets.append((end, end))
        first += len(piece)
    return "".join(chars), offsets


@dataclass
class GeneratedRows:
    """Builds cross-tokenizer batches (the CrossTokenizerCollator's columns) from generated completions.

    collator: the run's CrossTokenizerCollator (its teacher tokenizer, pad ids and ignore_index).
    student_texts: each student id's text as UTF-8 bytes (b"" for special tokens): `GeneratedRows.build`.
    student_eos_ids: the ids that end a completion (where generation cut it).
    teacher_eos_id: the teacher's end of sequence, paired with the student's EOS.
    """

    collator: CrossTokenizerCollator
    student_texts: list[bytes]
    student_eos_ids: frozenset[int]
    teacher_eos_id: int

    @classmethod
    def build(
        cls, collator: CrossTokenizerCollator, student_vocab_size: int, student_eos_ids: Iterable[int],
        teacher_eos_id: int | None,
    ) -> GeneratedRows:  # fmt: skip
        eos = frozenset(int(i) for i in student_eos_ids)
        if not eos or teacher_eos_id is None:
            raise ValueError(
                f"cross-tokenizer on-policy distillation pairs the student's EOS with the teacher's: got student EOS "
                f"ids {sorted(eos)} and teacher EOS id {teacher_eos_id}; set eos_token_id on the tokenizer or the "
                f"model's generation_config of the side that lacks it"
            )
        texts = token_texts(collator.student_tokenizer, student_vocab_size)
        return cls(collator, texts, eos, int(teacher_eos_id))

    def completion_text(self, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
        """The text of student ids and each one's character span (ids without a token: no text)."""
        size = len(self.student_texts)
        return decode_with_offsets([self.student_texts[i] if 0 <= i < size else b"" for i in ids])

    def __call__(
        self, student_prompts: list[list[int]], completions: list[list[int]], teacher_prompts: list[list[int]]
    ) -> dict:
        """One batch: row i is student_prompts[i] + completions[i] for the student, teacher_prompts[i] + the
        teacher's tokens of completions[i]'s text (+ its EOS where the completion ended at EOS) for the teacher."""
        if not len(student_prompts) == len(completions) == len(teacher_prompts) > 0:
            raise ValueError(
                f"need one student prompt, completion and teacher prompt per row; got {len(student_prompts)}, "
                f"{len(completions)}, {len(teacher_prompts)}"
            )
        ignore = self.collator.ignore_index
        rows, n_groups = [], 0
        for s_prompt, completion, t_prompt in zip(student_prompts, completions, teacher_prompts):
            stops = bool(completion) and completion[-1] in self.student_eos_ids
            text_ids = completion[:-1] if stops else completion  # EOS stands for no text: its own group below
            text, c_off = self.completion_text(text_ids)
            t_text, t_off = encode_with_offsets(self.collator.teacher_tokenizer, text)
            s_ids = list(s_prompt) + list(completion)
            t_ids = list(t_prompt) + t_text + ([self.teacher_eos_id] if stops else [])
            # completion-relative offsets; every prompt token ends at 0, where the completion starts
            s_rel = [(-1, 0)] * len(s_prompt) + c_off
            t_rel = [(-1, 0)] * len(t_prompt) + t_off
            groups = align_tokens(s_rel, t_rel, 0, len(text))
            if stops and len(t_ids) > 1:  # the first teacher token is predicted by no row
                groups.append(Group(len(s_ids) - 1, len(s_ids) - 1, len(t_ids) - 1, len(t_ids) - 1, True))
            s_labels = [ignore] * len(s_prompt) + list(completion)
            rows.append(aligned_row(s_ids, s_labels, t_ids, len(t_prompt), groups, n_groups, ignore))
            n_groups += len(groups)
        return pad_rows(rows, self.collator.student_pad_id, self.collator.teacher_pad_id, ignore)
