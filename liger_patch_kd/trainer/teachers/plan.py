"""The run's teacher, resolved once: `resolve_teacher` reads KDTrainer's arguments (teacher_model, kd_teacher_url,
teacher_tokenizer / kd_teacher_tokenizer, kd_self_distill, the dataset's rows) and returns one TeacherPlan, which
owns everything the teacher decides: the collator, the columns the Trainer keeps, the vocabulary of the loss, the
refusals of the model spread, the preparation of the teacher models and, once the student is prepared, the run's
TeacherSource (base.py).

A teacher is a member of one kind, each a file, built from its own arguments (base.Member) by `KINDS` below:

    in process   a teacher_model here (in_process.py)
    self         the student itself (self_distill.py)
    stored       rows that carry their teacher's data (stored.py); a rollout store's rows (offline_onpolicy/)
    served       top-k or samples behind kd_teacher_url (served.py)
    hidden       a served teacher's hidden states and head (served_hidden.py)

and a member of another tokenizer is a wrapper of the in-process, stored or served member
(other_tokenizer.py: OtherTokenizerTeacher; OTHER_TOKENIZER_WRAPS). A run has a set of members: one member is the
usual set; several by name (teacher_model={name: model}, kd_teacher_url={name: url}, stored rows naming their
teacher) are one MemberSet (member_set.py: `set_of` reads them, each member built by KINDS as one alone is). Kinds
compose, none inherits from another: a served member is the fetch of its server's reply plus the stored member
that scores the rows (served.py: `rows`), the student itself the in-process member behind its own check. `KINDS`
is where a kind is built and `kind_of` where it is chosen: a new kind is a source file, one entry and one branch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ...batch.columns import (
    CROSS_TOKENIZER_COLUMNS,
    POSITION_IDS,
    PRIVILEGED_COLUMNS,
    PROMPT_COLUMNS,
    ROUTING_COLUMNS,
    TEACHER_DATA_COLUMNS,
)
from ...batch.privileged import PrivilegedCollator, is_privileged_row
from ...batch.prompts import PromptOrTokenCollator
from ...batch.teacher_data import TeacherDataCollator
from ...config import KDLossConfig
from ..dataset_setup import (
    check_chat_template,
    check_prompts_leave_completions,
    check_store_tokenizer,
    check_training_rows,
    first_row_is,
    first_row_is_prompt,
    first_row_of,
    named_evaluations,
    prompt_collator,
    with_vocab_size,
)
from ..offline_onpolicy import OfflineRollouts
from .base import Member, TeacherSource
from .compute import prepare_teacher_compute
from .in_process import InProcessTeacher
from .member_set import MemberSet, set_of
from .other_tokenizer import CrossTokenizerSetup, OtherTokenizerTeacher, cross_tokenizer_enabled
from .routes import TeacherRoutes
from .self_distill import SelfDistillTeacher, self_distill_teacher
from .served import ServedTeacher, say_unused_server_options
from .served_hidden import HIDDEN_PROTOCOL, ServedHiddenTeacher
from .stored import StoredTeacher


@dataclass
class TeacherPlan:
    """The resolved teacher of one KDTrainer run (see the module docstring). `kind` names the entry of KINDS that
    builds its source; `teacher_model` is the one in-process teacher (frozen and placed by `source`); a set's
    members (`members`, routed by `routes`) become `teacher_set` there."""

    args: Any
    kind: str
    kd_config: KDLossConfig
    teacher_model: nn.Module | None
    routes: TeacherRoutes | None = None  # several named members: which each row learns from
    members: dict[str, Member] | None = None  # their own arguments (in process, served, or stored rows)
    xtok: CrossTokenizerSetup | None = None  # one teacher of another tokenizer
    offline: OfflineRollouts | None = None  # a rollout store
    prompt_rows: bool = False  # TRL's prompt / completion / messages rows
    tokenizer: Any = None  # the student's (processing_class)
    columns: list[str] = field(default_factory=list)  # the dataset columns the Trainer must keep
    teacher_set: MemberSet | None = None  # the set's source, made by `source`

    def check_spread(self, accelerator: Any, student: nn.Module) -> None:
        """Refusals that depend on how accelerate spreads the models (FSDP1 and ZeRO-3 across tokenizers), before
        anything is sharded."""
        if self.xtok is not None:
            self.xtok.check_spread(accelerator, (student, self.teacher_model))

    def source(self, student: nn.Module, freeze: Callable[[nn.Module], nn.Module]) -> TeacherSource:
        """The run's TeacherSource, its models prepared: the self-distilling student's teacher made from the
        prepared `student`, every in-process teacher frozen and placed by `freeze` (KDTrainer's: eval mode, no
        grad, the teacher kernels, sharded like the student), its compute options applied (compute.py)."""
        args = self.args
        if args.kd_self_distill:
            if self.teacher_model is not None:
                raise ValueError("kd_self_distill makes the student its own teacher; do not pass teacher_model")
            self.teacher_model = self_distill_teacher(args.kd_self_distill, student)  # self_distill.py
        elif self.teacher_model is not None:
            self.teacher_model = freeze(self.teacher_model)
        for member in (self.members or {}).values():
            member.model = None if member.model is None else freeze(member.model)
        members = tuple(m.model for m in (self.members or {}).values() if m.model is not None)
        prepare_teacher_compute(args, self.teacher_model, members)
        return self.member_source(self.kind, Member(self.teacher_model, args.kd_teacher_url,
                                                    args.kd_teacher_protocol, self.xtok))  # fmt: skip

    def member_set(self, fused: bool) -> MemberSet:
        """The set's source: each member's own (KINDS, as one alone would be), routed by `routes`."""
        members = {name: self.member_source(member_kind(member), member) for name, member in self.members.items()}
        self.teacher_set = MemberSet(self.routes, members, fused)
        return self.teacher_set

    def member_source(self, kind: str, member: Member) -> TeacherSource:
        """One member's source: its kind's (KINDS), wrapped when the member is of another tokenizer."""
        source = KINDS[kind](self, member, self.args.use_kd_patch)
        return source if member.xtok is None else OtherTokenizerTeacher(member.xtok, source, self.args.use_kd_patch)

    def check_generation(self, generates: bool) -> None:
        """Steps that sample completions need a teacher to score or to sample them."""
        args = self.args
        if args.kd_seq_kd and self.teacher_model is None:
            raise ValueError("kd_seq_kd samples completions from the teacher: pass teacher_model")
        if generates and self.teacher_model is None and not args.kd_teacher_url:
            raise ValueError(
                f"kd_lmbda={args.kd_lmbda} trains on completions generated during training, which no offline store "
                f"holds: pass teacher_model (or kd_self_distill=True) or kd_teacher_url, or set kd_lmbda=0"
            )


# kind -> its source from one member's arguments, built once the models are prepared (TeacherPlan.source)
KINDS: dict[str, Callable[[TeacherPlan, Member, bool], TeacherSource]] = {
    "set": lambda plan, member, fused: plan.member_set(fused),  # several members by name (member_set.py)
    "rollout store": lambda plan, member, fused: plan.offline.teacher_source(fused),
    "served hidden": lambda plan, member, fused: ServedHiddenTeacher(plan.args, plan.tokenizer, fused, member.url),
    "served": lambda plan, member, fused: ServedTeacher(plan.args, fused, member.url, member.protocol),
    "self": lambda plan, member, fused: SelfDistillTeacher(member.model, fused),
    "in process": lambda plan, member, fused: InProcessTeacher(member.model, fused),
    "stored": lambda plan, member, fused: StoredTeacher(fused),
}
# the kinds a teacher of another tokenizer wraps: its own top-k (stored, served) or its model here
OTHER_TOKENIZER_WRAPS = ("in process", "stored", "served")


def member_kind(member: Member) -> str:
    """The kind of one member from its own arguments: served (top-k / samples, or hidden), in process, stored."""
    if member.url:
        return "served hidden" if member.protocol == HIDDEN_PROTOCOL else "served"
    return "in process" if member.model is not None else "stored"


def kind_of(args: Any, offline: Any, teacher_model: Any) -> str:
    """The one place the kind of a run's one teacher is chosen (an entry of KINDS)."""
    if offline is not None:  # a rollout store's rows (a teacher_model only rescores refreshed ones)
        return "rollout store"
    if args.kd_self_distill:
        return "self"
    return member_kind(Member(teacher_model, args.kd_teacher_url, args.kd_teacher_protocol))


def check_other_tokenizer_wraps(kind: str, args: Any) -> None:
    """A teacher of another tokenizer wraps the kinds whose signal can be aligned across tokenizers; any other is
    refused in one line when the teacher is resolved, before any long work."""
    if kind not in OTHER_TOKENIZER_WRAPS:
        why = {
            "self": f"kd_self_distill={args.kd_self_distill!r}: the student is of its own tokenizer",
            "served hidden": "kd_teacher_protocol='hidden': its hidden states score over the student's vocabulary",
        }
        raise ValueError(
            f"kd_teacher_tokenizer / teacher_tokenizer (a teacher of another tokenizer) wraps a teacher in process, "
            f"stored rows or a served top-k teacher; this run's is {kind!r} ({why.get(kind, kind)}): unset the "
            f"teacher tokenizer, or give a teacher_model or a top-k protocol"
        )


def resolve_teacher(model: nn.Module, teacher_model: Any, args: Any, teacher_tokenizer: Any,
                    kwargs: dict[str, Any]) -> TeacherPlan:  # fmt: skip
    """KDTrainer's arguments -> the run's TeacherPlan. `kwargs` are the Trainer's keyword arguments: their
    data_collator is set to the teacher's (a given one kept, wrapped for routing when several teachers route rows).
    Every check of the teacher against the rows and the models runs here, before any long work."""
    tokenizer, rows = kwargs.get("processing_class"), kwargs.get("train_dataset")
    own_collator = kwargs.get("data_collator") is not None  # a user's collator renders conversations its own way
    found = set_of((model, tokenizer), teacher_model, args, teacher_tokenizer, rows, first_row_of(rows))
    routes, members = found if found is not None else (None, None)  # several members by name (member_set.py)
    if isinstance(teacher_model, (Mapping, nn.ModuleDict)):  # the set's members hold the models
        teacher_model = None
    if args.kd_teacher_url and teacher_model is not None:
        raise ValueError("pass teacher_model or set kd_teacher_url (a teacher server), not both")
    say_unused_server_options(args)
    xtok, kd_config = None, args.kd_loss_config()
    if members is None and cross_tokenizer_enabled(args, teacher_tokenizer):  # one, of another tokenizer
        check_other_tokenizer_wraps(kind_of(args, None, teacher_model), args)
        xtok = CrossTokenizerSetup.build(args, tokenizer, model, teacher_model, teacher_tokenizer=teacher_tokenizer)
        kwargs["data_collator"] = kwargs.get("data_collator") or xtok.collator
    else:
        kd_config = with_vocab_size(kd_config, model, teacher_model, tokenizer)
        for member in (members or {}).values():  # one vocab_size: the members of the student's tokenizer
            if member.model is not None and member.xtok is None:
                kd_config = with_vocab_size(kd_config, model, member.model, tokenizer)
    # a rollout store (offline on-policy): its checks (teacher consistency) before long work, its collator
    evaluation = kwargs.get("eval_dataset")
    offline = OfflineRollouts.setup(args, rows, teacher_model, tokenizer, evaluation, model, kd_config.vocab_size)
    if offline is not None and members is not None:
        raise ValueError(
            f"train_dataset is a rollout store, scored by the one teacher its manifest names, and teacher_model is a "
            f"set of {len(members)} ({sorted(members)}): its rows carry their scores already; pass the scoring teacher "
            f"alone (a refresh rescores with it) or none"
        )
    if offline is not None and kwargs.get("data_collator") is None:
        kwargs["data_collator"] = offline.collator
    check_training_rows(args, kd_config, rows, kwargs.get("data_collator"), teacher_model, evaluation)
    if xtok is not None:  # across tokenizers a store holds the teacher tokenizer's ids
        check_store_tokenizer(xtok.collator.teacher_tokenizer, rows, evaluation, "the teacher's tokenizer")
    elif not (routes is not None and routes.tokenizers):
        check_store_tokenizer(tokenizer, rows, evaluation)
    evaluations = list(evaluation.values()) if isinstance(evaluation, Mapping) else [evaluation]
    if not own_collator:
        named = evaluation.items() if isinstance(evaluation, Mapping) else [("eval_dataset", evaluation)]
        check_chat_template(tokenizer, {"train_dataset": rows, **{n if n == "eval_dataset" else f"eval_dataset[{n!r}]":
                                                                  d for n, d in named}})  # fmt: skip
    prompt_kinds = {first_row_is_prompt(d) for d in (rows, *evaluations) if d is not None}
    kind = "set" if members is not None else kind_of(args, offline if xtok is None else None, teacher_model)
    plan = TeacherPlan(args, kind, kd_config, teacher_model, routes, members, xtok, offline,
                       True in prompt_kinds, tokenizer)  # fmt: skip
    both_kinds = len(prompt_kinds) > 1  # prompt rows and token rows: each batch collated by its kind
    if plan.prompt_rows and kwargs.get("data_collator") is None and tokenizer is not None:  # ours cuts them
        check_prompts_leave_completions(args, tokenizer, [("train_dataset", rows), *named_evaluations(evaluation)])
    kwargs["data_collator"] = teacher_collator(plan, kwargs.get("data_collator"), rows, both_kinds)
    plan.columns = kept_columns(plan)
    return plan


def teacher_collator(plan: TeacherPlan, given: Any, rows: Any, both_kinds: bool = False) -> Any:
    """The run's collator: the one given (or the teacher kind's, set above), else the rows' kind's: TRL's prompt
    rows, rows with the teacher's own prompt, or token rows with their teacher columns padded (HF's default
    padding collator pads no labels); `both_kinds` (the training and evaluation rows are prompt rows and token
    rows): each batch its kind's; wrapped to add each row's routing when several teachers route rows."""
    pad = getattr(plan.tokenizer, "pad_token_id", None)
    pad = 0 if pad is None else pad
    prompts = None
    if given is None and plan.prompt_rows:
        if plan.tokenizer is None:
            raise ValueError("a dataset of prompts needs processing_class=tokenizer to tokenize them")
        prompts = prompt_collator(plan.args, plan.tokenizer)
        given = None if both_kinds else prompts
    if given is None and first_row_is(rows, is_privileged_row):
        given = PrivilegedCollator(pad_token_id=pad)  # the teacher's own token rows
    if given is None:
        given = TeacherDataCollator(pad_token_id=pad)
    if prompts is not None and both_kinds:
        given = PromptOrTokenCollator(prompts, given)
    # each row's 'teacher' / 'teacher_weights' become the batch's mixture
    return plan.routes.collator(given) if plan.routes is not None else given


def kept_columns(plan: TeacherPlan) -> list[str]:
    """The dataset columns the Trainer keeps beside the model's signature: the teacher's data and everything this
    teacher's collator reads."""
    extra = [*TEACHER_DATA_COLUMNS, POSITION_IDS, *(CROSS_TOKENIZER_COLUMNS if plan.xtok is not None else ())]
    extra += list(PROMPT_COLUMNS) if plan.prompt_rows else []
    extra += list(ROUTING_COLUMNS) if plan.routes is not None else []
    extra += list(PRIVILEGED_COLUMNS)
    extra += list(plan.offline.columns) if plan.offline is not None else []  # a rollout store's log-probs
    return extra
