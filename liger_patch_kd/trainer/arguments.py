"""KDTrainingArguments: TrainingArguments plus the distillation options, validated when they are made.

The arguments are plain data: this module checks each option on its own (ranges, choices); a feature's checks of
the options it reads (served teachers, several teachers, rollouts, an engine) live with the feature, which imports
this module and registers them with `checks_arguments`, never the reverse. `__post_init__` runs them after the
plain checks, in their rank order. Every feature module is imported by `liger_patch_kd.trainer` (its __init__
imports trainer.py), and this module can only be imported through that package, so they are registered before
any KDTrainingArguments is made.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from transformers import TrainingArguments

from ..config import KDLossConfig, check_importance_cap
from ..models import check_teacher_precision
from .model_loading import normalized_init_kwargs

PATCH_TOGGLES = ("rope", "swiglu", "rms_norm", "fused_linear_jsd")
ONPOLICY_LOSSES = ("divergence", "pg", "k1", "k3")
SELF_DISTILL_MODES = (False, True, "adapter", "frozen")  # kd_self_distill (teachers/self_distill.py)
SECRETS = ("kd_teacher_api_key", "kd_generation_api_key")
LOSS_OPTIONS = {"beta": "kd_beta", "temperature": "kd_temperature", "soft_weight": "kd_soft_weight",
                "hard_weight": "kd_hard_weight", "tail": "kd_top_k_tail", "vocab_size": "kd_vocab_size",
                "teacher_logits_fp8": "kd_teacher_logits_fp8",
                "student_logits_fp8": "kd_student_logits_fp8"}  # KDLossConfig field -> the option  # fmt: skip


def loss_option_names(message: str) -> str:
    """A KDLossConfig error about one of its fields ("beta must be ...; got beta=2.0"), with the field named as the
    KDTrainingArguments option it came from (kd_beta); any other message as it is."""
    for name, option in LOSS_OPTIONS.items():
        if message.startswith(f"{name} must "):
            return option + message[len(name) :].replace(f"got {name}=", f"got {option}=")
    return message

# (rank, check(args)) of the features, run by __post_init__ in rank order: rollout settings 0, several teachers 1
# (before the served checks: kd_teacher_url as a dict is refused there), a served teacher 2, the engine 3
FEATURE_CHECKS: list[tuple[int, Callable[[Any], None]]] = []


def field_defaults(args: Any) -> dict[str, Any]:
    """Each field's declared default of a dataclass of arguments (KDTrainingArguments), to tell an option a user set
    from one left alone; {} for arguments that are not a dataclass."""
    return {f.name: f.default for f in dataclasses.fields(args)} if dataclasses.is_dataclass(args) else {}


def checks_arguments(rank: int) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    """Decorator: `check(args)` validates a feature's KDTrainingArguments options when the arguments are made."""

    def register(check: Callable[[Any], None]) -> Callable[[Any], None]:
        FEATURE_CHECKS.append((rank, check))
        FEATURE_CHECKS.sort(key=lambda entry: entry[0])
        return check

    return register


def check_bf16_has_a_device(args: TrainingArguments) -> None:
    """bf16 mixed precision where TrainingArguments would refuse it (no GPU computing in bfloat16, use_cpu off):
    refused here in one line that names the option and both ways out."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    named = [name for name in ("bf16", "bf16_full_eval") if getattr(args, name)]
    if not named or args.use_cpu or is_torch_bf16_gpu_available() or is_torch_xla_available():
        return
    raise ValueError(
        f"{named[0]}=True (--{named[0]}): this machine has no GPU that computes in bfloat16; leave {named[0]} out to "
        f"train in float32, or also set use_cpu=True (--use_cpu) for bfloat16 autocast on the CPU"
    )


def check_batch_counts(args: TrainingArguments) -> None:
    """Batch sizes and accumulation of 0 pass TrainingArguments and fail later: at the first evaluation, or as a
    division by zero once training starts."""
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} (--{name}) must be an integer >= 1; got {value!r}")


def check_no_liger_kernel(args: TrainingArguments) -> None:
    """Liger-Kernel's patch replaces the student's forward with its own fused cross-entropy, which returns no
    logits while training on labels: it would undo use_kd_patch's forward, or leave the unpatched path's loss
    without the logits it reads."""
    if args.use_liger_kernel:
        raise ValueError(
            "use_liger_kernel=True (--use_liger_kernel) applies Liger-Kernel's patch, which replaces the student's "
            "forward that the distillation loss runs through; use_kd_patch=True (--use_kd_patch) is this package's "
            "patch (RMSNorm, RoPE, SwiGLU kernels and the fused distillation loss): leave use_liger_kernel out"
        )


@dataclass
class KDTrainingArguments(TrainingArguments):
    """TrainingArguments plus the distillation options. `use_kd_patch=True` is the one flag: the student is
    patched with `apply_kd_patch(model=...)` (kernel toggles from `kd_patch_config`, e.g. {"rope": False})."""

    use_kd_patch: bool = field(default=False, metadata={"help": "Patch the student: fused KD loss and Triton kernels."})
    kd_patch_config: dict | None = field(
        default=None, metadata={"help": f"apply_kd_patch toggles: {', '.join(PATCH_TOGGLES)} (each True/False)."}
    )
    kd_beta: float = field(default=0.5, metadata={"help": "Generalized JSD beta: 0 forward KL, 1 reverse KL."})
    kd_temperature: float = field(default=1.0, metadata={"help": "Softmax temperature of both distributions."})
    kd_soft_weight: float = field(
        default=1.0,
        metadata={"help": "Weight of the distillation term. 0 (sequence-level KD: cross-entropy on completions alone, "
                  "e.g. the teacher's with kd_seq_kd) runs no teacher forward in the loss, and kd_soft_loss / "
                  "kd_top1_agreement are not logged."},
    )  # fmt: skip
    kd_hard_weight: float = field(default=0.0, metadata={"help": "Weight of the hard-label cross-entropy term."})
    kd_top_k_tail: str = field(
        default="bucket", metadata={"help": "Top-k teacher tail policy: bucket, renormalize, none."}
    )
    kd_lmbda: float = field(
        default=0.0,
        metadata={"help": "Fraction of steps on student-generated completions (GKD); with kd_onpolicy_warmup_steps, "
                  "of the steps after the warm-up."},
    )  # fmt: skip
    kd_onpolicy_warmup_steps: float = field(
        default=0,
        metadata={"help": "Optimizer steps trained on the dataset's completions before the first generated step "
                  "(kd_lmbda, kd_seq_kd): the way GKD starts from a student fine-tuned on the data, since a "
                  "random or untrained student samples noise. An integer (steps) or a float in (0, 1) (a fraction "
                  "of the run's steps), as warmup_steps. After it, kd_lmbda's schedule is the one it would be "
                  "without a warm-up (the same steps generate)."},
    )  # fmt: skip
    kd_seq_kd: bool = field(
        default=False, metadata={"help": "Train on teacher-generated completions (sequence-level KD)."}
    )
    kd_max_new_tokens: int = field(default=128, metadata={"help": "Completion length for on-policy / seq-KD steps."})
    kd_generation_temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature of those completions."}
    )
    kd_num_generations: int = field(default=1, metadata={"help": "Completions sampled per prompt on generated steps."})
    kd_rollout_batch_size: int | None = field(
        default=None,
        metadata={"help": "Prompts per generate() call; None: every prompt of the optimizer step in one call."},
    )
    kd_generation_cache: str = field(
        default="auto",
        metadata={"help": "KV cache for generation: auto (graph on CUDA up to 256 rows where the model allows it, "
                  "else static there, dynamic elsewhere), dynamic, static, or graph (a static cache and the whole "
                  "decode step captured as one CUDA graph, reused across steps; eager on CPU)."},
    )  # fmt: skip
    kd_onpolicy_loss: str = field(
        default="divergence",
        metadata={"help": "Loss on generated completions: divergence (the kd_beta generalized JSD over the full "
                  "vocabulary, GKD), pg (policy gradient of the per-token reverse KL), k1 or k3 (estimators). pg "
                  "wants a smaller learning rate: from the demo's trained student it diverges at the demo's 3e-3 "
                  "(KL on its own samples 0.347 -> 0.593) and trains at 3e-4."},
    )  # fmt: skip
    kd_pg_importance_cap: float | None = field(
        default=3.0,
        metadata={"help": "kd_onpolicy_loss='pg' with an engine (kd_generation_url): truncate each token's importance "
                  "ratio q / b (student now / engine's weights, stale by up to kd_sync_steps - 1 + kd_async_rollouts "
                  "steps) at C, min(ratio, C) (truncated importance sampling, TRL's default 3). Bounds the variance; "
                  "unbiased while every ratio is <= C (fresh weights: 1), biased where the cap binds. None: "
                  "unbounded (exact, unbounded variance)."},
    )  # fmt: skip
    kd_generation_url: str | None = field(
        default=None,
        metadata={"help": "An inference engine speaking vLLM's /v1/completions (vLLM, or `liger-kd serve`) that "
                  "samples the on-policy rollouts; None: the student generates in this process."},
    )  # fmt: skip
    kd_generation_api_key: str | None = field(
        default=None,
        metadata={"help": "Sent to the engine as `Authorization: Bearer KEY`, never written (a checkpoint's "
                  "training_args.bin holds None; to_dict and the logs show <KD_GENERATION_API_KEY>). None: "
                  "kd_teacher_api_key, then the LIGER_KD_API_KEY environment variable (off the command line)."},
    )  # fmt: skip
    kd_sync_steps: int = field(
        default=1,
        metadata={"help": "Push the student's weights (a PEFT student: its adapter) to kd_generation_url every N "
                  "optimizer steps; rollouts are then up to N - 1 steps stale."},
    )  # fmt: skip
    kd_sync_transport: str = field(
        default="disk",
        metadata={"help": "How a full-weight student reaches kd_generation_url: disk (a safetensors file loaded by "
                  "/update_weights_from_disk: SGLang, liger-kd serve), broadcast (vLLM's weight-transfer routes, "
                  "a torch.distributed group: liger-kd serve) or vllm-nccl (the same routes, vLLM's NCCL "
                  "communicator: vllm serve --weight-transfer-config '{\"backend\": \"nccl\"}', vllm installed "
                  "here). A PEFT student always sends its adapter (/v1/load_lora_adapter)."},
    )  # fmt: skip
    kd_async_rollouts: int = field(
        default=0,
        metadata={"help": "Request the rollouts of the next K optimizer steps from kd_generation_url while this one "
                  "trains (a background thread; True is 1); rollouts are then K to K + kd_sync_steps - 1 steps "
                  "stale, which kd_onpolicy_loss='pg' corrects. 0: the trainer waits for each step's rollouts."},
    )  # fmt: skip
    kd_sync_dir: str | None = field(
        default=None,
        metadata={"help": "Where the pushed weights are written for the engine to read (a temporary directory made "
                  "and deleted inside it); None: the system's temporary directory."},
    )  # fmt: skip
    kd_store_refresh_steps: int = field(
        default=0,
        metadata={"help": "Training on a rollout store (liger-kd precompute --rollouts-from): every N optimizer steps, "
                  "regenerate kd_store_refresh_fraction of that step's rows with the current student and rescore "
                  "them with teacher_model (the store's own teacher), in memory (the store's files are not "
                  "rewritten). 0: fully offline, the stored rollouts only; 1 with fraction 1: every step on fresh "
                  "samples (fully online). Refresh when kd_behaviour_kl grows."},
    )  # fmt: skip
    kd_store_refresh_fraction: float = field(
        default=1.0,
        metadata={"help": "The share of a refreshed step's rows regenerated (ceil(fraction x the step's rows) in "
                  "all, the first rows of its micro-batches), in (0, 1]."},
    )  # fmt: skip
    kd_max_prompt_length: int | None = field(
        default=None, metadata={"help": "Prompt datasets: keep a prompt's last N tokens (None: all)."}
    )
    kd_max_length: int | None = field(
        default=None,
        metadata={"help": "Rows of text ({'text': ...}, tokenized by KDTrainer with processing_class): keep each "
                  "row's first N tokens; prompt rows (prompt + completion, messages): prompt and completion together "
                  "cut at N tokens (None: all)."},
    )  # fmt: skip
    # a Literal: HfArgumentParser offers exactly these choices (`--kd_self_distill frozen`, `--kd_self_distill True`)
    kd_self_distill: Literal[False, True, "adapter", "frozen"] = field(
        default=False,
        metadata={"help": "The student is its own teacher: 'adapter' (a PEFT student's base model, adapter off), "
                  "'frozen' (its current weights under no_grad, eval; rows need a teacher_prompt), True (adapter "
                  "for a PEFT student, else frozen); False: off."},
    )  # fmt: skip
    kd_teacher_tokenizer: str | None = field(  # a dict too, in Python (the command line parses a str)
        default=None,
        metadata={"help": "The teacher's tokenizer (name or path) when it differs from the student's: "
                  "cross-tokenizer distillation (liger_patch_kd.align). In Python also {teacher name: name or path} "
                  "for several teachers (teacher_model={name: model}); a teacher left out shares the student's."},
    )  # fmt: skip
    kd_cross_tokenizer_loss: str = field(
        default="hybrid", metadata={"help": "Cross-tokenizer loss: hybrid, uld, exact, next_byte or chain."}
    )
    kd_exact_weight: float = field(default=1.0, metadata={"help": "Hybrid cross-tokenizer loss: exact-token weight."})
    kd_uld_weight: float = field(default=1.0, metadata={"help": "Hybrid cross-tokenizer loss: ULD weight."})
    kd_uld_top_k: int | None = field(
        default=None, metadata={"help": "ULD over the sorted top-k plus a tail bucket; None: the full sort."}
    )
    kd_unmatched: str = field(
        default="bucket",
        metadata={"help": "Teacher mass on tokens the student lacks: bucket (one 'other' class) or ignore (GOLD)."},
    )
    kd_vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "Leading lm_head rows that are real tokens (e.g. len(tokenizer)); lets heads padded to different "
            "sizes be distilled. Default: len(processing_class) when the two heads differ in size."
        },
    )
    kd_teacher_weights: dict | None = field(
        default=None,
        metadata={"help": "Several teachers (teacher_model={name: model}): {name: weight} summing to 1, the mixture "
                  "of the teachers' distributions for rows without a 'teacher' / 'teacher_weights' column."},
    )  # fmt: skip
    kd_teacher_mixture: str = field(
        default="distribution",
        metadata={"help": "Several teachers: distribution (the student against sum_j w_j P_j) or loss "
                  "(sum_j w_j D(S, P_j))."},
    )  # fmt: skip
    kd_teacher_url: str | None = field(  # a dict too, in Python (the command line parses a str)
        default=None,
        metadata={"help": "Teacher server URL: top-k log-probs fetched ahead for each batch; or {name: url} for "
                  "several served teachers, each row routed to one by its 'teacher' column."},
    )  # fmt: skip
    kd_teacher_protocol: str = field(  # a dict too, in Python (the command line parses a str)
        default="auto",
        metadata={"help": "Teacher server protocol: auto (the server's GET /v1/models says what it is: liger for "
                  "`liger-kd serve`, sglang for SGLang, else vllm; logged), vllm, sglang, liger (top-k log-probs; "
                  "liger: binary replies, far cheaper than vLLM's JSON) or hidden (`liger-kd serve`'s final hidden "
                  "states and head: the exact in-process objective, never chosen by auto); with several served "
                  "teachers, one for all or {name: protocol} (hidden and top-k teachers mixed)."},
    )  # fmt: skip
    kd_teacher_hidden_dtype: str = field(
        default="auto",
        metadata={"help": "kd_teacher_protocol='hidden': the hidden states on the wire: auto (the teacher's dtype), "
                  "bf16, fp32 or fp8 (e4m3, one scale per row: half of bf16's bytes)."},
    )  # fmt: skip
    kd_teacher_top_k: int = field(default=64, metadata={"help": "Top-k log-probs asked from the teacher server."})
    kd_teacher_samples: int | None = field(
        default=None,
        metadata={"help": "Sampled teacher tokens from `liger-kd serve` (protocol liger): m draws per position at "
                  "kd_temperature, after the exact kd_teacher_top_k (0: draws alone). None: the top-k only."},
    )  # fmt: skip
    kd_teacher_sample_seed: int = field(
        default=0, metadata={"help": "Seed of the served draws (with each sequence's ids: precompute --seed's draws)."}
    )
    kd_teacher_sample_temperature: float | None = field(
        default=None,
        metadata={"help": "The temperature a dataset's sampled teacher tokens were drawn at, for rows without a "
                  "store's metadata (a plain list or datasets.Dataset); it must equal kd_temperature. None: such "
                  "rows train only at kd_temperature=1."},
    )  # fmt: skip
    kd_teacher_timeout: float = field(default=120.0, metadata={"help": "Seconds to wait for the teacher server."})
    kd_teacher_retries: int = field(default=5, metadata={
        "help": "Retries on teacher server (and generation engine) connection errors / 5xx; the waits double from "
                "0.5 s up to 10 s each, so N retries wait at most N x 10 s."})  # fmt: skip
    kd_teacher_api_key: str | None = field(
        default=None,
        metadata={"help": "Sent to the teacher server as `Authorization: Bearer KEY` (its --api-key), never written "
                  "(a checkpoint's training_args.bin holds None; to_dict and the logs show <KD_TEACHER_API_KEY>). "
                  "None: the LIGER_KD_API_KEY environment variable, if set (keeps it off the command line)."},
    )  # fmt: skip
    kd_teacher_precision: str = field(
        default="bf16",
        metadata={"help": "bf16: the teacher as loaded; fp8: its decoder products in FP8 (Ada/Hopper GPUs; "
                  "emulated on a CPU, for tests: no speed-up, logged); fp8_fast_accum: the same without the periodic "
                  "fp32 promotion of the products' sums (faster)."},
    )
    kd_teacher_cuda_graphs: bool = field(
        default=False,
        metadata={"help": "Replay the in-process teacher's decoder from CUDA graphs, one per batch shape (lengths "
                  "rounded up to 64): one launch instead of hundreds, for teachers small enough that the host, not "
                  "the GPU, sets their speed. Applies where the teacher runs on the student's tokens alone (an SDPA "
                  "teacher on right-padded rows, no packing); other batches run eagerly. Equal to the eager forward "
                  "up to rounding. Needs the fused loss (use_kd_patch=True); not with FSDP / DeepSpeed (a sharded "
                  "teacher gathers its weights in hooks); on a CPU it runs eagerly (logged)."},
    )
    kd_teacher_logits_fp8: bool = field(
        default=False,
        metadata={"help": "The fused loss's teacher logit product in FP8 (e4m3, rowwise scales; Ada/Hopper GPUs; "
                  "emulated on a CPU, for tests: no speed-up, logged)."},
    )
    kd_student_logits_fp8: bool = field(
        default=False,
        metadata={"help": "The fused loss's student forward logit product in FP8 (the backward stays bf16)."},
    )
    kd_recompute_layers: int | None = field(
        default=None,
        metadata={"help": "With gradient_checkpointing: only the first N student decoder layers recompute their "
                  "activations, the rest keep them (memory for speed, e.g. what an FP8 teacher frees) but for "
                  "their gated MLP's activation output, recomputed from gate and up in one elementwise pass. "
                  "None: every layer recomputes."},
    )  # fmt: skip

    def __post_init__(self):
        check_bf16_has_a_device(self)  # before TrainingArguments' own refusal, which names neither option nor fix
        super().__post_init__()
        check_batch_counts(self)
        check_no_liger_kernel(self)
        if not 0.0 <= self.kd_lmbda <= 1.0:
            raise ValueError(f"kd_lmbda must be in [0, 1] (a fraction of steps); got {self.kd_lmbda}")
        self.onpolicy_warmup(1)  # validates kd_onpolicy_warmup_steps now
        if self.kd_onpolicy_loss not in ONPOLICY_LOSSES:
            raise ValueError(f"kd_onpolicy_loss must be one of {ONPOLICY_LOSSES}; got {self.kd_onpolicy_loss!r}")
        check_importance_cap(self.kd_pg_importance_cap, name="kd_pg_importance_cap")
        if self.kd_onpolicy_loss != "divergence" and self.kd_generation_temperature != 1.0:
            raise ValueError(
                f"kd_onpolicy_loss={self.kd_onpolicy_loss!r} estimates the KL on tokens sampled from the student's own "
                f"distribution: set kd_generation_temperature=1 (got {self.kd_generation_temperature}), or use "
                f"kd_onpolicy_loss='divergence'"
            )
        if isinstance(self.kd_self_distill, str) and self.kd_self_distill.lower() in ("true", "false"):
            self.kd_self_distill = self.kd_self_distill.lower() == "true"  # from a command line
        if self.kd_self_distill not in SELF_DISTILL_MODES:
            raise ValueError(f"kd_self_distill must be one of {SELF_DISTILL_MODES}; got {self.kd_self_distill!r}")
        for name in ("kd_max_prompt_length", "kd_max_length"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an integer >= 1; got {value!r}")
        caps = (self.kd_max_prompt_length, self.kd_max_length)
        if None not in caps and caps[0] >= caps[1]:
            raise ValueError(
                f"kd_max_prompt_length={self.kd_max_prompt_length} must be below kd_max_length={self.kd_max_length}: "
                f"a prompt kept to its last {self.kd_max_prompt_length} tokens can fill the whole row and leave no "
                f"completion token to train on; set kd_max_prompt_length < kd_max_length"
            )
        unknown = sorted(set(self.kd_patch_config or {}) - set(PATCH_TOGGLES))
        if unknown:
            raise ValueError(
                f"kd_patch_config has unknown key(s) {unknown}; it takes the patch toggles {list(PATCH_TOGGLES)}. "
                f"Loss options have their own arguments (kd_beta, kd_temperature, kd_vocab_size, ...)"
            )
        check_teacher_precision(self.kd_teacher_precision, "kd_teacher_precision")
        if self.kd_recompute_layers is not None:
            if not isinstance(self.kd_recompute_layers, int) or self.kd_recompute_layers < 0:
                raise ValueError(f"kd_recompute_layers must be an int >= 0 or None; got {self.kd_recompute_layers!r}")
            # transformers 5.2x renames gradient_checkpointing to activation_checkpointing; either turns it on
            if not (getattr(self, "activation_checkpointing", False) or getattr(self, "gradient_checkpointing", False)):
                raise ValueError(
                    f"kd_recompute_layers={self.kd_recompute_layers} chooses which layers recompute under gradient "
                    f"checkpointing, which is off: set gradient_checkpointing=True (activation_checkpointing=True "
                    f"in newer transformers), or leave kd_recompute_layers=None"
                )
        fp8 = [name for name in ("kd_teacher_logits_fp8", "kd_student_logits_fp8") if getattr(self, name)]
        if fp8 and not self.use_kd_patch:  # the materialised path computes full logits in their own dtype
            raise ValueError(
                f"{fp8[0]}=True puts the fused loss's logit product in FP8, and use_kd_patch=False runs no fused "
                f"loss (it would train on unquantised logits): set use_kd_patch=True, or {fp8[0]}=False"
            )
        for name in ("model_init_kwargs", "teacher_model_init_kwargs"):  # dtype as a name: the arguments still save
            setattr(self, name, normalized_init_kwargs(getattr(self, name), name))
        try:  # validates the loss options now, not at the first step
            self.kd_loss_config()
        except ValueError as e:  # KDLossConfig names its own fields (beta): say the option that was given (kd_beta)
            raise ValueError(loss_option_names(str(e))) from None
        for _, check in FEATURE_CHECKS:  # the features' own checks (rollouts/, teachers/)
            check(self)

    @property
    def generates_every_step(self) -> bool:
        """Whether no optimizer step trains on the dataset's completions (kd_seq_kd or kd_lmbda=1, no warm-up)."""
        return bool(self.kd_seq_kd or self.kd_lmbda >= 1) and not self.kd_onpolicy_warmup_steps

    def onpolicy_warmup(self, total_steps: int) -> int:
        """The optimizer steps before the first generated one, in a run of `total_steps` (kd_onpolicy_warmup_steps
        read as warmup_steps is: >= 1 a count, below 1 a fraction, rounded up)."""
        warmup = self.kd_onpolicy_warmup_steps
        if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not 0 <= warmup < math.inf:
            raise ValueError(f"kd_onpolicy_warmup_steps must be a number >= 0 (steps, or a fraction of the run below "
                             f"1); got {warmup!r}")  # fmt: skip
        if warmup >= 1 and warmup != int(warmup):
            raise ValueError(f"kd_onpolicy_warmup_steps={warmup} is a step count (>= 1) that is not whole: give an "
                             f"integer, or a fraction of the run's steps below 1")  # fmt: skip
        if warmup and not (self.kd_seq_kd or self.kd_lmbda > 0):
            raise ValueError(f"kd_onpolicy_warmup_steps={warmup} delays the generated steps, and kd_lmbda=0 without "
                             f"kd_seq_kd makes none: set kd_lmbda > 0, or kd_onpolicy_warmup_steps=0")  # fmt: skip
        return int(warmup) if warmup >= 1 else math.ceil(total_steps * warmup)
    model_init_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "When KDTrainer's model is a name or path (TRL's convention): keyword arguments of "
                  "AutoModelForCausalLM.from_pretrained, e.g. {\"dtype\": \"bfloat16\", \"device_map\": ...}; "
                  "dtype (or torch_dtype) is 'auto' (the default), a torch dtype or its name. JSON on a command line."},
    )  # fmt: skip
    teacher_model_init_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "The same for a teacher_model given by name or path (each of a {name: path} set)."},
    )

    # The API keys are secrets: used in this process, never written. to_dict (to_json_string, the loggers' args,
    # the hub's model card) and str / repr show them as <KD_..._API_KEY>, as TrainingArguments shows its *_token
    # fields; a pickle (the checkpoints' training_args.bin, which push_to_hub uploads) holds None instead, so an
    # unpickled copy needs the key again (or LIGER_KD_API_KEY); copy.copy / deepcopy keep it (the same process).
    def to_dict(self):
        d = super().to_dict()
        for name in SECRETS:
            if d.get(name):
                d[name] = f"<{name.upper()}>"
        return d

    def __str__(self):  # TrainingArguments' lines "name=value,"
        text = super().__str__()
        for name in SECRETS:
            key = getattr(self, name)
            text = text.replace(f"{name}={key},", f"{name}=<{name.upper()}>,") if key else text
        return text

    __repr__ = __str__

    def __getstate__(self):
        return {**self.__dict__, **dict.fromkeys(SECRETS)}

    def __copy__(self):
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)
        return twin

    def __deepcopy__(self, memo):
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        twin.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return twin

    def kd_loss_config(self) -> KDLossConfig:
        return KDLossConfig(**{name: getattr(self, option) for name, option in LOSS_OPTIONS.items()})
