"""The exact served teacher: `kd_teacher_url=URL, kd_teacher_protocol="hidden"`.

`liger-kd serve` sends the teacher's final hidden states of each batch's sequences (asked a step ahead by the
served top-k path's prefetcher: retries, a dropped server waited for, no batch skipped) and, once per weight
version, its head (teacher/client/hidden_client.py). The loss then reads them as it reads an in-process teacher's
(the patched forward's `teacher_hidden_states=` / `teacher_weight=` / `teacher_bias=`, the head's soft-cap as
`teacher_softcap`; or models/signals' HiddenTeacher): the student trains on the in-process objective,
every kd_beta / kd_temperature / kd_hard_weight, padded heads (kd_vocab_size, or len(tokenizer) when both heads
are padded), on-policy rows (asked through the prefetcher's with_teacher, as the served top-k rows are) and
privileged teacher prompts (the server is asked about teacher_input_ids, the hidden states paired like a stored
signal's: models/privileged.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...batch.columns import TEACHER_HEAD, TEACHER_HIDDEN_STATES
from ...config import KDLossConfig
from ...teacher.client.hidden_client import HIDDEN_PROTOCOL, HiddenClient
from ...teacher.client.prefetch import Segments, TeacherPrefetcher, keys_of
from ...wire.hidden_wire import WIRE_DTYPES, TeacherHead
from ..arguments import KDTrainingArguments, checks_arguments
from .base import KDStepOutput, TeacherSource, one_teacher_loss
from .other_tokenizer import padded_vocab_size
from .served import check_client_timing, prefetched, teacher_client


def carries_hidden(batch: Mapping[str, Any]) -> bool:
    return batch.get(TEACHER_HIDDEN_STATES) is not None


@checks_arguments(rank=2)
def check_served_hidden_args(args: KDTrainingArguments) -> None:
    """KDTrainingArguments with kd_teacher_protocol='hidden', validated when the arguments are made (the top-k
    protocols' checks are teachers/served.py's)."""
    if not args.kd_teacher_url or args.kd_teacher_protocol != HIDDEN_PROTOCOL:
        return
    if isinstance(args.kd_teacher_url, Mapping):  # several served teachers: set_fetch.py checks them
        return
    check_hidden_dtype(args)
    check_client_timing(args)
    refused = {
        "kd_teacher_samples": args.kd_teacher_samples is not None,
        "kd_teacher_tokenizer": bool(args.kd_teacher_tokenizer),
        "kd_seq_kd": args.kd_seq_kd,
        "kd_self_distill": args.kd_self_distill,
    }
    used = [name for name, on in refused.items() if on]
    if used:
        raise ValueError(
            f"kd_teacher_protocol='hidden' (the served teacher's hidden states, scored over the "
            f"student's vocabulary) does not take {used}: unset them, or use a top-k protocol"
        )


def check_hidden_dtype(args: KDTrainingArguments) -> None:
    if args.kd_teacher_hidden_dtype not in WIRE_DTYPES:
        raise ValueError(f"kd_teacher_hidden_dtype must be one of {WIRE_DTYPES}; got {args.kd_teacher_hidden_dtype!r}")


class HiddenPrefetcher(TeacherPrefetcher):
    """TeacherPrefetcher attaching `teacher_hidden_states` (B, T, H) (zeros at padding) and the `teacher_head`
    they were computed with."""

    def attach(self, batch: Mapping[str, Any], segments: Segments, replies: list) -> dict[str, Any]:
        if TEACHER_HIDDEN_STATES in batch:
            raise ValueError(f"the batch already holds {TEACHER_HIDDEN_STATES}: use stored hidden states or a server, "
                             f"not both")  # fmt: skip
        heads = {id(head): head for _, head in replies}
        if len(heads) > 1:  # its requests straddled a weight update: ask again, all after it
            return self.with_teacher(batch)
        ids = batch[keys_of(batch, self.keys)[0]]
        head = next(iter(heads.values()))
        states = torch.zeros((*ids.shape, head.weight.shape[-1]), dtype=replies[0][0].dtype)
        for (row, positions), (hidden, _) in zip(segments, replies):
            states[row, positions] = hidden
        return {**batch, TEACHER_HIDDEN_STATES: states, TEACHER_HEAD: head}


class HeadOnDevice:
    """A served head's tensors on the student's device, moved once per (weight version, device)."""

    def __init__(self) -> None:
        self.key: tuple[int, torch.device] | None = None
        self.tensors: dict[str, torch.Tensor | None] = {}

    def put(self, inputs: dict, head: TeacherHead, cfg: KDLossConfig) -> KDLossConfig:
        """Put the batch's teacher (its hidden states, `head` on their device) into `inputs` as the patched forward
        takes it; the loss config with the head's soft-cap."""
        device = inputs[TEACHER_HIDDEN_STATES].device
        if self.key != (head.version, device):
            self.tensors = {"teacher_weight": head.weight.to(device), "teacher_bias": None}
            if head.bias is not None:
                self.tensors["teacher_bias"] = head.bias.to(device)
            self.key = (head.version, device)
        inputs.update(self.tensors)
        # fp8 replies arrive dequantised in fp32
        inputs[TEACHER_HIDDEN_STATES] = inputs[TEACHER_HIDDEN_STATES].to(head.weight.dtype)
        return cfg.replace(teacher_softcap=head.softcap)


class ServedHiddenTeacher(TeacherSource):
    """A teacher served as hidden states at `url` (default kd_teacher_url; see the module docstring). `vocab_size`:
    the vocabulary read from the served head when the dataloader is made (None: the Trainer's kd_config decides,
    heads of one size). In a set, the set asks it about its own rows (set_fetch.py) and puts its head (`head`)."""

    fetches = True

    def __init__(self, args: KDTrainingArguments, tokenizer: Any, fused: bool, url: str | None = None) -> None:
        super().__init__(fused)
        self.args, self.tokenizer, self.url = args, tokenizer, url or args.kd_teacher_url
        self.client: HiddenClient | None = None
        self.head = HeadOnDevice()

    def dataloader(self, dataloader: Any, student_vocab_size: Callable[[], int], depth: int = 4) -> Any:
        """The training DataLoader, each batch with its hidden states fetched `depth` batches ahead (CPU batches:
        the Trainer moves them with their teacher data); the server waited for and its head read now, before the
        first step."""
        self.prefetcher = self.asking(dataloader, student_vocab_size, depth=depth)
        # every step generated: the dataset's rows are only prompts, nothing to ask the server about ahead
        return dataloader if self.args.generates_every_step else self.prefetcher

    def eval_dataloader(self, dataloader: Any, student_vocab_size: Callable[[], int]) -> Any:
        return self.asking(dataloader, student_vocab_size, ahead=False)

    def asking(self, dataloader: Any, student_vocab_size: Callable[[], int], depth: int = 4,
               ahead: bool = True) -> HiddenPrefetcher:  # fmt: skip
        """`dataloader` (training's or evaluation's) wrapped to fetch each batch's hidden states; the client made,
        and the served head read, for the first DataLoader (the head then cached, fetched again for new weights)."""
        if self.client is None:
            self.client = teacher_client(self.args, self.url, HIDDEN_PROTOCOL)
            self.vocab_size = self.served_vocab_size(student_vocab_size())
        return prefetched(dataloader, self.client, depth=depth, kind=HiddenPrefetcher, ahead=ahead)

    def served_vocab_size(self, student_rows: int) -> int | None:
        """The vocabulary both distributions are taken over, from the served head (the server must answer: waited
        for up to kd_teacher_timeout): heads of other sizes are padded rows of one tokenizer (kd_vocab_size, else
        len(tokenizer) as for an in-process teacher: trainer/dataset_setup.with_vocab_size). None: nothing to
        change (kd_vocab_size given, or heads of one size)."""
        self.client.wait_until_ready()
        rows = (student_rows, self.client.head().weight.shape[0])
        if self.args.kd_vocab_size is not None or rows[0] == rows[1]:
            return None
        if self.tokenizer is None or not hasattr(self.tokenizer, "__len__"):
            raise ValueError(
                f"the student's lm_head has {rows[0]} rows and the served teacher's {rows[1]}; set kd_vocab_size to "
                f"the number of real tokens (len(tokenizer)), or pass processing_class=tokenizer"
            )
        no_local_teacher = torch.nn.Module()  # no saved tokenizer to compare: both heads must be padded
        return padded_vocab_size(rows, self.tokenizer, no_local_teacher)

    def prepare(self, inputs: dict) -> dict:
        if not carries_hidden(inputs):
            raise ValueError(
                f"no teacher: the batch has no {TEACHER_HIDDEN_STATES} from kd_teacher_url={self.url} "
                f"(kd_teacher_protocol='hidden'), which the training and evaluation DataLoaders' batches and generated "
                f"rows are asked for; score other batches with an in-process teacher_model"
            )
        return inputs

    def loss(self, model, inputs: dict, num_items_in_batch, cfg: KDLossConfig, log_now: bool,
             behaviour=None) -> KDStepOutput:  # fmt: skip
        cfg = self.signal(inputs, cfg)
        step = one_teacher_loss(model, None, inputs, num_items_in_batch, cfg, log_now, self.fused, behaviour)
        step.teacher_metrics = self.metrics() if log_now else None
        return step

    def signal(self, inputs: dict, cfg: KDLossConfig) -> KDLossConfig:
        return self.head.put(inputs, inputs.pop(TEACHER_HEAD), cfg)

    def metrics(self) -> dict[str, float]:
        """Wire figures for logs: bytes per token received, head fetches, seconds the loop waited for replies."""
        client, prefetcher = self.client, self.prefetcher
        if client is None:
            return {}
        return {
            "kd_teacher_bytes_per_token": client.bytes_received / max(1, client.tokens_received),
            "kd_teacher_head_fetches": float(client.head_fetches),
            "kd_teacher_wait_seconds": prefetcher.wait_seconds if prefetcher is not None else 0.0,
        }
