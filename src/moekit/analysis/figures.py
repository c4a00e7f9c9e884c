"""The figure of each results sweep: Pareto, scaling, language and ablations (PNG files, matplotlib's Agg).

Every point is the mean over the seeds of one configuration (times: the median), with the min-max range as
error bars.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from moekit.analysis.aggregate import Group, Metric, Stat, figure_kind, group_results, metrics_of, setting_label
from moekit.analysis.records import RunResult
from moekit.utils.format import with_prefix

__all__ = ["pyplot", "plot_pareto", "plot_scaling", "plot_language", "plot_ablations", "plot_all"]


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _tick_label(value: float) -> str:
    """A short tick label: ``300``, ``0.5``, ``24T`` (SI prefixes from 10^4 on)."""
    return with_prefix(value, ".3g", largest="P") if abs(value) >= 1e4 else f"{value:.4g}"


def _log_x(ax, base: float = 10) -> None:
    """A log x axis with short plain labels; minor ticks are labelled at 2, 3 and 5 x 10^n, or all of
    them where the axis spans less than 0.6 of a decade (a sweep of one model size)."""
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=base)

    def minor(value: float, _) -> str:
        low, high = sorted(ax.get_xlim())
        mantissa = round(value / 10 ** math.floor(math.log10(value)), 6)
        narrow = low > 0 and math.log10(high / low) < 0.6
        return _tick_label(value) if narrow or mantissa in (2.0, 3.0, 5.0) else ""

    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: _tick_label(value)))
    ax.xaxis.set_minor_formatter(FuncFormatter(minor))


def _errors(stats: Sequence[Stat], scale: float = 1.0, median: bool = False) -> list[list[float]]:
    """Matplotlib's asymmetric error bars: the distances from the means (or medians) to the min and the max."""
    return [
        [(s.center(median) - s.low) * scale for s in stats],
        [(s.high - s.center(median)) * scale for s in stats],
    ]


def _families(groups: Sequence[Group]) -> list[str]:
    return list(dict.fromkeys(g.family for g in groups))


def _series(
    ax,
    groups: Sequence[Group],
    x: Callable[[RunResult], float | None],
    y: Callable[[RunResult], float | None],
    y_scale: float = 1.0,
    y_median: bool = False,
) -> None:
    """One line per family through the configurations' points (sorted by x), with min-max error bars
    in y (and in x where x varies between seeds). A point sits at the median x over the seeds (x is a
    FLOP count or number of experts, the same for every seed, or a time) and at the mean y, or the
    median with ``y_median`` (y a time)."""
    for family in _families(groups):
        points = [(g.stat(x), g.stat(y)) for g in groups if g.family == family]
        points = sorted(((sx, sy) for sx, sy in points if sx is not None and sy is not None), key=lambda p: p[0].median)
        if not points:
            continue
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        ax.errorbar(
            [s.median for s in xs],
            [s.center(y_median) * y_scale for s in ys],
            xerr=_errors(xs, median=True),
            yerr=_errors(ys, y_scale, median=y_median),
            marker="o",
            capsize=3,
            label=family,
        )


def _save(fig, out: Path, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> Path:
    """Write ``fig`` to ``out`` as a PNG; ``rect`` is the part of the figure its axes may fill."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=rect)
    fig.savefig(out, dpi=120)
    pyplot().close(fig)
    return out


def _primary_metric(results: Iterable[RunResult]) -> Metric:
    return metrics_of(results)[0]


def plot_pareto(results: Sequence[RunResult], out: Path) -> Path:
    """Test accuracy against training FLOPs (left) and against training time (right), one line per
    family through its model sizes; writes a PNG to ``out``. The time is steps x the benchmarked step
    time when every run has one (:func:`attach_step_times`), else each run's recorded fit time."""
    plt = pyplot()
    groups = group_results(results)
    metric = _primary_metric(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    if all(run.bench_seconds is not None for run in results):
        time, time_label = (lambda r: r.bench_seconds), "training time (s): steps x benchmarked step time"
    else:
        time, time_label = (lambda r: r.fit_seconds), "training wall time (s), as recorded"
    for ax, x, xlabel in (
        (axes[0], lambda r: r.training_flops, "training FLOPs (3 x forward x images)"),
        (axes[1], time, time_label),
    ):
        _series(ax, groups, x, lambda r: r.test.get(metric.key), metric.scale)
        _log_x(ax)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(metric.label)
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()  # below the panels, clear of the points
    if labels:  # none when no run has a test metric (test=false)
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle("Pareto: mean accuracy and median time over seeds, bars = min-max")
    return _save(fig, out, rect=(0, 0.06, 1, 1))


def plot_scaling(results: Sequence[RunResult], out: Path) -> Path:
    """Training step time (left) and test accuracy (right) against the number of experts (log2
    axis), one line per router; writes a PNG to ``out``. The step time is the benchmarked one when
    every run has it (:func:`attach_step_times`), else each run's recorded mean batch time. Dense runs
    of the sweep (no experts) are the reference: a dashed horizontal line at their median step time and
    mean accuracy, shaded from their min to their max over the seeds."""
    plt = pyplot()
    groups = group_results(results)
    moe_groups = [g for g in groups if all(run.num_experts > 0 for run in g.runs)]
    dense_groups = [g for g in groups if g not in moe_groups]
    metric = _primary_metric(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    if all(run.bench_step_seconds is not None for run in results):
        step, step_label = (lambda r: r.bench_step_seconds), "training step (ms, benchmarked)"
    else:
        step, step_label = (lambda r: r.batch_seconds), "training step (ms, as recorded, data loading included)"

    def accuracy(run: RunResult) -> float | None:
        return run.test.get(metric.key)

    _series(axes[0], moe_groups, lambda r: r.num_experts, step, 1e3, y_median=True)
    _series(axes[1], moe_groups, lambda r: r.num_experts, accuracy, metric.scale)
    for ax, y, scale, median in ((axes[0], step, 1e3, True), (axes[1], accuracy, metric.scale, False)):
        _reference_lines(ax, dense_groups, y, scale, median)
    axes[0].set_ylabel(step_label)
    axes[1].set_ylabel(metric.label)
    for ax in axes:
        _log_x(ax, base=2)
        ax.set_xlabel("experts per MoE layer")
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle("Scaling experts: median step time and mean accuracy over seeds, bars = min-max")
    return _save(fig, out)


def _reference_lines(
    ax, groups: Sequence[Group], y: Callable[[RunResult], float | None], y_scale: float, y_median: bool
) -> None:
    """A dashed horizontal line per group at the mean (or median) of ``y`` over its runs, its min-max
    range shaded."""
    for group in groups:
        stat = group.stat(y)
        if stat is None:
            continue
        ax.axhline(stat.center(y_median) * y_scale, linestyle="--", color="0.35", label=group.family)
        ax.axhspan(stat.low * y_scale, stat.high * y_scale, color="0.35", alpha=0.12, linewidth=0)


def plot_language(results: Sequence[RunResult], out: Path) -> Path:
    """Test perplexity against training FLOPs, one line (or point) per family; writes a PNG to ``out``."""
    plt = pyplot()
    groups = group_results(results)
    metric = _primary_metric(results)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    _series(ax, groups, lambda r: r.training_flops, lambda r: r.test.get(metric.key), metric.scale)
    _log_x(ax)
    ax.set_xlabel("training FLOPs (3 x forward x tokens)")
    ax.set_ylabel(metric.label)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("Language models: mean over seeds, bars = min-max")
    return _save(fig, out)


def plot_ablations(results: Sequence[RunResult], out: Path) -> Path:
    """One bar chart per ablation (task): a bar per setting at the mean test metric over seeds,
    error bars min-max; the y axis is zoomed on the bars (it does not start at 0). Writes a PNG."""
    plt = pyplot()
    groups = group_results(results)
    tasks = list(dict.fromkeys(g.task_name for g in groups))
    bars = [max(2, sum(g.task_name == task for g in groups)) for task in tasks]  # panel width follows its bars
    fig, axes = plt.subplots(
        1, len(tasks), figsize=(max(6.0, 2.1 * sum(bars)), 4.2), squeeze=False, gridspec_kw={"width_ratios": bars}
    )
    for ax, task in zip(axes[0], tasks, strict=True):
        task_groups = [g for g in groups if g.task_name == task]
        metric = _primary_metric(run for g in task_groups for run in g.runs)
        stats = [g.stat(lambda r, key=metric.key: r.test.get(key)) for g in task_groups]
        shown = [(g, s) for g, s in zip(task_groups, stats, strict=True) if s is not None]
        if not shown:
            continue
        labels = [_short_label(setting_label(g, task_groups)) for g, _ in shown]
        values = [s for _, s in shown]
        ax.bar(range(len(values)), [s.mean * metric.scale for s in values], yerr=_errors(values, metric.scale))
        ax.set_xticks(range(len(values)), labels, fontsize=8)
        finite = [s for s in values if math.isfinite(s.low) and math.isfinite(s.high)]  # a NaN bar sets no limit
        if finite:
            low = min(s.low for s in finite) * metric.scale
            high = max(s.high for s in finite) * metric.scale
            margin = max(high - low, abs(high) * 0.01, 1e-6)
            ax.set_ylim(low - margin, high + margin)
        ax.set_ylabel(metric.label)
        ax.set_title(task.removeprefix("results_"))
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Ablations: mean over seeds, bars = min-max (y axis not from 0)")
    return _save(fig, out)


def _short_label(label: str) -> str:
    """``"normalize=false"`` from ``"moe.normalize=false"``; one line per override (a list or dict value such as
    ``model.stem_channels=[32,64]`` stays whole: only the commas outside brackets part the overrides)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(label):
        depth += (char in "[{(") - (char in "]})")
        if char == "," and depth == 0:
            parts.append(label[start:i])
            start = i + 1
    parts.append(label[start:])
    return (
        "\n".join(
            part.split("=", 1)[0].rsplit(".", 1)[-1] + "=" + part.split("=", 1)[1] for part in parts if "=" in part
        )
        or label
    )


_PLOTS: dict[str, Callable[[Sequence[RunResult], Path], Path]] = {
    "pareto": plot_pareto,
    "scaling": plot_scaling,
    "language": plot_language,
    "ablations": plot_ablations,
}


def plot_all(results: Sequence[RunResult], out_dir: Path) -> list[Path]:
    """The figure of every results sweep among ``results`` (:func:`figure_kind` of their task):
    ``<out_dir>/<kind>.png``. Runs of other experiments get no figure."""
    by_kind: dict[str, list[RunResult]] = {}
    for run in results:
        kind = figure_kind(run.task_name)
        if kind is not None:
            by_kind.setdefault(kind, []).append(run)
    return [_PLOTS[kind](runs, Path(out_dir) / f"{kind}.png") for kind, runs in by_kind.items()]
