"""CrossTokenizerCollator: one batch, two tokenizations, and the groups that align them.

Each example is a conversation ({"messages": [..., {"role": "assistant", "content": ...}]}, each tokenizer
rendering it through its own chat template) or a plain pair ({"prompt": str, "completion": str}, the text
prompt + completion for both), or, for on-policy steps, a prompt alone ({"prompt": str} or {"prompt": [messages]}:
the student generates the completion). Both texts are tokenized once with character offsets; the completion's content
(the last message's text) is located in each rendered string, and the tokens covering it are aligned by
`align_tokens`. The loss covers the completion only: student labels on every token after the prompt
(including the student template's end-of-turn tokens, for the CE term), groups on the aligned content.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..batch.columns import (
    ALIGN_EXACT_OK,
    HAS_COMPLETION,
    STUDENT_ALIGN_GROUPS,
    TEACHER_ALIGN_GROUPS,
    TEACHER_ATTENTION_MASK,
    TEACHER_INPUT_IDS,
    TEACHER_LABELS,
    TEACHER_LOGPROBS,
    TEACHER_PROMPT,
    TEACHER_TOKEN_IDS,
)
from .offsets import Group, align_tokens, encode_with_offsets, first_token_at_or_after


def render(tokenizer, example: dict[str, Any]) -> tuple[str, int, int]:
    """(text, first character of the completion's content, end of it) for one example and tokenizer."""
    if "messages" in example:
        messages = example["messages"]
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("messages must end with the assistant's completion ({'role': 'assistant', ...})")
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        content = messages[-1]["content"]
        start = text.find(content, len(prompt) if text.startswith(prompt) else 0)
        if start < 0 and content.strip():
            content = content.strip()  # templates that strip the message
            start = text.find(content, len(prompt) if text.startswith(prompt) else 0)
        if start < 0:
            raise ValueError(
                f"the completion's content is not in the text {type(tokenizer).__name__}'s chat template renders; "
                f"cross-tokenizer alignment needs the content verbatim in both renderings"
            )
        return text, start, start + len(content)
    prompt = example.get("prompt")
    if isinstance(prompt, list) and "completion" not in example:  # a conversational prompt alone (on-policy)
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return text, len(text), len(text)
    if isinstance(prompt, list):
        return render(tokenizer, {"messages": prompt + list(example["completion"])})
    if isinstance(prompt, str):  # a text prompt, with its completion or alone (on-policy steps generate one)
        text = prompt + example.get("completion", "")
        return text, len(prompt), len(text)
    raise ValueError(f"an example needs 'messages' or 'prompt' (+ 'completion'); got keys {sorted(example)}")


def has_completion(example: dict[str, Any]) -> bool:
    return "messages" in example or "completion" in example


Row = tuple[list[int], list[int], list[int], list[bool], list[int], list[int], list[int], int]


def aligned_row(
    s_ids: list[int], s_labels: list[int], t_ids: list[int], t_prompt: int, groups: list[Group], first_group: int,
    ignore_index: int = -100,
) -> Row:  # fmt: skip
    """One row's columns from its aligned groups (numbered from `first_group`, global in the batch): student ids,
    labels, groups and exact flags per shifted row (row r concerns token r + 1), teacher ids, labels (on grouped
    tokens only) and groups, and the teacher's prompt length (its tokens before the completion's content)."""
    t_labels = [ignore_index] * len(t_ids)
    s_group, t_group, exact = [-1] * len(s_ids), [-1] * len(t_ids), [False] * len(s_ids)
    for g, group in enumerate(groups, start=first_group):
        for j in range(group.s_first, group.s_last + 1):
            s_group[j - 1], exact[j - 1] = g, group.one_to_one
        for j in range(group.t_first, group.t_last + 1):
            t_group[j - 1] = g
            t_labels[j] = t_ids[j]
    return s_ids, s_labels, s_group, exact, t_ids, t_labels, t_group, t_prompt


def pad_rows(rows: list[Row], student_pad_id: int, teacher_pad_id: int, ignore_index: int = -100) -> dict:
    """The batch of `aligned_row`s, right-padded: padding is never labelled, attended or in a group."""
    s_len = max(len(r[0]) for r in rows)
    t_len = max(len(r[4]) for r in rows)

    def pad(values, length, fill, dtype=torch.long):
        return torch.tensor([v + [fill] * (length - len(v)) for v in values], dtype=dtype)

    return {
        "input_ids": pad([r[0] for r in rows], s_len, student_pad_id),
        "attention_mask": pad([[1] * len(r[0]) for r in rows], s_len, 0),
        "labels": pad([r[1] for r in rows], s_len, ignore_index),
        STUDENT_ALIGN_GROUPS: pad([r[2] for r in rows], s_len, -1),
        ALIGN_EXACT_OK: pad([r[3] for r in rows], s_len, False, torch.bool),
        TEACHER_INPUT_IDS: pad([r[4] for r in rows], t_len, teacher_pad_id),
        TEACHER_ATTENTION_MASK: pad([[1] * len(r[4]) for r in rows], t_len, 0),
        TEACHER_LABELS: pad([r[5] for r in rows], t_len, ignore_index),
        TEACHER_ALIGN_GROUPS: pad([r[6] for r in rows], t_len, -1),
        "teacher_prompt_length": torch.tensor([r[7] for r in rows], dtype=torch.long),
    }


@dataclass
class CrossTokenizerCollator:
    """Batches for `align.loss` / `trainer.teachers.other_tokenizer`: the student's input_ids / attention_mask / labels
    (HF style, unshifted), the teacher's teacher_input_ids / teacher_attention_mask / teacher_labels, and per shifted
    row (row r concerns token r + 1) student_align_groups / teacher_align_groups (group ids, global
    in the batch, -1 outside) and align_exact_ok (True on one-to-one groups,
    where the exact-token term applies); teacher_prompt_length (B,), the teacher's tokens before the completion's
    content (what an on-policy step keeps of the teacher's row, align.generated). A prompt without a completion
    ({"prompt": str} or a conversational prompt alone) has no label; such a batch carries `kd_has_completion`.
    Offline teacher data (a store or a server, no teacher model in process): an example that also carries
    `teacher_token_ids` / `teacher_logprobs` (L_t, K), row t the teacher's top-k after its token t, and
    `teacher_input_ids` (L_t,), the ids they were computed on (the store's key), gets them padded into the
    batch (padding slots: id -1, log-prob -inf) after checking those ids are the ones this collator builds from
    the text (`teacher_sequence`); the offsets are recomputed from the text, so the store need not hold them.
    `*_prefix_ids` are prepended to each sequence (e.g. [bos_token_id] when the template does not add it)."""

    student_tokenizer: Any
    teacher_tokenizer: Any
    student_pad_id: int = 0
    teacher_pad_id: int = 0
    student_prefix_ids: tuple[int, ...] = ()
    teacher_prefix_ids: tuple[int, ...] = ()
    max_length: int | None = None
    ignore_index: int = -100

    def encode(self, tokenizer, prefix: tuple[int, ...], example) -> tuple[list[int], list[tuple[int, int]], int, int]:
        text, start, end = render(tokenizer, example)
        ids, offsets = encode_with_offsets(tokenizer, text)
        ids, offsets = list(prefix) + ids, [(0, 0)] * len(prefix) + offsets
        if self.max_length is not None:
            ids, offsets = ids[: self.max_length], offsets[: self.max_length]
        return ids, offsets, start, end

    def teacher_sequence(self, example: dict[str, Any]) -> list[int]:
        """The teacher ids of one example, as batches hold them: what to precompute the teacher's top-k on."""
        return self.encode(self.teacher_tokenizer, self.teacher_prefix_ids, example)[0]

    def student_tokens(self, example: dict[str, Any]) -> tuple[list[int], list[tuple[int, int]], list[int], int]:
        """One example's student ids, their content-relative offsets, labels (every token after the prompt) and
        the content's length in characters: what every row of a batch takes from the student's tokenizer."""
        s_ids, s_off, s_start, s_end = self.encode(self.student_tokenizer, self.student_prefix_ids, example)
        s_rel = [(a - s_start, b - s_start) for a, b in s_off]  # content-relative: one coordinate system for both
        s_labels = [self.ignore_index] * len(s_ids)
        for j in range(max(1, first_token_at_or_after(s_rel, 0)), len(s_ids)):
            s_labels[j] = s_ids[j]
        return s_ids, s_rel, s_labels, s_end - s_start

    def _offline_topk(self, example: dict[str, Any], t_ids: list[int], index: int):
        stored = [int(i) for i in example.get(TEACHER_INPUT_IDS, t_ids)]
        if stored[: len(t_ids)] != t_ids:
            raise ValueError(
                f"example {index}: its teacher_input_ids (the ids its teacher_token_ids were computed on) differ from "
                f"the ids the teacher tokenizer gives its text; compute the teacher data on "
                f"collator.teacher_sequence(example), with the same tokenizer, template and prefix"
            )
        ids, logprobs = torch.as_tensor(example[TEACHER_TOKEN_IDS]), torch.as_tensor(example[TEACHER_LOGPROBS])
        if ids.dim() != 2 or ids.shape != logprobs.shape or ids.shape[0] < len(t_ids):
            raise ValueError(
                f"example {index}: teacher_token_ids {tuple(ids.shape)} and teacher_logprobs "
                f"{tuple(logprobs.shape)} must be one (L_t, K) shape with a row per teacher token ({len(t_ids)})"
            )
        return ids[: len(t_ids)].long(), logprobs[: len(t_ids)].float()

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows, topk = [], []
        n_groups = 0
        for index, example in enumerate(examples):
            if TEACHER_PROMPT in example:  # both sides here tokenize the one text: the teacher's prompt would be lost
                raise ValueError(
                    f"example {index} has a teacher_prompt (a prompt only the teacher sees), which cross-tokenizer "
                    f"distillation does not support yet: both tokenizers read the same prompt and completion; drop "
                    f"the teacher_prompt column, or distil from a teacher of the student's tokenizer"
                )
            s_ids, s_rel, s_labels, s_content = self.student_tokens(example)
            t_ids, t_off, t_start, t_end = self.encode(self.teacher_tokenizer, self.teacher_prefix_ids, example)
            if TEACHER_TOKEN_IDS in example:
                topk.append(self._offline_topk(example, t_ids, len(rows)))
            t_rel = [(a - t_start, b - t_start) for a, b in t_off]
            groups = align_tokens(s_rel, t_rel, 0, min(s_content, t_end - t_start))
            t_prompt = first_token_at_or_after(t_rel, 0)
            rows.append(aligned_row(s_ids, s_labels, t_ids, t_prompt, groups, n_groups, self.ignore_index))
            n_groups += len(groups)
        batch = pad_rows(rows, self.student_pad_id, self.teacher_pad_id, self.ignore_index)
        t_len = batch[TEACHER_INPUT_IDS].shape[1]
        if not all(has_completion(example) for example in examples):  # prompt-only rows: generated steps only
            batch[HAS_COMPLETION] = torch.tensor([has_completion(example) for example in examples])
        if topk:
            if len(topk) != len(rows):
                raise ValueError("either every example of a batch carries teacher_token_ids or none does")
            k = max(ids.shape[1] for ids, _ in topk)
            batch[TEACHER_TOKEN_IDS] = torch.full((len(rows), t_len, k), -1, dtype=torch.long)
            batch[TEACHER_LOGPROBS] = torch.full((len(rows), t_len, k), -math.inf)
            for b, (ids, logprobs) in enumerate(topk):
                batch[TEACHER_TOKEN_IDS][b, : ids.shape[0], : ids.shape[1]] = ids
                batch[TEACHER_LOGPROBS][b, : ids.shape[0], : ids.shape[1]] = logprobs
        return batch
