"""The capacity tuner's history read back from a run's TensorBoard logs: a figure and a summary per layer."""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path

from moekit.analysis.figures import pyplot
from moekit.loggers import read_metrics_csv

__all__ = ["read_capacity_scalars", "plot_capacity_tuning", "summarize_capacity_tuning"]

Series = list[tuple[int, float]]


def read_capacity_scalars(run_dir: Path) -> dict[str, dict[str, Series]]:
    """``{layer: {"factor": [(step, value)], "drop_rate": [...]}}`` from the TensorBoard event files
    under ``run_dir`` (the ``capacity/<layer>/<name>`` scalars the tuner logs), or, without them, from its
    ``metrics.csv`` files (``logger=csv``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    history: dict[str, dict[str, Series]] = defaultdict(dict)
    for folder in sorted({path.parent for path in run_dir.rglob("events.out.tfevents.*")}):
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            if tag.startswith("capacity/"):
                layer, name = tag[len("capacity/") :].rsplit("/", 1)
                history[layer][name] = [(event.step, event.value) for event in events.Scalars(tag)]
    if not history:
        for path in sorted(run_dir.rglob("metrics.csv")):
            header, rows = read_metrics_csv(path.read_text())
            for column in header:
                if column.startswith("capacity/"):
                    layer, name = column[len("capacity/") :].rsplit("/", 1)
                    series = [(int(float(row["step"])), float(row[column])) for row in rows if row.get(column)]
                    history[layer][name] = series
    if not history:
        raise ValueError(
            f"no capacity/<layer>/... scalars under {run_dir} (TensorBoard event files or metrics.csv): was the run "
            "logged with logger=tensorboard or logger=csv, and did the capacity tuner decide at least once?"
        )
    return dict(history)


def plot_capacity_tuning(
    history: dict[str, dict[str, Series]], target: float, path: Path, title: str = "CapacityTuner"
) -> None:
    """Drop rate (log scale down to 0.1%, with the target) above capacity factor, against the step,
    one line per layer, under ``title``."""
    plt = pyplot()
    figure, (drops, factors) = plt.subplots(2, 1, sharex=True, figsize=(7.5, 6), constrained_layout=True)
    for (layer, series), style in zip(sorted(history.items()), itertools.cycle(["-", "--", ":", "-."])):
        steps, values = zip(*series["drop_rate"])
        drops.plot(steps, values, linestyle=style, marker=".", label=layer)
        steps, values = zip(*series["factor"])
        factors.step(steps, values, linestyle=style, where="pre", label=layer)  # each value was in use up to its step
    drops.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:g}")
    drops.set_yscale("symlog", linthresh=1e-3)  # logarithmic above 0.1%, linear down to 0
    drops.set_ylim(bottom=0)
    drops.set_ylabel("dropped fraction\n(moving average)")
    drops.legend(fontsize=8)
    drops.grid(alpha=0.3)
    factors.set_ylabel("capacity factor")
    factors.set_xlabel("training step")
    factors.grid(alpha=0.3)
    figure.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def summarize_capacity_tuning(history: dict[str, dict[str, Series]], target: float) -> str:
    lines = [f"{'layer':<16}{'first step':>11}{'drop':>9}{'factor':>8}  ->{'last step':>10}{'drop':>9}{'factor':>8}"
             f"{'first step <= target':>22}"]  # fmt: skip
    for layer, series in sorted(history.items()):
        drops, factors = series["drop_rate"], series["factor"]
        under = next((step for step, value in drops if value <= target), None)
        lines.append(
            f"{layer:<16}{drops[0][0]:>11}{drops[0][1]:>9.4f}{factors[0][1]:>8.3f}  ->"
            f"{drops[-1][0]:>10}{drops[-1][1]:>9.4f}{factors[-1][1]:>8.3f}{str(under):>22}"
        )
    return "\n".join(lines)
