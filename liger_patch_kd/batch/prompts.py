"""Prompt datasets in TRL's conventions, tokenized for distillation.

Rows are one of:
- `{"prompt": str}` or conversational `{"prompt": [{"role": ..., "content": ...}, ...]}`: a prompt only; the
  completion is generated (on-policy steps, `kd_lmbda=1`, or teacher generations, `kd_seq_kd`);
- the same with a `completion` (str, or a list of messages after a conversational prompt): a fixed completion,
  which off-policy steps of a `kd_lmbda` mix train on;
- `{"messages": [...]}` ending with the assistant's turn: prompt = the turns before it, completion = it;
- any of these with a `teacher_prompt` (of the prompt's kind: text, or a list of messages): what the teacher sees
  instead of the prompt (a hint, a document, the reference answer) before the same completion (privileged.py).

A text prompt is tokenized as the tokenizer encodes text (its special tokens included, e.g. BOS); a conversational
prompt is rendered with the tokenizer's chat template with the generation prompt added. A text completion is
tokenized without special tokens and ends with EOS (as TRL's trainers do, so the student learns to stop); a
conversational one is the template's rendering of prompt + completion past the prompt's rendering.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from .columns import HAS_COMPLETION, TEACHER_INPUT_IDS, TEACHER_LABELS, TEACHER_PROMPT
from .privileged import PrivilegedCollator
from .teacher_data import TeacherDataCollator


def is_prompt_row(row: dict[str, Any]) -> bool:
    return "prompt" in row or "messages" in row


def _is_conversation(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def conversation_column(row: Any) -> str | None:
    """The column that makes `row` a conversation the tokenizer's chat template renders ('messages', or a
    conversational 'prompt'), or None for a row of text or token ids."""
    if not isinstance(row, dict):
        return None
    if "messages" in row:
        return "messages"
    return "prompt" if _is_conversation(row.get("prompt")) and row.get("prompt") else None


def encode(tokenizer, text: str, *, special_tokens: bool) -> list[int]:
    """Token ids of `text`: a Hugging Face tokenizer's own call (with or without its special tokens, e.g. BOS), or
    a plain tokenizer's `encode(text)` (such as the demo's character tokenizer, which has none)."""
    return encode_many(tokenizer, [text], special_tokens=special_tokens)[0]


def encode_many(tokenizer, texts: list[str], *, special_tokens: bool) -> list[list[int]]:
    """encode() of each text, a Hugging Face tokenizer called once for them all (a fast tokenizer encodes a list
    in one call into its Rust code: a batch of a few hundred prompts costs a step's milliseconds one by one)."""
    if not texts:
        return []
    if isinstance(tokenizer, PreTrainedTokenizerBase):  # takes a list: one call
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=special_tokens)["input_ids"]]
    if callable(tokenizer):  # another callable tokenizer: text by text, as it is documented to take
        return [list(tokenizer(text, add_special_tokens=special_tokens)["input_ids"]) for text in texts]
    return [list(tokenizer.encode(text)) for text in texts]


def _template_ids(tokenizer, messages: list[dict], *, add_generation_prompt: bool) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "a conversational prompt needs a tokenizer with a chat template (tokenizer.chat_template is None); "
            "set one, or give text prompts"
        )
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    return encode(tokenizer, text, special_tokens=False)


def tokenize_prompt_row(tokenizer, row: dict[str, Any]) -> tuple[list[int], list[int] | None]:
    """(prompt ids, completion ids or None when the row has no completion) for one row."""
    return tokenize_prompt_rows(tokenizer, [row])[0]


def tokenize_prompt_rows(tokenizer, rows: list[dict[str, Any]]) -> list[tuple[list[int], list[int] | None]]:
    """tokenize_prompt_row of each row; the text prompts of all rows encoded in one tokenizer call, and their text
    completions in another (the same ids as one by one)."""
    out: list = [None] * len(rows)
    texts: list[tuple[int, str, str | None]] = []  # (row, prompt, completion or None) of the text rows
    for index, row in enumerate(rows):
        try:
            prompt, completion = _prompt_and_completion(row)
            if _is_conversation(prompt):
                out[index] = _conversation_ids(tokenizer, prompt, completion)
            else:
                texts.append((index, prompt, completion))
        except ValueError as e:  # which row: a batch holds hundreds (one row's caller names it itself)
            if len(rows) == 1:
                raise
            raise ValueError(f"prompt row {index} of this batch: {e}") from None
    prompts = encode_many(tokenizer, [prompt for _, prompt, _ in texts], special_tokens=True)
    completed = [(index, completion) for index, _, completion in texts if completion is not None]
    completions = dict(zip([index for index, _ in completed],
                           encode_many(tokenizer, [c for _, c in completed], special_tokens=False)))  # fmt: skip
    eos = getattr(tokenizer, "eos_token_id", None)
    for (index, _, _), prompt_ids in zip(texts, prompts):
        completion_ids = completions.get(index)
        if completion_ids is not None and eos is not None and (not completion_ids or completion_ids[-1] != eos):
            completion_ids = completion_ids + [eos]
        out[index] = (prompt_ids, completion_ids)
    return out


def _prompt_and_completion(row: dict[str, Any]) -> tuple[Any, Any]:
    """A row's (prompt, completion or None), checked: messages as a conversational prompt and its last turn, or
    text."""
    if "messages" in row:
        messages = row["messages"]
        if not _is_conversation(messages) or not messages or messages[-1]["role"] != "assistant":
            raise ValueError(
                "a 'messages' row must be a list of {'role', 'content'} turns ending with the assistant's (its "
                f"completion); got {str(messages)[:80]}; for a prompt alone give {{'prompt': [turns]}} (a "
                "conversational prompt)"
            )
        row = {"prompt": messages[:-1], "completion": messages[-1:]}
    prompt, completion = row.get("prompt"), row.get("completion")
    if _is_conversation(prompt):
        if not prompt:  # a chat template renders nothing from no turns: the completion would follow no prompt
            raise ValueError(
                "a conversational prompt needs at least one turn before the completion (a user or system turn); "
                "a 'messages' row of the assistant's turn alone has none: add the turn it answers, or give the "
                "text as {'text': ...} to train on all of it"
            )
        return prompt, completion
    if not isinstance(prompt, str):
        raise ValueError(f"'prompt' must be a string or a list of messages; got {type(prompt).__name__}")
    if completion is not None and not isinstance(completion, str):
        raise ValueError(f"a text prompt takes a text completion; got {type(completion).__name__}")
    return prompt, completion


def _conversation_ids(tokenizer, prompt: list[dict], completion: Any) -> tuple[list[int], list[int] | None]:
    prompt_ids = _template_ids(tokenizer, prompt, add_generation_prompt=True)
    if completion is None:
        return prompt_ids, None
    if not _is_conversation(completion):
        raise ValueError("a conversational prompt takes a conversational completion (a list of messages)")
    full = _template_ids(tokenizer, prompt + completion, add_generation_prompt=False)
    if full[: len(prompt_ids)] != prompt_ids:
        raise ValueError(
            "the chat template renders the prompt differently alone and followed by the completion, so the "
            "completion's tokens cannot be told apart; use a template whose prompt is a prefix of the whole"
        )
    return prompt_ids, full[len(prompt_ids) :]


@dataclass
class PromptCollator:
    """Batches of prompt rows: input_ids = prompt + completion (right-padded), labels on the completion only,
    attention_mask, and `kd_has_completion` (B,) saying which rows came with one (a prompt-only row has no
    labelled token; only generated steps may train on it). Rows with a `teacher_prompt` also give the teacher's
    rows (teacher_input_ids = teacher prompt + the same completion tokens, teacher_attention_mask, teacher_labels:
    PrivilegedCollator); in such a batch a row without one shows the teacher the student's prompt.

    max_prompt_length keeps a prompt's last tokens (its end is what the completion continues); max_length cuts
    prompt + completion on the right. Neither cuts a teacher prompt; the teacher's completion is the student's kept
    one.
    """

    tokenizer: Any
    max_prompt_length: int | None = None
    max_length: int | None = None
    ignore_index: int = -100

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        pad = getattr(self.tokenizer, "eos_token_id", None) if pad is None else pad
        features, has_completion = [], []
        privileged = any(TEACHER_PROMPT in row for row in examples)
        for index, (row, (prompt, completion)) in enumerate(zip(examples, tokenize_prompt_rows(self.tokenizer,
                                                                                               examples))):  # fmt: skip
            prompt = self._kept_prompt(prompt)
            tokens = prompt + (completion or [])
            label = [self.ignore_index] * len(prompt) + (completion or [])
            if self.max_length is not None:
                if self._leaves_no_completion(prompt, completion):
                    raise ValueError(self.cut_to_nothing(f"prompt row {index} of this batch", row, len(prompt)))
                tokens, label = tokens[: self.max_length], label[: self.max_length]
            features.append({"input_ids": tokens, "labels": label})
            if privileged:
                kept = [t for t in label if t != self.ignore_index]
                teacher_prompt = self._teacher_prompt(row, index, completion, prompt)
                features[-1].update(teacher_input_ids=teacher_prompt + kept,
                                    teacher_labels=[self.ignore_index] * len(teacher_prompt) + kept)  # fmt: skip
            has_completion.append(completion is not None)
        collate = PrivilegedCollator if privileged else TeacherDataCollator
        batch = collate(pad_token_id=0 if pad is None else pad, ignore_index=self.ignore_index)(features)
        return {**batch, HAS_COMPLETION: torch.tensor(has_completion)}

    def _kept_prompt(self, prompt: list[int]) -> list[int]:
        """A prompt's tokens as training keeps them: its last max_prompt_length."""
        return prompt if self.max_prompt_length is None else prompt[-self.max_prompt_length :]

    def _leaves_no_completion(self, prompt: list[int], completion: list[int] | None) -> bool:
        """Whether cutting a kept prompt and its completion at max_length leaves no completion token."""
        return bool(completion) and self.max_length is not None and len(prompt) >= self.max_length

    def cut_to_nothing(self, where: str, row: dict[str, Any], prompt_tokens: int) -> str:
        """The error for a row whose prompt fills max_length, leaving no completion token to train on."""
        return (
            f"{where} ({str(row.get('prompt', row.get('messages')))[:40]!r}...): its prompt has {prompt_tokens} "
            f"tokens (kd_max_prompt_length={self.max_prompt_length}), and kd_max_length={self.max_length} cuts "
            f"prompt + completion there, leaving no completion token to train on: set kd_max_prompt_length below "
            f"kd_max_length (it keeps a prompt's last tokens), raise kd_max_length above {prompt_tokens}, or drop "
            f"such rows"
        )

    def first_row_cut_to_nothing(self, dataset: Any, chunk: int = 512) -> tuple[int, dict[str, Any], int] | None:
        """(index, row, prompt tokens) of the first row of `dataset` (a list of rows or a datasets.Dataset) with a
        completion whose prompt fills max_length, tokenized as training will; None where no row can be (no
        max_length, or a max_prompt_length below it) or none is. Read in chunks of rows, the text prompts of a
        chunk encoded in one tokenizer call: a run that would stop at the batch holding such a row (after hours,
        and again on resuming) is refused before it starts."""
        if self.max_length is None or (self.max_prompt_length is not None and self.max_prompt_length < self.max_length):
            return None
        for start in range(0, len(dataset), chunk):
            rows = dataset[start : start + chunk]
            if isinstance(rows, Mapping):  # a datasets.Dataset's slice: columns of values
                rows = [dict(zip(rows, values)) for values in zip(*rows.values())]
            for offset, (prompt, completion) in enumerate(tokenize_prompt_rows(self.tokenizer, list(rows))):
                prompt = self._kept_prompt(prompt)
                if self._leaves_no_completion(prompt, completion):
                    return start + offset, rows[offset], len(prompt)
        return None

    def _teacher_prompt(self, row: dict[str, Any], index: int, completion: list[int] | None, prompt: list[int]):
        """The teacher prompt's ids, checked to be followed by the very completion tokens the student scores."""
        if TEACHER_PROMPT not in row:
            return prompt
        completion_part = row["messages"][-1:] if "messages" in row else row.get("completion")
        teacher_row = {"prompt": row[TEACHER_PROMPT]}
        if completion_part is not None:
            teacher_row["completion"] = completion_part
        teacher_prompt, teacher_completion = tokenize_prompt_row(self.tokenizer, teacher_row)
        if teacher_completion != completion:
            raise ValueError(
                f"row {index}: the completion tokenizes to {len(completion or [])} tokens after the prompt and "
                f"{len(teacher_completion or [])} after the teacher_prompt (the chat template renders it "
                f"differently); give both prompts the same kind and template, or token-level rows "
                f"(teacher_input_ids)"
            )
        return teacher_prompt


@dataclass
class PromptOrTokenCollator:
    """A run whose datasets hold both kinds of rows (token rows to train on, prompt rows to evaluate on, or the
    other way round): each batch goes to the collator of its rows' kind, `prompts` (PromptCollator) or `tokens`.
    A batch of both kinds is a ValueError (one dataset holds one kind)."""

    prompts: PromptCollator
    tokens: Any

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        kinds = {is_prompt_row(row) for row in examples}
        if len(kinds) > 1:
            raise ValueError("a batch holds both prompt rows ('prompt' / 'messages') and token rows ('input_ids'): "
                             "give each dataset rows of one kind")  # fmt: skip
        return (self.prompts if kinds == {True} else self.tokens)(examples)


def prompt_token_rows(tokenizer, rows: list[dict[str, Any]], **options) -> list[dict[str, list[int]]]:
    """Prompt rows with a completion (`prompt` + `completion`, text or conversational, or `messages`) as token
    rows ({"input_ids", "labels"}, labels -100 on the prompt), tokenized exactly as PromptCollator(tokenizer,
    **options) tokenizes them in training (the chat template, max_prompt_length, max_length): what `liger-kd
    precompute` stores for such rows, so a store trains the objective the rows train with a teacher in process.

    Raises:
        ValueError: naming the row, when it has no completion (nothing to score offline) or a teacher_prompt (its
            teacher sees other tokens: privileged_token_rows).
    """
    collate, out = PromptCollator(tokenizer, **options), []
    for index, row in enumerate(rows):
        if TEACHER_PROMPT in row:
            raise ValueError(f"row {index} has a 'teacher_prompt': the teacher scores other tokens than the student "
                             f"reads; make its rows with privileged_token_rows")  # fmt: skip
        if not ("completion" in row or "messages" in row):
            raise ValueError(
                f"row {index} has a prompt but no completion ('completion', or 'messages' ending with the "
                f"assistant's turn): there is nothing for a teacher to score offline; add the completion, or let "
                f"the student write one (`liger-kd precompute --rollouts-from STUDENT`)"
            )
        batch = collate([row])  # one row: no padding
        out.append({k: batch[k][0].tolist() for k in ("input_ids", "labels")})
    return out


def privileged_token_rows(tokenizer, rows: list[dict[str, Any]], **options) -> list[dict[str, list[int]]]:
    """Text rows with a `teacher_prompt` as token-level rows ({"input_ids", "labels", "teacher_input_ids",
    "teacher_labels"}), tokenized exactly as PromptCollator(tokenizer, **options) tokenizes them in training: for a
    store precomputed on the teacher's sequences, `precompute(teacher, [r["teacher_input_ids"] for r in out], dir)`,
    joined back with teacher.JoinedTeacherData.

    Raises:
        ValueError: naming the row, when it has no teacher_prompt or no completion (nothing to score offline).
    """
    collate, out = PromptCollator(tokenizer, **options), []
    for index, row in enumerate(rows):
        if TEACHER_PROMPT not in row or not ("completion" in row or "messages" in row):
            raise ValueError(
                f"row {index} needs a 'teacher_prompt' and a completion ('completion', or 'messages' ending with the "
                f"assistant's turn) to give the teacher its own sequence; got the keys {sorted(row)}"
            )
        batch = collate([row])  # one row: no padding
        out.append({k: batch[k][0].tolist() for k in ("input_ids", "labels", TEACHER_INPUT_IDS, TEACHER_LABELS)})
    return out
