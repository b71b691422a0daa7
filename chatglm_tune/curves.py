"""The loss / dev-F1 curve of a run, drawn from its metrics.jsonl into a PNG.

Each logged train loss is the mean over its logging window; the raw values are drawn faint and an
exponential moving average (`smooth`) over them, so the trend reads through the step-to-step swings.
"""

from __future__ import annotations

import json
from pathlib import Path

SMOOTHING = 0.9  # weight of the running average: the line follows about the last 10 logged values


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Exponential moving average, debiased at the start (as TensorBoard's smoothing)."""
    out, running = [], 0.0
    for i, value in enumerate(values, start=1):
        running = weight * running + (1 - weight) * value
        out.append(running / (1 - weight**i))
    return out


def plot_curves(metrics_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    train = [(e["step"], e["loss"]) for e in entries if "loss" in e]
    evals = [(e["step"], e["eval"]["score"], e["eval"]["dev_loss"]) for e in entries if e.get("eval", {}).get("score") is not None]
    fig, loss_ax = plt.subplots(figsize=(7, 4))
    if train:
        steps, losses = zip(*train)
        loss_ax.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="train loss (each log)")
        loss_ax.plot(steps, smooth(list(losses)), color="tab:blue", linewidth=1.8, label="train loss (smoothed)")
    if evals:
        loss_ax.plot([s for s, _, _ in evals], [l for _, _, l in evals], "o--", label="dev loss", color="tab:cyan")
        f1_ax = loss_ax.twinx()
        f1_ax.plot([s for s, _, _ in evals], [f for _, f, _ in evals], "s-", label="dev score", color="tab:red")
        f1_ax.set_ylabel("dev score (micro-F1, or ROUGE-L / 100)")
        f1_ax.set_ylim(0, 1)
        f1_ax.legend(loc="center right")
    loss_ax.set_xlabel("optimizer step")
    loss_ax.set_ylabel("loss")
    loss_ax.set_yscale("log")
    loss_ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
