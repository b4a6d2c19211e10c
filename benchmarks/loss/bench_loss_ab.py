"""The fused losses of two checkouts, timed in alternation on one GPU: a refactor's gate (is the loss unchanged in
speed within run-to-run noise?).

    mkdir _before && git archive e19d489 liger_patch_kd benchmarks | tar -x -C _before   # the tree before a change
    python -m benchmarks.loss.bench_loss_ab --before _before --out runs/bench_loss_ab.json

Each checkout's `liger_patch_kd` runs in its own process (`--package-root`), `--rounds` times, alternating
(before, after, before, after, ...), so drift of the GPU's clocks falls on both alike. Cases: fused_linear_jsd
forward + backward at N rows, H = 4096, V = 128256, bf16, beta 0.5 (the JSD kernel), beta 0 (forward KL's fast
path) and fused_linear_topk_kd with K = 64 (the top-k kernel). Printed: the median over rounds of each side's
median time, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CASES = [("jsd beta 0.5", 8192), ("jsd beta 0.5", 2048), ("jsd beta 0", 8192), ("topk K 64 beta 0.5", 8192)]


def child(root: str) -> None:
    sys.path.insert(0, root)
    import torch

    import liger_patch_kd as L

    assert Path(L.__file__).resolve().is_relative_to(Path(root).resolve()), L.__file__
    from benchmarks.common import cuda_time_ms

    hidden, vocab = 4096, 128256
    out = {}
    for name, n in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        h = (torch.randn(n, hidden, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
        w = (torch.randn(vocab, hidden, device="cuda", generator=g) / hidden**0.5).bfloat16().requires_grad_()
        labels = torch.randint(0, vocab, (n,), device="cuda", generator=g)
        if name.startswith("topk"):
            start = torch.randint(0, vocab, (n, 1), device="cuda", generator=g)
            ids = ((start + 2003 * torch.arange(64, device="cuda")) % vocab).int()  # distinct within a row
            lp = torch.log_softmax(torch.randn(n, 64, device="cuda", generator=g), -1) - 1.0

            def step():
                L.fused_linear_topk_kd(h, w, ids, lp, labels, config=L.KDLossConfig(beta=0.5)).backward()
        else:
            h_t = (torch.randn(n, hidden, device="cuda", generator=g) * 0.5).bfloat16()
            w_t = (torch.randn(vocab, hidden, device="cuda", generator=g) / hidden**0.5).bfloat16()
            beta = 0.0 if "beta 0" in name and "0.5" not in name else 0.5

            def step():
                L.fused_linear_jsd(h, w, h_t, w_t, labels, config=L.KDLossConfig(beta=beta)).backward()

        out[f"{name}, N {n}"] = cuda_time_ms(step, warmup=3, reps=10)
        h.grad = w.grad = None
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a checkout (folder holding liger_patch_kd/) to compare with")
    parser.add_argument("--after", default=".", help="the checkout under test (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="runs/bench_loss_ab.json")
    parser.add_argument("--package-root", help=argparse.SUPPRESS)  # the child's checkout
    a = parser.parse_args()
    if a.package_root:
        return child(a.package_root)
    times: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for _ in range(a.rounds):
        for side in ("before", "after"):
            root = str(Path(getattr(a, side)).resolve())
            cmd = [sys.executable, "-m", "benchmarks.loss.bench_loss_ab", "--before", a.before, "--package-root", root]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{side} failed:\n{proc.stderr[-3000:]}")
            for case, ms in json.loads(line[7:]).items():
                times[side].setdefault(case, []).append(ms)
    from ..common import environment, print_table, write_json

    rows = []
    for case in times["after"]:
        before, after = (statistics.median(times[s][case]) for s in ("before", "after"))
        spread = max(times["before"][case] + times["after"][case]) - min(times["before"][case] + times["after"][case])
        rows.append({"case": case, "before_ms": before, "after_ms": after, "after/before": after / before,
                     "spread_ms": spread})  # fmt: skip
    print_table(rows, ["case", "before_ms", "after_ms", "after/before", "spread_ms"])
    write_json(a.out, {"environment": environment(), "times": times, "rows": rows})


if __name__ == "__main__":
    main()
