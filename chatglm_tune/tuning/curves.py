"""The loss / dev-F1 curve of a run, drawn from its metrics.jsonl into a PNG.

Each logged train loss is the mean over its logging window; the raw values are drawn faint and an
exponential moving average (`smooth`) over them, so the trend reads through the step-to-step swings.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

SMOOTHING = 0.9  # weight of the running average: the line follows about the last 10 logged values


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Exponential moving average run forward and backward, debiased at each start (as TensorBoard's
    smoothing), and the two averaged. A one-way average lags: on a falling loss it sits above every raw
    point. The forward lag and the backward one cancel on a straight trend, so the line runs through the
    points."""

    def one_way(xs: list[float]) -> list[float]:
        out, running = [], 0.0
        for i, value in enumerate(xs, start=1):
            running = weight * running + (1 - weight) * value
            out.append(running / (1 - weight**i))
        return out

    forward, backward = one_way(values), one_way(values[::-1])[::-1]
    return [(f + b) / 2 for f, b in zip(forward, backward)]


def plot_curves(metrics_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    drawable = lambda loss: math.isfinite(loss) and loss > 0  # noqa: E731  (the loss axis is logarithmic)
    train = [(e["step"], e["loss"]) for e in entries if "loss" in e and drawable(e["loss"])]
    evals = [(e["step"], e["eval"]["score"], e["eval"]["dev_loss"]) for e in entries
             if e.get("eval", {}).get("score") is not None and drawable(e["eval"]["dev_loss"])]
    fig, loss_ax = plt.subplots(figsize=(7, 4))
    if train:
        steps, losses = zip(*train)
        loss_ax.plot(steps, losses, ".-" if len(steps) == 1 else "-", color="tab:blue", alpha=0.25, linewidth=0.8,
                     label="train loss (each log)")
        loss_ax.plot(steps, smooth(list(losses)), color="tab:blue", linewidth=1.8, label="train loss (smoothed)")
    if evals:
        loss_ax.plot([s for s, _, _ in evals], [loss for _, _, loss in evals], "o--", label="dev loss",
                     color="tab:cyan")
        f1_ax = loss_ax.twinx()
        f1_ax.plot([s for s, _, _ in evals], [f for _, f, _ in evals], "s-", label="dev score", color="tab:red")
        f1_ax.set_ylabel("dev score (micro-F1, or ROUGE-L / 100)")
        f1_ax.set_ylim(0, 1)
        f1_ax.legend(loc="center right")
    loss_ax.set_xlabel("optimizer step")
    loss_ax.set_ylabel("loss")
    if train or evals:
        loss_ax.set_yscale("log")
        loss_ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
