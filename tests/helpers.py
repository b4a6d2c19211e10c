"""Shared test data: random (hidden, weight) pairs whose products are the logits the reference sees."""

from __future__ import annotations

import math
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def count_launches(monkeypatch, module, name: str) -> list:
    """Record every launch of the Triton kernel `module.<name>` (its grid per `kernel[grid](...)`), still launching
    it: how a test checks that a step runs as few kernels as it says."""
    launches, kernel = [], getattr(module, name)

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(module, name, Counting())
    return launches


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


U32 = 2.0**-24  # fp32 unit round-off
EXP32 = 2.0**-21  # a GPU's approximate fp32 exp (ex2.approx) relative error: 4 ulp, more than PTX's bound


def fp32_lse_bound(vocab: int, tiles: int = 1) -> float:
    """An upper bound on the absolute error of an fp32 log-sum-exp over `vocab` logits folded over `tiles`
    vocabulary tiles (ceil(V / BLOCK_V)), with a GPU's approximate exp and log, against exact arithmetic on the
    same logits. With u = 2^-24, m the max and S the softmax:

    - exp(a), a = x - m' <= 0 (m' a lane's running max), is ex2.approx(fl(a log2e)) compiled: relative error
      <= EXP32 + |a| u. Weighted by e^a / d, the |a| u parts add up to u E_S[m - x] <= u H(S) <= u log V (since
      m <= lse); the lanes' rescales by exp(m' - m) and the running rescales cost as much again each (|m' - m|
      <= |x - m| for every x of the lane), and EXP32 once per tile;
    - the fp32 sum of d: each lane adds `tiles` terms, then a tree over <= 2^12 lanes: (tiles + 12) u;
    - log d (d >= 1) carries d's relative error, plus its own (lg2.approx-like: EXP32 relative on log2 d <= log V
      / log 2, i.e. <= EXP32 (1 + log V) absolute).
    The CPU's exp and log (<= 1 ulp, exact arguments) are inside it."""
    log_v = math.log(vocab)
    return EXP32 * (2 + tiles) + 3 * U32 * log_v + (tiles + 12) * U32 + EXP32 * (1 + log_v)


def fp32_loss_bound(vocab: int, max_abs: float, tiles: int = 1) -> float:
    """One row's loss sum_j P^_j (lp_j - log S_j), sum_j P^_j <= 1, in fp32: the log-sum-exp's error (above); the
    rounding of the exponents' inputs themselves (x / T: u |x / T| on each, so <= u max_abs on the normaliser, and
    as much on log S_j); each term's rounding, u |lp_j - x_j / T + lse| <= 3 u max_abs, with as much again for their
    weighted sum (`max_abs` bounds |x / T|, |lp_j| and the log-sum-exp)."""
    return fp32_lse_bound(vocab, tiles) + 8 * U32 * max_abs


def fp32_grad_l1_bound(vocab: int, max_abs: float, tiles: int = 1) -> float:
    """One row's sum_v |error| of dL/du = S sum_j P^_j - P^ (weight 1) in fp32: S_v = exp(fl(fl(x_v / T) - lse)) is
    off by S_v (EXP32 + 2 |log S_v| u + 2 u max_abs) plus the log-sum-exp's error; summed (sum_v S_v = 1), S_v
    |log S_v| adds up to the entropy <= log V; then a few roundings of each product (8 u, the gradient's l1 norm
    being <= 2). `max_abs` as in `fp32_loss_bound`."""
    return EXP32 + fp32_lse_bound(vocab, tiles) + U32 * (2 * math.log(vocab) + 2 * max_abs + 8)


ROOT = Path(__file__).resolve().parents[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child process that must import this checkout: ROOT first on PYTHONPATH, the caller's
    own entries kept (packages installed with --target and PYTHONPATH, as on a machine without pip's site)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def stop_with_stacks(proc: subprocess.Popen, lines: int = 60) -> str:
    """Stop a child started with PYTHONFAULTHANDLER=1 and stderr=PIPE by SIGABRT (its faulthandler prints every
    thread's stack first) and return the last `lines` of its stderr: a child that hangs says where."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGABRT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    err = err.decode(errors="replace") if isinstance(err, bytes) else (err or "")
    return "\n".join(err.splitlines()[-lines:])


def run_child(cmd: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) in subprocess_env(**env); a child still running after
    `timeout` seconds fails the test with its threads' stacks instead of a bare TimeoutExpired."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=subprocess_env(PYTHONFAULTHANDLER="1", **env))  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{cmd} still running after {timeout:g} s; its stderr:\n{stop_with_stacks(proc)}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def claimed_classes(arch: str, field: str) -> list:
    """The classes a registry entry's `field` (residual_layers, attention) names, asserting the installed
    transformers has some: a layout claim about none is no claim."""
    from liger_patch_kd.models.registry import REGISTRY

    spec = REGISTRY[arch]
    classes = spec.classes(getattr(spec, field))
    assert classes, f"{arch}: none of {getattr(spec, field)} in the installed transformers"
    return classes
