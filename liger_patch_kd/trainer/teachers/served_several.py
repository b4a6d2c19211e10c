"""Several served teachers: `kd_teacher_url={"math": url1, "code": url2}`, each row routed to one of them.

Each sequence of a batch is asked of its own row's teacher (the `teacher` column, collated into the one-hot
`teacher_mixture`), all servers in flight at once, `depth` batches ahead like one served teacher
(teacher/client/prefetch.py); the batch then carries each row's own teacher's top-k, and trains as offline data
does (its `teacher_mixture` kept for the per-teacher figures of logging steps). A row weighted over several
served teachers is refused: a mixture needs every teacher's full distribution, and the top-k of each (with
unknown tails) does not give it.

`kd_teacher_protocol` may name one protocol per teacher (`{"math": "hidden", "code": "liger"}`): a "hidden"
teacher's rows get its final hidden states and head (served_hidden.py: the exact objective), the others their
top-k. A batch whose rows mix kinds runs the student's forward once per kind present (the top-k teachers
together, each hidden teacher alone), each pass scoring only its own teacher's tokens (the other labels ignored)
over the whole batch's token count: the sum is the batch's loss, as one pass over one kind would give it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...batch.columns import (
    TEACHER_HEAD_SET,
    TEACHER_HIDDEN_SET,
    TEACHER_HIDDEN_STATES,
    TEACHER_INPUT_IDS,
    TEACHER_MIXTURE,
    TOPK_COLUMNS,
)
from ...config import KDLossConfig
from ...teacher.client import TeacherPrefetcher
from ...teacher.client.hidden_client import HIDDEN_PROTOCOL, HiddenClient
from ...teacher.client.prefetch import STUDENT_KEYS, attach_teacher, keys_of, sequence_tokens
from ...wire.hidden_wire import TeacherHead
from ..arguments import KDTrainingArguments, checks_arguments
from .base import KDStepOutput, TeacherSource, one_teacher_loss
from .routed_offline import RoutedRowsTeacher
from .served import check_teacher_server, check_topk_client_options, prefetched, teacher_client
from .served_hidden import HeadOnDevice, check_hidden_dtype


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
    """One client per named server (a HiddenClient for a "hidden" teacher, else a TeacherClient); `top_k` and
    `wait_until_ready` as one client's."""

    def __init__(self, urls: dict[str, str], args: Any, vocab_size: int) -> None:
        self.names = list(urls)
        self.clients = [teacher_client(args, urls[name], protocol_of(args, name), vocab_size=vocab_size)
                        for name in self.names]  # fmt: skip
        self.top_k = args.kd_teacher_top_k
        self.hidden = [name for name, c in zip(self.names, self.clients) if isinstance(c, HiddenClient)]

    def wait_until_ready(self) -> None:
        for client in self.clients:
            client.wait_until_ready()


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


def checked_routed_clients(args: Any, *, vocab_size: int, tokenizer: Any = None) -> RoutedTeacherClients:
    """The clients of each row's own server (args.kd_teacher_url, a dict), each server checked first
    (served.check_teacher_server, or a hidden teacher's head)."""
    clients = RoutedTeacherClients(dict(args.kd_teacher_url), args, vocab_size)
    for name, client in zip(clients.names, clients.clients):
        if isinstance(client, HiddenClient):
            check_hidden_head(client, name, args, vocab_size)
        else:
            check_teacher_server(client, args, vocab_size=vocab_size, tokenizer=tokenizer)
    return clients


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


class ServedTeachers(TeacherSource):
    """Several served teachers (kd_teacher_url={name: url}): each row's top-k asked of its own row's server ahead
    of the step (the fetch, here), then trained by the routed-rows member (`routed`); batches with a hidden
    teacher's rows by mixed_kinds_loss."""

    from_rows = False  # each row's server is asked about it, evaluation's rows too

    def __init__(self, teachers, args: Any, fused: bool) -> None:
        super().__init__(fused)
        self.args = args
        self.routed = RoutedRowsTeacher(teachers, fused)  # the rows once each carries its own teacher's top-k
        self.clients: RoutedTeacherClients | None = None  # made, the servers checked, for the first DataLoader

    def dataloader(self, dataloader, student_vocab_size):
        # not self.prefetcher: generated rows name no teacher, so several served teachers do not score them
        return self.asking(dataloader, student_vocab_size)

    def eval_dataloader(self, dataloader, student_vocab_size):
        return self.asking(dataloader, student_vocab_size, ahead=False)

    def asking(self, dataloader, student_vocab_size, ahead: bool = True) -> RoutedTeacherPrefetcher:
        if self.clients is None:
            self.clients = checked_routed_clients(self.args, vocab_size=student_vocab_size())
            self.heads = {name: HeadOnDevice() for name in self.clients.hidden}
        return prefetched(dataloader, self.clients, kind=RoutedTeacherPrefetcher, ahead=ahead)

    def prepare(self, inputs: dict) -> dict:
        """A batch's teacher: top-k columns (rows of top-k teachers), hidden teachers' states (TEACHER_HIDDEN_SET), or
        both; a set of hidden teachers alone attaches no top-k columns at all."""
        if inputs.get(TEACHER_HIDDEN_SET):
            return inputs
        return self.routed.prepare(inputs)

    def loss(self, model, inputs: dict, num_items_in_batch, cfg: KDLossConfig, log_now: bool,
             behaviour=None) -> KDStepOutput:  # fmt: skip
        states, heads = inputs.pop(TEACHER_HIDDEN_SET, None), inputs.pop(TEACHER_HEAD_SET, None)
        if not states:  # no hidden teacher's row in this batch: the top-k rows as routed rows
            return self.routed.loss(model, inputs, num_items_in_batch, cfg, log_now, behaviour)
        return mixed_kinds_loss(model, inputs, states, heads, self, num_items_in_batch, cfg, log_now)


def mixed_kinds_loss(model, inputs: dict, states: dict, heads: dict, source: ServedTeachers, num_items_in_batch,
                     cfg: KDLossConfig, log_now: bool) -> KDStepOutput:  # fmt: skip
    """A batch of several served teachers, some hidden: one pass per kind present (the top-k teachers together,
    each hidden teacher alone), each scoring its own teacher's tokens, all over the batch's token count."""
    names = list(source.clients.names)
    routes = inputs.pop(TEACHER_MIXTURE)
    owner = routes.argmax(-1)  # each row's (B) or each position's (B, T) teacher
    owner = owner[:, None].expand_as(inputs["labels"]) if owner.dim() == 1 else owner
    ignore = cfg.ignore_index
    if num_items_in_batch is None:  # each pass's mean would be over its own tokens: give them the batch's count
        scored = inputs["shift_labels"] if "shift_labels" in inputs else inputs["labels"][:, 1:]
        num_items_in_batch = (scored != ignore).sum()
    passes = [([j for j, n in enumerate(names) if n not in states], None)] if TOPK_COLUMNS[0] in inputs else []
    passes += [([names.index(name)], name) for name in states]
    batches = []
    for indices, name in passes:
        mine = torch.isin(owner, torch.tensor(indices, device=owner.device))
        batch = {k: v for k, v in inputs.items() if name is None or k not in TOPK_COLUMNS}
        batch["labels"] = inputs["labels"].masked_fill(~mine, ignore)
        if "shift_labels" in inputs:  # shift_labels[t] is position t + 1's token
            after = torch.cat([mine[:, 1:], mine[:, -1:]], dim=1)
            batch["shift_labels"] = inputs["shift_labels"].masked_fill(~after, ignore)
        batches.append((batch, name, int((batch["labels"] != ignore).sum())))
    # a kind with no token in the batch makes no pass; a batch with no token at all makes the first (loss 0)
    batches = [b for b in batches if b[2]] or batches[:1]
    total, parts = None, []
    for batch, name, count in batches:
        pass_cfg = cfg
        if name is not None:
            batch[TEACHER_HIDDEN_STATES] = states[name]
            pass_cfg = source.heads[name].put(batch, heads[name], cfg)
        step = one_teacher_loss(model, None, batch, num_items_in_batch, pass_cfg, log_now, source.fused)
        parts.append((step, count))
        total = step.loss if total is None else total + step.loss
    first = parts[0][0]
    agreement = None
    if log_now and all(step.agreement is not None for step, _ in parts):  # per token, over every pass's tokens
        count = sum(n for _, n in parts)
        agreement = sum(step.agreement * n for step, n in parts) / max(1, count)
    soft = sum(step.soft for step, _ in parts)
    hard = sum(step.hard for step, _ in parts)
    return KDStepOutput(total, soft, hard, agreement, first.outputs)
