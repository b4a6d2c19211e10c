"""The Trainer's glue to a served teacher: its kd_teacher_* arguments checked, and its training DataLoader wrapped
with a TeacherPrefetcher (teacher/serve/) asking the server about each batch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..conventions import require_sampled_objective
from ..teacher.serve import PROTOCOLS, TeacherClient, TeacherPrefetcher
from ..teacher.serve.prefetch import TEACHER_KEYS
from ..teacher.store.samples import MAX_SAMPLES
from .served_hidden import HIDDEN_PROTOCOL, check_served_hidden_args

if TYPE_CHECKING:
    from .arguments import KDTrainingArguments

CROSS_TOKENIZER_KEYS = TEACHER_KEYS  # the teacher's own tokenization


def served_teacher_dataloader(
    dataloader: Any, args: KDTrainingArguments, *, vocab_size: int, depth: int = 4,
    keys: tuple[str, str] | None = None,
) -> TeacherPrefetcher:  # fmt: skip
    """The Trainer's training DataLoader wrapped with a prefetcher asking args.kd_teacher_url (KDTrainingArguments'
    kd_teacher_* fields) about batch[keys[0]] (keys=None: the batch's teacher_input_ids when it has them, the rows'
    own teacher prompt + completion; else its input_ids). Batches stay on the CPU until the Trainer moves them (with
    their teacher data) to the device, so the background thread never waits on the GPU."""
    if getattr(dataloader, "device", None) is not None:
        dataloader.device = None  # accelerate's DataLoaderShard would move batches in our background thread
    client = TeacherClient(
        args.kd_teacher_url, args.kd_teacher_protocol, top_k=args.kd_teacher_top_k, vocab_size=vocab_size,
        timeout=args.kd_teacher_timeout, retries=args.kd_teacher_retries, api_key=args.kd_teacher_api_key,
        samples=args.kd_teacher_samples, sample_seed=args.kd_teacher_sample_seed,
        sample_temperature=args.kd_temperature,  # drawn at the training temperature: the estimate is then exact
    )  # fmt: skip
    return TeacherPrefetcher(dataloader, client, depth=depth, keys=keys)


def check_served_teacher_args(args: KDTrainingArguments) -> None:
    """KDTrainingArguments' kd_teacher_* fields, validated when the arguments are made."""
    if not args.kd_teacher_url:
        return
    if args.kd_teacher_protocol == HIDDEN_PROTOCOL:  # the exact teacher: served_hidden.py
        check_served_hidden_args(args)
        return
    if args.kd_teacher_protocol not in PROTOCOLS:
        raise ValueError(f"kd_teacher_protocol must be one of {(*PROTOCOLS, HIDDEN_PROTOCOL)}; got "
                         f"{args.kd_teacher_protocol!r}")  # fmt: skip
    if args.kd_teacher_samples is not None:
        check_served_samples_args(args)
    elif args.kd_teacher_top_k < 1 or args.kd_teacher_timeout <= 0 or args.kd_teacher_retries < 0:
        raise ValueError(
            f"need kd_teacher_top_k >= 1, kd_teacher_timeout > 0, kd_teacher_retries >= 0; got "
            f"{args.kd_teacher_top_k}, {args.kd_teacher_timeout}, {args.kd_teacher_retries}"
        )
    if args.kd_onpolicy_loss != "divergence":
        raise ValueError(
            f"kd_onpolicy_loss={args.kd_onpolicy_loss!r} needs the teacher's log-prob of every sampled token; a served "
            f"teacher sends its top-{args.kd_teacher_top_k}, which may not hold it: use kd_onpolicy_loss='divergence' "
            f"or an in-process teacher_model"
        )
    if args.kd_seq_kd or args.kd_self_distill:
        raise ValueError(
            "kd_teacher_url serves teacher log-probs; sequence-level KD (kd_seq_kd, the teacher generates) and "
            "self-distillation need a teacher_model in the process"
        )


def check_served_samples_args(args: KDTrainingArguments) -> None:
    """kd_teacher_samples (sampled teacher tokens from `liger-kd serve`), validated with the arguments: the liger
    protocol, one server, the sampled loss's objective (forward KL), offline-style batches."""
    m, k, seed = args.kd_teacher_samples, args.kd_teacher_top_k, args.kd_teacher_sample_seed
    if not isinstance(m, int) or isinstance(m, bool) or not 1 <= m <= MAX_SAMPLES:
        raise ValueError(f"kd_teacher_samples must be None or an int in [1, {MAX_SAMPLES}] (draws per position); "
                         f"got {m!r}")  # fmt: skip
    if k < 0 or not isinstance(seed, int) or seed < 0 or args.kd_teacher_timeout <= 0 or args.kd_teacher_retries < 0:
        raise ValueError(
            f"with kd_teacher_samples need kd_teacher_top_k >= 0 (the hybrid's exact top-k; 0: draws alone), "
            f"kd_teacher_sample_seed >= 0, kd_teacher_timeout > 0, kd_teacher_retries >= 0; got {k}, {seed!r}, "
            f"{args.kd_teacher_timeout}, {args.kd_teacher_retries}"
        )
    if args.kd_teacher_protocol != "liger" or isinstance(args.kd_teacher_url, dict):
        raise ValueError(
            f"kd_teacher_samples: sampled teacher tokens are served by one `liger-kd serve` (kd_teacher_protocol="
            f"'liger', kd_teacher_url a str); got kd_teacher_protocol={args.kd_teacher_protocol!r}"
        )
    try:
        require_sampled_objective(args.kd_loss_config())
    except ValueError as e:
        raise ValueError(f"kd_beta: kd_teacher_samples asks for sampled teacher tokens; {e}") from None
    if args.kd_lmbda > 0 or args.kd_teacher_tokenizer or args.kd_seq_kd or args.kd_self_distill:
        raise ValueError(
            "kd_teacher_samples trains on the dataset's sequences with one tokenizer: leave kd_lmbda=0, "
            "kd_teacher_tokenizer=None, kd_seq_kd and kd_self_distill off (or ask for the top-k: "
            "kd_teacher_samples=None)"
        )
