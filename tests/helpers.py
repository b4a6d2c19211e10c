"""Shared test data: random (hidden, weight) pairs whose products are the logits the reference sees."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def backends() -> list[str]:
    """Backends worth testing here: torch always; triton when installed (compiled on GPU, interpreted on CPU)."""
    from liger_patch_kd.ops.backend import triton_available

    return ["torch", "triton"] if triton_available() else ["torch"]


@dataclass
class LinearPair:
    student_input: torch.Tensor
    student_weight: torch.Tensor
    teacher_input: torch.Tensor
    teacher_weight: torch.Tensor
    labels: torch.Tensor
    student_bias: torch.Tensor | None = None
    teacher_bias: torch.Tensor | None = None

    def student_logits(self) -> torch.Tensor:
        out = self.student_input @ self.student_weight.T
        return out if self.student_bias is None else out + self.student_bias

    def teacher_logits(self) -> torch.Tensor:
        out = self.teacher_input @ self.teacher_weight.T
        return out if self.teacher_bias is None else out + self.teacher_bias

    def params(self) -> list[torch.Tensor]:
        return [t for t in (self.student_input, self.student_weight, self.student_bias) if t is not None]


def make_pair(
    n: int = 41,
    h_s: int = 37,
    h_t: int = 23,
    vocab: int = 1271,
    *,
    dtype: torch.dtype = torch.float64,
    bias: bool = False,
    ignore_every: int = 3,
    scale: float = 1.0,
    leading: tuple[int, ...] | None = None,
    device: str | torch.device = "cpu",
) -> LinearPair:
    """Random inputs with logits of std ~scale; every `ignore_every`-th label is -100 (0: none ignored)."""
    shape = leading or (n,)

    def rand(*size, s=1.0):
        return (torch.randn(*size, dtype=torch.float64) * s).to(dtype=dtype, device=device).requires_grad_()

    labels = torch.randint(0, vocab, shape)
    if ignore_every:
        labels.view(-1)[::ignore_every] = -100
    return LinearPair(
        student_input=rand(*shape, h_s),
        student_weight=rand(vocab, h_s, s=scale / h_s**0.5),
        teacher_input=rand(*shape, h_t).detach(),
        teacher_weight=rand(vocab, h_t, s=scale / h_t**0.5).detach(),
        labels=labels.to(device),
        student_bias=rand(vocab, s=0.5) if bias else None,
        teacher_bias=rand(vocab, s=0.5).detach() if bias else None,
    )


def grads(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error ||a - b|| / ||b|| (elementwise ratios blow up near zero)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def random_sequences(vocab: int, n: int = 7, seed: int = 0, lengths: tuple[int, int] = (4, 12)) -> list[list[int]]:
    """n token-id lists of random lengths in [lengths[0], lengths[1]), reproducible from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(torch.randint(*lengths, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]
