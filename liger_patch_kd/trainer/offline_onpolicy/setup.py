"""A KDTrainer run on a rollout store: its checks before any training (teacher consistency, the options that
cannot apply), its collator, its teacher source and its optional refresh."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ...batch.columns import ROLLOUT_LOGPROB_COLUMNS
from ...batch.rollout_store import RolloutStoreCollator
from ...models import unwrap_model
from ...teacher.precompute import teacher_fingerprint
from ...teacher.store import store_meta
from ...teacher.store.rollouts import rollouts_of, sampling_is_the_policy
from ..arguments import checks_arguments, field_defaults
from .refresh import StoreRefresh
from .source import StoredRolloutsTeacher


@checks_arguments(rank=0)
def check_refresh_args(args: Any) -> None:
    """kd_store_refresh_steps / _fraction, validated when the arguments are made."""
    steps, fraction = args.kd_store_refresh_steps, args.kd_store_refresh_fraction
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"kd_store_refresh_steps must be an integer >= 0 (0: never refresh); got {steps!r}")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"kd_store_refresh_fraction must be a number in (0, 1] (of each refreshed step's rows); got "
                         f"{fraction!r}")  # fmt: skip


def check_teacher_consistency(meta: dict, teacher_model: Any) -> None:
    """A rollout store was scored by one teacher; a different teacher_model for its rows (refreshed rows scored by
    one, stored rows by another) would mix two objectives: refused in one line."""
    section = rollouts_of(meta)
    scored_by = section.get("teacher_fingerprint")
    if scored_by is None:  # a served teacher's: its weights were never read here
        server = section.get("teacher_server") or {}
        raise ValueError(
            f"the rollout store was scored by the served teacher {server.get('model', '?')!r} at "
            f"{server.get('url', '?')}, whose weights this run cannot compare with teacher_model's: pass no "
            f"teacher_model (and kd_store_refresh_steps=0), or make a store scored in process (liger-kd precompute "
            f"--rollouts-from ... --teacher ...)"
        )
    given = teacher_fingerprint(teacher_model)
    if given != scored_by:
        dtypes = sorted({str(p.dtype) for p in teacher_model.parameters()})
        raise ValueError(
            f"the rollout store was scored by teacher {meta.get('teacher') or '?'} (weights fingerprint {scored_by}) "
            f"but teacher_model has fingerprint {given} (weights in {', '.join(dtypes)}; the fingerprint covers the "
            f"config and every weight in its dtype, so the same checkpoint loaded in another dtype than the scoring "
            f"run's differs too): pass the teacher that scored it, as it was loaded then (liger-kd precompute loads "
            f"it in the checkpoint's dtype), or make a store scored by this one (liger-kd precompute --rollouts-from "
            f"... --teacher ...)"
        )


def check_options_a_store_fixes(args: Any, section: dict) -> None:
    """A rollout store's rows were sampled and cut when it was made, and a refresh samples with the store's settings
    (one completion per row, its max_new_tokens and sampling): options that would shape rollouts or cut rows do
    nothing beside one. One that was set to another value than the store's is refused in one line, all named, rather
    than silently unused (the defaults, and values equal to the store's, pass)."""
    sampling = section.get("sampling") or {}
    defaults = field_defaults(args)
    stored_length, stored_temperature = section.get("max_new_tokens"), sampling.get("temperature", 1.0)
    unused = []
    if args.kd_max_new_tokens not in (defaults.get("kd_max_new_tokens"), stored_length):
        unused.append(f"kd_max_new_tokens={args.kd_max_new_tokens} (the store's completions, and a refresh's, are at "
                      f"most {stored_length} tokens: --max-new-tokens of liger-kd precompute)")  # fmt: skip
    if args.kd_generation_temperature not in (1.0, stored_temperature):
        unused.append(f"kd_generation_temperature={args.kd_generation_temperature} (the store was sampled, and a "
                      f"refresh samples, at {stored_temperature}: --generation-temperature of liger-kd "
                      f"precompute)")  # fmt: skip
    stored_generations = section.get("num_generations", 1)
    if args.kd_num_generations not in (1, stored_generations):
        unused.append(f"kd_num_generations={args.kd_num_generations} (the store holds {stored_generations} "
                      f"completion(s) a prompt, each a row, and a refresh replaces a row with one: --num-generations "
                      f"of liger-kd precompute)")  # fmt: skip
    if not args.kd_store_refresh_steps:  # the options of a refresh, which only kd_store_refresh_steps makes
        if args.kd_store_refresh_fraction != defaults.get("kd_store_refresh_fraction", 1.0):
            unused.append(f"kd_store_refresh_fraction={args.kd_store_refresh_fraction} (the share of a step a refresh "
                          f"regenerates, and kd_store_refresh_steps=0 makes none)")  # fmt: skip
        if args.kd_rollout_batch_size is not None:
            unused.append(f"kd_rollout_batch_size={args.kd_rollout_batch_size} (the prompts of a refresh's generation "
                          f"calls, and kd_store_refresh_steps=0 makes none)")  # fmt: skip
    if unused:
        raise ValueError(
            f"train_dataset is a rollout store, whose rows were sampled and scored when it was made, so "
            f"{'; '.join(unused)} would never be used: leave {'it' if len(unused) == 1 else 'them'} unset (the "
            f"store's settings are its manifest's 'rollouts' section)"
        )


def check_sampled_vocabulary(meta: dict, vocab_size: int | None, student: Any) -> None:
    """A rollout store's tokens were drawn from the ids both heads have (its vocab_size, when the generator's head
    has more rows), and its behaviour log-probs are normalised over them: a student normalised over another number
    of rows (its whole padded head, kd_vocab_size unset) would give every token a ratio to its behaviour that is no
    staleness. Refused in one line, naming the kd_vocab_size to set."""
    # the ids the store was drawn from: recorded where they were fewer than the generator's head (heads of two sizes:
    # the tokenizer's); stores made before they were recorded drew from the scoring teacher's head, vocab_size
    stored = (rollouts_of(meta) or {}).get("sampled_vocab_size") or meta.get("vocab_size")
    head = getattr(student.get_output_embeddings(), "out_features", None) if student is not None else None
    if not isinstance(stored, int) or not isinstance(head, int):
        return
    sampled = min(stored, head)  # a generator's head never draws past its own rows
    if (vocab_size or head) != sampled:
        fix = f"set kd_vocab_size={sampled}" if head > sampled else "leave kd_vocab_size unset"
        raise ValueError(
            f"the rollout store was sampled from ids [0, {sampled}) (its manifest's sampled_vocab_size, else its "
            f"vocab_size, within the student's head of {head} rows), so the student must be normalised over those "
            f"{sampled} ids as its behaviour log-probs are (kd_vocab_size is {vocab_size}): {fix}"
        )


def check_evaluation_is_rollouts(eval_dataset: Any, train_meta: dict | None = None, onpolicy_loss: str = "divergence"
                                 ) -> None:  # fmt: skip
    """A run on a rollout store scores every batch, evaluation's too, as stored rollouts (their teacher log-probs,
    the rollout collator): an evaluation dataset that is not one is refused when the Trainer is built, not at the
    first evaluation. Its eval_loss is the run's objective only against the training store's teacher, and with a
    sampled-token estimator only on tokens sampled from the student's own distribution: an evaluation store scored by
    another teacher (weights fingerprints that differ), or sampled otherwise, is refused too."""
    named = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval_dataset", eval_dataset)]
    scored_by = (rollouts_of(train_meta) or {}).get("teacher_fingerprint") if train_meta else None
    for name, dataset in named:
        if dataset is None:
            continue
        where = name if name == "eval_dataset" else f"eval_dataset[{name!r}]"
        section = rollouts_of(store_meta(dataset) or {})
        if section is None:
            raise ValueError(
                f"{where} is not a rollout store ({type(dataset).__name__}), and train_dataset is one: the run scores "
                f"every batch as stored rollouts. Evaluate on a rollout store too (liger-kd precompute "
                f"--rollouts-from on held-out prompts, or rows held out of this store), or on this dataset in "
                f"another run"
            )
        theirs = section.get("teacher_fingerprint")
        if scored_by and theirs and theirs != scored_by:
            raise ValueError(
                f"{where}'s rollout store was scored by teacher {store_meta(dataset).get('teacher') or '?'} (weights "
                f"fingerprint {theirs}) and train_dataset's by {train_meta.get('teacher') or '?'} (fingerprint "
                f"{scored_by}): its eval_loss would measure the distance to another teacher. Evaluate on a store "
                f"scored by the training store's teacher (or rows held out of it), or on this one in another run"
            )
        if onpolicy_loss != "divergence" and not sampling_is_the_policy(section):
            raise ValueError(
                f"{where}: kd_onpolicy_loss={onpolicy_loss!r} estimates the KL on tokens sampled from the student's "
                f"own distribution, and this evaluation store was sampled with {section['sampling']}: evaluate on a "
                f"store made with temperature 1, top-p 1, top-k 0, or use kd_onpolicy_loss='divergence'"
            )


def joined_rollout_stores(dataset: Any) -> int:
    """How many rollout stores a join of datasets holds (torch's ConcatDataset, its `datasets`, under any Subset):
    0 for anything else."""
    for _ in range(8):
        parts = getattr(dataset, "datasets", None)
        if parts is not None:
            return sum(1 if rollouts_of(store_meta(part) or {}) is not None else joined_rollout_stores(part)
                       for part in parts)  # fmt: skip
        if not hasattr(dataset, "dataset"):
            return 0
        dataset = dataset.dataset
    return 0


def check_not_a_join_of_rollout_stores(dataset: Any, onpolicy_loss: str) -> None:
    """A join of rollout stores has no one manifest, so it would train as plain teacher rows: the divergence on
    their top-k whatever kd_onpolicy_loss says, no kd_behaviour_kl, no teacher checked. Refused in one line."""
    stores = joined_rollout_stores(dataset)
    if stores:
        joined = f"{stores} rollout store{'s' if stores > 1 else ''} ({type(dataset).__name__})"
        raise ValueError(
            f"train_dataset joins {joined}, and a run on rollouts reads one store's manifest (its scoring teacher, "
            f"sampling and behaviour log-probs): joined, they would train as plain teacher rows (kd_onpolicy_loss="
            f"{onpolicy_loss!r} unused, no kd_behaviour_kl, no teacher check). Make one store of all the prompts "
            f"(liger-kd precompute --rollouts-from ... --data with every prompt), or train on one store at a time"
        )


class OfflineRollouts:
    """What a run on a rollout store adds to KDTrainer; `setup` returns None for any other dataset."""

    def __init__(self, meta: dict, args: Any, collator: RolloutStoreCollator) -> None:
        self.meta = meta
        self.collator = collator
        self.refresh = StoreRefresh(meta, args, collator) if args.kd_store_refresh_steps else None

    @classmethod
    def setup(cls, args: Any, dataset: Any, teacher_model: Any, tokenizer: Any, eval_dataset: Any = None,
              student: Any = None, vocab_size: int | None = None) -> OfflineRollouts | None:  # fmt: skip
        meta = store_meta(dataset)
        section = rollouts_of(meta) if meta is not None else None
        if section is None:
            check_not_a_join_of_rollout_stores(dataset, args.kd_onpolicy_loss)
            if args.kd_store_refresh_steps:
                raise ValueError(f"kd_store_refresh_steps={args.kd_store_refresh_steps} regenerates rows of a "
                                 f"rollout store (liger-kd precompute --rollouts-from), and train_dataset is not one: "
                                 f"set kd_store_refresh_steps=0")  # fmt: skip
            return None
        if args.kd_lmbda > 0 or args.kd_seq_kd:
            raise ValueError(
                f"train_dataset is a rollout store, whose rows are the student's samples already; kd_lmbda="
                f"{args.kd_lmbda} / kd_seq_kd={args.kd_seq_kd} would sample more: set kd_lmbda=0 and kd_seq_kd=False, "
                f"and kd_store_refresh_steps to resample part of the store"
            )
        if args.kd_onpolicy_loss != "divergence" and not sampling_is_the_policy(section):
            raise ValueError(
                f"kd_onpolicy_loss={args.kd_onpolicy_loss!r} estimates the KL on tokens sampled from the student's own "
                f"distribution, and the store was sampled with {section['sampling']}: make it with temperature 1, "
                f"top-p 1, top-k 0, or use kd_onpolicy_loss='divergence'"
            )
        if args.kd_onpolicy_loss != "divergence" and args.kd_temperature != 1.0:
            raise ValueError(
                f"kd_temperature={args.kd_temperature} would never be used: kd_onpolicy_loss="
                f"{args.kd_onpolicy_loss!r} scores every row of a rollout store at temperature 1 (its tokens were "
                f"drawn, and its teacher and behaviour log-probs taken, at 1): set kd_temperature=1, or use "
                f"kd_onpolicy_loss='divergence' to train the tempered divergence on the stored top-k"
            )
        check_options_a_store_fixes(args, section)
        if args.kd_teacher_url:
            raise ValueError(
                f"kd_teacher_url={args.kd_teacher_url!r} would never be asked: train_dataset is a rollout store, which "
                f"carries the scores of the teacher that made it (its manifest names it), and a refresh rescores with "
                f"teacher_model: unset kd_teacher_url (a store scored by a served teacher: liger-kd precompute "
                f"--rollouts-from with --teacher-url)"
            )
        if teacher_model is not None:
            check_teacher_consistency(meta, teacher_model)
        elif args.kd_store_refresh_steps:
            raise ValueError(f"kd_store_refresh_steps={args.kd_store_refresh_steps} rescores regenerated rows with "
                             f"the teacher: pass teacher_model (the one that scored the store)")  # fmt: skip
        check_sampled_vocabulary(meta, vocab_size, None if student is None else unwrap_model(student))
        check_evaluation_is_rollouts(eval_dataset, meta, args.kd_onpolicy_loss)
        pad = getattr(tokenizer, "pad_token_id", None)
        return cls(meta, args, RolloutStoreCollator(pad_token_id=0 if pad is None else pad))

    @property
    def columns(self) -> tuple[str, ...]:
        """The store items' columns besides a store's usual ones (the Trainer keeps them for the collator)."""
        return tuple(ROLLOUT_LOGPROB_COLUMNS)

    def teacher_source(self, fused: bool) -> StoredRolloutsTeacher:
        return StoredRolloutsTeacher(fused)

    def refreshed(
        self, batches: list, student, teacher, *, tokenizer: Any, step: int, vocab_size: int | None,
        precision: Callable[[], AbstractContextManager] = contextlib.nullcontext,
    ) -> list:  # fmt: skip
        """The step's micro-batches, a slice of them regenerated when the refresh is due (refresh.py), sampled and
        scored under `precision()` (the Trainer's autocast)."""
        if self.refresh is None:
            return batches
        return self.refresh(batches, student, teacher, tokenizer=tokenizer, step=step, vocab_size=vocab_size,
                            precision=precision)  # fmt: skip

