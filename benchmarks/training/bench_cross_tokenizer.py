"""Cross-tokenizer distillation loss: fused (liger_patch_kd.align) against TRL GOLD's materialised path.

Forward + backward of the distillation loss alone on synthetic aligned batches: student V_s = 151936
(Qwen2.5), teacher V_t = 128256 (Llama-3), bf16 hidden states, student / teacher sequences tokenized
differently (groups of 1-3 tokens on either side, ~70 % one-to-one). For each N (student tokens): time and
peak memory beyond the inputs of ours (hybrid full sort, hybrid top-k ULD, next-byte) and of GOLD's ULDLoss on
materialised logits (hybrid, "bayesian" merge), with |ours - GOLD| / GOLD where both run the same objective
(ours with unmatched="ignore" and every group exact-eligible); and the top-k ULD's error against the full sort.

    python -m benchmarks.training.bench_cross_tokenizer --out $OUT/bench_cross_tokenizer.json     # H200, < 8 min
    python -m benchmarks.training.bench_cross_tokenizer --tiny --out /tmp/x.json                  # CPU smoke test
"""

from __future__ import annotations

import argparse
import math
import random
import time
import types

import torch

from benchmarks.common import environment, print_table, write_json
from liger_patch_kd.align import CrossTokenizerConfig, VocabMap, align_tokens, fused_linear_cross_tokenizer_kd
from liger_patch_kd.align import reference as xref


def synthetic_batch(n_tokens: int, seq: int, v_s: int, v_t: int, h_s: int, h_t: int, device, dtype, seed=0) -> dict:
    """Sequences of `seq` student tokens over one text each; the teacher cuts the same text differently."""
    rng = random.Random(seed)
    g = torch.Generator(device="cpu").manual_seed(seed)
    batches = max(1, n_tokens // seq)
    s_off, t_off = [], []
    for _ in range(batches):
        s_cuts, t_cuts, pos = [0], [0], 0
        while len(s_cuts) <= seq:
            pos += 4
            r = rng.random()
            if r < 0.15:  # the teacher splits a student token: one-to-many
                t_cuts.append(pos - 2)
            elif r < 0.30:  # the student splits a teacher token: many-to-one
                s_cuts.append(pos - 2)
            s_cuts.append(pos)
            t_cuts.append(pos)
        s_cuts, t_cuts = s_cuts[: seq + 1], [c for c in t_cuts if c <= s_cuts[seq]]
        s_off.append([(0, 0)] + list(zip(s_cuts[:-1], s_cuts[1:])))
        t_off.append([(0, 0)] + list(zip(t_cuts[:-1], t_cuts[1:])))
    t_len = max(len(o) for o in t_off)
    s_len = seq + 1
    s_groups = torch.full((batches, s_len), -1)
    t_groups = torch.full((batches, t_len), -1)
    s_ids = torch.randint(0, v_s, (batches, s_len), generator=g)
    t_ids = torch.randint(0, v_t, (batches, t_len), generator=g)
    n = 0
    for b in range(batches):
        for grp in align_tokens(s_off[b], t_off[b]):
            s_groups[b, grp.s_first - 1 : grp.s_last] = n
            t_groups[b, grp.t_first - 1 : grp.t_last] = n
            n += 1
    shift = lambda ids, L: torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)  # noqa: E731
    s_labels, t_labels = shift(s_ids, s_len), shift(t_ids, t_len)
    t_labels = torch.where(t_groups >= 0, t_labels, -100)
    t_pad = torch.tensor([[0] * len(o) + [1] * (t_len - len(o)) for o in t_off], dtype=torch.bool)
    scale = 1.0 / math.sqrt(h_s)
    x = dict(
        h_s=(torch.randn(batches, s_len, h_s, generator=g) * 2).to(device, dtype).requires_grad_(),
        w_s=(torch.randn(v_s, h_s, generator=g) * scale * 2).to(device, dtype).requires_grad_(),
        h_t=(torch.randn(batches, t_len, h_t, generator=g) * 2).to(device, dtype),
        w_t=(torch.randn(v_t, h_t, generator=g) * 2 / math.sqrt(h_t)).to(device, dtype),
        s_labels=s_labels.to(device), t_labels=t_labels.to(device), s_groups=s_groups.to(device),
        t_groups=t_groups.to(device), s_ids=s_ids.to(device), t_ids=t_ids.to(device),
        s_off=torch.tensor([o for o in s_off]), t_off=torch.tensor([o + [(0, 0)] * (t_len - len(o)) for o in t_off]),
        t_pad=t_pad,
    )  # fmt: skip
    # a vocabulary map as between two BPE families: a third of the student's ids share a string with the teacher
    shared = torch.randperm(min(v_s, v_t), generator=g)[: min(v_s, v_t) // 3].sort().values
    teacher_ids = torch.randperm(v_t, generator=g)[: shared.numel()]
    bytes_s, bytes_t = torch.randint(0, 257, (v_s,), generator=g), torch.randint(0, 257, (v_t,), generator=g)
    x["vocab_map"] = VocabMap(shared, teacher_ids, v_s, v_t, bytes_s, bytes_t)
    return x


def ours(x: dict, cfg: CrossTokenizerConfig, exact_ok=None):
    loss = fused_linear_cross_tokenizer_kd(
        x["h_s"], x["w_s"], x["h_t"], x["w_t"], x["s_labels"], x["t_labels"], x["s_groups"], x["t_groups"],
        x["vocab_map"], exact_ok, config=cfg,
    )  # fmt: skip
    loss.backward()
    return loss


def gold(x: dict, hybrid: bool):
    """TRL GOLD's ULDLoss on materialised logits (its own alignment from the byte offsets)."""
    from trl.experimental.gold.gold_trainer import ULDLoss

    cfg = types.SimpleNamespace(
        uld_crossentropy_weight=0.0, uld_distillation_weight=1.0, uld_student_temperature=1.0,
        uld_teacher_temperature=1.0, uld_skip_student_eos=False, uld_skip_teacher_eos=False, use_extended_uld=True,
        uld_token_merge_strategy="bayesian", uld_use_hybrid_loss=hybrid, uld_hybrid_matched_weight=1.0,
        uld_hybrid_unmatched_weight=1.0, beta=0.0,
    )  # fmt: skip
    loss_fn = ULDLoss(cfg)
    if hybrid:  # GOLD builds its map from tokenizers; hand it ours
        vm = x["vocab_map"]
        loss_fn._vocab_mapping = dict(zip(vm.teacher_ids.tolist(), vm.student_ids.tolist()))
        loss_fn._teacher_matched_ids = set(vm.teacher_ids.tolist())
        loss_fn._student_matched_ids = set(vm.student_ids.tolist())
        loss_fn.mapping_tensor = torch.full((x["w_t"].shape[0],), -1, dtype=torch.long, device=x["w_t"].device)
        loss_fn.mapping_tensor[vm.teacher_ids.to(x["w_t"].device)] = vm.student_ids.to(x["w_t"].device)
    s_logits = x["h_s"] @ x["w_s"].T
    with torch.no_grad():
        t_logits = x["h_t"] @ x["w_t"].T
    unshift = lambda lab: torch.cat([torch.full_like(lab[:, :1], -100), lab[:, :-1]], 1)  # noqa: E731
    loss = loss_fn(s_logits, t_logits, unshift(x["s_labels"]), unshift(x["t_labels"]), x["s_ids"], x["t_ids"],
                   x["s_off"], x["t_off"])  # fmt: skip
    loss.backward()
    return loss


def gold_equivalent(x: dict, per_row: torch.Tensor) -> torch.Tensor:
    """GOLD's reduction of our per-group losses ("none"): mean over groups per sequence, then over sequences."""
    totals = []
    for b in range(per_row.shape[0]):
        groups = x["s_groups"][b]
        totals.append(per_row[b].sum() / max(1, int(groups.max()) - int(groups[groups >= 0].min()) + 1))
    return torch.stack(totals).mean()


def measure(fn, device) -> tuple[float, float]:
    """(ms, peak GiB beyond what existed before) of fn() after one warm-up call; on CPU no memory figure."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3, (torch.cuda.max_memory_allocated() - before) / 2**30
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_cross_tokenizer.json")
    parser.add_argument("--ns", type=int, nargs="+", default=None, help="student tokens (default 1024 ... 8192)")
    parser.add_argument("--gold-max-n", type=int, default=4096, help="largest N for GOLD's materialised path")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: V_s 1000, V_t 800, H 32, N 64/128")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.tiny:
        v_s, v_t, h_s, h_t, seq, ns, dtype, topks = 1000, 800, 32, 48, 32, [64, 128], torch.float32, [16, 64]
    else:
        v_s, v_t, h_s, h_t, seq, dtype, topks = 151936, 128256, 1536, 4096, 1024, torch.bfloat16, [64, 256, 1024]
        ns = [1024, 2048, 4096, 8192]
    ns = args.ns or ns
    methods = {
        "ours ULD (full sort)": CrossTokenizerConfig(kind="uld"),
        "ours hybrid (full sort)": CrossTokenizerConfig(kind="hybrid", unmatched="ignore"),
        f"ours hybrid (top-{topks[-1]} ULD)": CrossTokenizerConfig(
            kind="hybrid", unmatched="ignore", uld_top_k=topks[-1]
        ),
        "ours next-byte": CrossTokenizerConfig(kind="next_byte"),
    }
    rows = []
    for n in ns:
        x = synthetic_batch(n, seq, v_s, v_t, h_s, h_t, device, dtype)
        n_groups = int(x["s_groups"].max()) + 1
        ref_values = {}
        for name, cfg in methods.items():

            def step(cfg=cfg):
                x["h_s"].grad = x["w_s"].grad = None
                return ours(x, cfg)

            ms, gib = measure(step, device)
            row = dict(N=n, groups=n_groups, method=name, ms=ms, peak_gib=gib)
            if "full sort" in name:  # GOLD's reduction of the same objective, for the comparison below
                per_row = fused_linear_cross_tokenizer_kd(
                    x["h_s"], x["w_s"], x["h_t"], x["w_t"], x["s_labels"], x["t_labels"], x["s_groups"], x["t_groups"],
                    x["vocab_map"], None, config=cfg.replace(reduction="none"),
                ).detach()  # fmt: skip
                ref_values[cfg.kind] = float(gold_equivalent(x, per_row))
            rows.append(row)
        # GOLD's hybrid clamps probabilities at 1e-8 in its matched term, so it agrees with ours only where no merged
        # probability is that small (at these vocabularies merged groups are far below it): compare on ULD
        for kind in ("uld", "hybrid") if n <= args.gold_max_n else ():
            method = f"TRL GOLD {kind} (materialised)"
            try:
                holder = {}

                def gold_step(kind=kind):
                    x["h_s"].grad = x["w_s"].grad = None
                    holder["loss"] = gold(x, hybrid=kind == "hybrid")

                ms, gib = measure(gold_step, device)
                value = float(holder["loss"].detach())
                err = abs(value - ref_values[kind]) / abs(value)
                rows.append(dict(N=n, groups=n_groups, method=method, ms=ms, peak_gib=gib, rel_diff_vs_ours=err))
            except torch.OutOfMemoryError:
                rows.append(dict(N=n, groups=n_groups, method=method, ms=None, peak_gib="OOM"))
            x["h_s"].grad = x["w_s"].grad = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\nforward + backward, V_s={v_s}, V_t={v_t}, H_s={h_s}, H_t={h_t}, {str(dtype)[6:]}, {device.type}")
    table = print_table(rows, ["N", "groups", "method", "ms", "peak_gib", "rel_diff_vs_ours"])

    # top-k ULD against the full sort on merged group distributions of one batch (materialised, fp32)
    x = synthetic_batch(min(ns[0], 1024), seq, v_s, v_t, h_s, h_t, device, dtype, seed=1)
    n_groups = int(x["s_groups"].max()) + 1
    with torch.no_grad():
        s_logits = (x["h_s"] @ x["w_s"].T).float().reshape(-1, v_s)
        t_logits = (x["h_t"] @ x["w_t"].T).float().reshape(-1, v_t)
        log_q = xref.merged_log_probs(
            s_logits, x["s_labels"].reshape(-1).clamp(min=0), x["s_groups"].reshape(-1), n_groups
        )
        log_p = xref.merged_log_probs(
            t_logits, x["t_labels"].reshape(-1).clamp(min=0), x["t_groups"].reshape(-1), n_groups
        )
        del s_logits, t_logits
        q, p = log_q.exp(), log_p.exp()
        full = xref.sorted_l1(q, p)
        topk_rows = []
        for k in topks:
            approx = xref.sorted_l1(q, p, k)
            rel = (full - approx).abs() / full
            topk_rows.append(dict(k=k, mean_rel_err=float(rel.mean()), max_rel_err=float(rel.max()),
                                  total_rel_err=float((full.sum() - approx.sum()).abs() / full.sum())))  # fmt: skip
    print(
        f"\ntop-k ULD against the full sort, {n_groups} merged groups (teacher entropy "
        f"{float(-(p / p.sum(-1, keepdim=True) * log_p.log_softmax(-1)).sum(-1).mean()):.2f} nats)"
    )
    topk_table = print_table(topk_rows, ["k", "mean_rel_err", "max_rel_err", "total_rel_err"])
    write_json(args.out, dict(environment=environment(), rows=rows, table=table, topk=topk_rows, topk_table=topk_table))


if __name__ == "__main__":
    main()
