"""A teacher of another tokenizer (kd_teacher_tokenizer set, or KDTrainer(teacher_tokenizer=...); in a set,
{name: tokenizer}): a wrapper around a member of a single kind (OtherTokenizerTeacher), and what it is built from
once: the vocabulary map and collator from KDTrainingArguments' kd_cross_tokenizer_loss, kd_exact_weight,
kd_uld_weight, kd_uld_top_k, kd_unmatched and the shared kd_beta, kd_temperature, kd_soft_weight, kd_hard_weight;
the refusals that depend on how accelerate spreads the models. The loss of one batch is
other_tokenizer_loss.compute_cross_tokenizer_loss (align/ holds the alignment and the loss)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers.utils import logging

from ...align import CrossTokenizerCollator, CrossTokenizerConfig, VocabMap, byte_level_to_text
from ...align.generated import GeneratedRows
from ...batch.columns import TEACHER_ALIGN_GROUPS
from ...config import KDLossConfig
from ...generation.special_tokens import special_ids
from ...models import unwrap_model
from ...models.kd_forward import install_kd_forward
from ..arguments import KDTrainingArguments
from .base import KDStepOutput, TeacherSource
from .other_tokenizer_loss import check_spread, compute_cross_tokenizer_loss, is_registered
from .self_distill import require_teacher_prompt
from .served import ServedTeacher

logger = logging.get_logger(__name__)


def cross_tokenizer_enabled(args: KDTrainingArguments, teacher_tokenizer: Any = None) -> bool:
    """kd_teacher_tokenizer set, or a teacher tokenizer object given to KDTrainer(teacher_tokenizer=...), for a run
    of one teacher (a set takes a dict of tokenizers: trainer/teachers/set_text_rows.py)."""
    for what, value in (("kd_teacher_tokenizer", args.kd_teacher_tokenizer), ("teacher_tokenizer", teacher_tokenizer)):
        if isinstance(value, Mapping):
            raise ValueError(
                f"{what} as a dict names the tokenizers of several teachers (teacher_model={{name: model}}), but this "
                f"run has one teacher (or none): pass that teacher's tokenizer itself"
            )
    return args.kd_teacher_tokenizer is not None or teacher_tokenizer is not None


def check_cross_tokenizer_args(args: KDTrainingArguments) -> None:
    """Options the cross-tokenizer path does not support, refused before training starts. On-policy steps
    (kd_lmbda) are supported (rollouts/retokenized.py); the teacher's own generations (kd_seq_kd) would need
    the student to re-tokenize the teacher's text, and the sampled-token losses need the teacher's log-prob of the
    student's token, which another vocabulary does not have."""
    if args.kd_seq_kd:
        raise ValueError(
            "cross-tokenizer sequence-level KD is not supported: kd_seq_kd=True with kd_teacher_tokenizer (or "
            "teacher_tokenizer=) would train the student on the teacher's ids; set kd_seq_kd=False (student-"
            "generated completions, kd_lmbda > 0, are supported across tokenizers)"
        )
    fp8 = [name for name in ("kd_teacher_logits_fp8", "kd_student_logits_fp8") if getattr(args, name)]
    if fp8:  # the cross-tokenizer loss computes both models' logits itself, in their own dtype
        raise ValueError(
            f"{fp8[0]}=True is not supported across tokenizers (the cross-tokenizer loss takes both models' logits "
            f"unquantised): set {fp8[0]}=False, or distil from a teacher of the student's tokenizer"
        )
    if args.kd_lmbda > 0 and args.kd_onpolicy_loss != "divergence":
        raise ValueError(
            f"kd_onpolicy_loss={args.kd_onpolicy_loss!r} scores the teacher's log-prob of each token the student "
            f"sampled, which a teacher with another tokenizer has no id for; across tokenizers on-policy steps use "
            f"the cross-tokenizer loss (kd_cross_tokenizer_loss): set kd_onpolicy_loss='divergence'"
        )


def is_cross_tokenizer_batch(inputs: dict) -> bool:
    return inputs.get(TEACHER_ALIGN_GROUPS) is not None


def cross_tokenizer_config(args: KDTrainingArguments) -> CrossTokenizerConfig:
    """The loss options from KDTrainingArguments (the cross-tokenizer fields and the shared kd_* ones)."""
    return CrossTokenizerConfig(
        kind=args.kd_cross_tokenizer_loss, exact_weight=args.kd_exact_weight, uld_weight=args.kd_uld_weight,
        uld_top_k=args.kd_uld_top_k, unmatched=args.kd_unmatched, beta=args.kd_beta, temperature=args.kd_temperature,
        soft_weight=args.kd_soft_weight, hard_weight=args.kd_hard_weight,
    )  # fmt: skip


def _pad_id(tokenizer) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if pad is not None else (getattr(tokenizer, "eos_token_id", None) or 0)


def teacher_eos_id(teacher_tokenizer: Any, teacher_model: nn.Module | None) -> int | None:
    """The teacher's end of sequence: its tokenizer's eos_token_id, else its model's generation / model config."""
    eos = getattr(teacher_tokenizer, "eos_token_id", None)
    if eos is None and teacher_model is not None:
        inner = unwrap_model(teacher_model)
        for config in (getattr(inner, "generation_config", None), getattr(inner, "config", None)):
            eos = getattr(config, "eos_token_id", None)
            if eos is not None:
                break
    return eos[0] if isinstance(eos, list) and eos else eos


def generated_rows(
    collator: CrossTokenizerCollator, student: nn.Module, student_tokenizer: Any, teacher: nn.Module | None,
    vocab_map: VocabMap,
) -> tuple[GeneratedRows, VocabMap]:  # fmt: skip
    """The run's GeneratedRows (checked now: both EOS ids known) and the vocabulary map with the student's EOS
    ids paired with the teacher's, so that the EOS group's exact term compares the two stopping probabilities."""
    _, student_eos, _ = special_ids(student, student_tokenizer)
    rows = GeneratedRows.build(
        collator, vocab_map.student_vocab_size, student_eos, teacher_eos_id(collator.teacher_tokenizer, teacher)
    )
    pairs = [(s, rows.teacher_eos_id) for s in sorted(student_eos) if s < vocab_map.student_vocab_size]
    if rows.teacher_eos_id < vocab_map.teacher_vocab_size:
        vocab_map = vocab_map.with_pairs(pairs)
    return rows, vocab_map


@dataclass
class CrossTokenizerSetup:
    """Everything built once for a cross-tokenizer run."""

    config: CrossTokenizerConfig
    vocab_map: VocabMap
    collator: CrossTokenizerCollator
    generated: GeneratedRows | None = None  # on-policy runs (kd_lmbda > 0): batches of the student's rollouts

    @classmethod
    def build(cls, args: KDTrainingArguments, student_tokenizer, student_model: nn.Module,
              teacher_model: nn.Module | None, teacher_tokenizer: Any = None, max_length: int | None = None,
              teacher_vocab_size: int | None = None) -> CrossTokenizerSetup:  # fmt: skip
        """`teacher_tokenizer` defaults to AutoTokenizer.from_pretrained(args.kd_teacher_tokenizer). The
        vocabulary map matches token strings after `byte_level_to_text` (so "Ġthe" matches "▁the"), over the
        ids the two lm_heads have. Without a teacher_model (offline top-k data) the teacher's vocabulary is
        `teacher_vocab_size`, default len(teacher_tokenizer): the ids the top-k's tail is spread over. With
        kd_lmbda > 0 it also pairs the student's EOS ids with the teacher's in the map and builds `generated`."""
        check_cross_tokenizer_args(args)
        if is_registered(student_model):  # before any wrapper (accelerate's autocast) replaces its forward
            install_kd_forward(student_model)
        if student_tokenizer is None:
            raise ValueError("cross-tokenizer distillation needs the student's tokenizer (processing_class=...)")
        if teacher_tokenizer is None:
            if args.kd_teacher_tokenizer is None:
                raise ValueError("cross-tokenizer distillation needs kd_teacher_tokenizer or teacher_tokenizer=")
            from transformers import AutoTokenizer

            teacher_tokenizer = AutoTokenizer.from_pretrained(args.kd_teacher_tokenizer)
        vocab_map = VocabMap.build(
            student_tokenizer, teacher_tokenizer, normalize=byte_level_to_text,
            student_vocab_size=student_model.get_output_embeddings().weight.shape[0],
            teacher_vocab_size=(
                teacher_model.get_output_embeddings().weight.shape[0] if teacher_model is not None
                else teacher_vocab_size or len(teacher_tokenizer)
            ),
        )  # fmt: skip
        collator = CrossTokenizerCollator(
            student_tokenizer, teacher_tokenizer, student_pad_id=_pad_id(student_tokenizer),
            teacher_pad_id=_pad_id(teacher_tokenizer), max_length=max_length,
        )  # fmt: skip
        generated = None
        if args.kd_lmbda > 0:
            generated, vocab_map = generated_rows(collator, student_model, student_tokenizer, teacher_model, vocab_map)
        return cls(cross_tokenizer_config(args), vocab_map, collator, generated)

    @staticmethod
    def check_spread(accelerator, models: tuple[nn.Module | None, ...]) -> None:
        """At KDTrainer's start, before anything is sharded, from accelerate's settings (the student is wrapped
        when training starts): check_spread on the (student, teacher) as they will be spread."""
        state = accelerator.state
        kind = accelerator.distributed_type  # a str enum: "FSDP", "DEEPSPEED", "MULTI_GPU", ...
        zero = getattr(state.deepspeed_plugin, "zero_stage", None) if kind == "DEEPSPEED" else None
        spread = f"FSDP{getattr(state.fsdp_plugin, 'fsdp_version', 1)}" if kind == "FSDP" else None
        spread = spread or ("ZeRO-3" if zero == 3 else "DDP" if accelerator.num_processes > 1 else None)
        for role, model in zip(("student", "teacher"), models):
            if model is not None:
                check_spread(model, role, spread)


class OtherTokenizerTeacher(TeacherSource):
    """A member of another tokenizer: wraps a single-kind member (`member`: in process, stored rows holding the
    teacher's own top-k, or served top-k, asked about its own tokenization of each row) and aligns each batch's
    student and teacher tokens by CrossTokenizerCollator's groups, the loss align's fused cross-tokenizer loss
    (compute_cross_tokenizer_loss). A batch without the groups (a collator of the caller's) is the member's own.
    Which members it wraps is plan.py's OTHER_TOKENIZER_WRAPS; in a set, its in-process members (set_text_rows.py)."""

    def __init__(self, setup: CrossTokenizerSetup, member: TeacherSource, fused: bool) -> None:
        super().__init__(fused)
        self.setup, self.member = setup, member
        self.model = getattr(member, "model", None)  # an in-process member's, frozen and placed
        self.from_rows = member.from_rows  # its top-k in the rows
        self.in_process, self.fetches = member.in_process, member.fetches
        if isinstance(member, ServedTeacher):  # asked about the teacher's own tokens, over its own ids
            member.ask_about_own_tokens(setup.vocab_map.teacher_vocab_size)

    @property
    def client(self):
        """A served member's client (made, the server checked, for the first DataLoader), else None."""
        return getattr(self.member, "client", None)

    def dataloader(self, dataloader, student_vocab_size):
        dataloader = self.member.dataloader(dataloader, student_vocab_size)
        self.prefetcher = self.member.prefetcher  # asked about generated rows too
        return dataloader

    def eval_dataloader(self, dataloader, student_vocab_size):
        return self.member.eval_dataloader(dataloader, student_vocab_size)

    def prepare(self, inputs: dict) -> dict:
        inputs = self.member.prepare(inputs)
        if not is_cross_tokenizer_batch(inputs):  # across tokenizers teacher_input_ids are the same text's tokens
            require_teacher_prompt(self.model, inputs)
        return inputs

    def loss(self, model, inputs: dict, num_items_in_batch, cfg: KDLossConfig, log_now: bool,
             behaviour=None) -> KDStepOutput:  # fmt: skip
        if not is_cross_tokenizer_batch(inputs):
            return self.member.loss(model, inputs, num_items_in_batch, cfg, log_now, behaviour)
        outputs = compute_cross_tokenizer_loss(
            model, self.model, inputs, self.setup.config, self.setup.vocab_map, num_items_in_batch
        )
        return KDStepOutput(outputs.loss, outputs.soft, outputs.hard, None, outputs)


# ------------------------------------------------------------- heads of different sizes, one tokenizer?
def _tokenizer_of(model: nn.Module) -> Any:
    """The tokenizer saved with a model (config._name_or_path / name_or_path: a local directory, or a hub id
    already in the local cache; never downloaded), or None when there is none to be found."""
    inner = unwrap_model(model)
    names = (getattr(getattr(inner, "config", None), "_name_or_path", None), getattr(inner, "name_or_path", None))
    for name in dict.fromkeys(n for n in names if isinstance(n, str) and n):
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(name, local_files_only=True)
        except Exception:  # no tokenizer there (weights only, not cached, not a path): unknown
            continue
    return None


def _same_tokenizer(a: Any, b: Any) -> bool:
    if len(a) != len(b):
        return False
    get_a, get_b = getattr(a, "get_vocab", None), getattr(b, "get_vocab", None)
    return get_a is not None and get_b is not None and get_a() == get_b()


def padded_vocab_size(rows: tuple[int, int], tokenizer: Any, teacher: nn.Module) -> int:
    """The vocabulary for a student and teacher whose lm_heads differ in size (rows: student's, teacher's),
    kd_vocab_size unset: len(tokenizer) when the extra rows are padding of one shared tokenizer, else ValueError.

    Padding is taken when the teacher's own tokenizer (_tokenizer_of) is found equal to the student's, or, when
    none is found, when both heads are longer than len(tokenizer) (both padded, as Qwen2.5's 151936 / 152064
    rows for 151665 tokens). A teacher tokenizer found different, a head shorter than len(tokenizer), or a head
    of exactly len(tokenizer) rows next to a longer one with no tokenizer to say why (a teacher with its own,
    larger vocabulary looks like that) is refused: kd_teacher_tokenizer or kd_vocab_size says which it is."""
    n = len(tokenizer)
    teacher_tok = _tokenizer_of(teacher)
    how = f"the student's lm_head has {rows[0]} rows and the teacher's {rows[1]} (student tokenizer: {n} tokens)"
    fix = (
        "if the teacher has its own tokenizer, set kd_teacher_tokenizer (or pass teacher_tokenizer=) for "
        "cross-tokenizer distillation; if both share the student's tokenizer and the extra rows are padding, set "
        f"kd_vocab_size={n}"
    )
    if teacher_tok is not None and not _same_tokenizer(tokenizer, teacher_tok):
        raise ValueError(f"{how}, and the teacher's saved tokenizer ({len(teacher_tok)} tokens) differs: {fix}")
    if min(rows) < n:
        raise ValueError(f"{how}: a head shorter than the tokenizer cannot be its padded form; {fix}")
    if teacher_tok is None and min(rows) == n:
        raise ValueError(f"{how}, and no tokenizer was found with the teacher to tell padding from another "
                         f"vocabulary: {fix}")  # fmt: skip
    logger.warning_once(
        f"{how}: distilling over the shared tokenizer's {n} tokens (kd_vocab_size={n}; the teacher's tokenizer "
        f"{'is the same' if teacher_tok is not None else 'was not found, both heads are padded'}); set "
        f"kd_vocab_size to choose otherwise"
    )
    return n
