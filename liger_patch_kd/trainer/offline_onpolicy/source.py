"""The teacher source of a rollout store's rows: they carry the teacher's signal (top-k and / or sampled tokens,
and the teacher's log-prob of every sampled token) and the student's behaviour log-probs. The full divergence
(kd_onpolicy_loss='divergence') scores the stored top-k / samples as any store's rows; the sampled-token
estimators (k1, k3, pg) score the stored tokens against the stored teacher log-probs, pg importance-weighted by
the stored behaviour log-probs (truncated at kd_pg_importance_cap). On logging steps it measures
`kd_behaviour_kl`: the KL from the policy that sampled the stored tokens to the student now, the figure that says
when the store has gone stale."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...batch.columns import TEACHER_TOKEN
from ...config import KDLossConfig
from ...losses.stored_estimators import estimator_kd_from_logprobs
from ...models.kd_forward import call_student
from ...ops.token_logprobs import linear_token_logprobs
from ..teachers.base import KDStepOutput, TeacherSource, one_teacher_loss

BEHAVIOUR_KL = "kd_behaviour_kl"


def shifted(label_aligned: torch.Tensor) -> torch.Tensor:
    """Label-aligned (B, T) values moved to the rows that predict them (HF's label shift), flattened."""
    return F.pad(label_aligned[..., 1:], (0, 1), value=0.0).reshape(-1)


def behaviour_kl(student_logprobs: torch.Tensor, behaviour: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """KL(behaviour || student) estimated on tokens the behaviour policy sampled: the mean of k3 = r - 1 - log r,
    r = q / b (unbiased, never negative); 0 with no scored token."""
    log_r = (student_logprobs.detach().double() - behaviour.double())[scored]
    if log_r.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=behaviour.device)
    return (log_r.exp() - 1 - log_r).mean()


class StoredRolloutsTeacher(TeacherSource):
    def prepare(self, inputs: dict) -> dict:
        if inputs.get(TEACHER_TOKEN) is None:
            raise ValueError(f"a rollout store's batch lacks {TEACHER_TOKEN}: collate it with "
                             f"trainer.offline_onpolicy.RolloutStoreCollator (KDTrainer's default for such a store)")
        return inputs

    def loss(self, model, inputs: dict, num_items_in_batch, cfg: KDLossConfig, log_now: bool,
             behaviour=None) -> KDStepOutput:  # fmt: skip
        teacher_own = inputs.pop(TEACHER_TOKEN)
        labels = inputs["labels"]
        flat_labels = F.pad(labels[..., 1:], (0, 1), value=cfg.ignore_index).reshape(-1)
        scored = flat_labels != cfg.ignore_index
        log_b = None if behaviour is None else shifted(behaviour.float())
        metrics = None
        if cfg.estimator is None:  # the full divergence on the stored top-k / samples, as any store's rows
            step = one_teacher_loss(model, None, inputs, num_items_in_batch, cfg, log_now, self.fused)
            if log_now and log_b is not None:
                with torch.no_grad():
                    log_q = self.token_logprobs(model, inputs, flat_labels, cfg)
                metrics = {BEHAVIOUR_KL: behaviour_kl(log_q, log_b, scored)}
            step.teacher_metrics, step.metric_tokens = metrics, scored.sum() if metrics else None
            return step
        log_q = self.token_logprobs(model, inputs, flat_labels, cfg)
        loss, soft, hard = estimator_kd_from_logprobs(
            log_q, shifted(teacher_own.float()), flat_labels, cfg, num_items_in_batch,
            log_b if cfg.estimator == "pg" else None,
        )  # fmt: skip
        if log_now and log_b is not None:
            metrics = {BEHAVIOUR_KL: behaviour_kl(log_q, log_b, scored)}
        return KDStepOutput(loss, soft, hard, None, {"loss": loss}, metrics, scored.sum() if metrics else None)

    def token_logprobs(self, model, inputs: dict, flat_labels: torch.Tensor, cfg: KDLossConfig) -> torch.Tensor:
        """(N,) the student's log-prob (temperature 1) of each row's label (0 where ignored): from hidden states a
        chunk of logits at a time (fused), or off its full logits (materialised)."""
        ids = torch.where(flat_labels == cfg.ignore_index, -1, flat_labels)
        vocab = cfg.vocab_size
        if self.fused:

            def on_head(hidden, weight, bias, softcap):
                flat = hidden.reshape(-1, hidden.shape[-1])
                rows = vocab or weight.shape[0]
                return linear_token_logprobs(flat, weight[:rows], ids, None if bias is None else bias[:rows],
                                             softcap=softcap, chunk_size=cfg.chunk_size)  # fmt: skip

            return call_student(model, inputs["input_ids"], inputs.get("attention_mask"), on_head)
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask")).logits
        logits = logits[..., :vocab] if vocab else logits
        logprobs = torch.log_softmax(logits.float().reshape(-1, logits.shape[-1]), dim=-1)
        picked = logprobs.gather(-1, ids.clamp(min=0)[:, None]).squeeze(-1)
        return torch.where(ids >= 0, picked, torch.zeros_like(picked))

