"""KDTrainer: online, offline (teacher log-probs as data), served and on-policy distillation through the Hugging
Face Trainer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import Trainer
from transformers.utils import logging

from .. import distributed
from ..config import KDLossConfig
from ..models import apply_kd_patch, patch_teacher_kernels, quantize_teacher_fp8, unwrap_model
from ..models.kd_io import TeacherInputs, targets_of
from ..models.materialised import materialised_kd
from ..models.privileged import PrivilegedInputs
from ..models.recompute import limit_recompute
from ..teacher import TeacherDataCollator
from .arguments import KDTrainingArguments
from .cross_tokenizer import (
    CROSS_TOKENIZER_COLUMNS,
    CrossTokenizerSetup,
    compute_cross_tokenizer_loss,
    cross_tokenizer_enabled,
    is_cross_tokenizer_batch,
    padded_vocab_size,
)
from .onpolicy import GENERATED, HAS_COMPLETION, OnPolicySteps, require_completions
from .privileged import PRIVILEGED_COLUMNS, PrivilegedCollator, is_privileged_row
from .prompts import PROMPT_COLUMNS, PromptCollator, is_prompt_row
from .self_distill import is_self_teacher, require_teacher_prompt, self_distill_teacher
from .served import CROSS_TOKENIZER_KEYS, served_teacher_dataloader

logger = logging.get_logger(__name__)

KD_COLUMNS = ("teacher_token_ids", "teacher_logprobs")


class KDTrainer(Trainer):
    """Trainer that distils `teacher_model` (or the teacher log-probs in the batches) into `model`.

    The loss is soft_weight * KD + hard_weight * CE as KDTrainingArguments set it, exact under gradient
    accumulation (normalised by the token count of the whole accumulated batch). With use_kd_patch it runs
    through the patched forward (no logits); without, the same objective on materialised logits
    (reference.py), the baseline to compare with.
    """

    def __init__(
        self,
        model: nn.Module,
        teacher_model: nn.Module | None = None,
        args: KDTrainingArguments | None = None,
        teacher_tokenizer: Any = None,
        **kwargs,
    ):
        if args is None or not isinstance(args, KDTrainingArguments):
            raise ValueError("KDTrainer needs args=KDTrainingArguments(...)")
        if args.kd_teacher_url and teacher_model is not None:
            raise ValueError("pass teacher_model or set kd_teacher_url (a teacher server), not both")
        if args.n_gpu > 1:
            # One process seeing several GPUs would make the Trainer wrap the student in nn.DataParallel, which
            # splits every input tensor across replicas while the teacher stays on one GPU. Distillation runs one
            # GPU per process; several GPUs through accelerate / torchrun (DDP, FSDP, ZeRO-3).
            logger.warning(
                f"KDTrainer: this process sees {args.n_gpu} GPUs; training on one (cuda:0). For several GPUs, launch "
                f"one process per GPU: `accelerate launch` or `torchrun` (DDP, FSDP or DeepSpeed)"
            )
            args._n_gpu = 1
        self.xtok = None
        if cross_tokenizer_enabled(args, teacher_tokenizer):  # another tokenizer: liger_patch_kd/align/
            self.xtok = CrossTokenizerSetup.build(
                args, kwargs.get("processing_class"), model, teacher_model, teacher_tokenizer=teacher_tokenizer
            )
            kwargs["data_collator"] = kwargs.get("data_collator") or self.xtok.collator
            self.kd_config = args.kd_loss_config()
        else:
            self.kd_config = _with_vocab_size(
                args.kd_loss_config(), model, teacher_model, kwargs.get("processing_class")
            )
        self.prompt_rows = _first_row_is_prompt(kwargs.get("train_dataset"))
        if kwargs.get("data_collator") is None and self.prompt_rows:  # TRL's prompt / completion / messages rows
            if kwargs.get("processing_class") is None:
                raise ValueError("a dataset of prompts needs processing_class=tokenizer to tokenize them")
            kwargs["data_collator"] = PromptCollator(
                kwargs["processing_class"], max_prompt_length=args.kd_max_prompt_length
            )
        if kwargs.get("data_collator") is None and _first_row(kwargs.get("train_dataset"), is_privileged_row):
            pad = getattr(kwargs.get("processing_class"), "pad_token_id", None)  # the teacher's own token rows
            kwargs["data_collator"] = PrivilegedCollator(pad_token_id=0 if pad is None else pad)
        if kwargs.get("data_collator") is None:
            # pads input_ids, labels and the teacher columns alike; HF's default padding collator pads no labels
            pad = getattr(kwargs.get("processing_class"), "pad_token_id", None)
            kwargs["data_collator"] = TeacherDataCollator(pad_token_id=0 if pad is None else pad)
        if args.use_kd_patch:
            apply_kd_patch(model=model, kd_config=self.kd_config, **(args.kd_patch_config or {}))
        super().__init__(model=model, args=args, **kwargs)
        self.model_accepts_loss_kwargs = True  # compute_loss normalises by num_items_in_batch itself
        if self._fsdp_version() == 2:  # lm_head must stay in the root unit: see distributed.py
            self.model = self.model_wrapped = distributed.fsdp2_prepare(self.model, self.accelerator, trainable=True)
        if args.kd_self_distill:
            if teacher_model is not None:
                raise ValueError("kd_self_distill makes the student its own teacher; do not pass teacher_model")
            teacher_model = self_distill_teacher(args.kd_self_distill, self.model)  # self_distill.py
        elif teacher_model is not None:
            teacher_model.eval().requires_grad_(False)
            if args.use_kd_patch:
                patch_teacher_kernels(teacher_model, args.kd_patch_config)
            teacher_model = self._prepare_teacher(teacher_model)
        if args.kd_teacher_precision == "fp8":
            if teacher_model is None or args.kd_self_distill:
                raise ValueError(
                    "kd_teacher_precision='fp8' quantises an in-process teacher_model; this run has none "
                    "(offline data, a teacher server or self-distillation): serve the teacher with "
                    "`liger-kd serve --precision fp8` instead, or leave kd_teacher_precision='bf16'"
                )
            summary = quantize_teacher_fp8(teacher_model)
            logger.info(
                "FP8 teacher: %d products quantised, %d kept in bf16 (%s); %.2f -> %.2f GiB",
                len(summary.quantized), len(summary.kept), ", ".join(sorted(set(summary.kept.values()))),
                summary.bytes_before / 2**30, summary.bytes_after / 2**30,
            )  # fmt: skip
        self.teacher_model = teacher_model
        self._kd_sums: dict[str, torch.Tensor] = {}
        self._kd_count = 0
        self._kd_agreement: torch.Tensor | None = None
        self._kd_recompute_limited = False
        self.onpolicy = OnPolicySteps(args)
        self._served = None  # the served teacher's prefetcher: asked about generated rows too
        if args.kd_seq_kd and teacher_model is None:
            raise ValueError("kd_seq_kd samples completions from the teacher: pass teacher_model")
        if self.onpolicy.enabled and teacher_model is None and not args.kd_teacher_url:
            raise ValueError(
                f"kd_lmbda={args.kd_lmbda} trains on completions generated during training, which no offline store "
                f"holds: pass teacher_model (or kd_self_distill=True) or kd_teacher_url, or set kd_lmbda=0"
            )

    @property
    def kd_rollout_seconds(self) -> list[float]:
        """Seconds spent in generate() per generated optimizer step."""
        return self.onpolicy.seconds

    def _fsdp_version(self) -> int | None:
        return getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1) if self.is_fsdp_enabled else None

    def _prepare_teacher(self, teacher: nn.Module) -> nn.Module:
        """Shard the frozen teacher like the student (accelerate's prepare_model(evaluation_mode=True) would leave
        it whole on every process); on one device, move it there."""
        version = self._fsdp_version()
        if version == 2:
            return distributed.fsdp2_prepare(teacher, self.accelerator, trainable=False)
        if version == 1:
            return distributed.fsdp1_prepare_teacher(teacher, self.accelerator)
        if self.is_deepspeed_enabled:
            config = distributed.zero3_teacher_config(
                self.accelerator.state.deepspeed_plugin.deepspeed_config,
                hidden_size=teacher.config.hidden_size,
                micro_batch=self.args.per_device_train_batch_size,
                accumulation=self.args.gradient_accumulation_steps,
                world=self.accelerator.num_processes,
            )
            return distributed.zero3_prepare_teacher(teacher, config)
        return teacher.to(self.args.device)

    # --------------------------------------------------------------------------------------- data columns
    def get_train_dataloader(self):
        dataloader = super().get_train_dataloader()
        if self.args.kd_teacher_url and self.xtok is not None:  # asked about the teacher's own tokenization
            dataloader = served_teacher_dataloader(
                dataloader, self.args, vocab_size=self.xtok.vocab_map.teacher_vocab_size, keys=CROSS_TOKENIZER_KEYS
            )
        elif self.args.kd_teacher_url:  # teacher top-k from a server, fetched ahead (served.py)
            vocab_size = self.kd_config.vocab_size or unwrap_model(self.model).get_output_embeddings().out_features
            served = served_teacher_dataloader(dataloader, self.args, vocab_size=vocab_size)
            self._served = served
            # every step generated: the dataset's rows are only prompts, nothing to ask the server about ahead
            dataloader = dataloader if self.args.kd_lmbda >= 1 or self.args.kd_seq_kd else served
        return dataloader

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        extra = [*KD_COLUMNS, "position_ids", *(CROSS_TOKENIZER_COLUMNS if self.xtok is not None else ())]
        extra += list(PROMPT_COLUMNS) if self.prompt_rows else []
        extra += list(PRIVILEGED_COLUMNS)
        self._signature_columns = list(dict.fromkeys([*self._signature_columns, *extra]))

    # ---------------------------------------------------------------------------------------------- loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        generated = inputs.pop(GENERATED, False)
        inputs.pop(HAS_COMPLETION, None)
        if inputs.get("labels") is None:
            raise ValueError(
                f"the batch has no 'labels' (keys: {sorted(inputs)}); KDTrainer scores the positions that have a "
                f"label. Give the dataset a 'labels' column, or use a collator that sets them (the default "
                f"liger_patch_kd.teacher.TeacherDataCollator copies input_ids; "
                f"DataCollatorForLanguageModeling(mlm=False) and DataCollatorWithFlattening do too)"
            )
        offline = inputs.get("teacher_token_ids") is not None
        if not offline and self.teacher_model is None:
            raise ValueError(
                "no teacher: pass teacher_model=..., set kd_self_distill=True with a PEFT student, or give batches "
                "teacher_token_ids / teacher_logprobs (see liger_patch_kd.teacher)"
            )
        require_teacher_prompt(self.teacher_model, inputs)
        if self.args.kd_teacher_url and inputs.get("teacher_input_ids") is not None:
            raise ValueError(
                "these rows give the teacher its own prompt (teacher_input_ids), but a served teacher (kd_teacher_url) "
                "is asked about the student's rows; run the teacher in process (teacher_model) or precompute a store "
                "on teacher_input_ids"
            )
        cfg = self.kd_config
        if generated and self.args.kd_onpolicy_loss != "divergence":  # a sampled-token estimator on the rollouts
            cfg = cfg.replace(estimator=self.args.kd_onpolicy_loss, temperature=1.0)
        log_now = self._kd_should_log()
        if is_cross_tokenizer_batch(inputs):
            xtok = self.xtok
            outputs = compute_cross_tokenizer_loss(
                model, self.teacher_model, inputs, xtok.config, xtok.vocab_map, num_items_in_batch
            )
            loss, soft, hard, agreement = outputs.loss, outputs.soft, outputs.hard, None
        elif self.args.use_kd_patch:
            outputs = model(
                **inputs, teacher_model=None if offline else self.teacher_model,
                num_items_in_batch=num_items_in_batch, kd_log_agreement=log_now, kd_config=cfg,
            )  # fmt: skip
            loss, soft, hard = outputs.loss, outputs.kd_soft_loss, outputs.kd_hard_loss
            agreement = getattr(outputs, "kd_top1_agreement", None)
        else:
            loss, soft, hard, agreement, outputs = self._materialised_loss(model, inputs, num_items_in_batch, cfg)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes  # DDP averages gradients over processes
        self._kd_record(soft, hard, agreement)
        return (loss, outputs) if return_outputs else loss

    def _materialised_loss(self, model, inputs, num_items_in_batch, cfg: KDLossConfig):
        """use_kd_patch=False: both models' logits scored by reference.py (models/materialised.py)."""
        teacher = TeacherInputs(
            model=self.teacher_model if inputs.get("teacher_token_ids") is None else None,
            token_ids=inputs.pop("teacher_token_ids", None), logprobs=inputs.pop("teacher_logprobs", None),
        )  # fmt: skip
        targets = targets_of(inputs.pop("labels"), inputs.pop("shift_labels", None), cfg.ignore_index)
        privileged = PrivilegedInputs.pop(inputs)  # the teacher's own prompt (models/privileged.py)
        outputs = materialised_kd(
            unwrap_model(model),
            model,
            teacher,
            targets,
            cfg,
            num_items_in_batch,
            inputs,
            log_agreement=self._kd_should_log(),
            privileged=privileged,
        )
        return outputs.loss, outputs.kd_soft_loss, outputs.kd_hard_loss, outputs.kd_top1_agreement, outputs

    def train(self, *args, **kwargs):
        self._kd_recompute_limited = False  # every train() turns checkpointing back on for every layer
        return super().train(*args, **kwargs)

    # ------------------------------------------------------------------------------------------ on-policy
    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.args.kd_recompute_layers is not None and not self._kd_recompute_limited:
            # HF's train() turns checkpointing on for every layer before the first step; this narrows it once
            recompute, keep = limit_recompute(model, self.args.kd_recompute_layers)
            logger.info("checkpointing: %d decoder layers recompute, %d keep their activations", recompute, keep)
            self._kd_recompute_limited = True
        return super().training_step(model, inputs, num_items_in_batch)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """An optimizer step's micro-batches; on a generated step (kd_lmbda, kd_seq_kd) their completions are
        sampled here, all in one pass (onpolicy.py), and num_items_in_batch counts the sampled tokens."""
        batches, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batches:  # the Trainer's loop is the only caller: these are training micro-batches
            return batches, num_items_in_batch
        if not (self.onpolicy.enabled and self.onpolicy.step_generates()):
            require_completions(batches, self.args)
            return batches, num_items_in_batch
        generator = self.teacher_model if self.args.kd_seq_kd else self.model
        attach = None
        if self._served is not None:
            attach = self._served.with_teacher
        batches = self.onpolicy.replace(
            generator, batches, tokenizer=self.processing_class, step=self.state.global_step,
            device=self.args.device, attach_teacher=attach,
        )  # fmt: skip
        return batches, self._get_num_items_in_batch(batches, device)

    # -------------------------------------------------------------------------------------------- logging
    def _kd_should_log(self) -> bool:
        steps = self.args.logging_steps
        return self.model.training and steps > 0 and (self.state.global_step + 1) % max(1, int(steps)) == 0

    def _kd_record(self, soft, hard, agreement) -> None:
        """Sum the terms on the device (no host sync per step); `log` reads them once per logging step."""
        if self._kd_count == 0:
            self._kd_first_step = self.state.global_step  # the optimizer step these terms start in
        self._kd_count += 1
        for key, value in (("kd_soft_loss", soft), ("kd_hard_loss", hard)):
            self._kd_sums[key] = self._kd_sums.get(key, 0.0) + value.detach().float().mean()
        if agreement is not None:  # measured on logging steps only
            self._kd_agreement = agreement.detach().float()

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self._kd_count and "loss" in logs:
            # per optimizer step, as the Trainer logs "loss": each micro-batch's terms are normalised by the whole
            # step's item count (num_items_in_batch), so they add up over gradient accumulation, then average
            # over the steps since the last log; a loop without the Trainer's step count averages per call
            steps = self.state.global_step - self._kd_first_step
            for key, total in self._kd_sums.items():
                logs[key] = round(float(total) / (steps if steps > 0 else self._kd_count), 6)
            if getattr(self, "_kd_agreement", None) is not None:
                logs["kd_top1_agreement"] = round(float(self._kd_agreement), 4)
            self._kd_sums, self._kd_count, self._kd_agreement = {}, 0, None
        super().log(logs, *args, **kwargs)


def _first_row_is_prompt(dataset: Any) -> bool:
    """Whether the training rows are TRL-style prompt rows (prompt / completion / messages), judged by the first."""
    return _first_row(dataset, lambda row: isinstance(row, dict) and is_prompt_row(row))


def _first_row(dataset: Any, test) -> bool:
    try:
        row = dataset[0]
    except Exception:  # an iterable dataset, or none: the collator given decides
        return False
    return bool(test(row))


def _with_vocab_size(cfg: KDLossConfig, student: nn.Module, teacher: nn.Module | None, tokenizer: Any) -> KDLossConfig:
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
