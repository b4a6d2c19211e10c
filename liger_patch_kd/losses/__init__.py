"""The front doors: functional losses and their nn.Module twins (fused.py), their input checks (checks.py),
and the losses on log-probs (logprob.py). Nothing here knows about models. The checks are public in
`losses.checks` (align's fused loss runs them too); `__all__` is what a user imports."""

from .fused import KDLossOutput, fused_linear_jsd, fused_linear_topk_kd
from .logprob import kl_estimator, topk_kd_from_logprobs
from .modules import FusedLinearJSDLoss, FusedLinearTopKKDLoss
from .multi_teacher import fused_linear_multi_teacher_jsd
from .sampled_teacher import fused_linear_sampled_kd

__all__ = [
    "FusedLinearJSDLoss",
    "FusedLinearTopKKDLoss",
    "KDLossOutput",
    "fused_linear_jsd",
    "fused_linear_sampled_kd",
    "fused_linear_multi_teacher_jsd",
    "fused_linear_topk_kd",
    "kl_estimator",
    "topk_kd_from_logprobs",
]
