"""`liger-kd train`: check every option and the data, load the tokenizers, the dataset and then the models, train,
evaluate, save the student and its tokenizer. Every mistake found before the models load is one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..teacher.store import store_meta
from ..teacher.store.rollouts import rollouts_of
from ..trainer.dataset_setup import (
    check_chat_template,
    check_completions_for_off_policy,
    check_evaluation_scores_completions,
    check_length_options_apply,
    check_messages_end_with_the_completion,
    check_no_text_rows_to_generate_from,
    first_row_of,
)
from ..trainer.output_checkpoints import check_rotation_spares_others
from .data import check_dataset_name, load_splits
from .models import check_model_options, check_same_tokenizer, load_model, load_tokenizer, with_lora
from .output import check_output_dir, checked_resume, drop_stale, earlier_saves, record_saved, resume_note
from .parser import parse


def check_teacher(model: Any, training: Any, store: Path | None, train_rows: Any) -> None:
    """One teacher: a model here, a server, a store's rows, or the student itself. A store beside a model here is
    a store's rows plus a live teacher: for generated steps (kd_lmbda, kd_seq_kd), or to rescore a rollout store's
    refreshed rows (kd_store_refresh_steps)."""
    named = (("--teacher_model_name_or_path", model.teacher_model_name_or_path),
             ("--kd_teacher_url", training.kd_teacher_url), ("--kd_self_distill", training.kd_self_distill),
             ("a teacher store as --dataset_name", store))  # fmt: skip
    sources = [name for name, given in named if given]
    if not sources:
        raise ValueError("no teacher: give --teacher_model_name_or_path (a model sharing the student's tokenizer), "
                         "--kd_teacher_url (a teacher server), a teacher store as --dataset_name, or "
                         "--kd_self_distill")  # fmt: skip
    refresh = training.kd_store_refresh_steps
    if refresh and (store is None or rollouts_of(store_meta(train_rows) or {}) is None):
        raise ValueError(f"--kd_store_refresh_steps {refresh}: regenerates rows of a rollout store (liger-kd "
                         f"precompute --rollouts-from), and --dataset_name is not one: give a rollout store, or "
                         f"leave the option out")  # fmt: skip
    on_policy = training.kd_lmbda > 0 or training.kd_seq_kd  # a store's rows plus a live teacher for generated steps
    rescores = refresh and model.teacher_model_name_or_path  # the teacher that scored the store rescores its rows
    if len(sources) > 1 and not ((on_policy or rescores) and store is not None and len(sources) == 2):
        beside = ""
        if store is not None and model.teacher_model_name_or_path and rollouts_of(store_meta(train_rows) or {}):
            beside = (" (the teacher that scored a rollout store goes beside it with --kd_store_refresh_steps, "
                      "which rescores the rows it regenerates)")  # fmt: skip
        raise ValueError(f"{' and '.join(sources)} each name a teacher: give one{beside}")


def check_trains(training: Any) -> None:
    """A run of no step would save the student untouched as if distilled: --num_train_epochs 0 (or below) is
    refused unless --max_steps (which overrides it when > 0) sets the steps."""
    if training.max_steps <= 0 and training.num_train_epochs <= 0:
        raise ValueError(
            f"--num_train_epochs {training.num_train_epochs:g}: no training step would run, and the student would be "
            "saved untrained; give --num_train_epochs > 0 or --max_steps > 0"
        )


def check_reporting(report_to: list[str] | None) -> None:
    """--report_to's integrations, made once here as the Trainer makes them: one whose package is missing (or a
    name transformers does not know) is one line now, not a traceback once the weights have loaded."""
    from transformers.integrations import get_reporting_integration_callbacks

    try:
        for callback in get_reporting_integration_callbacks(report_to):
            callback()  # each checks its package and imports it, nothing more (the run starts in on_train_begin)
    except (ImportError, RuntimeError, ValueError) as e:
        raise ValueError(f"--report_to {' '.join(report_to or [])}: {' '.join(str(e).split())} (or --report_to "
                         f"none)") from None  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """`liger-kd train ARGV`: 0 once the student is saved (a mistake is an exception: cli.main makes it one line)."""
    train(argv)
    return 0


def train(argv: list[str] | None = None):
    """The run of one `liger-kd train` command line; returns the KDTrainer, trained and saved."""
    script, model, training = parse(argv)
    check_model_options(model)
    check_dataset_name(script)
    training.resume_from_checkpoint = checked_resume(training.resume_from_checkpoint, training.output_dir)
    if isinstance(training.resume_from_checkpoint, str) and training.process_index == 0:
        print(resume_note(training.resume_from_checkpoint, training.max_steps))
    check_reporting(training.report_to)
    check_trains(training)
    check_rotation_spares_others(training, training.resume_from_checkpoint)  # KDTrainer.train's check, said early
    check_output_dir(training.output_dir, {"--model_name_or_path": model.model_name_or_path,
                                           "--teacher_model_name_or_path": model.teacher_model_name_or_path},
                     script.overwrite_output_dir)  # fmt: skip
    student_name = model.model_name_or_path
    tokenizer = load_tokenizer(student_name, model, "--model_name_or_path", model.model_revision)
    if model.teacher_model_name_or_path and not training.kd_teacher_tokenizer:  # one tokenizer for both
        teacher_tokenizer = load_tokenizer(model.teacher_model_name_or_path, model, "--teacher_model_name_or_path",
                                           model.teacher_model_revision)  # fmt: skip
        check_same_tokenizer(tokenizer, teacher_tokenizer, model)

    def open_store(path: Path):
        from ..teacher import TeacherLogprobsDataset, TeacherStoreError

        try:
            return TeacherLogprobsDataset(path, vocab_size=len(tokenizer), tokenizer=tokenizer)
        except TeacherStoreError as e:  # the store's own words, said of the options that chose it and the student
            raise ValueError(f"--dataset_name {script.dataset_name} (a teacher store) and --model_name_or_path "
                             f"{student_name}: {e}") from None  # fmt: skip

    splits = load_splits(script, training.seed, open_store)
    check_teacher(model, training, splits.store, splits.train)
    # KDTrainer's checks of the rows, made before the weights load
    train_rows = f"--dataset_name {script.dataset_name} (split {script.dataset_train_split})"
    check_no_text_rows_to_generate_from(training, splits.train, train_rows)
    unset = "drop {} from the command line and from --config's YAML (a recipe sets them)"
    evaluation_rows = f"--dataset_name {script.dataset_name} (evaluation rows)"
    evaluation = [(evaluation_rows, splits.evaluation)] if splits.evaluation is not None else []
    check_length_options_apply(training, [(train_rows, splits.train), *evaluation], unset)
    check_messages_end_with_the_completion(first_row_of(splits.train), train_rows)
    check_completions_for_off_policy(training, splits.train)
    check_evaluation_scores_completions(splits.evaluation, evaluation_rows,
                                        "evaluate on none: --dataset_test_split none, no --eval_fraction")  # fmt: skip
    check_chat_template(tokenizer, {train_rows: splits.train,
                                    evaluation_rows: splits.evaluation},
                        f"--model_name_or_path {student_name}'s tokenizer")  # fmt: skip
    strategy = getattr(training.eval_strategy, "value", training.eval_strategy)
    if strategy != "no" and splits.evaluation is None:
        raise ValueError(f"--eval_strategy {strategy}: there are no evaluation rows (the dataset has no test split, "
                         "or --dataset_test_split none); name a split with --dataset_test_split, or hold rows out "
                         "with --eval_fraction")  # fmt: skip
    say = print if training.process_index == 0 else (lambda *_: None)  # one process speaks under a launcher
    say(f"liger-kd train: {len(splits.train)} training rows from {script.dataset_name}; {splits.description}")

    from ..trainer import KDTrainer  # the weights load only once everything above holds

    student = load_model(student_name, model.dtype, model, model.model_revision)
    if model.use_peft:
        student = with_lora(student, model)
    teacher = None
    if model.teacher_model_name_or_path:
        teacher = load_model(model.teacher_model_name_or_path, model.teacher_dtype, model, model.teacher_model_revision)
    trainer = KDTrainer(model=student, teacher_model=teacher, args=training, train_dataset=splits.train,
                        eval_dataset=splits.evaluation, processing_class=tokenizer)  # fmt: skip
    trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
    done = trainer.state.global_step
    evaluated = [h for h in trainer.state.log_history if "eval_loss" in h and h.get("step") == done]
    if splits.evaluation is not None:
        metrics = evaluated[-1] if evaluated else trainer.evaluate()  # the last step's evaluation, once
        say("liger-kd train: evaluation: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()
                                                         if isinstance(v, float)))  # fmt: skip
    out = training.output_dir
    earlier = earlier_saves(out)
    trainer.save_model(out)
    if training.process_index == 0:
        tokenizer.save_pretrained(out)
        stale = drop_stale(out, earlier)  # an earlier run's files this save did not replace
        if stale:
            say(f"liger-kd train: removed {', '.join(stale)}, saved there by an earlier run and not by this one")
        record_saved(out)  # these files are this tool's now: the next run into `out` may replace them
    kind = "the student's LoRA adapter" if model.use_peft else "the student"
    say(f"liger-kd train: saved {kind} and its tokenizer to {Path(out).resolve()}")
    return trainer
