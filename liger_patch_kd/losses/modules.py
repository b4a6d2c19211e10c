"""The nn.Module twins of the fused losses: the options at construction (`KDLossConfig.build`), the tensors to
`forward`."""

from __future__ import annotations

import torch
from torch import nn

from ..config import KDLossConfig
from .docs import args_section, returns_loss_section, shared_docs
from .fused import KDLossOutput, fused_linear_jsd, fused_linear_topk_kd

__all__ = ["FusedLinearJSDLoss", "FusedLinearTopKKDLoss"]


class ConfiguredLoss(nn.Module):
    """The loss options go to the constructor (`KDLossConfig.build(config, **options)`), the tensors to forward."""

    def __init__(self, config: KDLossConfig | None = None, **options) -> None:
        super().__init__()
        self.config = KDLossConfig.build(config, **options)

    def extra_repr(self) -> str:
        return repr(self.config)


class FusedLinearJSDLoss(ConfiguredLoss):
    """Module form of `fused_linear_jsd`: the loss options at construction, the tensors to `forward`.

    Args:
        config (KDLossConfig | None): every loss option at once.
        **options: KDLossConfig fields as keywords (beta=0.3, ...), merged with `config` by `KDLossConfig.build`:
            a keyword that conflicts with `config` is a ValueError.
    """

    @shared_docs(
        args=args_section(
            "student_input", "student_weight", "teacher_input", "teacher_weight", "labels", "student_bias",
            "teacher_bias", "num_items_in_batch", "return_components", indent=12,
        ),
        returns_loss=returns_loss_section(indent=12),
    )  # fmt: skip
    def forward(
        self,
        student_input: torch.Tensor,
        student_weight: torch.Tensor,
        teacher_input: torch.Tensor,
        teacher_weight: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        student_bias: torch.Tensor | None = None,
        teacher_bias: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        return_components: bool = False,
    ) -> torch.Tensor | KDLossOutput:
        """The loss of these tensors with this module's options (`self.config`).

        Args:
{args}

        Returns:
{returns_loss}
        """
        return fused_linear_jsd(
            student_input, student_weight, teacher_input, teacher_weight, labels,
            student_bias=student_bias, teacher_bias=teacher_bias, num_items_in_batch=num_items_in_batch,
            config=self.config, return_components=return_components,
        )  # fmt: skip


class FusedLinearTopKKDLoss(ConfiguredLoss):
    """Module form of `fused_linear_topk_kd`: the loss options at construction, the tensors to `forward`.

    Args:
        config (KDLossConfig | None): every loss option at once.
        **options: KDLossConfig fields as keywords (beta=0.3, ...), merged with `config` by `KDLossConfig.build`:
            a keyword that conflicts with `config` is a ValueError.
    """

    @shared_docs(
        args=args_section(
            "student_input", "student_weight", "teacher_token_ids", "teacher_logprobs", "labels", "student_bias",
            "num_items_in_batch", "return_components", indent=12,
        ),
        returns_loss=returns_loss_section(indent=12),
    )  # fmt: skip
    def forward(
        self,
        student_input: torch.Tensor,
        student_weight: torch.Tensor,
        teacher_token_ids: torch.Tensor,
        teacher_logprobs: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        student_bias: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        return_components: bool = False,
    ) -> torch.Tensor | KDLossOutput:
        """The loss of these tensors with this module's options (`self.config`).

        Args:
{args}

        Returns:
{returns_loss}
        """
        return fused_linear_topk_kd(
            student_input, student_weight, teacher_token_ids, teacher_logprobs, labels, student_bias=student_bias,
            num_items_in_batch=num_items_in_batch, config=self.config, return_components=return_components,
        )  # fmt: skip
