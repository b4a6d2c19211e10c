"""The text rows of a teacher set whose in-process members have tokenizers of their own (other_tokenizer.py wraps
each such member): `KDTrainer(teacher_model={"math": m1, "code": m2}, teacher_tokenizer={"code": code_tok})` (or
`kd_teacher_tokenizer={"code": "path"}`, loaded with AutoTokenizer); a member left out, or given None, shares the
student's tokenizer.

Rows are text (TRL's prompt / completion, or messages): only text can be tokenized both ways. Each row's student
tokens come from the student's tokenizer once (align.CrossTokenizerCollator.student_tokens); each member of another
tokenizer tokenizes and aligns the rows that give it a weight > 0 (its own CrossTokenizerCollator), under the
batch's TOKENIZER_TEACHERS: {name: its columns}. The loss (mixture_loss.py) runs the student once and scores every
row by its own members, each part weighted per row by its share of the row's weights w_r:

    share_same(r) = sum of w_rj over the members of the student's tokenizer      (the fused several-teacher loss)
    share_j(r)    = w_rj for a member j of another tokenizer                     (the fused cross-tokenizer loss)

A routed row (one-hot w_r) is then exactly its own member's loss; with kd_teacher_mixture="loss" a mixed row is
sum_j w_rj D_j(r) + CE(r) (CE counted once: the shares sum to 1). The mixture of distributions P = sum_j w_j P_j is
not defined across vocabularies (the P_j live on different ids; projecting them is another objective), so under
kd_teacher_mixture="distribution" a row weighing a member of another tokenizer together with any other member is
refused; a mixture among the student-tokenizer members stays a mixture of their distributions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ...align.collator import has_completion
from ...batch.columns import (
    ALIGN_EXACT_OK,
    HAS_COMPLETION,
    STUDENT_ALIGN_GROUPS,
    TEACHER_ALIGN_GROUPS,
    TEACHER_ATTENTION_MASK,
    TEACHER_INPUT_IDS,
    TEACHER_LABELS,
    TEACHER_LOGPROBS,
    TEACHER_PROMPT,
    TEACHER_SAMPLE_IDS,
    TEACHER_TOKEN_IDS,
    TOKENIZER_TEACHERS,
)
from .base import Member
from .other_tokenizer import CrossTokenizerSetup

# a teacher's own columns, from its CrossTokenizerCollator (on its rows only)
TEACHER_COLUMNS = (TEACHER_INPUT_IDS, TEACHER_ATTENTION_MASK, TEACHER_LABELS, TEACHER_ALIGN_GROUPS)
# what a row may carry for a teacher that no teacher of this path reads (refused, not dropped)
UNREAD_COLUMNS = (TEACHER_PROMPT, TEACHER_INPUT_IDS, TEACHER_TOKEN_IDS, TEACHER_LOGPROBS, TEACHER_SAMPLE_IDS)


def given_tokenizers(names: Sequence[str], args: Any, teacher_tokenizer: Any) -> dict[str, Any]:
    """name -> tokenizer for each teacher with its own: KDTrainer's teacher_tokenizer={name: object} first, else
    kd_teacher_tokenizer={name: name or path} (loaded), as with one teacher; teachers left out share the student's."""
    loaded = args.kd_teacher_tokenizer
    for what, value in (("teacher_tokenizer", teacher_tokenizer), ("kd_teacher_tokenizer", loaded)):
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(
                f"{what}={value!r} with several teachers {list(names)}: give a dict {{teacher name: tokenizer}} "
                f"(a teacher left out, or None, shares the student's tokenizer)"
            )
        unknown = sorted(set(value or {}) - set(names))
        if unknown:
            raise ValueError(f"{what} names unknown teacher(s) {unknown}; the teachers are {list(names)}")
    found = {}
    for name in names:
        tokenizer = (teacher_tokenizer or {}).get(name)
        if tokenizer is None and (loaded or {}).get(name) is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(loaded[name])
        if tokenizer is not None:
            found[name] = tokenizer
    return found


class TokenizerTeachers:
    """The set's members of other tokenizers (`cross`: name -> CrossTokenizerSetup, its vocabulary
    map, collator and loss options); the other teachers (`same`: their indices) share the student's tokenizer."""

    def __init__(self, names: Sequence[str], cross: dict[str, CrossTokenizerSetup], mixture: str) -> None:
        self.names, self.cross, self.mixture = tuple(names), cross, mixture
        self.same = [j for j, name in enumerate(self.names) if name not in cross]
        self.student_side = next(iter(cross.values())).collator  # every collator tokenizes the student alike

    @classmethod
    def build(
        cls, members: Mapping[str, Member], args: Any, teacher_tokenizer: Any, student_model: nn.Module | None,
        student_tokenizer: Any,
    ) -> TokenizerTeachers | None:  # fmt: skip
        """The set's members of other tokenizers, each in-process `members[name]` given its CrossTokenizerSetup
        (`xtok`: the wrapper's); None when every member shares the student's tokenizer."""
        names = list(members)
        tokenizers = given_tokenizers(names, args, teacher_tokenizer)
        if not tokenizers:
            return None
        if student_model is None or student_tokenizer is None:
            raise ValueError(
                f"teachers of other tokenizers ({sorted(tokenizers)}) need the student's tokenizer to align with: "
                f"pass processing_class=student_tokenizer"
            )
        if getattr(args, "world_size", 1) > 1:  # the student's decoder runs outside its forward: DDP would sync nothing
            raise ValueError(
                f"teachers of other tokenizers ({sorted(tokenizers)}) among several teachers run in one process "
                f"(world_size is {args.world_size}): the student's decoder is called outside its forward, where "
                f"DDP syncs no gradient and FSDP gathers no weight. Train in one process, or with one teacher"
            )
        for name, tok in tokenizers.items():
            members[name].xtok = CrossTokenizerSetup.build(args, student_tokenizer, student_model, members[name].model,
                                                           teacher_tokenizer=tok)  # fmt: skip
        return cls(names, {name: members[name].xtok for name in tokenizers}, args.kd_teacher_mixture)

    def index(self, name: str) -> int:
        return self.names.index(name)

    def check_mixture(self, weights: torch.Tensor, what: str) -> None:
        """(B, J) or (J,) weights: with mixture="distribution", no row may mix a teacher of another tokenizer with
        any other teacher (see the module docstring)."""
        if self.mixture != "distribution":
            return
        w = torch.as_tensor(weights).reshape(-1, len(self.names))
        used = w > 0
        across = used[:, [self.index(name) for name in self.cross]].any(-1) & (used.sum(-1) > 1)
        if bool(across.any()):
            row = w[int(across.nonzero()[0, 0])].tolist()
            mixed = {name: x for name, x in zip(self.names, row) if x > 0}
            raise ValueError(
                f"{what} {mixed} mixes teachers of different tokenizers under kd_teacher_mixture='distribution': the "
                f"mixture P = sum_j w_j P_j is not defined across vocabularies; set kd_teacher_mixture='loss' (the "
                f"mixture of losses sum_j w_j D(S, P_j)), or route the row to one teacher"
            )

    def collate(self, examples: list[dict[str, Any]], weights: torch.Tensor) -> dict[str, Any]:
        """The batch of text examples with (B, J) `weights`: the student's input_ids / attention_mask / labels
        (right-padded, labels on the completion) and, under TOKENIZER_TEACHERS, each other-tokenizer teacher's
        columns on its rows (those weighing it; student_align_groups / align_exact_ok of the whole batch's
        shape, -1 / False on the rows that are not its own)."""
        self.check_mixture(weights, "a row's teacher weights")
        for i, example in enumerate(examples):
            unread = [c for c in UNREAD_COLUMNS if example.get(c) is not None]
            if unread:
                raise ValueError(
                    f"example {i} carries {unread} (a teacher's own prompt, tokens or top-k), which several teachers "
                    f"with other tokenizers do not read yet: each teacher here scores the row's own text; drop them"
                )
        side = self.student_side
        student = [side.student_tokens(example) for example in examples]
        width = max(len(s[0]) for s in student)

        def pad(values, fill, dtype=torch.long):
            return torch.tensor([list(v) + [fill] * (width - len(v)) for v in values], dtype=dtype)

        batch: dict[str, Any] = {
            "input_ids": pad([s[0] for s in student], side.student_pad_id),
            "attention_mask": pad([[1] * len(s[0]) for s in student], 0),
            "labels": pad([s[2] for s in student], side.ignore_index),
        }
        if not all(has_completion(example) for example in examples):  # prompt-only rows: refused off-policy
            batch[HAS_COMPLETION] = torch.tensor([has_completion(example) for example in examples])
        parts = {}
        for name, setup in self.cross.items():
            rows = torch.nonzero(weights[:, self.index(name)] > 0).flatten()
            if rows.numel() == 0:  # no row of this batch learns from it
                continue
            own = setup.collator([examples[i] for i in rows.tolist()])
            columns = own["input_ids"].shape[1]  # its rows' student tokens: the batch's, padded to their own width
            groups = torch.full((len(examples), width), -1, dtype=torch.long)
            groups[rows, :columns] = own[STUDENT_ALIGN_GROUPS]
            exact = torch.zeros((len(examples), width), dtype=torch.bool)
            exact[rows, :columns] = own[ALIGN_EXACT_OK]
            parts[name] = {
                STUDENT_ALIGN_GROUPS: groups,
                ALIGN_EXACT_OK: exact,
                **{c: own[c] for c in TEACHER_COLUMNS},
            }
        batch[TOKENIZER_TEACHERS] = parts
        return batch
