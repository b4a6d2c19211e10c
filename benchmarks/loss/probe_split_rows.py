"""Probe (not the product): can the JSD chunk kernel's three passes come from L2 instead of HBM?

Today's kernel (ops/fused_linear_jsd.py) gives each row to one program and streams it three times from HBM
(26 bytes per logit); with ~130 rows in flight the rows' 1 MB each overflow the 50 MB L2 before the second pass.
This probe splits each row over SPLIT programs of a persistent grid (one per SM), which meet at two per-row
barriers (atomic counters) to combine their partial log-sum-exps and sums: 130 / SPLIT rows in flight, so the
second and third passes can hit L2. Each segment writes its bf16 gradient into the first half of its own fp32
teacher bytes (behind its reads), a per-segment layout the backward products would read segment by segment.

    python -m benchmarks.loss.probe_split_rows --out $OUT/probe_split_rows.json

Prints the kernel times (and the max |difference| of loss and gradient against today's kernel, beta 0.5) for
SPLIT = 1 (the same persistent loop, no split), 2, 4, 8 beside today's kernel and a copy.

Measured 2026-12-01 on one H200, 1024 rows x 128256 (the timed calls
include a 0.26 ms clone of the teacher logits): today's kernel 1.19 ms, a copy of both arrays 0.50 ms; split 1
(persistent, 2 programs per SM) 1.49, split 2 / 4 / 8 2.34 / 2.11 / 2.22 ms. The barriers cost more than L2
saves, so the product keeps one program per row.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from liger_patch_kd import KDLossConfig
from liger_patch_kd.ops.fused_linear_jsd import jsd_chunk_triton

from ..common import cuda_time_ms, environment, write_json


@triton.jit
def _barrier(counter_ptr, target):
    tl.debug_barrier()  # every thread's stores of this program precede the release
    tl.atomic_add(counter_ptr, 1, sem="release")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")


@triton.jit
def _split_kernel(
    zs_ptr, zt_ptr, g_ptr, sync_ptr, stats_ptr, loss_ptr,
    rows, V, SEG, stride, g_stride,
    inv_temp, beta,
    SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    seg = pid % SPLIT
    lane = pid // SPLIT
    lanes = tl.num_programs(0) // SPLIT
    cols = tl.arange(0, BLOCK)
    parts = tl.arange(0, SPLIT)
    lo = seg * SEG
    hi = tl.minimum(lo + SEG, V)
    for row in range(lane, rows, lanes):
        row64 = row.to(tl.int64)
        zs_row = zs_ptr + row64 * stride
        zt_row = zt_ptr + row64 * stride
        m_s = tl.full([BLOCK], float("-inf"), tl.float32)
        m_t = tl.full([BLOCK], float("-inf"), tl.float32)
        d_s = tl.zeros([BLOCK], tl.float32)
        d_t = tl.zeros([BLOCK], tl.float32)
        for off in range(lo, hi, BLOCK):
            mask = off + cols < hi
            xs = tl.where(mask, tl.load(zs_row + off + cols, mask=mask, other=0.0) * inv_temp, float("-inf"))
            xt = tl.where(mask, tl.load(zt_row + off + cols, mask=mask, other=0.0) * inv_temp, float("-inf"))
            new_s = tl.maximum(m_s, xs)
            safe_s = tl.where(new_s == float("-inf"), 0.0, new_s)
            d_s = d_s * tl.exp(m_s - safe_s) + tl.exp(xs - safe_s)
            m_s = new_s
            new_t = tl.maximum(m_t, xt)
            safe_t = tl.where(new_t == float("-inf"), 0.0, new_t)
            d_t = d_t * tl.exp(m_t - safe_t) + tl.exp(xt - safe_t)
            m_t = new_t
        ms = tl.max(m_s, axis=0)
        mt = tl.max(m_t, axis=0)
        stat = stats_ptr + (row64 * SPLIT + seg) * 4
        tl.store(stat + 0, ms)
        tl.store(stat + 1, tl.sum(d_s * tl.exp(m_s - ms), axis=0))
        tl.store(stat + 2, mt)
        tl.store(stat + 3, tl.sum(d_t * tl.exp(m_t - mt), axis=0))
        _barrier(sync_ptr + row64 * 2, SPLIT)
        all_stat = stats_ptr + (row64 * SPLIT + parts) * 4
        pm_s = tl.load(all_stat + 0, volatile=True)
        pd_s = tl.load(all_stat + 1, volatile=True)
        pm_t = tl.load(all_stat + 2, volatile=True)
        pd_t = tl.load(all_stat + 3, volatile=True)
        gm_s = tl.max(pm_s, axis=0)
        gm_t = tl.max(pm_t, axis=0)
        lse_s = gm_s + tl.log(tl.sum(pd_s * tl.exp(pm_s - gm_s), axis=0))
        lse_t = gm_t + tl.log(tl.sum(pd_t * tl.exp(pm_t - gm_t), axis=0))

        loss = tl.zeros([BLOCK], tl.float32)
        sum_sg = tl.zeros([BLOCK], tl.float32)
        for off in range(lo, hi, BLOCK):
            mask = off + cols < hi
            log_s = tl.load(zs_row + off + cols, mask=mask, other=0.0) * inv_temp - lse_s
            log_p = tl.load(zt_row + off + cols, mask=mask, other=0.0) * inv_temp - lse_t
            s = tl.exp(log_s)
            p = tl.exp(log_p)
            log_m = tl.log(tl.maximum(beta * p + (1.0 - beta) * s, 1.1754944e-38))
            sg = s * (log_s - log_m)
            loss += tl.where(mask, beta * p * (log_p - log_m) + (1.0 - beta) * sg, 0.0)
            sum_sg += tl.where(mask, sg, 0.0)
        part = stats_ptr + rows * SPLIT * 4 + (row64 * SPLIT + seg) * 2
        tl.store(part + 0, tl.sum(loss, axis=0))
        tl.store(part + 1, tl.sum(sum_sg, axis=0))
        _barrier(sync_ptr + row64 * 2 + 1, SPLIT)
        all_part = stats_ptr + rows * SPLIT * 4 + (row64 * SPLIT + parts) * 2
        row_loss = tl.sum(tl.load(all_part + 0, volatile=True), axis=0)
        row_sg = tl.sum(tl.load(all_part + 1, volatile=True), axis=0)
        if seg == 0:
            tl.store(loss_ptr + row64, row_loss)

        g_row = g_ptr + row64 * g_stride + 2 * lo  # this segment's own bytes, first half: behind its reads
        for off in range(lo, hi, BLOCK):
            mask = off + cols < hi
            log_s = tl.load(zs_row + off + cols, mask=mask, other=0.0) * inv_temp - lse_s
            log_p = tl.load(zt_row + off + cols, mask=mask, other=0.0) * inv_temp - lse_t
            s = tl.exp(log_s)
            log_m = tl.log(tl.maximum(beta * tl.exp(log_p) + (1.0 - beta) * s, 1.1754944e-38))
            grad = (1.0 - beta) * s * (log_s - log_m - row_sg) * inv_temp
            tl.debug_barrier()
            tl.store(g_row + (off - lo) + cols, grad.to(tl.bfloat16), mask=mask)


def split_call(zs, zt, split: int, programs: int, beta: float = 0.5, block: int = 4096):
    rows, vocab = zs.shape
    seg = -(-vocab // split)
    seg = -(-seg // block) * block if split > 1 else vocab
    sync = torch.zeros(rows * 2, dtype=torch.int32, device=zs.device)
    stats = torch.empty(rows * split * 6, dtype=torch.float32, device=zs.device)
    loss = torch.empty(rows, dtype=torch.float32, device=zs.device)
    g = zt.view(torch.bfloat16)
    grid = (programs - programs % split,)
    _split_kernel[grid](zs, zt, g, sync, stats, loss, rows, vocab, seg, zs.stride(0), g.stride(0), 1.0, beta,
                        SPLIT=split, BLOCK=block, num_warps=8)  # fmt: skip
    return loss, g, seg


def gathered_grad(g: torch.Tensor, vocab: int, seg: int) -> torch.Tensor:
    """The per-segment layout back to (rows, V): segment k's columns sit at bf16 offset 2 k SEG."""
    parts = [g[:, 2 * lo : 2 * lo + min(seg, vocab - lo)] for lo in range(0, vocab, seg)]
    return torch.cat(parts, dim=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--out", default="runs/probe_split_rows.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows, vocab = args.rows, args.vocab
    zs = torch.randn(rows, vocab, device="cuda") * 4
    zt = torch.randn(rows, vocab, device="cuda") * 4
    labels = torch.zeros(rows, dtype=torch.long, device="cuda")
    ones = torch.ones(rows, device="cuda")
    cfg = KDLossConfig(beta=0.5)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ref_loss, _, ref_grad = jsd_chunk_triton(zs, zt.clone(), labels, ones, ones * 0, torch.bfloat16, cfg)
    ref_grad = ref_grad.float()
    copy_dst = torch.empty_like(zs)
    results = [
        dict(name="today's kernel", ms=cuda_time_ms(lambda: jsd_chunk_triton(zs, zt.clone(), labels, ones, ones * 0,
                                                                             torch.bfloat16, cfg))),  # fmt: skip
        dict(name="clone of zt alone (subtract from the kernel rows)", ms=cuda_time_ms(lambda: zt.clone())),
        dict(name="copy of both arrays (26 B/logit would be 3.25 of these)",
             ms=cuda_time_ms(lambda: (copy_dst.copy_(zs), copy_dst.copy_(zt)))),
    ]  # fmt: skip
    for split in (1, 2, 4, 8):
        for per_sm in (1, 2):
            programs = sms * per_sm
            try:
                work = zt.clone()
                loss, g, seg = split_call(zs, work, split, programs)
                grad = gathered_grad(g, vocab, seg).float()
                err_l = float((loss - ref_loss).abs().max())
                err_g = float((grad - ref_grad).abs().max())
                ms = cuda_time_ms(lambda: split_call(zs, zt.clone(), split, programs))
                results.append(dict(name=f"split {split}, {per_sm}/SM", ms=ms, loss_err=err_l, grad_err=err_g))
            except Exception as e:  # a probe: report and go on
                error = f"{type(e).__name__}: {e}"[:200]
                results.append(dict(name=f"split {split}, {per_sm}/SM", ms=None, error=error))
            print(results[-1], flush=True)
    for r in results:
        print(r)
    write_json(args.out, {"environment": environment(), "rows": rows, "vocab": vocab, "results": results})


if __name__ == "__main__":
    main()
