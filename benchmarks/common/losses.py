"""What the loss benchmarks share (bench_fused_linear_jsd, bench_loss_breakdown, bench_loss_floor, probe_jsd_order):
inputs of a Llama-shaped loss, the floor's products, Liger's and TRL's methods, the relative error."""

from __future__ import annotations

from collections.abc import Callable

import torch

from liger_patch_kd import KDLossConfig

LLAMA_V, QWEN_V, GEMMA_V = 128256, 151936, 262144


def make_inputs(n: int, hidden: int, vocab: int, seed: int = 0, teacher_vocab: int | None = None) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    # hidden states ~N(0,1), weights scaled so logits have std ~2: distributions neither flat nor one-hot
    return dict(
        h_s=rand(n, hidden).requires_grad_(),
        w_s=rand(vocab, hidden, scale=2 / hidden**0.5).requires_grad_(),
        h_t=rand(n, hidden),
        w_t=rand(teacher_vocab or vocab, hidden, scale=2.5 / hidden**0.5),
        labels=torch.randint(0, vocab, (n,), device="cuda", generator=g),
    )


def floor_products(x: dict) -> tuple[Callable[[], None], Callable[[], None]]:
    """The loss's floor as two callables over `make_inputs`-style tensors: (the two bf16 logit products, the two
    bf16 gradient products) into buffers made here; run back to back they are the four N x H x V products any
    method must do (the FP8 floor swaps in its own logit products)."""
    n, vocab = x["h_s"].shape[0], x["w_s"].shape[0]
    logits = torch.empty(n, vocab, device=x["h_s"].device, dtype=torch.bfloat16)
    g_in, g_w = torch.empty_like(x["h_s"]), torch.empty_like(x["w_s"])
    h_s, w_s, h_t, w_t = (x[k].detach() for k in ("h_s", "w_s", "h_t", "w_t"))

    def logit_products():
        torch.mm(h_s, w_s.T, out=logits)
        torch.mm(h_t, w_t.T, out=logits)

    def grad_products():
        torch.mm(logits, w_s, out=g_in)
        torch.mm(logits.T, h_s, out=g_w)

    return logit_products, grad_products


def liger_methods(cfg: KDLossConfig) -> tuple[dict[str, Callable], str | None]:
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
        from liger_kernel.transformers import LigerFusedLinearJSD
    except ImportError as e:
        return {}, f"Liger-Kernel not importable ({e}); its rows are skipped"
    chunked = LigerFusedLinearJSDLoss(
        weight_hard_loss=0.0, weight_soft_loss=1.0, beta=cfg.beta, temperature=cfg.temperature, compiled=True
    )
    fused = LigerFusedLinearJSD(jsd_beta=cfg.beta, temperature=cfg.temperature)
    return {
        "liger chunked (compiled)": lambda x, _: chunked(x["h_s"], x["w_s"], x["h_t"], x["w_t"], x["labels"]),
        "liger triton": lambda x, _: fused(x["h_s"], x["w_s"], x["h_t"], x["w_t"], x["labels"]),
    }, None


def trl_methods(cfg: KDLossConfig) -> tuple[dict[str, Callable], str | None]:
    """TRL's own divergence kernel, what `DistillationTrainer` runs on hidden states and heads: the competitor a TRL
    user has today. Its reduction is sum / num_items_in_batch over the unmasked rows, the same as ours."""
    try:
        from trl.trainer.distillation_trainer import _chunked_divergence_loss
    except ImportError as e:
        return {}, f"TRL's divergence kernel not importable ({e}); its row is skipped"

    def trl_divergence(x: dict, _) -> torch.Tensor:
        mask = x["labels"] != cfg.ignore_index
        loss, _entropy, _count = _chunked_divergence_loss(
            x["h_s"][None], x["h_t"][None], x["w_s"], x["w_t"], mask[None], beta=cfg.beta,
            num_items_in_batch=mask.sum(), temperature=cfg.temperature,
        )  # fmt: skip
        return loss

    return {"trl divergence kernel": trl_divergence}, None


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm())
