"""The headline charts of the benchmarks page, drawn from the results JSON so a reader sees the distances before the
numbers: the loss as a multiple of its matmul floor beside its extra memory, per method and N (Liger's methods; and
every method with TRL's divergence kernel, from another run); and the decode step against one read of the weights,
per row count.

    python -m benchmarks.plot_headlines            # reads benchmarks/results/, writes docs/images/*.png

Needs matplotlib (the `bench` extra). Reads only what the benchmarks wrote: no figure is typed in here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common.losses import LLAMA_V

ROOT = Path(__file__).resolve().parents[1]
FLOOR_PREFIX = "matmul floor"


def loss_rows(results: dict, beta: float = 0.5, names: dict[str, str] | None = None) -> dict[int, list[dict]]:
    """Rows of bench_fused_linear_jsd at `beta` on the Llama vocabulary, grouped by N, floor excluded; with `names`,
    only the methods it lists, under the names it gives them."""
    by_n: dict[int, list[dict]] = {}
    for row in results["rows"]:
        if row["beta"] == beta and row["V"] == LLAMA_V and not row["method"].startswith(FLOOR_PREFIX):
            if names is not None:
                if row["method"] not in names:
                    continue
                row = {**row, "method": names[row["method"]]}
            by_n.setdefault(row["N"], []).append(row)
    return dict(sorted(by_n.items()))


def plot_loss(results: dict, out: Path) -> None:
    import matplotlib.pyplot as plt

    by_n = loss_rows(results)
    methods = list(dict.fromkeys(r["method"] for rows in by_n.values() for r in rows))
    fig, (time_ax, mem_ax) = plt.subplots(1, 2, figsize=(11, 3.6))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        xs, times, mems = [], [], []
        for j, rows in enumerate(by_n.values()):
            row = next((r for r in rows if r["method"] == method), None)
            if row is not None:
                xs.append(j + i * width)
                times.append(row["x_floor"])
                mems.append(row.get("extra_GiB") or 0.0)
        time_ax.bar(xs, times, width, label=method)
        mem_ax.bar(xs, mems, width, label=method)
    for ax, label in ((time_ax, "time / matmul floor"), (mem_ax, "extra GiB")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(by_n))], [f"N = {n}" for n in by_n])
        ax.set_ylabel(label)
    time_ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    time_ax.set_title("fused JSD, forward + backward (lower is better)")
    mem_ax.set_title("memory beyond inputs and gradients")
    time_ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(_source_line(results), fontsize=7, y=0.02)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=130)
    plt.close(fig)


def plot_loss_two_timings(results: dict, out: Path, names: dict[str, str]) -> None:
    """Each method's time as a multiple of the floor, timed alone (solid) and with the host ahead (hatched)."""
    import matplotlib.pyplot as plt

    by_n = loss_rows(results, names=names)
    methods = list(dict.fromkeys(r["method"] for rows in by_n.values() for r in rows))
    fig, ax = plt.subplots(figsize=(11, 3.6))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        for j, rows in enumerate(by_n.values()):
            row = next((r for r in rows if r["method"] == method), None)
            if row is None or not isinstance(row.get("ms"), float):
                continue
            x = j + i * width
            color = f"C{i}"
            ax.bar(x - width / 4, row["x_floor"], width / 2, color=color, label=method if j == 0 else None)
            ax.bar(x + width / 4, row["gpu_x_floor"], width / 2, color=color, alpha=0.55, hatch="//")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(by_n))], [f"N = {n}" for n in by_n])
    ax.set_ylabel("time / matmul floor")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_title("fused JSD, fwd + bwd: each pair timed alone (solid) and with the host ahead (hatched)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(_source_line(results), fontsize=7, y=0.02)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=130)
    plt.close(fig)


def plot_decode(results: dict, out: Path) -> None:
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r.get("decode_step_ms")]
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    labels = [f"{r['rows']} rows" for r in rows]
    ax.bar(labels, [r["decode_step_ms"] for r in rows], 0.5, label="captured decode step")
    ax.scatter(labels, [r["floor_ms"] for r in rows], color="black", marker="_", s=900, label="one read of the weights")
    ax.set_ylabel("ms per step")
    ax.set_title("decode step against its floor (lower is better)")
    ax.legend(fontsize=7)
    fig.suptitle(_source_line(results), fontsize=7, y=0.02)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(out, dpi=130)
    plt.close(fig)


def _source_line(results: dict) -> str:
    env = results.get("environment", {})
    return f"{env.get('gpu', '?')}, torch {env.get('torch', '?')}: {env.get('command', '')}"[:160]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    charts = {  # results file -> (chart, drawing)
        "bench_fused_linear_jsd.json": ("loss_vs_floor.png", plot_loss),
        "bench_fused_linear_jsd_trl.json": ("loss_vs_floor_trl.png", plot_loss),  # every method, TRL's kernel too
        "bench_rollouts_graph.json": ("decode_vs_floor.png", plot_decode),
    }
    # that run's "liger_patch_kd" row ran gradient groups, no longer the default for a bf16 weight gradient; its
    # "chunk 1024, no groups" row is what the default runs (the file's read_me)
    two_timings = {"liger_patch_kd chunk 1024, no groups": "liger_patch_kd", "liger_patch_kd chunk 2048":
                   "liger_patch_kd chunk 2048 (2 GiB)", "trl divergence kernel": "TRL's divergence kernel",
                   "liger chunked (compiled)": "Liger chunked (compiled)", "liger triton": "Liger Triton"}  # fmt: skip
    charts["bench_fused_linear_jsd_two_timings_h100.json"] = (
        "loss_two_timings_h100.png", lambda results, out: plot_loss_two_timings(results, out, two_timings)
    )
    for results, (chart, draw) in charts.items():
        draw(json.loads((args.results / results).read_text()), args.out / chart)
        print(f"wrote {args.out / chart}")


if __name__ == "__main__":
    main()
