"""Every loss hyper-parameter in one dataclass, validated once.

The fused ops, the reference and the patched forward all take a
:class:`KDLossConfig` (or its fields as keyword arguments), so a bad value is
rejected in one place with one message instead of deep inside a kernel.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

REDUCTIONS = ("batchmean", "sum", "none")
# sampled-token estimators of KL(student || teacher), on labels that are tokens sampled from the student
ESTIMATORS = ("pg", "k1", "k2", "k3")
TAIL_POLICIES = ("bucket", "renormalize", "none")


def check_shared_options(cfg: Any) -> None:
    """Validate the options every loss config shares (this KDLossConfig and align's CrossTokenizerConfig): beta,
    temperature, reduction, the soft / hard weights, the soft-caps, chunk_size and ignore_index."""
    if not (isinstance(cfg.beta, (int, float)) and 0.0 <= cfg.beta <= 1.0):
        raise ValueError(f"beta must be a number in [0, 1] (0 = forward KL, 1 = reverse KL); got beta={cfg.beta!r}")
    if not (isinstance(cfg.temperature, (int, float)) and math.isfinite(cfg.temperature) and cfg.temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0; got temperature={cfg.temperature!r}")
    if cfg.reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; got reduction={cfg.reduction!r}")
    for name in ("soft_weight", "hard_weight"):
        check_weight(cfg, name)
    if cfg.soft_weight == 0 and cfg.hard_weight == 0:
        raise ValueError("soft_weight and hard_weight are both 0, so the loss would be identically 0; set one > 0")
    for name in ("softcap", "teacher_softcap"):
        value = getattr(cfg, name)
        if value is not None and not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{name} must be None or a number > 0 (e.g. 30.0 for Gemma-2); got {name}={value!r}")
    if cfg.chunk_size is not None and not (isinstance(cfg.chunk_size, int) and cfg.chunk_size > 0):
        raise ValueError(f"chunk_size must be None (automatic) or an int > 0; got chunk_size={cfg.chunk_size!r}")
    if not isinstance(cfg.ignore_index, int):
        raise ValueError(f"ignore_index must be an int; got ignore_index={cfg.ignore_index!r}")


def check_grad_chunk_size(grad_chunk_size: Any, chunk_size: int | None) -> None:
    """A gradient group is whole chunks: None, or an int > 0 that chunk_size (when given) divides."""
    if grad_chunk_size is None:
        return
    if isinstance(grad_chunk_size, bool) or not (isinstance(grad_chunk_size, int) and grad_chunk_size > 0):
        raise ValueError(
            f"grad_chunk_size must be None (automatic) or an int > 0; got grad_chunk_size={grad_chunk_size!r}"
        )
    if chunk_size is not None and grad_chunk_size % chunk_size:
        raise ValueError(
            f"grad_chunk_size={grad_chunk_size} must be a multiple of chunk_size={chunk_size} (a gradient group is "
            f"whole chunks); e.g. grad_chunk_size={-(-grad_chunk_size // chunk_size) * chunk_size}"
        )


def require_full_teacher(cfg: Any) -> None:
    """Top-k teacher data cannot serve a sampled-token estimator: the sampled token may be outside the top-k, and
    its teacher log-prob is then unknown (guessing it would change the objective)."""
    if getattr(cfg, "estimator", None) is not None:
        raise ValueError(
            f"estimator={cfg.estimator!r} needs the teacher's log-prob of every sampled token, which top-k teacher "
            f"data do not hold; use a teacher model (or estimator=None, the full divergence on the top-k)"
        )


def check_fp8_options(cfg: Any) -> None:
    """teacher_logits_fp8 / student_logits_fp8 are bools and apply to the full-vocabulary chunk loop only."""
    for name in ("teacher_logits_fp8", "student_logits_fp8"):
        value = getattr(cfg, name)
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False; got {name}={value!r}")
        if value and cfg.estimator is not None:
            raise ValueError(
                f"{name}=True puts the fused loss's logit products in FP8, but estimator={cfg.estimator!r} scores one "
                f"sampled token per row without them; set {name}=False or estimator=None"
            )


def check_importance_cap(cap: Any, estimator: str | None = "pg", name: str = "importance_cap") -> None:
    """`name` (importance_cap): None, or a finite number >= 1 (a cap below 1 would truncate fresh tokens, whose
    ratio is 1), and only with the "pg" estimator (the only one weighed by an importance ratio)."""
    if cap is None:
        return
    if isinstance(cap, bool) or not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap >= 1):
        raise ValueError(f"{name} must be None or a finite number >= 1 (the largest importance ratio a token may "
                         f"weigh; 1 is a fresh token's); got {name}={cap!r}")  # fmt: skip
    if estimator != "pg":
        raise ValueError(
            f"{name}={cap!r} bounds the importance ratio of estimator 'pg', and estimator={estimator!r} has none: set "
            f"estimator='pg' or {name}=None"
        )


def check_weight(cfg: Any, name: str) -> None:
    value = getattr(cfg, name)
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0; got {name}={value!r}")


@dataclass(frozen=True)
class KDLossConfig:
    """Hyper-parameters of the distillation objective.

    total = soft_weight * KD(student, teacher) + hard_weight * CE(student at T=1, labels)

    beta: generalized-JSD interpolation, TRL / Liger convention: 0 is forward KL(teacher || student),
        1 is reverse KL(student || teacher), anything in between is
        beta * KL(P || M) + (1 - beta) * KL(S || M) with M = beta * P + (1 - beta) * S.
    temperature: both distributions are softmax(logits / temperature). The loss is not rescaled by T**2.
    ignore_index: label value whose row contributes nothing.
    reduction: "batchmean" (sum over vocab, mean over non-ignored rows, or sum / num_items_in_batch
        when that is given), "sum", or "none" (one value per row).
    soft_weight / hard_weight: weights of the KD term and of the hard-label cross-entropy.
    softcap: final-logit soft-capping (tanh(x / c) * c) of the student, as Gemma-2/3 apply it; None for none.
    teacher_softcap: the teacher's own soft-capping; None for none. The two are independent because teacher and
        student may be different architectures (the patched forward reads each from its model's config).
    chunk_size: rows per chunk of the fused loss; None lets the op choose from the shapes and free memory.
    grad_chunk_size: rows per gradient group of the full-vocabulary and top-k fused losses: the gradients of that
        many rows (whole chunks) are gathered in one buffer of the input dtype, then the input- and
        weight-gradient products run once on them. The weight-gradient product writes the whole V x H gradient
        each time it runs, so fewer, larger products move fewer bytes; the chunks get smaller for the same memory.
        None: chunk_size when that is given, else chosen with it (groups on a GPU with fp32_weight_grad, where
        they were measured to pay; with the weight's own dtype they do not, and each chunk runs its products).
        Given without chunk_size, it is split into equal chunks that fit beside it (and rounded up to whole ones).
    tail: with top-k teacher log-probs, how the mass outside the top-k is treated
        ("bucket", "renormalize" or "none"; see `losses.fused_linear_topk_kd`).
    fp32_weight_grad: accumulate the lm_head weight gradient in float32 across chunks
        (one extra V x H float32 buffer; more exact for long inputs in bf16).
    vocab_size: the number of leading lm_head rows that are real tokens (e.g. len(tokenizer)); both
        distributions and the CE term are taken over ids [0, vocab_size) only, so heads padded to different
        sizes (Qwen2.5 151936 / 152064 rows, Gemma-3 262144 / 262208) can be distilled into each other.
        None: the whole head, and the two heads must have one size.
    estimator: None (the default) scores the full-vocabulary generalized JSD above. "pg", "k1", "k2" or "k3"
        instead scores only each row's label, which must be a token sampled from the student (on-policy
        rollouts): the sampled-token estimators of KL(student || teacher) of `reference.kl_estimator_terms`
        ("pg": the policy gradient of the per-token reverse KL). They take the models' own distributions
        (temperature 1); beta and tail do not apply.
    importance_cap: estimator "pg" with behaviour log-probs (rollouts from an engine whose weights may be stale):
        truncate the importance ratio rho = q / b at C, min(rho, C) (truncated importance sampling), bounding each
        token's weight. Unbiased while every ratio is <= C (fresh weights: rho = 1); biased where the cap binds
        (reference.policy_gradient_terms). None: unbounded.
    teacher_logits_fp8: the teacher's logit product of the fused loss in FP8 (e4m3, one scale per hidden row and
        per vocabulary row, fp32 accumulation; ops/fp8_logits.py says what the rounding does); the teacher's
        distribution moves by the rounding, nothing else changes. Needs FP8 products (Ada / Hopper GPUs, or the
        CPU, slowly) and a teacher model (top-k teacher data have no product).
    student_logits_fp8: the student's forward logit product in FP8 likewise; the backward products stay in the
        input dtype, so the gradient is dLoss/dlogits at the FP8 logits chained through the unquantised head (a
        straight-through estimator of the rounding).
    """

    beta: float = 0.5
    temperature: float = 1.0
    ignore_index: int = -100
    reduction: str = "batchmean"
    soft_weight: float = 1.0
    hard_weight: float = 0.0
    softcap: float | None = None
    teacher_softcap: float | None = None
    chunk_size: int | None = None
    grad_chunk_size: int | None = None
    tail: str = "bucket"
    fp32_weight_grad: bool = False
    vocab_size: int | None = None
    estimator: str | None = None
    importance_cap: float | None = None
    teacher_logits_fp8: bool = False
    student_logits_fp8: bool = False

    def __post_init__(self) -> None:
        check_shared_options(self)
        check_fp8_options(self)
        check_grad_chunk_size(self.grad_chunk_size, self.chunk_size)
        if self.estimator is not None and self.grad_chunk_size is not None:
            raise ValueError(
                f"grad_chunk_size={self.grad_chunk_size} gathers full-vocabulary gradients, and estimator="
                f"{self.estimator!r} scores one token a row, with no such gradient: leave grad_chunk_size=None"
            )
        if self.estimator is not None:
            if self.estimator not in ESTIMATORS:
                raise ValueError(f"estimator must be None or one of {ESTIMATORS}; got estimator={self.estimator!r}")
            if self.temperature != 1.0:
                raise ValueError(
                    f"estimator={self.estimator!r} scores sampled tokens under the models' own distributions, so it "
                    f"takes temperature=1; got temperature={self.temperature!r}"
                )
        check_importance_cap(self.importance_cap, self.estimator)
        if self.tail not in TAIL_POLICIES:
            raise ValueError(f"tail must be one of {TAIL_POLICIES}; got tail={self.tail!r}")
        if self.vocab_size is not None and not (
            isinstance(self.vocab_size, int) and not isinstance(self.vocab_size, bool) and self.vocab_size > 0
        ):
            raise ValueError(
                f"vocab_size must be None (the whole lm_head) or an int > 0, e.g. len(tokenizer); "
                f"got vocab_size={self.vocab_size!r}"
            )

    def replace(self, **changes: Any) -> KDLossConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def build(cls, config: Any = None, **given: Any) -> Any:
        """The one rule for merging a config with keyword options (every loss function, module and patch uses it).

        Keywords that are None were not given. With no `config`: the defaults with the given keywords applied.
        With a `config`: a given keyword equal to the config's value is fine; one that differs is a ValueError
        naming the option and both values, never a silent choice of one of them. A config field that is None
        (an option whose default is None: vocab_size, softcap, chunk_size, ...) holds no value, so a given
        keyword fills it in. Unknown names are a ValueError.
        """
        return merge_options(cls, config, given)


def merge_options(cls: type, config: Any, given: dict[str, Any]) -> Any:
    """`KDLossConfig.build`'s rule for any frozen config dataclass `cls` (align's CrossTokenizerConfig too)."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} option(s) {unknown}; valid options are {sorted(known)}")
    given = {k: v for k, v in given.items() if v is not None}
    if config is None:
        return cls(**given)
    if not isinstance(config, cls):
        raise ValueError(f"config must be a {cls.__name__}; got {type(config).__name__}")
    for name, value in given.items():
        held = getattr(config, name)
        if held is not None and held != value:
            raise ValueError(f"{name}={value!r} conflicts with config.{name}={held!r}; pass one or the other")
    fill = {k: v for k, v in given.items() if getattr(config, k) is None}
    return dataclasses.replace(config, **fill) if fill else config


def override_options(config: Any, changes: dict[str, Any]) -> Any:
    """A copy of `config` with `changes` (None: unchanged) replacing its values: for a deliberate per-call
    override of options set earlier (the patched forward's `kd_config` dict), not for merging two sources."""
    known = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise ValueError(f"unknown {type(config).__name__} option(s) {unknown}; valid options are {sorted(known)}")
    changes = {k: v for k, v in changes.items() if v is not None}
    return dataclasses.replace(config, **changes) if changes else config
