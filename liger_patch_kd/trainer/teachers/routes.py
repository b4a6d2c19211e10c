"""Which member of a teacher set each row learns from: the set's names, its default mixture, each row's weights.

A set's rows say whom they learn from: a `teacher` column (a member's name, or its index in the set's order) routes
the row to that member; a `teacher_weights` column ({"math": 0.3, "code": 0.7}, or one weight per member in order)
scores it against that mixture; a row with neither gets `kd_teacher_weights` (one mixture for every row), and
without that is an error. The routing collator (batch/routing.py) turns these columns into a (B, J)
`teacher_mixture` tensor; members whose signal rides in the rows (stored, served) take one member per row.
Here also: the several-teacher arguments' checks, the refusal of routing columns in a run of one teacher, and the
names a dataset's routed rows list (the per-teacher figures of stored rows).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ...batch.columns import ROUTING_COLUMNS, TEACHER_SAMPLE_IDS, TEACHER_TOKEN_IDS, TEACHER_WEIGHTS
from ...batch.prompts import PromptCollator
from ...batch.routing import NamesIfGivenCollator, RoutingCollator
from ...reference import MIXTURES
from ..arguments import checks_arguments

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
    check_mixture("kd_teacher_weights", [float(w) for w in weights.values()])


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


def check_mixture(what: str, weights: list[float]) -> None:
    if not all(math.isfinite(w) and w >= 0 for w in weights) or abs(sum(weights) - 1) > WEIGHT_SUM_TOLERANCE:
        raise ValueError(f"{what} must be finite weights >= 0 that sum to 1 (a mixture of the teachers); got {weights}")


def teacher_names_of(dataset: Any) -> list[str] | None:
    """The teacher names a dataset's rows may carry, in a fixed order: RoutedTeacherData's `names`, a datasets
    Dataset's distinct `teacher` values (sorted), a list's (in order of first appearance); None when they cannot be
    listed without reading every row (any other dataset) or are not all str."""
    names = getattr(dataset, "names", None)
    if names is None and callable(getattr(dataset, "unique", None)) and "teacher" in (dataset.column_names or ()):
        names = sorted(dataset.unique("teacher"), key=str)
    elif names is None and isinstance(dataset, Sequence):
        names = list(dict.fromkeys(row.get("teacher") for row in dataset if isinstance(row, Mapping)))
    if not names or not all(isinstance(n, str) and n for n in names):
        return None
    return list(names)


class TeacherRoutes:
    """The names of a teacher set's members, in order, its default mixture (kd_teacher_weights) and each row's
    weights over them (see the module docstring)."""

    def __init__(self, names: Iterable[str], args: Any) -> None:
        names = list(names)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"teacher_model as a dict needs non-empty str names for its teachers; got {names}")
        self.names = tuple(names)
        self.mixture = args.kd_teacher_mixture
        self.default = None
        if args.kd_teacher_weights is not None:
            self.default = self.weights_from("kd_teacher_weights", args.kd_teacher_weights)
        self.tokenizers = None  # members of tokenizers of their own, which collate the rows' text (set_text_rows.py)
        self.names_only = False  # stored rows naming their member: the names kept only for per-member figures

    def collator(self, inner) -> RoutingCollator:
        """The run's collator, with the routing columns turned into the (B, J) `teacher_mixture` tensor. With
        members of other tokenizers the rows are text, collated by `tokenizers` (not `inner`): KDTrainer's default
        PromptCollator for such rows is replaced, anything else refused. Names only: batches whose rows name no
        member (an evaluation store, say) are collated as they would be without them, not refused."""
        if self.tokenizers is not None and not isinstance(inner, PromptCollator):
            raise ValueError(
                f"teachers of other tokenizers ({sorted(self.tokenizers.cross)}) read each row's text: give rows of "
                f"text ('prompt' + 'completion', or 'messages') and no data_collator (KDTrainer tokenizes each row "
                f"for the student and for each teacher); got data_collator={type(inner).__name__}"
            )
        return NamesIfGivenCollator(self, inner) if self.names_only else RoutingCollator(self, inner)

    def index_of(self, teacher: Any) -> int:
        """A row's `teacher` value (a name, or an index in the set's order) -> its index; anything else raises."""
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
        """{name: weight} (missing names weigh 0) or one weight per member, in order -> J weights summing to 1."""
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
        check_mixture(what, weights)
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

    def owners(self, routes: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each label's member (B, T), from a batch's one-hot `teacher_mixture` (B, J), or (B, T, J) when packed."""
        owner = routes.argmax(-1).to(labels.device)
        return owner[:, None].expand_as(labels) if owner.dim() == 1 else owner

    def routed_metrics(self, inputs: dict, routes: torch.Tensor, score, ignore_index: int) -> dict[str, torch.Tensor]:
        """Routed members' figures: `score(batch) -> (soft, agreement)` on the batch with the labels of every row
        (token, when packed) routed elsewhere ignored, one no-grad call per member (on logging steps only).
        kd_soft_loss/<name> is that batch's mean over its own rows' tokens."""
        labels = inputs["labels"]
        owner = self.owners(routes, labels)
        figures = {}
        for j, name in enumerate(self.names):
            soft, agreement = score({**inputs, "labels": torch.where(owner == j, labels, ignore_index)})
            figures[f"kd_soft_loss/{name}"] = soft.detach().float()
            figures[f"kd_top1_agreement/{name}"] = torch.zeros(()) if agreement is None else agreement.detach().float()
        return figures
