"""KDTrainer: online, offline (teacher log-probs as data), served and on-policy distillation through the Hugging
Face Trainer. The teacher side of each batch is its TeacherSource's (teachers/base.py), resolved once
(teachers/plan.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn
from transformers import Trainer
from transformers.utils import logging

from .. import distributed
from ..batch.columns import BEHAVIOUR, GENERATED, HAS_COMPLETION, TEACHER_DATA_COLUMNS
from ..models import apply_kd_patch, patch_teacher_kernels, unwrap_model
from ..models.recompute import limit_recompute
from ..utils.logs import follow_log_level
from .arguments import KDTrainingArguments
from .dataset_setup import (
    check_evaluation_has_teacher,
    check_length_options_apply,
    check_no_text_rows_to_generate_from,
    named_evaluations,
)
from .model_loading import check_named_teachers_share_the_tokenizer, loaded_models, tokenizer_of_named
from .nonfinite import check_logged, check_step_loss
from .output_checkpoints import check_rotation_spares_others
from .rollouts.onpolicy import OnPolicySteps
from .rollouts.retokenized import rows_maker
from .teachers.base import StepMetrics, has_teacher_rows
from .teachers.plan import resolve_teacher
from .text_rows import materialised_logits_note, tokenize_text_datasets
from .token_range import check_collated_ids

KD_COLUMNS = TEACHER_DATA_COLUMNS  # the teacher columns a dataset may carry (the public name)

logger = logging.get_logger(__name__)


def train_on_one_gpu(args: KDTrainingArguments) -> None:
    """One process seeing several GPUs would make the Trainer wrap the student in nn.DataParallel, which splits
    every input tensor across replicas while the teacher stays on one GPU. Distillation runs one GPU per process;
    several GPUs through accelerate / torchrun (DDP, FSDP, ZeRO-3)."""
    if args.n_gpu > 1:
        logger.warning(
            f"KDTrainer: this process sees {args.n_gpu} GPUs; training on one (cuda:0). For several GPUs, launch "
            f"one process per GPU: `accelerate launch` or `torchrun` (DDP, FSDP or DeepSpeed)"
        )
        args._n_gpu = 1


class KDTrainer(Trainer):
    """Trainer that distils `teacher_model` (or the teacher log-probs in the batches) into `model`.

    The loss is soft_weight * KD + hard_weight * CE as KDTrainingArguments set it, exact under gradient
    accumulation (normalised by the token count of the whole accumulated batch). With use_kd_patch it runs
    through the patched forward (no logits); without, the same objective on materialised logits
    (reference/), the baseline to compare with. `model` and `teacher_model` may be names or paths (TRL's
    convention), loaded with args.model_init_kwargs / args.teacher_model_init_kwargs (model_loading.py).
    """

    def __init__(
        self,
        model: nn.Module | str,
        teacher_model: nn.Module | str | None = None,
        args: KDTrainingArguments | None = None,
        teacher_tokenizer: Any = None,
        **kwargs,
    ):
        if args is None or not isinstance(args, KDTrainingArguments):
            raise ValueError("KDTrainer needs args=KDTrainingArguments(...)")
        # the package's INFO lines at --log_level info, as transformers' own
        follow_log_level(args.get_process_log_level(), (args.log_level if args.should_log else
                                                        args.log_level_replica) != "passive")  # fmt: skip
        if kwargs.get("processing_class") is None:  # a model given by name: its saved tokenizer, as TRL loads it
            kwargs["processing_class"] = tokenizer_of_named(model)
        across_tokenizers = bool(args.kd_teacher_tokenizer or teacher_tokenizer)
        check_named_teachers_share_the_tokenizer(teacher_model, kwargs["processing_class"], across_tokenizers)
        model, teacher_model = loaded_models(model, teacher_model, args)  # models given by name or path
        check_no_text_rows_to_generate_from(args, kwargs.get("train_dataset"))  # before they become token rows
        training = [("train_dataset", kwargs.get("train_dataset"))]
        check_length_options_apply(args, training + named_evaluations(kwargs.get("eval_dataset")))
        tokenize_text_datasets(kwargs, args.kd_max_length, bool(args.kd_teacher_tokenizer or teacher_tokenizer))
        # the teacher's kind, collator, columns, vocabulary and checks, chosen once (teachers/plan.py)
        self.teacher_plan = resolve_teacher(model, teacher_model, args, teacher_tokenizer, kwargs)
        self.kd_config = self.teacher_plan.kd_config
        train_on_one_gpu(args)
        if args.use_kd_patch:
            apply_kd_patch(model=model, kd_config=self.kd_config, **(args.kd_patch_config or {}))
        super().__init__(model=model, args=args, **kwargs)
        if args.dataloader_pin_memory and args.device.type == "cpu":
            args.dataloader_pin_memory = False  # pinning needs an accelerator; torch warns at every DataLoader else
        self.model_accepts_loss_kwargs = True  # compute_loss normalises by num_items_in_batch itself
        self.teacher_plan.check_spread(self.accelerator, model)  # before anything is sharded
        if self._fsdp_version() == 2:  # lm_head must stay in the root unit: see distributed.py
            self.model = self.model_wrapped = distributed.fsdp2_prepare(self.model, self.accelerator, trainable=True)
        self.teacher_source = self.teacher_plan.source(self.model, self._frozen_teacher)  # the teachers prepared
        check_evaluation_has_teacher(self.teacher_source.from_rows, self.eval_dataset)
        self._kd_sums: dict[str, torch.Tensor] = {}
        self._kd_count = 0
        self._kd_agreement: torch.Tensor | None = None
        self._kd_teacher_metrics: StepMetrics | None = None  # teacher figures of the logging step (teachers/base.py)
        self._kd_recompute_limited = False
        self.onpolicy = OnPolicySteps(args, precision=self.accelerator.autocast)
        self.onpolicy.settings = replace(self.onpolicy.settings, vocab_size=self.kd_config.vocab_size)
        self.teacher_plan.check_generation(self.onpolicy.enabled)

    @property
    def teacher_model(self) -> nn.Module | None:
        """The one in-process teacher (frozen and placed; the student's self for self-distillation), or None."""
        return self.teacher_plan.teacher_model

    @property
    def teacher_set(self):
        """The set of several named members (in process, served, or stored rows routed to them:
        teachers/member_set.py), or None."""
        return self.teacher_plan.teacher_set

    @property
    def xtok(self):
        """One teacher of another tokenizer: its vocabulary map and collator, or None."""
        return self.teacher_plan.xtok

    @property
    def offline(self):
        """A rollout store's setup (offline on-policy), or None."""
        return self.teacher_plan.offline

    @property
    def kd_rollout_seconds(self) -> list[float]:
        """Seconds spent in generate() per generated optimizer step."""
        return self.onpolicy.seconds

    def _fsdp_version(self) -> int | None:
        return getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1) if self.is_fsdp_enabled else None

    def _frozen_teacher(self, teacher: nn.Module) -> nn.Module:
        teacher.eval().requires_grad_(False)
        if self.args.use_kd_patch:
            patch_teacher_kernels(teacher, self.args.kd_patch_config)
        return self._prepare_teacher(teacher)

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
        dataloader = self._checked_ids(super().get_train_dataloader(), "train_dataset")
        # a served teacher asks its server about each batch ahead of the step (teachers/served*.py)
        dataloader = self.teacher_source.dataloader(dataloader, self._student_vocab_size)
        self._take_served_vocab_size()
        return dataloader

    def get_eval_dataloader(self, eval_dataset=None):
        where = f"eval_dataset[{eval_dataset!r}]" if isinstance(eval_dataset, str) else "eval_dataset"
        dataloader = self._checked_ids(super().get_eval_dataloader(eval_dataset), where)
        # evaluation batches get their teacher as training's do: a served teacher is asked about them too
        dataloader = self.teacher_source.eval_dataloader(dataloader, self._student_vocab_size)
        self._take_served_vocab_size()
        return dataloader

    def get_test_dataloader(self, test_dataset):
        dataloader = self._checked_ids(super().get_test_dataloader(test_dataset), "test_dataset")
        dataloader = self.teacher_source.eval_dataloader(dataloader, self._student_vocab_size)
        self._take_served_vocab_size()
        return dataloader

    def _checked_ids(self, dataloader, where: str):
        """Each batch's input_ids and labels checked against the student's vocabulary as it is collated."""
        student = unwrap_model(self.model)
        rows = getattr(student.get_input_embeddings(), "num_embeddings", None)
        head = getattr(student.get_output_embeddings(), "out_features", None)
        return check_collated_ids(dataloader, rows, head, self.kd_config.ignore_index, where)

    def _take_served_vocab_size(self) -> None:
        if self.teacher_source.vocab_size is not None:  # read from a served head (teachers/served_hidden.py)
            self.kd_config = self.kd_config.replace(vocab_size=self.teacher_source.vocab_size)
            self.onpolicy.settings = replace(self.onpolicy.settings, vocab_size=self.kd_config.vocab_size)

    def _student_vocab_size(self) -> int:
        return self.kd_config.vocab_size or unwrap_model(self.model).get_output_embeddings().out_features

    @property
    def _served(self):
        """The served teacher's prefetcher, asked about generated rows too (None: no server, or several)."""
        return self.teacher_source.prefetcher

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        self._signature_columns = list(dict.fromkeys([*self._signature_columns, *self.teacher_plan.columns]))

    # ---------------------------------------------------------------------------------------------- loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """One journey: the batch prepared (the Trainer's markers, then the teacher side by the run's teacher
        source) -> the source's teacher signal and the one loss call -> the logged figures."""
        inputs = dict(inputs)
        generated = inputs.pop(GENERATED, False)
        completed = inputs.pop(HAS_COMPLETION, None)
        if not model.training and completed is not None and not bool(completed.all()):
            # a dataset given to evaluate() later, or an iterable one, that the checks at construction did not see
            raise ValueError(
                "an evaluation batch holds prompts without a completion; evaluation scores the rows' completions "
                "(it generates none), so their eval_loss would be 0: give every evaluation row a 'completion' (a "
                "reference answer), or evaluate on rows that have one"
            )
        behaviour = inputs.pop(BEHAVIOUR, None)  # an engine's log-probs of the sampled tokens (pg only)
        if inputs.get("labels") is None:
            raise ValueError(
                f"the batch has no 'labels' (keys: {sorted(inputs)}); KDTrainer scores the positions that have a "
                f"label. Give the dataset a 'labels' column, or use a collator that sets them (the default "
                f"liger_patch_kd.teacher.TeacherDataCollator copies input_ids; "
                f"DataCollatorForLanguageModeling(mlm=False) and DataCollatorWithFlattening do too)"
            )
        inputs = self.teacher_source.prepare(inputs)
        cfg = self.kd_config
        if generated and self.args.kd_onpolicy_loss != "divergence":  # a sampled-token estimator on the rollouts
            cap = self.args.kd_pg_importance_cap if self.args.kd_onpolicy_loss == "pg" else None
            cfg = cfg.replace(estimator=self.args.kd_onpolicy_loss, temperature=1.0, importance_cap=cap)
        if not self.args.use_kd_patch and not getattr(self, "_kd_noted_materialised", False):  # its cost, once
            self._kd_noted_materialised = True
            vocab = unwrap_model(model).get_output_embeddings().weight.shape[0]
            logger.warning(materialised_logits_note(inputs["input_ids"].numel(), vocab, has_teacher_rows(inputs)))
        step = self.teacher_source.loss(model, inputs, num_items_in_batch, cfg, self._kd_should_log(), behaviour)
        if step.teacher_metrics:  # teacher figures (several teachers', kd_behaviour_kl), kept until the next log
            self._kd_teacher_metrics = self._kd_teacher_metrics or StepMetrics()
            self._kd_teacher_metrics.add(step.teacher_metrics, step.metric_tokens)
        loss = step.loss
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes  # DDP averages gradients over processes
        if model.training:  # evaluation's batches are the Trainer's eval_loss, not the next training log's terms
            self._kd_record(step.soft, step.hard, step.agreement)
        return (loss, step.outputs) if return_outputs else loss

    def train(self, *args, **kwargs):
        check_rotation_spares_others(self.args, kwargs.get("resume_from_checkpoint", args[0] if args else None))
        self._kd_recompute_limited = False  # every train() turns checkpointing back on for every layer
        try:
            return super().train(*args, **kwargs)
        finally:
            self.onpolicy.close()  # an engine's pushed weights: the directory this run made goes

    # ------------------------------------------------------------------------------------------ on-policy
    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.args.kd_recompute_layers is not None and not self._kd_recompute_limited:
            # HF's train() turns checkpointing on for every layer before the first step; this narrows it once
            recompute, keep = limit_recompute(model, self.args.kd_recompute_layers)
            logger.info("checkpointing: %d decoder layers recompute, %d keep their activations", recompute, keep)
            self._kd_recompute_limited = True
        loss = super().training_step(model, inputs, num_items_in_batch)
        check_step_loss(loss, self.args, self.state.global_step)  # never trained on: nonfinite.py
        return loss

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """An optimizer step's micro-batches (the dataset's rows checked to have completions); on a generated step
        (kd_lmbda, kd_seq_kd) their completions are sampled here in one pass, or were requested ahead
        (kd_async_rollouts; onpolicy.py), and num_items_in_batch counts the sampled tokens."""
        generates_across = self.xtok is not None and self.onpolicy.enabled  # the generated rows' teacher side
        rows = rows_maker(self.xtok.generated, self.data_collator) if generates_across else None
        batches = self.onpolicy.step_batches(
            epoch_iterator, num_batches, self.teacher_model if self.args.kd_seq_kd else self.model,
            tokenizer=self.processing_class, step=self.state.global_step, last_step=self.state.max_steps,
            device=self.args.device, attach_teacher=None if self._served is None else self._served.with_teacher,
            make_rows=rows,
        )  # fmt: skip
        if self.offline is not None:  # kd_store_refresh_steps: a slice of the stored rows resampled now
            # sampled as on-policy rollouts are and rescored as the live teacher's forward runs: under the
            # Trainer's autocast (accelerate's, around the student's forward that calls the teacher)
            batches = self.offline.refreshed(batches, self.model, self.teacher_model, tokenizer=self.processing_class,
                                             step=self.state.global_step, vocab_size=self.kd_config.vocab_size,
                                             precision=self.accelerator.autocast)  # fmt: skip
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
        terms = (("kd_soft_loss", soft), ("kd_hard_loss", hard))
        if self.kd_config.soft_weight == 0:  # a term of weight 0 is not computed against a teacher: not logged
            terms = terms[1:]
        for key, value in terms:
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
            if self.onpolicy.staleness:  # steps between the engine's weights and the student's, latest rollout
                logs["kd_rollout_staleness"] = self.onpolicy.staleness[-1]
            if self.offline is not None and self.offline.refresh is not None:  # kd_store_refresh_steps: since the log
                logs["kd_refreshed_rows"] = self.offline.refresh.take_unlogged_rows()
            for key, value in (self._kd_teacher_metrics or {}).items():  # kd_soft_loss/<name>, kd_behaviour_kl
                logs[key] = round(float(value), 6)
            self._kd_sums, self._kd_count, self._kd_agreement, self._kd_teacher_metrics = {}, 0, None, None
        check_logged(logs, self.state.global_step)
        super().log(logs, *args, **kwargs)
