"""The time-to-accuracy figure from bench_time_to_accuracy's JSON: exact match against training GPU-seconds (left)
and against optimizer steps (right), one line per recipe (the mean over seeds at each checkpoint), the seeds'
spread (± one standard deviation) shaded, the teacher and the target dashed.

    python -m benchmarks.accuracy.plot_time_to_accuracy                     # results JSON -> docs/images PNG
    python -m benchmarks.accuracy.plot_time_to_accuracy --json runs/bench_time_to_accuracy.json --out x.png
    python -m benchmarks.accuracy.plot_time_to_accuracy --small    # the README's: GPU-seconds only, SMALL_RECIPES

Seeds stop at different checkpoints (a run capped by its seconds, or the ground-truth SFT row that runs as long
as the longest): a checkpoint index is plotted while every seed has it; its x is the seeds' mean.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..common.accuracy import mean_std, seconds_clock


def mean_curve(runs: list[dict], key: str) -> tuple[list[float], list[float], list[float]]:
    """(x, mean accuracy, std) per checkpoint index that every seed reached."""
    length = min(len(r["curve"]) for r in runs)
    xs, means, stds = [], [], []
    for i in range(length):
        xs.append(mean_std([r["curve"][i][key] for r in runs])[0])
        mean, std = mean_std([r["curve"][i]["accuracy"] for r in runs])
        means.append(mean)
        stds.append(std)
    return xs, means, stds


# the README's small figure: the ground-truth baseline, one off-policy and one on-policy recipe of ours, the offline
# row and TRL's two trainers on the on-policy objective (prefixes of the benchmark's recipe names)
SMALL_RECIPES = ("SFT on ground truth", "off-policy KD, JSD", "on-policy GKD (lmbda 1", "offline on-policy (",
                 "TRL GKDTrainer", "TRL DistillationTrainer")  # fmt: skip


def plot(payload: dict, out: Path, *, small: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seconds = f"training {seconds_clock(payload)}-seconds (scoring excluded)"
    if small:
        fig, ax = plt.subplots(figsize=(7, 3.8))
        axes = [ax]
        panels = ((ax, "seconds", seconds),)
    else:
        fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), sharey=True)
        panels = ((axes[0], "seconds", seconds), (axes[1], "step", "optimizer steps"))
    for ax, key, label in panels:
        for name, runs in payload["runs"].items():
            if not runs or (small and not name.startswith(SMALL_RECIPES)):
                continue
            xs, means, stds = mean_curve(runs, key)
            style = "--" if name.startswith("TRL") else "-"
            (line,) = ax.plot(xs, means, style, marker="o", markersize=3, label=name)
            # the band clipped to what an accuracy can be: two seeds either side of a jump spread past 0 and 1
            low = [max(0.0, m - s) for m, s in zip(means, stds)]
            high = [min(1.0, m + s) for m, s in zip(means, stds)]
            ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15)
        ax.axhline(payload["teacher"]["accuracy"], color="black", linestyle=":", linewidth=1, label="teacher")
        ax.axhline(payload["target"], color="gray", linestyle="--", linewidth=1, label="target (90 % of teacher)")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("exact match, held-out problems (greedy)")
    if not small:  # the small figure's seconds stay linear: its rows share one cap
        axes[0].set_xscale("symlog", linthresh=1.0)
        axes[1].set_xscale("symlog", linthresh=10.0)
    for ax in axes:
        ax.set_xlim(left=0)  # no negative seconds or steps: symlog would otherwise pad to the left of 0
    gpu = payload.get("environment", {}).get("gpu") or "CPU"
    seeds = sorted({r["seed"] for runs in payload["runs"].values() for r in runs})  # those that ran, not those asked
    config = payload.get("config", {})
    task = f"{config.get('operands', 3)} numbers of {config.get('digits', 2)} digit(s)"
    if config.get("labelled"):
        task += f", solutions for {config['labelled']} of {config.get('train_problems')} problems"
    cut = " (cut short)" if payload.get("summary", {}).get("cut_short") else ""
    if small:
        share = f" (solutions for {config['labelled']:,} of {config.get('train_problems'):,} problems)" if config.get(
            "labelled") else ""
        fig.suptitle(f"Student exact match on arithmetic{share},\nmean ± std over seeds {seeds} ({gpu}){cut}",
                     fontsize=9)  # fmt: skip
    else:
        # two lines: a task line and a labelled share together outrun the figure's width
        fig.suptitle(f"Student exact match, arithmetic on {task},\nmean ± std over seeds {seeds} ({gpu}){cut}")
    axes[-1].legend(fontsize=6 if small else 7, loc="upper left" if small else "best")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="benchmarks/results/bench_time_to_accuracy.json")
    p.add_argument("--out", default=None, help="default: docs/images/time_to_accuracy.png (_small with --small)")
    p.add_argument("--small", action="store_true", help="one panel (GPU-seconds) and six recipes, for the README")
    a = p.parse_args()
    out = a.out or f"docs/images/time_to_accuracy{'_small' if a.small else ''}.png"
    plot(json.loads(Path(a.json).read_text()), Path(out), small=a.small)


if __name__ == "__main__":
    main()
