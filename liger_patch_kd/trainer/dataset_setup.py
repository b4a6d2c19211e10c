"""What KDTrainer reads off its inputs when it is built: the kind of rows a dataset holds, the vocabulary two heads
share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..batch.columns import TEACHER_DATA_COLUMNS, TEACHER_INPUT_IDS, TEACHER_LABELS, TEACHER_SAMPLE_IDS, TOPK_COLUMNS
from ..batch.prompts import PromptCollator, conversation_column, is_prompt_row
from ..config import KDLossConfig
from ..models import unwrap_model
from ..teacher.store import store_meta, tokenizer_fingerprint
from ..teacher.store.rollouts import rollouts_of
from .teachers.other_tokenizer import padded_vocab_size
from .teachers.sampled_data import check_sampled_dataset, check_tempered_topk
from .teachers.self_distill import is_self_teacher
from .teachers.set_fetch import check_rows_for_several_served


def first_row_is_prompt(dataset: Any) -> bool:
    """Whether the training rows are TRL-style prompt rows (prompt / completion / messages), judged by the first."""
    return first_row_is(dataset, lambda row: isinstance(row, dict) and is_prompt_row(row))


def first_row_is(dataset: Any, test) -> bool:
    """Whether `test` holds for the dataset's first row (False for an iterable dataset: its collator decides)."""
    row = first_row_of(dataset)
    return row is not None and bool(test(row))


def first_row_of(dataset: Any) -> Any:
    """The dataset's first row, or None for an iterable dataset (or none). An iterable is never indexed: a
    datasets.IterableDataset answers [0] with a column object, not a row."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    try:
        return dataset[0]
    except Exception:  # an iterable dataset, or none: the collator given decides
        return None


def columns_of(dataset: Any) -> Any:
    """What a check that reads only a row's column names needs: the first row, or for an iterable dataset whose
    columns are known (a datasets.IterableDataset with features) a row of those names with no values; None
    otherwise. An iterable is not read, so nothing of it is consumed."""
    row = first_row_of(dataset)
    if row is not None:
        return row
    names = getattr(dataset, "column_names", None)
    return dict.fromkeys(names) if isinstance(names, (list, tuple)) and names else None


def check_chat_template(tokenizer: Any, datasets: Mapping[str, Any], whose: str = "processing_class") -> None:
    """Conversations ('messages', or a conversational 'prompt') are rendered by the tokenizer's chat template when
    their batches are made: a tokenizer without one is refused now, naming the rows, not at the first batch after
    the models loaded. `datasets`: {how the caller names it: dataset}; `whose`: how the caller names the tokenizer."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is not None:
        return
    for name, dataset in datasets.items():
        column = conversation_column(first_row_of(dataset)) if dataset is not None else None
        if column is not None:
            raise ValueError(
                f"{name}: its rows are conversations ('{column}': a list of role / content turns), which the "
                f"tokenizer's chat template renders, and {whose} has none (tokenizer.chat_template is None): use a "
                f"chat model's tokenizer, set tokenizer.chat_template, or give text rows ('text', or a text "
                f"'prompt' + 'completion')"
            )


# teacher columns a row may carry that a collator must pass on (a generic one drops what it does not know)
TEACHER_ROW_COLUMNS = (TEACHER_INPUT_IDS, *TEACHER_DATA_COLUMNS)
_PROBE_COLUMNS = ("input_ids", "labels", "attention_mask", "position_ids", TEACHER_LABELS, *TEACHER_ROW_COLUMNS)


def check_collator_keeps_teacher_columns(dataset: Any, collator: Any) -> None:
    """A user's data_collator run on the first row: teacher columns it drops would leave the run on another
    objective (the teacher on the student's prompt, a live teacher instead of the data), so they are refused."""
    row = first_row_of(dataset)
    if collator is None or not isinstance(row, Mapping):
        return
    given = [c for c in TEACHER_ROW_COLUMNS if row.get(c) is not None]
    if not given:
        return
    try:
        batch = collator([{k: v for k, v in row.items() if k in _PROBE_COLUMNS}])
    except Exception:  # a collator that needs more of the row than this probe gives: the run decides
        return
    lost = [c for c in given if not isinstance(batch, Mapping) or batch.get(c) is None]
    if lost:
        raise ValueError(
            f"data_collator={type(collator).__name__} drops the rows' {lost}, so training would ignore them: use "
            f"liger_patch_kd.teacher.TeacherDataCollator for offline teacher data, trainer.privileged."
            f"PrivilegedCollator for rows with teacher_input_ids (packing=True packs them), or leave data_collator "
            f"unset (KDTrainer then picks one that keeps them)"
        )


def with_vocab_size(cfg: KDLossConfig, student: nn.Module, teacher: nn.Module | None, tokenizer: Any) -> KDLossConfig:
    """Heads padded to different sizes (Qwen2.5 151936 / 152064 rows, Gemma-3 262144 / 262208) share a
    tokenizer: take both distributions over its real tokens, len(tokenizer), unless kd_vocab_size says otherwise."""

    if cfg.vocab_size is not None or teacher is None or is_self_teacher(teacher):
        return cfg
    rows = [getattr(unwrap_model(m).get_output_embeddings(), "out_features", None) for m in (student, teacher)]
    if None in rows or rows[0] == rows[1]:
        return cfg
    if tokenizer is None or not hasattr(tokenizer, "__len__"):
        raise ValueError(
            f"the student's lm_head has {rows[0]} rows and the teacher's {rows[1]}; distillation compares "
            f"distributions over one vocabulary. Set kd_vocab_size to the number of real tokens (len(tokenizer)), "
            f"or pass processing_class=tokenizer so KDTrainer takes len(tokenizer)"
        )
    return cfg.replace(vocab_size=padded_vocab_size(tuple(rows), tokenizer, teacher))  # or a ValueError


def check_teacher_is_used(args: Any, teacher_model: Any, first_row: Any, eval_dataset: Any = None) -> None:
    """A live teacher_model beside rows that carry their own teacher data, with no step it would score: refused, as
    the run would train on the rows' data while the teacher sits on the device unused (kd_lmbda > 0 uses both: the
    teacher scores the generated steps; kd_seq_kd samples from it; it scores evaluation rows without their own)."""
    if teacher_model is None or not isinstance(first_row, dict) or args.kd_lmbda > 0 or args.kd_seq_kd:
        return
    if getattr(args, "kd_store_refresh_steps", 0):  # it rescores a rollout store's refreshed rows
        return
    evaluations = eval_dataset.values() if isinstance(eval_dataset, Mapping) else [eval_dataset] if eval_dataset else []
    for row in map(first_row_of, evaluations):
        if not isinstance(row, dict) or not any(row.get(c) is not None for c in (*TOPK_COLUMNS, TEACHER_SAMPLE_IDS)):
            return  # the teacher scores these (or may: an iterable dataset's rows are unknown here)
    carried = [c for c in (*TOPK_COLUMNS, TEACHER_SAMPLE_IDS) if first_row.get(c) is not None]
    if carried:
        raise ValueError(
            f"teacher_model would never be used: the rows carry offline teacher data ({', '.join(carried)}) and "
            f"kd_lmbda=0 trains on it alone. Drop teacher_model (the rows' data is the teacher), drop those columns "
            f"to distil from teacher_model, or set kd_lmbda > 0 for on-policy steps it scores"
        )


def named_evaluations(eval_dataset: Any, name: str = "eval_dataset") -> list[tuple[str, Any]]:
    """The evaluation datasets (one, or a dict of them) as (how a message names it: `name`, or name['key'] in a
    dict, the dataset); None ones left out."""
    if isinstance(eval_dataset, Mapping):
        return [(f"{name}[{key!r}]", d) for key, d in eval_dataset.items() if d is not None]
    return [] if eval_dataset is None else [(name, eval_dataset)]


def check_evaluation_has_teacher(teacher_from_rows: bool, eval_dataset: Any) -> None:
    """With no teacher but the rows' own data (a store; `teacher_from_rows`), every evaluation dataset's rows must
    carry it too, or the first evaluation fails after training started: refused now, by name."""
    if not teacher_from_rows or eval_dataset is None:
        return
    for where, dataset in named_evaluations(eval_dataset):
        row = first_row_of(dataset)
        if isinstance(row, Mapping) and not any(row.get(c) is not None for c in (*TOPK_COLUMNS, TEACHER_SAMPLE_IDS)):
            raise ValueError(
                f"{where}'s rows carry no teacher data (columns {sorted(row)}) and the run's only teacher is the "
                f"training rows' own (offline data, no teacher_model or kd_teacher_url): give the evaluation rows "
                f"their teacher's top-k too (a store precomputed on them), or pass teacher_model / kd_teacher_url"
            )


def check_store_tokenizer(tokenizer: Any, train_dataset: Any, eval_dataset: Any = None,
                          role: str = "processing_class") -> None:  # fmt: skip
    """A store's manifest names the tokenizer its ids are of (its fingerprint): a store, training's or evaluation's,
    of another tokenizer than the run's (`role`: the student's processing_class, or across tokenizers the teacher's)
    is refused now, not found when an id overflows the vocabulary (or never, when none does)."""
    if tokenizer is None or not callable(getattr(tokenizer, "get_vocab", None)):
        return
    datasets = {"train_dataset": train_dataset, **dict(named_evaluations(eval_dataset))}
    ours = None
    for name, dataset in datasets.items():
        parts = [dataset, *(getattr(dataset, "stores", None) or ())]  # teacher.RoutedTeacherData: one per teacher
        for meta in filter(None, map(store_meta, parts)):
            theirs = meta.get("tokenizer_fingerprint")
            if not theirs:
                continue
            ours = ours or tokenizer_fingerprint(tokenizer)
            if ours != theirs:
                teacher = f" of teacher {meta['teacher']!r}" if meta.get("teacher") else ""
                raise ValueError(
                    f"{name}: the store{teacher} was precomputed with a tokenizer of "
                    f"fingerprint {theirs}, and {role} ({type(tokenizer).__name__}, {len(tokenizer)} tokens) has "
                    f"fingerprint {ours}: the store's ids mean other tokens. Pass the tokenizer the store was made "
                    f"with (AutoTokenizer, as precompute loads it), or precompute the store again with this one "
                    f"(liger-kd precompute --tokenizer)"
                )


def check_length_options_apply(args: Any, datasets: list[tuple[str, Any]], unset: str = "leave {} unset") -> None:
    """kd_max_length cuts the text and prompt rows KDTrainer tokenizes, kd_max_prompt_length the prompt rows.

    Rows that come tokenized (input_ids; a teacher or rollout store, scored as they are) are trained or evaluated
    whole: either option beside them would not hold for them, so it is refused naming them, unless the store was
    cut to at most that length when it was made (the option has nothing left to cut). A text row has no prompt:
    kd_max_prompt_length holds for it trivially, and is refused only where no rows of the run have a prompt (it
    would never be used). `datasets`: (how the caller names it, its rows), the training rows first, then the
    evaluation's. Refused in one line, before the rows are tokenized; rows whose columns cannot be read without
    consuming them (an iterable of unknown columns) are not checked. `unset`: how the caller's user drops the
    options ({} is 'it' or 'them'; a command line's YAML --config may be setting them)."""
    made_as = {"kd_max_length": "max_length", "kd_max_prompt_length": "max_prompt_length"}  # precompute's inputs
    asked = {option: getattr(args, option, None) for option in made_as}
    asked = {option: value for option, value in asked.items() if value is not None}
    if not asked:
        return
    text_only = []  # the datasets of text rows, while no dataset of prompts has shown up
    prompts = False
    for name, dataset in datasets:
        row = columns_of(dataset)  # column names only: an iterable's known columns will do
        if not isinstance(row, Mapping):
            prompts = True  # unknown rows may hold prompts
        elif is_prompt_row(row):
            prompts = True
        elif "text" in row and "input_ids" not in row:
            text_only.append(name)
        elif "input_ids" in row and "text" not in row:
            _check_tokenized_rows_are_cut(name, dataset, asked, made_as, unset)
    if "kd_max_prompt_length" in asked and text_only and not prompts:
        raise ValueError(f"{text_only[0]} holds {{'text': ...}} rows, which have no prompt: kd_max_prompt_length="
                         f"{asked['kd_max_prompt_length']} would never be used; {unset.format('it')} (kd_max_length "
                         f"cuts text rows; prompt rows are {{'prompt', 'completion'}} or 'messages')")  # fmt: skip


def _check_tokenized_rows_are_cut(name: str, dataset: Any, asked: dict[str, int], made_as: dict[str, str],
                                  unset: str) -> None:  # fmt: skip
    meta = store_meta(dataset)
    store = meta is not None
    # a store cut when it was made (liger-kd precompute --max-length / --max-prompt-length) to at most the option's
    # length: the option would cut nothing more, as a recipe's and its store's same lengths do
    made = (meta or {}).get("inputs") or {}
    unused = [f"{option}={value}" for option, value in asked.items()
              if not (isinstance(made.get(made_as[option]), int) and made[made_as[option]] <= value)]  # fmt: skip
    if not unused:
        return
    kind = "a teacher store's rows, trained whole as they were scored" if store else "rows given as input_ids"
    fix = ("liger-kd precompute --max-length / --max-prompt-length cut a store's rows when it is made" if store
           else "cut the rows yourself")  # fmt: skip
    drop = unset.format("it" if len(unused) == 1 else "them")
    raise ValueError(f"{name} holds {kind}, which nothing cuts: {' and '.join(unused)} would never be used; {drop} "
                     f"({fix})")  # fmt: skip


def check_no_text_rows_to_generate_from(args: Any, dataset: Any, name: str = "train_dataset") -> None:
    """Generated steps (kd_lmbda > 0, kd_seq_kd) sample a completion after each row's prompt; a {"text": ...} row
    names none (tokenized whole, every token is scored, so its prompt would be empty and its text unused): refused
    when KDTrainer is built (and by `liger-kd train` before the weights load; `name`: how the caller names the
    rows)."""
    row = columns_of(dataset)  # column names only: an iterable's known columns will do
    if not (args.kd_lmbda > 0 or args.kd_seq_kd) or not isinstance(row, Mapping) or "text" not in row:
        return
    if any(c in row for c in ("input_ids", "prompt", "messages")):  # the text is not what trains
        return
    raise ValueError(
        f"{name} has {{'text': ...}} rows, and kd_lmbda={args.kd_lmbda} (kd_seq_kd={args.kd_seq_kd}) "
        f"generates completions after each row's prompt, which a text row does not name: give rows of "
        f"{{'prompt': ..., 'completion': ...}} (or {{'messages': [...]}}), or set kd_lmbda=0 and kd_seq_kd=False to "
        f"train on the text as it is"
    )


def check_completions_for_off_policy(args: Any, dataset: Any) -> None:
    """Prompt-only rows with steps that train on the dataset's completions (kd_lmbda < 1, no kd_seq_kd): refused
    now, by the first such row's index where the rows can be read (a list, a datasets.Dataset; else the first row),
    not at the first off-policy step that meets one (onpolicy.require_completions)."""
    if args.generates_every_step:
        return
    missing = first_prompt_without_completion(dataset)
    if missing is None:
        if not is_prompt_alone(first_row_of(dataset)):
            return
        missing = 0
    raise ValueError(
        f"kd_lmbda={args.kd_lmbda} (kd_onpolicy_warmup_steps={args.kd_onpolicy_warmup_steps}) trains some steps "
        f"on the dataset's completions, but the rows hold prompts without a completion (row {missing} the first); "
        f"give every row a 'completion', or set kd_lmbda=1 (every step generated) or kd_seq_kd=True, with no warm-up"
    )


def check_messages_end_with_the_completion(row: Any, name: str) -> None:
    """A 'messages' row's last turn is its completion, so it must be the assistant's: a conversation ending in the
    user's turn (a prompt alone, as on-policy rows are) is refused now with the column that holds one, not when its
    first batch is made after the models loaded. `name`: how the caller names the rows."""
    turns = row.get("messages") if isinstance(row, Mapping) else None
    if not isinstance(turns, list) or not turns or not isinstance(turns[-1], Mapping):
        return  # not a conversation of turns: the collator's own message
    role = turns[-1].get("role")
    if role != "assistant":
        raise ValueError(
            f"{name}: its 'messages' rows end with the {role!r} turn, and a 'messages' row's last turn is the "
            f"completion (the assistant's): for prompts alone give {{'prompt': [turns]}} rows (a conversational "
            f"prompt, whose completion kd_lmbda=1 generates), or end each conversation with the assistant's turn"
        )


def is_datasets_dataset(dataset: Any) -> bool:
    """A datasets.Dataset (map-style, read by column), told by its type's name and module: datasets is an optional
    extra, not imported to ask."""
    return type(dataset).__name__ == "Dataset" and type(dataset).__module__.startswith("datasets")


def prompt_collator(args: Any, tokenizer: Any) -> PromptCollator:
    """The collator of prompt rows as the run's options cut them (kd_max_prompt_length, kd_max_length)."""
    return PromptCollator(tokenizer, max_prompt_length=args.kd_max_prompt_length, max_length=args.kd_max_length)


def is_prompt_alone(row: Any) -> bool:
    """A row that is a prompt with no completion: 'prompt' and no 'completion', or a null one (how a
    datasets.Dataset holds a row without it), and no 'messages'."""
    return isinstance(row, Mapping) and "prompt" in row and "messages" not in row and row.get("completion") is None


def first_prompt_without_completion(dataset: Any) -> int | None:
    """The index of the first row that is_prompt_alone, in a list of rows or a datasets.Dataset (read as one arrow
    column); None when there is none or the dataset is neither (a store, an iterable)."""
    if isinstance(dataset, (list, tuple)):
        return next((i for i, row in enumerate(dataset) if is_prompt_alone(row)), None)
    if is_datasets_dataset(dataset):
        columns = dataset.column_names or ()
        if "prompt" not in columns or "messages" in columns or len(dataset) == 0:
            return None
        if "completion" not in columns:
            return 0
        import pyarrow.compute as pc  # datasets' own dependency

        missing = pc.index(pc.is_null(dataset.with_format("arrow")[:]["completion"]), True).as_py()
        return None if missing < 0 else missing
    return None


def check_evaluation_scores_completions(eval_dataset: Any, name: str = "eval_dataset",
                                        fix: str = "leave eval_dataset out") -> None:  # fmt: skip
    """Evaluation scores each row's completion and generates none: a prompt row without one has no token to score,
    so eval_loss would be 0 for it (and an average with the others' would be too low). Refused by index, before
    training. `name`: how the caller names the rows; `fix`: how the caller evaluates on none."""
    for where, rows in named_evaluations(eval_dataset, name):
        check_messages_end_with_the_completion(first_row_of(rows), where)
        missing = first_prompt_without_completion(rows)
        if missing is not None:
            raise ValueError(
                f"{where}[{missing}] is a prompt without a completion, and evaluation scores the rows' completions "
                f"(it generates none), so its eval_loss would be 0 for such rows: give every evaluation row a "
                f"'completion' (a reference answer), or {fix}"
            )


def check_not_empty(dataset: Any) -> None:
    """A train_dataset of 0 rows: refused by name (torch's sampler would say `num_samples=0` at train())."""
    try:
        rows = len(dataset)
    except TypeError:  # an iterable dataset, or none: nothing to count
        return
    if rows == 0:
        raise ValueError(
            f"train_dataset has 0 rows ({type(dataset).__name__}); give it rows to train on (a filter, a split or "
            f"max_length may have removed them all)"
        )


def _first_empty_row(dataset: Any) -> int | None:
    """The index of the first row whose input_ids are empty, in a list of rows or a datasets.Dataset (read as one
    arrow column, not row by row); None when there is none or the dataset is neither (a store, an iterable)."""
    if isinstance(dataset, (list, tuple)):
        return next((i for i, row in enumerate(dataset) if isinstance(row, Mapping) and row.get("input_ids") is not None
                     and len(row["input_ids"]) == 0), None)  # fmt: skip
    if is_datasets_dataset(dataset):
        if "input_ids" not in (dataset.column_names or ()):
            return None
        import pyarrow.compute as pc  # datasets' own dependency

        lengths = pc.list_value_length(dataset.with_format("arrow")[:]["input_ids"])
        empty = pc.index(lengths, 0).as_py()
        return None if empty < 0 else empty
    return None


def check_no_empty_rows(dataset: Any, name: str) -> None:
    """A row of no tokens (input_ids []) gives the model nothing to run on: a batch of such rows fails in the
    forward, and one beside others trains on nothing. Refused by index before training, for datasets indexed by row."""
    named = dataset.items() if isinstance(dataset, Mapping) else [(name, dataset)]
    for where, rows in named:
        empty = _first_empty_row(rows)
        if empty is not None:
            where = where if where == name else f"{name}[{where!r}]"
            raise ValueError(f"{where}[{empty}] has no tokens (input_ids of length 0): remove empty rows (e.g. "
                             f"dataset.filter(lambda row: len(row['input_ids']) > 0))")  # fmt: skip


def check_prompts_leave_completions(args: Any, tokenizer: Any, datasets: list[tuple[str, Any]]) -> None:
    """Every prompt row of each dataset (a list of rows or a datasets.Dataset) keeps a completion token under
    kd_max_length: a prompt that fills it would leave nothing to train on, which the collator refuses at the batch
    holding the row (hours in, and again on resuming from a checkpoint, the order being seeded). Refused here by
    index, before training. Nothing is read where no row can be cut so (kd_max_length unset, or
    kd_max_prompt_length below it)."""
    collate = prompt_collator(args, tokenizer)
    for name, dataset in datasets:
        indexed = isinstance(dataset, (list, tuple)) or is_datasets_dataset(dataset)
        if not indexed or not first_row_is_prompt(dataset):
            continue
        found = collate.first_row_cut_to_nothing(dataset)
        if found is not None:
            index, row, prompt_tokens = found
            raise ValueError(collate.cut_to_nothing(f"{name}[{index}]", row, prompt_tokens))


def scores_sampled_tokens_only(args: Any, dataset: Any) -> bool:
    """A rollout store under a sampled-token estimator (kd_onpolicy_loss k1, k3, pg): every batch is scored on its
    sampled tokens against the stored teacher log-probs, and the store's teacher top-k / samples go unused."""
    return args.kd_onpolicy_loss != "divergence" and rollouts_of(store_meta(dataset) or {}) is not None


def check_training_rows(
    args: Any, cfg: KDLossConfig, dataset: Any, collator: Any, teacher_model: Any, eval_dataset: Any = None
) -> None:
    """The first row's checks before any training: the dataset has rows, the collator keeps its teacher columns,
    sampled teacher tokens can train the objective (beta 0, their draw temperature), a live teacher has steps to
    score, off-policy steps have completions to train on, and so has evaluation."""
    check_not_empty(dataset)
    check_no_empty_rows(dataset, "train_dataset")
    if eval_dataset is not None:
        check_no_empty_rows(eval_dataset, "eval_dataset")
        check_evaluation_scores_completions(eval_dataset)
    check_collator_keeps_teacher_columns(dataset, collator)
    first_row = first_row_of(dataset)
    check_messages_end_with_the_completion(first_row, "train_dataset")
    train_store_checked = not scores_sampled_tokens_only(args, dataset)
    if train_store_checked:  # the estimators on a rollout store never read its samples
        check_sampled_dataset(dataset, cfg, first_row, args.kd_teacher_sample_temperature)
        check_tempered_topk(dataset, cfg)  # nor its top-k
    # evaluation scores the kd_beta divergence on the top-k, under any estimator; a store the train set's check has
    # spoken about already (the same store, or a split of it) is not spoken about twice
    eval_meta = store_meta(eval_dataset) if eval_dataset is not None else None
    if eval_dataset is not None and not (train_store_checked and eval_meta is not None
                                         and eval_meta == store_meta(dataset)):  # fmt: skip
        check_tempered_topk(eval_dataset, cfg, "eval_dataset")
    check_rows_for_several_served(args, first_row)
    check_teacher_is_used(args, teacher_model, first_row, eval_dataset)
    check_completions_for_off_policy(args, dataset)
