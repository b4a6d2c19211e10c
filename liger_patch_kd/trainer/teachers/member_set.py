"""A run's set of named teachers, one TeacherSource over members of the single kinds (plan.py's KINDS: in process,
stored, served top-k or sampled, served hidden; an in-process member may be of another tokenizer, other_tokenizer.py
wrapping it):

    KDTrainer(teacher_model={"math": m1, "code": m2})     members in process (teacher_tokenizer={name: tokenizer}
                                                          for those of tokenizers of their own)
    kd_teacher_url={"math": url1, "code": url2}           members served (kd_teacher_protocol: one, or {name: ...})
    stored rows with a `teacher` column                   members stored (the names kept for per-teacher figures)

Each row learns from the member its `teacher` column names, or from a mixture (routes.py). How the members combine
follows from what they give the loss, not from a class per combination:

    members in process (their full distributions)      mixed per row, the student run once: mixture_loss.py
    members whose signal rides in the rows             one member per row, one pass per kind of signal: routed_loss.py

A set mixing the two is refused when it is resolved (`set_of`), with the other options no set takes. Served members
are asked about their own rows ahead of the step (set_fetch.py). Logged per member on logging steps:
`kd_soft_loss/<name>` and `kd_top1_agreement/<name>`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from transformers.utils import logging

from ...batch.columns import OFFLINE_MARK_COLUMNS, TEACHER_HIDDEN_SET, TEACHER_MIXTURE
from ...config import KDLossConfig
from .base import KDStepOutput, Member, TeacherSource, require_teacher
from .mixture_loss import live_set_loss
from .routed_loss import routed_rows_loss
from .routes import TeacherRoutes, check_single_teacher, teacher_names_of
from .served_hidden import ServedHiddenTeacher
from .set_fetch import RoutedTeacherPrefetcher, protocol_of, served_clients
from .set_text_rows import TokenizerTeachers

logger = logging.get_logger(__name__)


def set_of(student: tuple[nn.Module, Any], teacher_model: Any, args: Any, teacher_tokenizer: Any,
           rows: Any, first_row: Any) -> tuple[TeacherRoutes, dict[str, Member]] | None:  # fmt: skip
    """The run's set of members by name from KDTrainer's arguments (`student` = (model, tokenizer)), with its
    routing, or None for a run of one teacher (or none), whose several-teacher options are then refused."""
    if isinstance(teacher_model, (Mapping, nn.ModuleDict)):
        members = {name: Member(model=model) for name, model in teacher_model.items()}
    elif isinstance(args.kd_teacher_url, Mapping):
        members = {name: Member(url=url, protocol=protocol_of(args, name)) for name, url in args.kd_teacher_url.items()}
    else:
        check_single_teacher(args, first_row)
        names = stored_member_names(args, rows, first_row, teacher_model)
        if names is None:
            return None
        members = {name: Member() for name in names}
    routes = TeacherRoutes(members, args)
    in_process = [name for name, m in members.items() if m.model is not None]
    check_set_options(args, routes.names, in_process=bool(in_process), teacher_tokenizer=teacher_tokenizer)
    routes.names_only = not in_process and not isinstance(args.kd_teacher_url, Mapping)
    if in_process:  # members of other tokenizers: each given its vocabulary map and collator (its `xtok`)
        routes.tokenizers = TokenizerTeachers.build(members, args, teacher_tokenizer, *student)
    if routes.tokenizers is not None and routes.default is not None:  # mixed distributions across tokenizers
        routes.tokenizers.check_mixture(routes.default, "kd_teacher_weights")
    if not in_process and routes.default is not None and sum(w > 0 for w in routes.default) != 1:
        raise ValueError(
            f"kd_teacher_weights={args.kd_teacher_weights} mixes served teachers; served teachers route rows (one "
            f"teacher per row): a mixture needs every teacher's full distribution, which top-k replies do not hold"
        )
    return routes, members


def check_set_options(args: Any, names: tuple[str, ...], *, in_process: bool, teacher_tokenizer: Any) -> None:
    """What no set takes (the options of one teacher), refused in one line before any long work."""
    refused = {
        "kd_self_distill": args.kd_self_distill, "kd_seq_kd": args.kd_seq_kd, "kd_lmbda > 0": args.kd_lmbda > 0,
        "kd_teacher_url beside in-process teachers": bool(args.kd_teacher_url) and in_process,
        f"kd_teacher_precision={args.kd_teacher_precision!r}": args.kd_teacher_precision != "bf16",
        "kd_teacher_logits_fp8": args.kd_teacher_logits_fp8 and in_process,
        "served teachers of another tokenizer": not in_process and (bool(args.kd_teacher_tokenizer) or
                                                                     teacher_tokenizer is not None),
    }  # fmt: skip
    used = [name for name, on in refused.items() if on]
    if used:
        raise ValueError(
            f"several teachers (teacher_model={{{', '.join(map(repr, names))}: ...}}) are not supported with "
            f"{used} yet; several teachers run in process (teachers of other tokenizers too: teacher_tokenizer="
            f"{{name: tokenizer}}), or behind kd_teacher_url={{name: url}} sharing the student's tokenizer"
        )


def stored_member_names(args: Any, dataset: Any, first_row: Any, teacher_model: Any) -> list[str] | None:
    """The members of stored rows that name their teacher (teacher.RoutedTeacherData: one store per teacher, or any
    offline dataset with a `teacher` column), kept for the per-teacher figures; or None: the rows are not stored
    rows with a `teacher` column, or another teacher is in play (a live teacher_model, a server, self-distillation,
    another tokenizer), or the names cannot be listed (logged as a warning)."""
    row = first_row if isinstance(first_row, Mapping) else {}
    if row.get("teacher") is None or not any(row.get(c) is not None for c in OFFLINE_MARK_COLUMNS):
        return None
    if teacher_model is not None or args.kd_teacher_url or args.kd_self_distill or args.kd_teacher_tokenizer:
        return None
    names = teacher_names_of(dataset)
    if names is None:
        logger.warning(
            "the offline rows name their teacher (a 'teacher' column) but the dataset does not list the names (use "
            "liger_patch_kd.teacher.RoutedTeacherData, a datasets.Dataset or a list of str names): no per-teacher "
            "kd_soft_loss/<name> figures are logged"
        )
    return names


class MemberSet(TeacherSource):
    """The set's members by name (`members`, each a single-kind TeacherSource), routed per row by `routes` (see the
    module docstring). `models`: the in-process members' models (None when the members are stored or served);
    `tokenizers`: the in-process members of other tokenizers (their text rows), or None."""

    def __init__(self, routes: TeacherRoutes, members: dict[str, TeacherSource], fused: bool) -> None:
        super().__init__(fused)
        self.routes, self.members, self.names = routes, members, routes.names
        self.tokenizers: TokenizerTeachers | None = routes.tokenizers
        live = [name for name, member in members.items() if member.in_process]
        if live and len(live) != len(members):  # set_of refuses this from the arguments; members built otherwise
            raise ValueError(
                f"a teacher set mixes members in process {live} with members whose signal rides in the rows "
                f"{sorted(set(members) - set(live))}: give every member in process, or every member served or stored"
            )
        self.models = {name: member.model for name, member in members.items()} if live else None
        self.served = [name for name, member in members.items() if member.fetches]
        self.from_rows = not live and not self.served  # stored rows: evaluation rows must carry their data too
        self.heads = {name: m.head for name, m in members.items() if isinstance(m, ServedHiddenTeacher)}
        self.clients = None  # the served members' clients, made (their servers checked) for the first DataLoader

    def dataloader(self, dataloader, student_vocab_size):
        # not self.prefetcher: generated rows name no member, so the served members do not score them
        return self.asking(dataloader, student_vocab_size) if self.served else dataloader

    def eval_dataloader(self, dataloader, student_vocab_size):
        return self.asking(dataloader, student_vocab_size, ahead=False) if self.served else dataloader

    def asking(self, dataloader, student_vocab_size, ahead: bool = True) -> RoutedTeacherPrefetcher:
        if self.clients is None:
            self.clients = served_clients(self.members, vocab_size=student_vocab_size())
        return self.clients.prefetched(dataloader, ahead=ahead)

    def prepare(self, inputs: dict) -> dict:
        """Members in process need nothing of the batch; the others' rows carry top-k / sampled columns, hidden
        members' states (TEACHER_HIDDEN_SET), or both."""
        if self.models is not None or inputs.get(TEACHER_HIDDEN_SET):
            return inputs
        require_teacher(inputs, has_model=False)
        return inputs

    def loss(self, model, inputs: dict, num_items_in_batch, cfg: KDLossConfig, log_now: bool,
             behaviour=None) -> KDStepOutput:  # fmt: skip
        if self.models is None:
            return routed_rows_loss(model, inputs, self.routes, self.heads, num_items_in_batch, cfg, log_now,
                                    self.fused, behaviour)  # fmt: skip
        weights = inputs.pop(TEACHER_MIXTURE, None)
        if weights is None:
            raise ValueError(
                f"the batch has no '{TEACHER_MIXTURE}' (keys: {sorted(inputs)}); with several teachers KDTrainer wraps "
                f"the data collator to add it from each row's 'teacher' / 'teacher_weights' column"
            )
        outputs = live_set_loss(model, self.models, self.tokenizers, self.routes.mixture, inputs, weights,
                                num_items_in_batch, cfg, self.fused, log_now)  # fmt: skip
        return KDStepOutput(outputs.loss, outputs.kd_soft_loss, outputs.kd_hard_loss, None, outputs,
                            outputs.kd_teacher_metrics)  # fmt: skip
