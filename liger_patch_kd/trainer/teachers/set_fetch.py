"""A teacher set's served members asked about their own rows: `kd_teacher_url={"math": url1, "code": url2}`.

Each sequence of a batch is asked of its own row's member (the `teacher` column, collated into the one-hot
`teacher_mixture`), all servers in flight at once, `depth` batches ahead like one served teacher
(teacher/client/prefetch.py); the batch then carries each row's own member's top-k (routed_loss.py trains it). A
row weighted over several served members is refused: a mixture needs every member's full distribution, and the
top-k of each (with unknown tails) does not give it.

`kd_teacher_protocol` may name one protocol per member (`{"math": "hidden", "code": "liger"}`): a "hidden"
member's rows get its final hidden states and head (served_hidden.py: the exact objective), the others their top-k.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...batch.columns import (
    TEACHER_HEAD_SET,
    TEACHER_HIDDEN_SET,
    TEACHER_INPUT_IDS,
    TEACHER_MIXTURE,
)
from ...teacher.client import TeacherPrefetcher
from ...teacher.client.hidden_client import HIDDEN_PROTOCOL, HiddenClient
from ...teacher.client.prefetch import STUDENT_KEYS, attach_teacher, keys_of, sequence_tokens
from ...wire.hidden_wire import TeacherHead
from ..arguments import KDTrainingArguments, checks_arguments
from .base import TeacherSource
from .served import ServedTeacher, check_topk_client_options, prefetched, teacher_client
from .served_hidden import check_hidden_dtype


def protocol_of(args: Any, name: str) -> str:
    """The protocol of served teacher `name`: kd_teacher_protocol's entry for it, or the one protocol of all."""
    protocol = args.kd_teacher_protocol
    return protocol[name] if isinstance(protocol, Mapping) else protocol


@checks_arguments(rank=2)
def check_several_served_args(args: KDTrainingArguments) -> None:
    """kd_teacher_protocol as a dict (one per served teacher), or "hidden" for several: validated when the
    arguments are made."""
    protocol, urls = args.kd_teacher_protocol, args.kd_teacher_url  # their values: served.check_teacher_protocol
    if not isinstance(urls, Mapping) or not (isinstance(protocol, Mapping) or protocol == HIDDEN_PROTOCOL):
        return
    check_hidden_dtype(args)
    check_topk_client_options(args)
    refused = {"kd_teacher_samples": args.kd_teacher_samples is not None, "kd_seq_kd": args.kd_seq_kd,
               "kd_self_distill": args.kd_self_distill, "kd_teacher_tokenizer": bool(args.kd_teacher_tokenizer),
               f"kd_onpolicy_loss={args.kd_onpolicy_loss!r}": args.kd_onpolicy_loss != "divergence"}  # fmt: skip
    used = [name for name, on in refused.items() if on]
    if used:
        raise ValueError(f"several served teachers with per-teacher protocols do not take {used}: unset them, or "
                         f"serve one teacher")  # fmt: skip


class RoutedTeacherClients:
    """One client per served member (a HiddenClient for a "hidden" member, else a TeacherClient), in the set's
    order; `top_k` and `wait_until_ready` as one client's."""

    def __init__(self, names: list[str], clients: list[Any], top_k: int) -> None:
        self.names, self.clients, self.top_k = names, clients, top_k
        self.hidden = [name for name, c in zip(self.names, self.clients) if isinstance(c, HiddenClient)]

    def wait_until_ready(self) -> None:
        for client in self.clients:
            client.wait_until_ready()

    def prefetched(self, dataloader: Any, ahead: bool = True) -> RoutedTeacherPrefetcher:
        """`dataloader` wrapped to ask each row's own member (training's ahead, evaluation's as drawn)."""
        return prefetched(dataloader, self, kind=RoutedTeacherPrefetcher, ahead=ahead)


class _Merged:
    """The replies of several servers, put back in the batch's sequence order."""

    def __init__(self, parts: list[tuple[list[int], Any]], count: int) -> None:
        self.parts, self.count = parts, count

    def result(self) -> list:
        """Each sequence's reply in order: a top-k, or (name, (hidden states, head)) from a hidden teacher."""
        out = [None] * self.count
        for order, pending, name in self.parts:
            for i, reply in zip(order, pending.result()):
                out[i] = reply if name is None else (name, reply)
        return out


PRIVILEGED_ROWS_REFUSED = (
    "rows with the teacher's own prompt (teacher_input_ids) and several served teachers (kd_teacher_url={name: url}) "
    "are not supported yet: serve one teacher (kd_teacher_url=url), or run the teachers in process"
)


def check_rows_for_several_served(args: Any, first_row: Any) -> None:
    """Refused when KDTrainer is built, before any server is asked (the prefetcher refuses such batches too)."""
    if isinstance(args.kd_teacher_url, Mapping) and isinstance(first_row, Mapping) and TEACHER_INPUT_IDS in first_row:
        raise ValueError(PRIVILEGED_ROWS_REFUSED)


class RoutedTeacherPrefetcher(TeacherPrefetcher):
    """TeacherPrefetcher asking each sequence's own teacher (routed by the batch's one-hot `teacher_mixture`)."""

    def submit(self, batch, segments):
        if self.keys is None and keys_of(batch, None) != STUDENT_KEYS:  # privileged rows (their own teacher prompt)
            raise ValueError(PRIVILEGED_ROWS_REFUSED)
        weights = batch[TEACHER_MIXTURE]
        routes = []
        for row, positions in segments:
            w = weights[row] if weights.dim() == 2 else weights[row, positions[0]]
            if int((w > 0).sum()) != 1:
                raise ValueError(
                    f"a row weighs several served teachers ({w.tolist()} over {self.client.names}); served teachers "
                    f"route rows (a 'teacher' column, one teacher per row): a mixture needs every teacher's full "
                    f"distribution, which top-k replies do not hold"
                )
            routes.append(int(w.argmax()))
        tokens = sequence_tokens(batch, segments, self.keys or STUDENT_KEYS)
        parts = []
        for j, (name, client) in enumerate(zip(self.client.names, self.client.clients)):
            order = [i for i, r in enumerate(routes) if r == j]
            if order:
                hidden = name if isinstance(client, HiddenClient) else None
                parts.append((order, client.submit([tokens[i] for i in order]), hidden))
        return _Merged(parts, len(segments))

    def attach(self, batch, segments, replies):
        """The top-k teachers' replies as teacher_token_ids / teacher_logprobs (padding on other rows), each hidden
        teacher's as its states and head (TEACHER_HIDDEN_SET / TEACHER_HEAD_SET); a set without hidden teachers as one
        served teacher's top-k."""
        if not self.client.hidden:
            return super().attach(batch, segments, replies)
        keys = keys_of(batch, self.keys)
        hidden = [(seg, r) for seg, r in zip(segments, replies) if isinstance(r[1], tuple)]
        topk = [(seg, r) for seg, r in zip(segments, replies) if not isinstance(r[1], tuple)]
        out = dict(batch)
        if len(self.client.hidden) < len(self.client.names):  # top-k teachers in the set: their columns always
            out = attach_teacher(batch, [seg for seg, _ in topk], [r for _, r in topk], self.client.top_k, keys)
        states: dict[str, torch.Tensor] = {}
        heads: dict[str, TeacherHead] = {}
        for (row, positions), (name, (h, head)) in hidden:
            if heads.setdefault(name, head) is not head:  # its requests straddled a weight update: ask again
                return self.with_teacher(batch)
            if name not in states:
                states[name] = torch.zeros((*batch[keys[0]].shape, h.shape[-1]), dtype=h.dtype)
            states[name][row, positions] = h
        return {**out, TEACHER_HIDDEN_SET: states, TEACHER_HEAD_SET: heads}


def served_clients(members: dict[str, TeacherSource], *, vocab_size: int) -> RoutedTeacherClients:
    """The clients of the set's members (all served), each server checked first (a top-k member's by its own
    source: served.check_teacher_server; a hidden member's head against the student's)."""
    clients = []
    for name, member in members.items():
        if isinstance(member, ServedTeacher):
            member.client = member.checked_client(vocab_size)
        else:  # a hidden member: its head must score over the student's vocabulary
            member.client = teacher_client(member.args, member.url, HIDDEN_PROTOCOL)
            check_hidden_head(member.client, name, member.args, vocab_size)
        clients.append(member.client)
    return RoutedTeacherClients(list(members), clients, next(iter(members.values())).args.kd_teacher_top_k)


def check_hidden_head(client: HiddenClient, name: str, args: Any, vocab_size: int) -> None:
    """A hidden teacher of a set scores over the student's vocabulary: its head has the student's rows (or, with
    kd_vocab_size, at least that many real ones); anything else is one line before the first step."""
    client.wait_until_ready()
    rows = client.head().weight.shape[0]
    need = args.kd_vocab_size
    if (need is None and rows != vocab_size) or (need is not None and rows < need):
        raise ValueError(
            f"served teacher {name!r} (kd_teacher_url={client.url}, protocol 'hidden') has a head of {rows} rows and "
            f"the student's has {vocab_size}: in a set of served teachers a hidden teacher's head must match the "
            f"student's (or set kd_vocab_size to the real tokens); serve it alone, or ask it for top-k"
        )
