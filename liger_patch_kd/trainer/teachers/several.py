"""Several teachers in KDTrainer: `KDTrainer(teacher_model={"math": m1, "code": m2})`.

Each row says whom it learns from: a `teacher` column (the teacher's name, or its index in the dict's order) routes
it to that teacher; a `teacher_weights` column ({"math": 0.3, "code": 0.7}, or one weight per teacher in order)
scores it against that mixture; a row with neither gets `kd_teacher_weights` (one mixture for every row), and
without that is an error. The collator turns these columns into a (B, J) `teacher_mixture` tensor; the loss is
models.teachers (the mixture of distributions by default, `kd_teacher_mixture="loss"` for the mixture of losses).
Logged per teacher: `kd_soft_loss/<name>` and `kd_top1_agreement/<name>` (see models/teachers.py). Teachers with
tokenizers of their own (teacher_tokenizer={name: tokenizer}): trainer/teachers/several_tokenizers.py.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...batch.columns import (
    ROUTING_COLUMNS,
    TEACHER_INPUT_IDS,
    TEACHER_MIXTURE,
    TEACHER_SAMPLE_IDS,
    TEACHER_TOKEN_IDS,
    TEACHER_WEIGHTS,
)
from ...batch.prompts import PromptCollator
from ...batch.routing import RoutingCollator
from ...config import KDLossConfig
from ...models import TeacherSet, unwrap_model
from ...models.kd_io import targets_of
from ...models.materialised import materialised_kd
from ...models.signals import Scored, TeacherMix
from ...reference import MIXTURES
from ..arguments import checks_arguments
from .base import KDStepOutput, TeacherSource
from .several_tokenizers import TokenizerTeachers
from .several_tokenizers_loss import tokenizer_teachers_loss

WEIGHT_SUM_TOLERANCE = 1e-3  # a row's weights must sum to 1, up to the rounding of weights written as decimals


@checks_arguments(rank=1)  # before the served checks: kd_teacher_url as a dict is refused there
def check_teacher_set_args(args: Any) -> None:
    """The several-teacher options of KDTrainingArguments, checked when the arguments are made."""
    if args.kd_teacher_mixture not in MIXTURES:
        raise ValueError(f"kd_teacher_mixture must be one of {MIXTURES}; got {args.kd_teacher_mixture!r}")
    urls = args.kd_teacher_url
    if isinstance(urls, Mapping) and not (urls and all(isinstance(k, str) and k and isinstance(v, str) and v
                                                       for k, v in urls.items())):  # fmt: skip
        raise ValueError(f"kd_teacher_url as a dict names each served teacher's URL: {{'name': url}}; got {urls!r}")
    weights = args.kd_teacher_weights
    if weights is None:
        return
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError(f"kd_teacher_weights must be a dict {{teacher name: weight}}; got {weights!r}")
    _check_mixture("kd_teacher_weights", [float(w) for w in weights.values()])


def check_single_teacher(args: Any, first_row: Any) -> None:
    """A run of one teacher (or none) given the several-teacher options: refused, as they would be ignored."""
    if args.kd_teacher_weights is not None:
        raise ValueError(
            f"kd_teacher_weights={args.kd_teacher_weights} mixes several teachers, but this run has one (or none): "
            f"pass teacher_model={{name: model, ...}} (or kd_teacher_url={{name: url}}), or unset kd_teacher_weights"
        )
    row = first_row if isinstance(first_row, Mapping) else {}
    given = [c for c in ROUTING_COLUMNS if row.get(c) is not None]
    offline = row.get(TEACHER_TOKEN_IDS) is not None or row.get(TEACHER_SAMPLE_IDS) is not None
    if offline and given == ["teacher"]:  # teacher.RoutedTeacherData: the row's top-k is its own teacher's already
        return
    if given:
        raise ValueError(
            f"the rows carry {given} (routing rows to several teachers), but this run has one teacher (or none): "
            f"pass teacher_model={{name: model, ...}}, or drop the column(s)"
        )


def _check_mixture(what: str, weights: list[float]) -> None:
    if not all(math.isfinite(w) and w >= 0 for w in weights) or abs(sum(weights) - 1) > WEIGHT_SUM_TOLERANCE:
        raise ValueError(f"{what} must be finite weights >= 0 that sum to 1 (a mixture of the teachers); got {weights}")


class TeacherSetSetup:
    """The named teachers of a KDTrainer run, their default mixture and the routing of rows to them."""

    def __init__(
        self, teachers: Mapping[str, nn.Module | None], args: Any, teacher_tokenizer: Any = None,
        student: tuple[nn.Module | None, Any] = (None, None), served: bool = False,
    ) -> None:  # fmt: skip
        """`teachers`: name -> in-process model; `served`: the names of kd_teacher_url's servers (no models).
        `teacher_tokenizer` / kd_teacher_tokenizer: {name: tokenizer} for teachers with their own (aligned with
        `student` = (model, tokenizer): trainer/teachers/several_tokenizers.py)."""
        names = list(teachers)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"teacher_model as a dict needs non-empty str names for its teachers; got {names}")
        refused = {
            "kd_self_distill": args.kd_self_distill, "kd_seq_kd": args.kd_seq_kd, "kd_lmbda > 0": args.kd_lmbda > 0,
            "kd_teacher_url beside in-process teachers": bool(args.kd_teacher_url) and not served,
            f"kd_teacher_precision={args.kd_teacher_precision!r}": args.kd_teacher_precision != "bf16",
            "kd_teacher_logits_fp8": args.kd_teacher_logits_fp8 and not served,
            "served teachers of another tokenizer": served and (bool(args.kd_teacher_tokenizer) or
                                                                 teacher_tokenizer is not None),
        }  # fmt: skip
        used = [name for name, on in refused.items() if on]
        if used:
            raise ValueError(
                f"several teachers (teacher_model={{{', '.join(map(repr, names))}: ...}}) are not supported with "
                f"{used} yet; several teachers run in process (teachers of other tokenizers too: teacher_tokenizer="
                f"{{name: tokenizer}}), or behind kd_teacher_url={{name: url}} sharing the student's tokenizer"
            )
        self.served = served  # served: each row's top-k comes from its server, and trains as offline data
        self.models = None if served else dict(teachers)
        self.names = tuple(names)
        self.mixture = args.kd_teacher_mixture
        self.tokenizers = (
            None if served else TokenizerTeachers.build(names, teachers, args, teacher_tokenizer, *student)
        )
        self.default = None
        if args.kd_teacher_weights is not None:
            self.default = self.weights_from("kd_teacher_weights", args.kd_teacher_weights)
            if self.tokenizers is not None:  # a mixture of distributions across tokenizers: refused now, not later
                self.tokenizers.check_mixture(torch.tensor(self.default), "kd_teacher_weights")
        if served and self.default is not None and sum(w > 0 for w in self.default) != 1:
            raise ValueError(
                f"kd_teacher_weights={args.kd_teacher_weights} mixes served teachers; served teachers route rows (one "
                f"teacher per row): a mixture needs every teacher's full distribution, which top-k replies do not hold"
            )

    def index_of(self, teacher: Any) -> int:
        """A row's `teacher` value (a name, or an index in the dict's order) -> its index; anything else raises."""
        if isinstance(teacher, str):
            if teacher not in self.names:
                raise ValueError(f"a row's teacher={teacher!r} is not one of the teachers {list(self.names)}")
            return self.names.index(teacher)
        if isinstance(teacher, torch.Tensor) and teacher.numel() == 1 and not teacher.is_floating_point():
            teacher = int(teacher)
        if isinstance(teacher, numbers.Integral) and not isinstance(teacher, bool) and 0 <= teacher < len(self.names):
            return int(teacher)  # numpy ints too (a datasets column read with format="numpy")
        raise ValueError(
            f"a row's teacher={teacher!r} must be a teacher's name {list(self.names)} or its index in [0, "
            f"{len(self.names)})"
        )

    def weights_from(self, what: str, given: Any) -> list[float]:
        """{name: weight} (missing names weigh 0) or one weight per teacher, in order -> J weights summing to 1."""
        if isinstance(given, Mapping):
            unknown = sorted(set(given) - set(self.names))
            if unknown:
                raise ValueError(f"{what} names unknown teacher(s) {unknown}; the teachers are {list(self.names)}")
            # a datasets struct column fills a teacher a row leaves out with None: that teacher weighs 0 there
            weights = [float(0.0 if given.get(name) is None else given[name]) for name in self.names]
        else:
            weights = [float(w) for w in given]
            if len(weights) != len(self.names):
                raise ValueError(
                    f"{what} has {len(weights)} weights for {len(self.names)} teachers {list(self.names)}; give one "
                    f"per teacher in that order, or a dict {{name: weight}}"
                )
        _check_mixture(what, weights)
        return weights

    def row_weights(self, row: Mapping[str, Any]) -> list[float]:
        teacher, weights = row.get("teacher"), row.get(TEACHER_WEIGHTS)
        if teacher is not None and weights is not None:
            raise ValueError("a row gives both 'teacher' (routing) and 'teacher_weights' (a mixture); give one")
        if teacher is not None:
            one_hot = [0.0] * len(self.names)
            one_hot[self.index_of(teacher)] = 1.0
            return one_hot
        if weights is not None:
            return self.weights_from("a row's teacher_weights", weights)
        if self.default is None:
            raise ValueError(
                f"a row has neither a 'teacher' nor a 'teacher_weights' column and kd_teacher_weights is not set: "
                f"say which of the teachers {list(self.names)} each row learns from, or set kd_teacher_weights"
            )
        return self.default

    def student_vocab_teachers(self) -> list[nn.Module]:
        """The in-process teachers sharing the student's tokenizer (their heads must hold its real ids)."""
        cross = self.tokenizers.cross if self.tokenizers is not None else {}
        return [model for name, model in (self.models or {}).items() if name not in cross]

    def collator(self, inner) -> RoutingCollator:
        """The run's collator, with the routing columns turned into the (B, J) `teacher_mixture` tensor. With
        teachers of other tokenizers the rows are text, collated by TokenizerTeachers (not `inner`): KDTrainer's
        default PromptCollator for such rows is replaced, anything else refused."""
        if self.tokenizers is not None and not isinstance(inner, PromptCollator):
            raise ValueError(
                f"teachers of other tokenizers ({sorted(self.tokenizers.cross)}) read each row's text: give rows of "
                f"text ('prompt' + 'completion', or 'messages') and no data_collator (KDTrainer tokenizes each row "
                f"for the student and for each teacher); got data_collator={type(inner).__name__}"
            )
        return RoutingCollator(self, inner)

    def routed_metrics(self, inputs: dict, routes: torch.Tensor, score, ignore_index: int) -> dict[str, torch.Tensor]:
        """Served teachers' figures: `score(batch) -> (soft, agreement)` on the batch with the labels of every row
        (token, when packed) routed elsewhere ignored, one no-grad call per teacher (on logging steps only).
        kd_soft_loss/<name> is that batch's mean over its own rows' tokens."""
        labels = inputs["labels"]
        owner = routes.argmax(-1).to(labels.device)  # one-hot rows: the teacher each row (token) was asked of
        owner = owner[:, None].expand_as(labels) if owner.dim() == 1 else owner
        figures = {}
        for j, name in enumerate(self.names):
            soft, agreement = score({**inputs, "labels": torch.where(owner == j, labels, ignore_index)})
            figures[f"kd_soft_loss/{name}"] = soft.detach().float()
            figures[f"kd_top1_agreement/{name}"] = torch.zeros(()) if agreement is None else agreement.detach().float()
        return figures

    def loss(self, model: nn.Module, inputs: dict, num_items_in_batch, cfg: KDLossConfig, fused: bool, log: bool):
        """The KD forward against the teacher set (fused through the patched model, else on materialised logits)."""
        weights = inputs.pop(TEACHER_MIXTURE, None)
        if weights is None:
            raise ValueError(
                f"the batch has no '{TEACHER_MIXTURE}' (keys: {sorted(inputs)}); with several teachers KDTrainer wraps "
                f"the data collator to add it from each row's 'teacher' / 'teacher_weights' column"
            )
        if self.tokenizers is not None:  # some teachers have their own tokenizers: several_tokenizers_loss.py
            return tokenizer_teachers_loss(model, self.models, self.tokenizers, inputs, weights, num_items_in_batch,
                                           cfg, log)  # fmt: skip
        if inputs.get(TEACHER_INPUT_IDS) is not None:  # a teacher's own tokens (other prompt or tokenizer)
            raise ValueError(
                "the batch carries teacher_input_ids (a teacher's own prompt or tokenization), which several "
                "in-process teachers do not read yet: every teacher here scores the student's input_ids"
            )
        if inputs.get(TEACHER_TOKEN_IDS) is not None or inputs.get(TEACHER_SAMPLE_IDS) is not None:
            raise ValueError(
                "batches with teacher_token_ids / teacher_sample_ids (offline data) and several live teachers: pass "
                "one or the other. "
                "Offline rows routed to several teachers are one store whose rows hold each its own teacher's top-k"
            )
        teachers = TeacherSet(self.models, weights, self.mixture)
        if fused:
            return model(
                **inputs, kd_teacher_set=teachers, num_items_in_batch=num_items_in_batch, kd_log_agreement=log,
                kd_config=cfg,
            )  # fmt: skip
        targets = targets_of(inputs.pop("labels"), inputs.pop("shift_labels", None), cfg.ignore_index)
        scored = Scored(targets, cfg, num_items_in_batch, log)
        return materialised_kd(unwrap_model(model), model, TeacherMix(teachers), scored, inputs)


class SeveralTeachers(TeacherSource):
    """Several teachers in process (teacher_model={name: model}), each row routed to one or scored against a
    mixture (`teacher_mixture`), some perhaps of tokenizers of their own: TeacherSetSetup.loss."""

    def __init__(self, teachers: TeacherSetSetup, fused: bool) -> None:
        super().__init__(fused)
        self.teachers = teachers

    def loss(self, model, inputs: dict, num_items_in_batch, cfg: KDLossConfig, log_now: bool,
             behaviour=None) -> KDStepOutput:  # fmt: skip
        outputs = self.teachers.loss(model, inputs, num_items_in_batch, cfg, self.fused, log_now)
        return KDStepOutput(outputs.loss, outputs.kd_soft_loss, outputs.kd_hard_loss, None, outputs,
                            outputs.kd_teacher_metrics)  # fmt: skip
