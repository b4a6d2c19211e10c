"""The Trainer's glue to a served teacher: its kd_teacher_* arguments checked, and its training and evaluation
DataLoaders wrapped with a TeacherPrefetcher (teacher/client/) asking the server about each batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers.utils import logging

from ...conventions import require_sampled_objective
from ...teacher.client import TeacherClient, TeacherPrefetcher
from ...teacher.client.client import AUTO_PROTOCOL
from ...teacher.client.hidden_client import HIDDEN_PROTOCOL, HiddenClient
from ...teacher.client.prefetch import TEACHER_KEYS
from ...wire import PROTOCOLS
from ...wire.sampled_tokens import MAX_SAMPLES
from ..arguments import KDTrainingArguments, checks_arguments, field_defaults
from .base import KDStepOutput, TeacherSource
from .stored import StoredTeacher

CROSS_TOKENIZER_KEYS = TEACHER_KEYS  # the teacher's own tokenization
logger = logging.get_logger(__name__)


def checked_teacher_client(
    args: KDTrainingArguments, *, vocab_size: int, keys: tuple[str, str] | None = None, tokenizer: Any = None,
    url: str | None = None, protocol: str | None = None,
) -> TeacherClient:  # fmt: skip
    """The client of a served top-k (or sampled) teacher at `url` with `protocol` (default: args.kd_teacher_url and
    kd_teacher_protocol; KDTrainingArguments' other kd_teacher_* fields), the server asked what it serves first
    (check_teacher_server): when the first DataLoader is made, before the first step. `keys`: CROSS_TOKENIZER_KEYS
    when it is asked about the teacher's own tokens."""
    client = teacher_client(
        args, url or args.kd_teacher_url, protocol or args.kd_teacher_protocol, vocab_size=vocab_size,
        samples=args.kd_teacher_samples, sample_seed=args.kd_teacher_sample_seed,
        sample_temperature=args.kd_temperature,  # drawn at the training temperature: the estimate is then exact
    )  # fmt: skip
    check_teacher_server(client, args, vocab_size=vocab_size, tokenizer=tokenizer,
                         own_vocabulary=keys == CROSS_TOKENIZER_KEYS)  # fmt: skip
    return client


def prefetched(dataloader: Any, client: Any, *, depth: int = 4, keys: tuple[str, str] | None = None,
               kind: type[TeacherPrefetcher] = TeacherPrefetcher, ahead: bool = True) -> TeacherPrefetcher:  # fmt: skip
    """`dataloader` wrapped to ask `client` about each batch, `depth` batches ahead (training), or as each is drawn
    (ahead=False: evaluation, see TeacherPrefetcher), its batches left on the CPU until the Trainer moves them with
    their teacher data."""
    if getattr(dataloader, "device", None) is not None:
        dataloader.device = None  # accelerate's DataLoaderShard would move batches in our background thread
    return kind(dataloader, client, depth=depth, keys=keys, ahead=ahead)


def teacher_client(
    args: KDTrainingArguments, url: str, protocol: str, *, vocab_size: int | None = None, **sampling: Any
) -> TeacherClient | HiddenClient:
    """The client of one served teacher, with KDTrainingArguments' connection options (kd_teacher_timeout,
    kd_teacher_retries, kd_teacher_api_key): a HiddenClient for the "hidden" protocol (kd_teacher_hidden_dtype on the
    wire), else a top-k TeacherClient (kd_teacher_top_k over `vocab_size`; `sampling`: its sampled-token options)."""
    options = dict(timeout=args.kd_teacher_timeout, retries=args.kd_teacher_retries, api_key=args.kd_teacher_api_key)
    if protocol == HIDDEN_PROTOCOL:
        return HiddenClient(url, dtype=args.kd_teacher_hidden_dtype, **options)
    return TeacherClient(url, protocol, top_k=args.kd_teacher_top_k, vocab_size=vocab_size, **options, **sampling)


def check_teacher_server(
    client: TeacherClient, args: KDTrainingArguments, *, vocab_size: int, tokenizer: Any = None,
    own_vocabulary: bool = False,
) -> dict:  # fmt: skip
    """What the server at client.url serves (GET /v1/models, once it answers /health): a kd_teacher_top_k above
    its --top-k, or a vocabulary that cannot be the one the loss uses, is a one-line ValueError now rather than a
    failed request at the first step. `liger-kd serve` lists both; vLLM and SGLang list the model alone (a top-k
    above vLLM's --max-logprobs is its 400 at the first request). `vocab_size`: the ids the loss takes (the
    student's, or with `own_vocabulary` the teacher tokenizer's, across tokenizers). Returns the model's entry."""
    client.wait_until_ready()
    model = client.served_model()
    protocol = client.resolve_protocol(model)  # kd_teacher_protocol="auto": the best this server speaks
    where = f"kd_teacher_url={client.url} (model {model['id']!r})"
    most = model.get("max_logprobs")
    if isinstance(most, int) and args.kd_teacher_top_k > most:
        raise ValueError(
            f"kd_teacher_top_k={args.kd_teacher_top_k} asks {where} for {args.kd_teacher_top_k} log-probs per "
            f"position, and it serves at most {most} (its --top-k): set kd_teacher_top_k={most} (or lower), or "
            f"restart the server with --top-k {args.kd_teacher_top_k}"
        )
    served = model.get("vocab_size")
    if isinstance(served, int) and not isinstance(served, bool):
        check_served_vocabulary(served, vocab_size, where, args.kd_vocab_size, tokenizer, own_vocabulary)
    logger.info("served teacher: %s, protocol %r, top-%d of at most %s, vocabulary %s", where, protocol,
                args.kd_teacher_top_k, most, served)  # fmt: skip
    return model


def check_served_vocabulary(
    served: int, vocab_size: int, where: str, kd_vocab_size: int | None, tokenizer: Any, own_vocabulary: bool
) -> None:
    """The served teacher's lm_head rows against the vocabulary of the loss, as KDTrainer checks an in-process
    teacher's (dataset_setup.with_vocab_size): equal, or the extra rows of one of them padding of one tokenizer."""
    if served == vocab_size:
        return
    n = len(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else None
    if own_vocabulary or kd_vocab_size is not None:  # the real tokens are known: the teacher's head must hold them
        if served >= vocab_size:
            return
        what = "the teacher tokenizer's" if own_vocabulary else f"kd_vocab_size={kd_vocab_size}"
        raise ValueError(f"{where} has a vocabulary of {served} ids, fewer than {what} {vocab_size}: it is not "
                         f"that tokenizer's model; serve the teacher the data was tokenized for")  # fmt: skip
    if served > vocab_size and n is not None and n < vocab_size:  # both heads padded beyond one tokenizer
        logger.warning_once(f"{where} has {served} vocabulary rows and the student {vocab_size}: distilling over "
                            f"the student's; set kd_vocab_size={n} (len(tokenizer)) to say so")  # fmt: skip
        return
    fix = f"kd_vocab_size={n} (len(tokenizer))" if n is not None and n <= min(served, vocab_size) else "kd_vocab_size"
    raise ValueError(
        f"{where} has a vocabulary of {served} ids and the student's lm_head {vocab_size}: distillation compares "
        f"distributions over one vocabulary. If both share a tokenizer and the extra rows are padding, set {fix}; "
        f"if the teacher has its own tokenizer, set kd_teacher_tokenizer (cross-tokenizer distillation)"
    )



@checks_arguments(rank=2)
def check_teacher_protocol(args: KDTrainingArguments) -> None:
    """kd_teacher_protocol, validated here alone when the arguments are made: one protocol (str) for a served
    teacher, or {name: protocol} naming each of kd_teacher_url's served teachers. The kinds it chooses are
    teachers/plan.py's (served.py, served_hidden.py; several: member_set.py, set_fetch.py)."""
    protocol, urls, known = args.kd_teacher_protocol, args.kd_teacher_url, (AUTO_PROTOCOL, *PROTOCOLS, HIDDEN_PROTOCOL)
    if isinstance(protocol, Mapping):
        if not isinstance(urls, Mapping):
            raise ValueError(f"kd_teacher_protocol is a dict ({dict(protocol)}) but kd_teacher_url is not: give "
                             f"kd_teacher_url={{name: url}} with the same names, or one protocol as a str")  # fmt: skip
        if set(protocol) != set(urls):
            raise ValueError(f"kd_teacher_protocol names {sorted(protocol)} and kd_teacher_url {sorted(urls)}: give "
                             f"one protocol per served teacher, the same names")  # fmt: skip
        wrong = {name: p for name, p in dict(protocol).items() if p not in known}
        if wrong:
            raise ValueError(f"kd_teacher_protocol values must be in {known}; got {wrong}")
    elif urls and protocol not in known:
        raise ValueError(f"kd_teacher_protocol must be one of {known}; got {protocol!r}")


@checks_arguments(rank=2)
def check_served_teacher_args(args: KDTrainingArguments) -> None:
    """KDTrainingArguments' kd_teacher_* fields for a top-k (or sampled) served teacher, validated when the
    arguments are made."""
    if not args.kd_teacher_url or args.kd_teacher_protocol == HIDDEN_PROTOCOL:  # the exact one: served_hidden.py
        return
    if isinstance(args.kd_teacher_protocol, Mapping):  # one per served teacher: set_fetch.py checks them
        return
    if args.kd_teacher_samples is not None:
        check_served_samples_args(args)
    else:
        check_topk_client_options(args)
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


def check_client_timing(args: KDTrainingArguments) -> None:
    """What every served-teacher client (top-k, sampled, hidden states) is asked with: a timeout, retries that are
    not negative."""
    if not args.kd_teacher_timeout > 0 or args.kd_teacher_retries < 0:
        raise ValueError(f"a served teacher needs kd_teacher_timeout > 0 (seconds) and kd_teacher_retries >= 0; got "
                         f"{args.kd_teacher_timeout} and {args.kd_teacher_retries}")  # fmt: skip


def check_topk_client_options(args: KDTrainingArguments) -> None:
    """What a top-k client is asked with: at least one log-prob, a timeout, retries that are not negative."""
    check_client_timing(args)
    if args.kd_teacher_top_k < 1:
        raise ValueError(f"a served top-k teacher needs kd_teacher_top_k >= 1; got {args.kd_teacher_top_k}")


def check_served_samples_args(args: KDTrainingArguments) -> None:
    """kd_teacher_samples (sampled teacher tokens from `liger-kd serve`), validated with the arguments: the liger
    protocol, one server, the sampled loss's objective (forward KL), offline-style batches."""
    m, k, seed = args.kd_teacher_samples, args.kd_teacher_top_k, args.kd_teacher_sample_seed
    if not isinstance(m, int) or isinstance(m, bool) or not 1 <= m <= MAX_SAMPLES:
        raise ValueError(f"kd_teacher_samples must be None or an int in [1, {MAX_SAMPLES}] (draws per position); "
                         f"got {m!r}")  # fmt: skip
    check_client_timing(args)
    if k < 0 or not isinstance(seed, int) or seed < 0:
        raise ValueError(
            f"with kd_teacher_samples need kd_teacher_top_k >= 0 (the hybrid's exact top-k; 0: draws alone) and "
            f"kd_teacher_sample_seed >= 0; got {k} and {seed!r}"
        )
    if args.kd_teacher_protocol not in ("liger", AUTO_PROTOCOL) or isinstance(args.kd_teacher_url, dict):
        raise ValueError(
            f"kd_teacher_samples: sampled teacher tokens are served by one `liger-kd serve` (kd_teacher_protocol="
            f"'liger' or 'auto', kd_teacher_url a str); got kd_teacher_protocol={args.kd_teacher_protocol!r}"
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


class ServedTeacher(TeacherSource):
    """A teacher behind `url` (default kd_teacher_url): each batch's top-k (and / or samples) asked of the server
    `depth` batches ahead by a TeacherPrefetcher wrapping the DataLoader (the fetch, here), the rows then scored by
    the stored member (`rows`), as a store's rows are. In a set, the set asks it about its own rows (set_fetch.py)."""

    from_rows = False  # the server is asked about every batch, evaluation's too
    fetches = True

    def __init__(self, args: KDTrainingArguments, fused: bool, url: str | None = None,
                 protocol: str | None = None) -> None:  # fmt: skip
        super().__init__(fused)
        self.args = args
        self.url, self.protocol = url or args.kd_teacher_url, protocol or args.kd_teacher_protocol
        self.keys: tuple[str, str] | None = None  # the student's tokens; CROSS_TOKENIZER_KEYS: the teacher's own
        self.own_vocab_size: int | None = None  # the ids of the teacher's own tokenizer, asked about its own tokens
        self.client: TeacherClient | None = None  # made, and the server checked, for the first DataLoader
        self.rows = StoredTeacher(fused)  # a batch with the server's reply attached carries its teacher's data

    def ask_about_own_tokens(self, vocab_size: int) -> None:
        """Ask the server about the teacher's own tokenization of each row, over its own `vocab_size` ids (a
        teacher of another tokenizer: other_tokenizer.py wraps this member)."""
        self.keys, self.own_vocab_size = CROSS_TOKENIZER_KEYS, vocab_size

    def checked_client(self, student_vocab_size: int) -> TeacherClient:
        """Its client, the server checked (checked_teacher_client) over the ids of the loss."""
        return checked_teacher_client(self.args, vocab_size=self.own_vocab_size or student_vocab_size, keys=self.keys,
                                      url=self.url, protocol=self.protocol)  # fmt: skip

    def dataloader(self, dataloader, student_vocab_size):
        self.prefetcher = self.asking(dataloader, student_vocab_size)
        # every step generated: the dataset's rows are only prompts, nothing to ask the server about ahead
        return dataloader if self.args.generates_every_step else self.prefetcher

    def eval_dataloader(self, dataloader, student_vocab_size):
        return self.asking(dataloader, student_vocab_size, ahead=False)

    def asking(self, dataloader, student_vocab_size, ahead: bool = True) -> TeacherPrefetcher:
        if self.client is None:
            self.client = self.checked_client(student_vocab_size())
        return prefetched(dataloader, self.client, keys=self.keys, ahead=ahead)

    def prepare(self, inputs: dict) -> dict:
        return self.rows.prepare(inputs)

    def loss(self, model, inputs: dict, num_items_in_batch, cfg, log_now: bool, behaviour=None) -> KDStepOutput:
        return self.rows.loss(model, inputs, num_items_in_batch, cfg, log_now, behaviour)


# options only a teacher server reads: with no kd_teacher_url they describe a teacher the run does not have (in
# KDTrainingArguments' order, the order they are named in)
SERVER_ONLY_OPTIONS = ("kd_teacher_protocol", "kd_teacher_hidden_dtype", "kd_teacher_top_k", "kd_teacher_samples",
                       "kd_teacher_sample_seed")  # fmt: skip


def say_unused_server_options(args: Any) -> None:
    """A server-only option changed from its default with no kd_teacher_url is said to be unused, once, naming it:
    the run trains against another teacher (a model, a store) than the one the option describes. Said, not refused:
    one config may serve a served run and an in-process one."""
    if args.kd_teacher_url:
        return
    defaults = field_defaults(args)
    unused = [f"{name}={getattr(args, name)!r}" for name in SERVER_ONLY_OPTIONS
              if name in defaults and getattr(args, name) != defaults[name]]  # fmt: skip
    if unused:
        logger.warning(
            "%s %s read only from a teacher server, and kd_teacher_url is not set: %s unused (set kd_teacher_url to "
            "the server to use %s)", " and ".join(unused), "is" if len(unused) == 1 else "are",
            "it is" if len(unused) == 1 else "they are", "it" if len(unused) == 1 else "them",
        )
