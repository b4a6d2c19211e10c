"""Writing a rollout store: the student's own completions to a set of prompts, sampled once, scored by the teacher
once, written as a resumable, checksummed store (teacher/store/rollouts.py is the format) that KDTrainer trains on
like any store, with the on-policy losses too (kd_onpolicy_loss k1 / pg read the stored log-probs). The student may
be an engine at a URL (engine_student.EngineStudent: its completions and behaviour log-probs asked of it) and the
teacher a server (served_teacher.ServedTeacher); the manifest then names them by URL and model.

Prompts are generated from in fixed calls of `prompts_per_call` prompts: call c holds prompts [c * B, (c + 1) * B)
and samples exactly what an in-process on-policy step c would sample from them with this seed
(generate_rollouts(step=c): the same RolloutSettings, the same call seed), whatever ran before it. A shard holds a
whole number of calls, so a run resumed after a kill regenerates the missing shards as the uninterrupted run wrote
them (on the same device type: another one rounds, and so samples, differently).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from torch import nn
from transformers import GenerationConfig
from transformers.utils import logging

from ...batch.columns import TEACHER_PROMPT
from ...batch.prompts import tokenize_prompt_rows
from ...teacher.precompute import check_precompute_args, sequences_fingerprint, teacher_fingerprint
from ...teacher.store import StoreWriter, check_store_folder, tokenizer_fingerprint
from ...utils.text_files import read_utf8
from ..rollouts.generate import RolloutSettings, generate_rollouts
from ..rollouts.onpolicy import special_ids
from .engine_student import EngineStudent
from .scoring import ScoredRollouts, ScoreOptions, score_rollouts
from .served_teacher import ServedTeacher

logger = logging.get_logger(__name__)


def prompts_per_shard(shard_size: int, num_generations: int, prompts_per_call: int) -> int:
    """Prompts a shard holds: about shard_size sequences, a whole number of generation calls (at least one)."""
    per_call = prompts_per_call
    return max(per_call, (shard_size // num_generations) // per_call * per_call)


def read_prompt_lines(path: str | Path, tokenizer: Any, *, rows_per_call: int = 1024
                      ) -> tuple[list[list[int]], list[int]]:  # fmt: skip
    """Prompt token ids from a JSONL file of TRL's rows: {"prompt": text or messages} (a completion, if given, is
    not read: the student writes its own) or {"messages": [..., the assistant's turn]} (the turns before it);
    blank lines ignored. A line that is neither, or that has a 'teacher_prompt' (which the store could not honour),
    is a ValueError naming file:line. The text prompts are encoded
    `rows_per_call` rows to a tokenizer call (the same ids as one by one). Rows with a completion are counted
    and said once (a user may expect them to be trained on). Returns the prompts and each one's line in the file
    (counted from 1), by which later checks name a prompt."""
    numbered = []  # (line number, the row without its completion)
    completions = []  # the line numbers of rows with a completion, which is not read
    for line_no, line in enumerate(read_utf8(path, "--data").split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{line_no}: not valid JSON ({e})") from None
        if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
            raise ValueError(f"{path}:{line_no}: a rollout prompt row needs 'prompt' (text or messages) or "
                             f"'messages' (TRL's formats)")  # fmt: skip
        if TEACHER_PROMPT in row:  # the store scores the student's own sequence: the teacher's prompt would be lost
            raise ValueError(f"{path}:{line_no}: the row has a '{TEACHER_PROMPT}', and a rollout store's teacher "
                             f"scores the student's own prompt + completion, so the privileged prompt would be "
                             f"dropped: remove the column, or distil with the teacher prompt on-policy online "
                             f"(KDTrainer on these rows with kd_lmbda=1)")  # fmt: skip
        if "completion" in row:
            completions.append(line_no)
        numbered.append((line_no, {k: v for k, v in row.items() if k != "completion"}))
    if completions:
        logger.warning("%s: %d of %d rows carry a 'completion' (the first at line %d), which a rollout store does not "
                       "read: the student samples its own after each prompt", path, len(completions), len(numbered),
                       completions[0])  # fmt: skip
    prompts = []
    for first in range(0, len(numbered), rows_per_call):
        part = numbered[first : first + rows_per_call]
        try:
            prompts += [prompt for prompt, _ in tokenize_prompt_rows(tokenizer, [row for _, row in part])]
        except ValueError:  # which line: the rows again one by one, the first bad one named
            for line_no, row in part:
                try:
                    tokenize_prompt_rows(tokenizer, [row])
                except ValueError as e:
                    raise ValueError(f"{path}:{line_no}: {e}") from None
            raise
    return prompts, [line_no for line_no, _ in numbered]


def check_rollout_inputs(
    prompts: Sequence[Sequence[int]], settings: RolloutSettings, *, prompts_per_call: int, context: int | None,
    vocab_size: int, names: Sequence[str] | None = None,
) -> None:  # fmt: skip
    """Everything about the prompts and sampling checked before any model runs: a ValueError naming the fix, the
    prompt named by `names` (a file's `path:line`, as read_prompt_lines gives them), else as "prompt i"."""
    name = (lambda i: names[i]) if names is not None else (lambda i: f"prompt {i}")  # noqa: E731
    if len(prompts) == 0:
        raise ValueError("no prompts: --data must hold rows with a 'prompt' (text or messages) or 'messages' (TRL's "
                         "formats); rollouts are sampled from them")  # fmt: skip
    if isinstance(prompts_per_call, bool) or not isinstance(prompts_per_call, int) or prompts_per_call < 1:
        raise ValueError(f"prompts_per_call (--batch-size) must be an integer >= 1; got {prompts_per_call!r}")
    for n, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"{name(n)} holds token id {bad[0]}, outside the student's vocabulary [0, "
                             f"{vocab_size}): tokenize the prompts with the student's tokenizer")  # fmt: skip
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    size = max(len(prompts[longest]), 1)
    if context is not None and size >= context:  # no --max-new-tokens fits: the prompt is the problem
        raise ValueError(
            f"{name(longest)} has {size} tokens, which leaves no room for a completion in the context of "
            f"{context} tokens (max_position_embeddings): shorten it to at most {context - 1} tokens, leaving "
            f"--max-new-tokens for the completion, or drop the row"
        )
    if context is not None and size + settings.max_new_tokens > context:
        raise ValueError(
            f"--max-new-tokens {settings.max_new_tokens}: {name(longest)} has {size} tokens, and {size} + "
            f"{settings.max_new_tokens} exceeds the context of {context} tokens (max_position_embeddings); pass "
            f"--max-new-tokens <= {context - size} or shorter prompts"
        )


def rollout_section(settings: RolloutSettings, generator: dict, teacher: dict, prompts_per_call: int,
                    score: ScoreOptions, num_prompts: int) -> dict:  # fmt: skip
    """The manifest's `rollouts` section: who generated and scored and how (compared on a resume: another value
    there is another store). `generator` / `teacher`: {"generator_fingerprint": weights fingerprint} of a model in
    this process, or {"generator_engine": {url, model}} / {"teacher_server": {url, model, protocol}} of a served one
    (its weights unknown here: teacher_fingerprint None)."""
    return {
        "generator_fingerprint": None,
        "teacher_fingerprint": None,
        **generator,
        **teacher,
        "sampling": {"temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k,
                     "seed": settings.seed},  # fmt: skip
        "num_generations": settings.num_generations,
        "max_new_tokens": settings.max_new_tokens,
        "prompts_per_call": prompts_per_call,
        "num_prompts": num_prompts,
        "score": asdict(score),
    }


def head_rows(model: nn.Module | EngineStudent | ServedTeacher) -> int | None:
    """The rows of a model's head (its vocabulary, padding included); a served one's as its server lists them."""
    if isinstance(model, nn.Module):
        return model.get_output_embeddings().weight.shape[0]
    return model.vocab_size


def context_of(model: nn.Module | EngineStudent | ServedTeacher) -> int | None:
    if isinstance(model, nn.Module):
        context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        return context if isinstance(context, int) else None
    return model.context


def check_vocabularies(student_rows: int | None, teacher_rows: int | None, tokenizer: Any, student_name: str,
                       teacher_name: str) -> None:  # fmt: skip
    """The generator's and the teacher's heads must be one tokenizer's: equal, or both at least the tokenizer's
    length (rows past it are padding, never sampled). A ValueError naming both otherwise; a head whose rows are not
    listed (vLLM's /v1/models) passes, its ids checked in each reply."""
    if student_rows is None or teacher_rows is None or student_rows == teacher_rows:
        return
    size = len(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else None
    if size is not None and min(student_rows, teacher_rows) >= size:
        return
    raise ValueError(
        f"the generator {student_name} has a vocabulary of {student_rows} ids and the teacher {teacher_name} "
        f"{teacher_rows}" + (f", and the tokenizer {size}" if size is not None else "") + ": a rollout store pairs "
        "the teacher's log-probs with the generator's tokens one for one, so both must be models of one tokenizer; "
        "point --rollouts-from and --teacher (--teacher-url) at models of the same tokenizer"
    )


def precompute_rollouts(
    student: nn.Module | EngineStudent,
    teacher: nn.Module | ServedTeacher,
    prompts: Sequence[Sequence[int]],
    out_dir: str | Path,
    *,
    settings: RolloutSettings,
    score: ScoreOptions | None = None,
    prompts_per_call: int = 8,
    shard_size: int = 1024,
    logprob_dtype: str = "float32",
    encoding: str = "plain",
    tokenizer: Any = None,
    student_name: str = "",
    teacher_name: str = "",
    tokenizer_fp: str | None = None,
    inputs: dict | None = None,
    progress: bool = True,
    generation_config: Any = None,
) -> Path:
    """Sample settings.num_generations completions per prompt from `student`, score them with `teacher`, write a
    rollout store to `out_dir`; resumes an interrupted one (refusing, by name, any input that differs).

    Args:
        student / teacher: Hugging Face causal LMs of one tokenizer (the teacher's head may be padded past it); or
            the student served by an engine (EngineStudent: its completions and behaviour log-probs asked of it)
            and / or the teacher served (ServedTeacher: its scores asked of it).
        prompts: token ids per prompt (an empty prompt starts from BOS).
        settings: how to sample (max_new_tokens, temperature, top_p, top_k, num_generations, seed, cache).
        score: the teacher signal per position (ScoreOptions: top_k, samples, temperature, seed).
        prompts_per_call: prompts per generation call (rows per call: this times num_generations).
        shard_size: about this many sequences a shard (a whole number of calls).
        logprob_dtype / encoding: as `precompute`'s (the store's top-k / samples).
        tokenizer: the student's, for its pad / EOS ids (else its generation config's); its fingerprint is the
            manifest's tokenizer_fingerprint unless `tokenizer_fp` is given, so training with another is refused.
        inputs: more fingerprints that shape the store (the CLI adds the data file's hash).
        generation_config: an engine student's (its EOS ids; None: the tokenizer's).
    """
    score = score or ScoreOptions()
    if tokenizer_fp is None and callable(getattr(tokenizer, "get_vocab", None)):
        tokenizer_fp = tokenizer_fingerprint(tokenizer)
    vocab, student_vocab = head_rows(teacher), head_rows(student)
    if vocab is None:  # a served top-k teacher that does not list its vocabulary (vLLM): the generator's ids
        vocab = student_vocab if student_vocab is not None else len(tokenizer)
    student_vocab = vocab if student_vocab is None else student_vocab
    check_vocabularies(head_rows(student), head_rows(teacher), tokenizer, student_name or "(student)",
                       teacher_name or "(teacher)")  # fmt: skip
    check_precompute_args(vocab, top_k=score.top_k, temperature=score.temperature, shard_size=shard_size,
                          logprob_dtype=logprob_dtype, encoding=encoding, samples=score.samples)  # fmt: skip
    real = min(vocab, student_vocab)  # a head padded past the other's rows: those ids are never sampled
    if vocab != student_vocab and tokenizer is not None and hasattr(tokenizer, "__len__"):
        real = min(real, len(tokenizer))  # heads of two sizes, both padded (check_vocabularies): the tokenizer's ids,
        # the vocabulary KDTrainer normalises such a pair over (kd_vocab_size), on-policy and on the store alike
    settings = replace(settings, batch_size=None, vocab_size=real if real < student_vocab else settings.vocab_size)
    context = [context_of(m) for m in (student, teacher)]
    context = min((c for c in context if c is not None), default=None)
    check_rollout_inputs(prompts, settings, prompts_per_call=prompts_per_call, context=context, vocab_size=real)
    if isinstance(teacher, ServedTeacher):
        teacher.check(score, vocab)
    check_store_folder(out_dir)
    per_shard = prompts_per_shard(shard_size, settings.num_generations, prompts_per_call)
    fingerprints = {"prompts": sequences_fingerprint([list(p) for p in prompts]), **(inputs or {})}
    generator = ({"generator_engine": student.section()} if isinstance(student, EngineStudent)
                 else {"generator_fingerprint": teacher_fingerprint(student)})  # fmt: skip
    scorer = ({"teacher_server": teacher.section()} if isinstance(teacher, ServedTeacher)
              else {"teacher_fingerprint": teacher_fingerprint(teacher)})  # fmt: skip
    section = rollout_section(settings, generator, scorer, prompts_per_call, score, len(prompts))
    if real < student_vocab:  # the ids drawn from and normalised over: fewer than the generator's head
        section["sampled_vocab_size"] = real
    writer = StoreWriter.open(
        out_dir, teacher=teacher_name, generator=student_name, vocab_size=vocab, tokenizer_fingerprint=tokenizer_fp,
        top_k=score.top_k, logprob_dtype=logprob_dtype, temperature=score.temperature,
        shard_size=per_shard * settings.num_generations, num_sequences=len(prompts) * settings.num_generations,
        encoding=encoding, inputs=fingerprints, rollouts=section,
        **({"samples": score.samples, "sample_seed": score.seed} if score.samples else {}),
    )  # fmt: skip
    if isinstance(student, EngineStudent):
        pad, eos_ids, start = engine_special_ids(tokenizer, generation_config)
    else:
        pad, eos_ids, start = special_ids(student, tokenizer)
    try:
        _write_shards(student, teacher, prompts, writer, settings, score, prompts_per_call, per_shard,
                      (pad, eos_ids, start), progress, real)  # fmt: skip
    except BaseException:
        if writer.created_manifest and writer.done_shards() == 0:
            writer.abort()  # nothing was finished: leave no store behind that a corrected rerun would trip on
        raise
    return writer.finish()


def engine_special_ids(tokenizer: Any, generation_config: Any = None) -> tuple[int, set[int], int]:
    """(pad, EOS ids, the token an empty prompt starts with) for an engine's rollouts, as the in-process student's
    are found (generation/special_tokens.py): its generation config (`generation_config`, e.g. read from the
    student's folder) first, then the tokenizer. No EOS at all is refused: a completion would never end."""
    pad, eos_ids, start = special_ids(SimpleNamespace(generation_config=generation_config or GenerationConfig()),
                                      tokenizer)  # fmt: skip
    if not eos_ids:
        raise ValueError("the engine's student has no EOS id (neither its generation config nor the tokenizer "
                         "names one): give a --tokenizer that has an eos_token")  # fmt: skip
    return pad, eos_ids, start


def _write_shards(student, teacher, prompts, writer: StoreWriter, settings: RolloutSettings, score: ScoreOptions,
                  prompts_per_call: int, per_shard: int, ids: tuple, progress: bool,
                  vocab_size: int) -> None:  # fmt: skip
    from tqdm.auto import tqdm

    pad, eos_ids, start = ids
    engine = isinstance(student, EngineStudent)
    n_shards = math.ceil(len(prompts) / per_shard)
    done = min(len(prompts), writer.done_shards() * per_shard)
    with tqdm(total=len(prompts), initial=done, desc="rollouts", unit="prompt", disable=not progress) as bar:
        for shard in range(writer.done_shards(), n_shards):
            calls = []
            for first in range(shard * per_shard, min((shard + 1) * per_shard, len(prompts)), prompts_per_call):
                chunk = [list(p) for p in prompts[first : first + prompts_per_call]]
                call = first // prompts_per_call
                if engine:  # the behaviour log-probs are the engine's: no student runs here
                    rollouts = student.generate(chunk, settings, eos_ids=eos_ids, start_id=start, call=call,
                                                vocab_size=vocab_size)  # fmt: skip
                else:
                    rollouts = generate_rollouts(student, chunk, settings, pad_id=pad, eos_ids=eos_ids,
                                                 start_id=start, step=call)  # fmt: skip
                calls.append(score_rollouts(None if engine else student, teacher, rollouts, score,
                                            vocab_size=settings.vocab_size))  # fmt: skip
                bar.update(len(chunk))
            rows = ScoredRollouts.cat(calls)
            writer.write_shard(rows.input_ids.split(rows.lengths), rows.topk_ids, rows.topk_logprobs,
                               samples=rows.samples, rollouts=rows.columns)  # fmt: skip
