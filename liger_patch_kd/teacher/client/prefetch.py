"""Teacher data from a server, fetched ahead: while step i trains, the requests for batches i + 1 ... i + depth are in
flight, so the student waits only when the server is slower than the student.

TeacherPrefetcher wraps the training DataLoader: a background thread draws batches, splits each into its sequences
(rows by attention_mask; packed rows, where position_ids restart, into the sequences packed in them) and submits
them to a TeacherClient; the training loop gets each batch, in order, with teacher_token_ids / teacher_logprobs (B,
T, K) aligned with its positions (padding positions: id -1, log-prob -inf), i.e. exactly what an offline store's
collator gives (with a client asking for samples: the sampled teacher tokens' columns, attach_samples). Every batch
waits for its own replies: none trains without its teacher data, and an error (server gone after the retries,
timeout, malformed reply, or the DataLoader's own) is raised in the training loop. Each process wraps its own
DataLoader shard, so each rank asks for its own batches.

A teacher that reads its own sequences is asked about the batch's `teacher_input_ids` under its
`teacher_attention_mask` (packed: cut where `teacher_position_ids` restart), and its replies are aligned with
those positions, as offline data computed on them is: a teacher with another tokenizer (align/), or one with its
own prompt before the student's completion (privileged rows, models/privileged.py, which pairs the completion
positions). By default (`keys=None`) a batch holding teacher_input_ids asks about them, any other the student's.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ...batch.columns import (
    TEACHER_ATTENTION_MASK,
    TEACHER_INPUT_IDS,
    TEACHER_LOGPROBS,
    TEACHER_POSITION_IDS,
    TEACHER_SAMPLE_COUNTS,
    TEACHER_SAMPLE_IDS,
    TEACHER_SAMPLE_LOGPROBS,
    TEACHER_TOKEN_IDS,
)
from ...wire.protocols import TopK
from ...wire.sampled_tokens import SampledTokens
from .client import TeacherClient

Segments = list[tuple[int, torch.Tensor]]  # (batch row, positions in that row) per sequence
STUDENT_KEYS = ("input_ids", "attention_mask")  # the ids the teacher is asked about, and their mask
TEACHER_KEYS = (TEACHER_INPUT_IDS, TEACHER_ATTENTION_MASK)  # the teacher's own sequences
POSITION_KEYS = {STUDENT_KEYS: "position_ids", TEACHER_KEYS: TEACHER_POSITION_IDS}  # where packed rows restart


def keys_of(batch: Mapping[str, Any], keys: tuple[str, str] | None) -> tuple[str, str]:
    """The (ids, mask) keys the teacher is asked about: `keys` when given, else the teacher's own sequences when the
    batch holds them (teacher_input_ids), else the student's."""
    if keys is not None:
        return keys
    return TEACHER_KEYS if batch.get(TEACHER_KEYS[0]) is not None else STUDENT_KEYS


def split_sequences(batch: Mapping[str, torch.Tensor], keys: tuple[str, str] = STUDENT_KEYS) -> Segments:
    """The sequences of a batch: per row the positions the mask keeps (all without a mask), cut where the keys'
    position ids (position_ids, teacher_position_ids) restart at 0 (several sequences packed in one row)."""
    ids = batch[keys[0]]
    mask = batch.get(keys[1])
    position_key = POSITION_KEYS.get(tuple(keys))
    position_ids = batch.get(position_key) if position_key else None
    segments: Segments = []
    for row in range(ids.shape[0]):
        keep = mask[row].bool().nonzero().squeeze(-1) if mask is not None else torch.arange(ids.shape[1])
        if keep.numel() == 0:
            continue
        starts = [0]
        if position_ids is not None:
            starts += [s for s in (position_ids[row, keep] == 0).nonzero().squeeze(-1).tolist() if s > 0]
        bounds = [*starts, keep.numel()]
        segments += [(row, keep[a:b]) for a, b in zip(bounds, bounds[1:])]
    return segments


def attach_teacher(
    batch: Mapping[str, Any], segments: Segments, topks: list[TopK], top_k: int, keys: tuple[str, str] = STUDENT_KEYS
) -> dict[str, Any]:
    """A copy of `batch` with teacher_token_ids (B, T, K) int32 and teacher_logprobs (B, T, K) float32 (T: the
    length of batch[keys[0]]): each sequence's rows at its positions, padding elsewhere."""
    if TEACHER_TOKEN_IDS in batch:
        raise ValueError("the batch already holds teacher_token_ids: use an offline store or a server, not both")
    if len(topks) != len(segments):
        raise ValueError(f"{len(topks)} teacher replies for {len(segments)} sequences")
    rows, length = batch[keys[0]].shape
    ids = torch.full((rows, length, top_k), -1, dtype=torch.int32)
    logprobs = torch.full((rows, length, top_k), -math.inf, dtype=torch.float32)
    for (row, positions), (i, v) in zip(segments, topks):
        ids[row, positions] = i
        logprobs[row, positions] = v
    return {**batch, TEACHER_TOKEN_IDS: ids, TEACHER_LOGPROBS: logprobs}


def attach_samples(
    batch: Mapping[str, Any], segments: Segments, draws: list[SampledTokens], samples: int, top_k: int,
    keys: tuple[str, str] = STUDENT_KEYS,
) -> dict[str, Any]:  # fmt: skip
    """A copy of `batch` with the sampled teacher tokens a store's collator gives: teacher_sample_ids (B, T, m)
    int32, teacher_sample_counts int32, teacher_sample_logprobs float32 (padding -1, 0, -inf) and, for the hybrid
    (top_k > 0), its top-k as teacher_token_ids / teacher_logprobs; draws alone carry no top-k columns."""
    if TEACHER_SAMPLE_IDS in batch:
        raise ValueError("the batch already holds teacher_sample_ids: use an offline store or a server, not both")
    out = dict(batch)
    if top_k:
        out = attach_teacher(batch, segments, [(d.topk_ids, d.topk_logprobs) for d in draws], top_k, keys)
    rows, length = batch[keys[0]].shape
    columns = {TEACHER_SAMPLE_IDS: (-1, torch.int32), TEACHER_SAMPLE_COUNTS: (0, torch.int32),
               TEACHER_SAMPLE_LOGPROBS: (-math.inf, torch.float32)}  # fmt: skip
    for (name, (fill, dtype)), part in zip(columns.items(), ("ids", "counts", "logprobs")):
        column = torch.full((rows, length, samples), fill, dtype=dtype)
        for (row, positions), d in zip(segments, draws):
            column[row, positions] = getattr(d, part).to(dtype)
        out[name] = column
    return out


def sequence_tokens(batch: Mapping[str, torch.Tensor], segments: Segments, keys: tuple[str, str]) -> list[list[int]]:
    ids = batch[keys[0]].cpu()
    return [ids[row, positions].tolist() for row, positions in segments]


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


class TeacherPrefetcher:
    """Iterates `dataloader`, attaching the served teacher's top-k to each batch, `depth` batches ahead.

    Behaves as the wrapped DataLoader otherwise (len, set_epoch, dataset, sampler, ... are its). `collate_fn`
    is the DataLoader's with the teacher attached synchronously, so a DataLoader rebuilt from this one (the
    Trainer skipping batches when it resumes from a checkpoint) still gives every batch its teacher data.
    `wait_seconds` is the time the training loop spent waiting for replies.

    `ahead=False` asks about each batch when it is drawn, in the iterating thread, nothing drawn ahead: for an
    evaluation loop, which reads accelerate's end-of-DataLoader state while it holds the last batch (to drop the
    duplicates that even out the last batch); a thread drawing ahead ends the DataLoader while an earlier batch is
    being evaluated, and the wrong batch's losses are cut.
    """

    def __init__(
        self, dataloader: Any, client: TeacherClient, *, depth: int = 4, keys: tuple[str, str] | None = None,
        ahead: bool = True,
    ) -> None:  # fmt: skip
        if depth < 1:
            raise ValueError(f"depth must be >= 1 (batches fetched ahead); got {depth}")
        self.dataloader, self.client, self.depth, self.keys, self.ahead = dataloader, client, depth, keys, ahead
        self.wait_seconds, self.batches = 0.0, 0
        self._ready = False

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:
        if name == "dataloader":  # not set yet (e.g. during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataloader, "set_epoch"):
            self.dataloader.set_epoch(epoch)

    @property
    def collate_fn(self) -> Callable:
        collate = self.dataloader.collate_fn
        return lambda features: self.with_teacher(collate(features))

    def with_teacher(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """One batch with its teacher data, fetched now."""
        segments = split_sequences(batch, keys_of(batch, self.keys))
        return self.attach(batch, segments, self.submit(batch, segments).result())

    def submit(self, batch: Mapping[str, Any], segments: Segments):
        """The requests for one batch's sequences, in flight (`.result()`: their top-k, in order)."""
        return self.client.submit(sequence_tokens(batch, segments, keys_of(batch, self.keys)))

    def attach(self, batch: Mapping[str, Any], segments: Segments, replies: list) -> dict[str, Any]:
        ask = getattr(self.client, "ask", None)  # a TeacherClient asking for samples; other clients send top-k
        keys = keys_of(batch, self.keys)
        if ask is not None:  # sampled teacher tokens (the client's samples)
            return attach_samples(batch, segments, replies, ask.samples, ask.top_k, keys)
        return attach_teacher(batch, segments, replies, self.client.top_k, keys)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not self._ready:  # a server down at start fails here, within the client's timeout
            self.client.wait_until_ready()
            self._ready = True
        if not self.ahead:
            yield from self._in_step()
            return
        pending: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    pending.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for batch in self.dataloader:
                    segments = split_sequences(batch, keys_of(batch, self.keys))
                    if not put((batch, segments, self.submit(batch, segments))):
                        return
                put(_END)
            except BaseException as e:  # raised again in the training loop
                put(_Failure(e))

        thread = threading.Thread(target=produce, name="teacher-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = pending.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                batch, segments, replies = item
                start = time.perf_counter()
                topks = replies.result()
                self.wait_seconds += time.perf_counter() - start
                self.batches += 1
                yield self.attach(batch, segments, topks)
        finally:
            stop.set()
            thread.join(timeout=5)

    def _in_step(self) -> Iterator[dict[str, Any]]:
        for batch in self.dataloader:
            start = time.perf_counter()
            batch = self.with_teacher(batch)
            self.wait_seconds += time.perf_counter() - start
            self.batches += 1
            yield batch
