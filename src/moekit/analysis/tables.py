"""Markdown tables of a sweep: a row per configuration, and the paired reading of scaling and Pareto sweeps."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Sequence

from moekit.analysis.aggregate import (
    Group,
    Repeat,
    Stat,
    drop_repeats,
    figure_kind,
    group_results,
    metrics_of,
    setting_label,
)
from moekit.analysis.records import RunResult
from moekit.utils.format import si

__all__ = ["markdown_table", "merge_markdown_tables"]


def _spread(stat: Stat | None, scale: float = 1.0, digits: int = 2, median: bool = False) -> str:
    """``mean (min-max)`` (``median (min-max)`` for times), or the value alone for one run."""
    if stat is None:
        return "-"
    value = f"{stat.center(median) * scale:.{digits}f}"
    return value if stat.n == 1 else f"{value} ({stat.low * scale:.{digits}f}-{stat.high * scale:.{digits}f})"


def _task_table(groups: Sequence[Group]) -> list[str]:
    metrics = metrics_of(run for g in groups for run in g.runs)
    header = ["setting", "family", "seeds", "params", "active params / token", "FLOPs / example", "training FLOPs"]
    benched = any(run.bench_step_seconds is not None for g in groups for run in g.runs)
    header += ["fit time s", "step ms", *(["bench step ms"] if benched else []), *(m.label for m in metrics)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for group in groups:
        cells = [
            f"`{setting_label(group, groups)}`",
            group.family,
            ",".join(str(s) for s in group.seeds),
            si(_mean(group.stat(lambda r: r.total_params))),
            si(_mean(group.stat(lambda r: r.active_params))),
            si(_mean(group.stat(lambda r: r.forward_flops))),
            si(_mean(group.stat(lambda r: r.training_flops))),
            _spread(group.stat(lambda r: r.fit_seconds), digits=0, median=True),
            _spread(group.stat(lambda r: r.batch_seconds), scale=1e3, digits=0, median=True),
        ]
        if benched:
            cells.append(_spread(group.stat(lambda r: r.bench_step_seconds), scale=1e3, digits=0, median=True))
        cells += [_spread(group.stat(lambda r, key=m.key: r.test.get(key)), scale=m.scale) for m in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _mean(stat: Stat | None) -> float | None:
    return None if stat is None else stat.mean


def _slope(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of y against x through ``(x, y)`` points (at least two distinct x)."""
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)


def _scaling_trends(groups: Sequence[Group]) -> list[str]:
    """The reading of a scaling sweep, per router: the slope of the test metric against log2(experts)
    fitted to each seed's runs, and each run's difference to the dense run of the same seed (paired:
    the runs of one seed hold out the same validation images and train on the same batches; a run without a seed,
    which draws its own, has no pair)."""
    metric = metrics_of(run for g in groups for run in g.runs)[0]
    runs = [run for g in groups for run in g.runs if run.test.get(metric.key) is not None]
    dense = {run.seed: run.test[metric.key] for run in runs if run.num_experts == 0 and run.seed is not None}
    lines = [
        f"| router | seeds | {metric.label} per doubling of experts: mean (per seed) | vs dense of the same seed: mean "
        "(min to max) | above dense |",
        "|---|---|---|---|---|",
    ]
    for family in dict.fromkeys(run.family for run in runs if run.num_experts > 0):
        mine = [run for run in runs if run.family == family]
        seeds = sorted({run.seed for run in mine}, key=lambda s: (s is None, s))
        slopes = []
        for seed in seeds:
            points = [(math.log2(r.num_experts), r.test[metric.key] * metric.scale) for r in mine if r.seed == seed]
            if len({x for x, _ in points}) > 1:
                slopes.append(_slope(points))
        diffs = [(r.test[metric.key] - dense[r.seed]) * metric.scale for r in mine if r.seed in dense]
        slope = f"{sum(slopes) / len(slopes):+.2f} ({', '.join(f'{s:+.2f}' for s in slopes)})" if slopes else "-"
        paired = f"{sum(diffs) / len(diffs):+.2f} ({min(diffs):+.2f} to {max(diffs):+.2f})" if diffs else "-"
        above = f"{sum(d > 0 for d in diffs)} of {len(diffs)}" if diffs else "-"
        lines.append(f"| {family} | {','.join(map(str, seeds))} | {slope} | {paired} | {above} |")
    return lines


def _median_ratio(pairs: Sequence[tuple[RunResult, RunResult]], value: Callable[[RunResult], float | None]) -> str:
    """``0.95x``: the median over ``(run, reference)`` pairs of ``value(run) / value(reference)``."""
    ratios = [value(r) / value(d) for r, d in pairs if value(r) is not None and value(d)]
    return f"{statistics.median(ratios):.2f}x" if ratios else "-"


def _pareto_pairs(groups: Sequence[Group]) -> list[str]:
    """The reading of a Pareto sweep: each MoE configuration against the dense run of the same setting
    but the recipe (the same width) and the same seed (paired: one seed's runs see the same batches). FLOPs
    and fit time as ratios to that dense run (the median over the seeds), the test metric as
    differences, seed by seed. A run without a seed (each draws its own) has no pair."""
    metric = metrics_of(run for g in groups for run in g.runs)[0]

    def without_model(group: Group) -> tuple[tuple[str, str], ...]:  # `moe=` picks the model (`model=` in older
        return tuple((k, v) for k, v in group.setting if k not in ("moe", "model"))  # archived records)

    dense_runs = [(g, run) for g in groups if g.family == "dense" for run in g.runs if run.seed is not None]
    dense = {(without_model(g), run.seed): run for g, run in dense_runs}
    lines = [
        f"| setting | seeds | FLOPs / example vs dense | fit time vs dense | {metric.label} vs dense: mean (per seed) "
        "| above dense |",
        "|---|---|---|---|---|---|",
    ]
    for group in groups:
        pairs = [(run, dense.get((without_model(group), run.seed))) for run in group.runs]
        pairs = sorted(((r, d) for r, d in pairs if d is not None), key=lambda p: (p[0].seed is None, p[0].seed))
        if group.family == "dense" or not pairs:
            continue
        diffs = [
            (r.test[metric.key] - d.test[metric.key]) * metric.scale
            for r, d in pairs
            if metric.key in r.test and metric.key in d.test
        ]
        paired = f"{sum(diffs) / len(diffs):+.2f} ({', '.join(f'{x:+.2f}' for x in diffs)})" if diffs else "-"
        above = f"{sum(x > 0 for x in diffs)} of {len(diffs)}" if diffs else "-"
        lines.append(
            f"| `{setting_label(group, groups)}` | {','.join(str(r.seed) for r, _ in pairs)} "
            f"| {_median_ratio(pairs, lambda r: r.forward_flops)} | {_median_ratio(pairs, lambda r: r.fit_seconds)} "
            f"| {paired} | {above} |"
        )
    return lines


def markdown_table(results: Sequence[RunResult]) -> str:
    """One markdown table per task (sweep): a row per configuration with its parameters, FLOPs,
    times and test metrics; a value over several seeds reads ``mean (min-max)``, a time ``median
    (min-max)``. A scaling sweep also gets its trends per router (:func:`_scaling_trends`), a Pareto
    sweep its MoEs against the dense run of their width (:func:`_pareto_pairs`). A run recorded twice (the same
    setting and seed) counts once, as its newest record; the section names the records left out."""
    results, repeats = drop_repeats(results)
    groups = group_results(results)
    out = []
    for task in dict.fromkeys(g.task_name for g in groups):
        task_groups = [g for g in groups if g.task_name == task]
        seeds = sum(len(g.runs) for g in task_groups)
        out += [f"#### {task} ({len(task_groups)} configurations, {seeds} runs)", ""]
        machines = Counter(run.machine for g in task_groups for run in g.runs if run.machine)
        if machines:
            out += ["Ran on: " + "; ".join(f"{name} ({count} runs)" for name, count in machines.most_common()), ""]
        out += _repeats_line([r for r in repeats if r.kept.task_name == task])
        out += [*_task_table(task_groups), ""]
        if figure_kind(task) == "scaling":
            out += ["Trends against the number of experts:", "", *_scaling_trends(task_groups), ""]
        pairs = _pareto_pairs(task_groups) if figure_kind(task) == "pareto" else []
        if len(pairs) > 2:  # a row under the header: an MoE run with a dense run of its width and seed
            out += ["Against the dense run of the same width and seed:", "", *pairs, ""]
    out.append(_table_note(benched=any(run.bench_step_seconds is not None for run in results)))
    return "\n".join(out) + "\n"


def _repeats_line(repeats: Sequence[Repeat]) -> list[str]:
    """The line (and its blank line) that names the records of repeated runs left out of a task's table."""
    if not repeats:
        return []
    named = "; ".join(f"`{r.left_out.path}` (kept: `{r.kept.path}`)" for r in repeats)
    return [
        f"Left out: {len(repeats)} older record(s) of a run made again with the same setting and seed (each seed "
        f"counts once, as its newest record): {named}",
        "",
    ]


_NOTE_START = "Values over several seeds:"
_BENCH_COLUMN = "| bench step ms |"


def _table_note(benched: bool) -> str:
    """The closing paragraph of :func:`markdown_table`: how to read its cells."""
    note = (
        f"{_NOTE_START} mean (min-max), times median (min-max): a run slowed by other work on the"
        " machine moves the mean, not the median. Training FLOPs = 3 x forward FLOPs x examples trained on."
    )
    if benched:
        note += (
            " Step ms: the run's own mean batch time (data loading included); bench step ms: its model's training"
            " step timed by scripts/bench_models.py."
        )
    return note


def _task_sections(table: str) -> dict[str, str]:
    """The per-task sections of a :func:`markdown_table` text, by task name, in order, without the
    closing note."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in table.splitlines():
        if line.startswith("#### "):
            current = sections.setdefault(line.split()[1], [])
        elif line.startswith(_NOTE_START):
            current = None
        if current is not None:
            current.append(line)
    return {task: "\n".join(lines).rstrip("\n") + "\n" for task, lines in sections.items()}


def merge_markdown_tables(existing: str, new: str) -> tuple[str, list[str]]:
    """``existing`` (an earlier ``results.md``) with the task sections of ``new`` put in place of its
    sections of the same tasks (new tasks go last), and the names of the tasks kept from ``existing``.

    A figure folder keeps the figures of the sweeps that a later drawing did not include; this keeps
    their tables alike, so one sweep can be redrawn from its records while another's section (drawn
    from records that are no longer at hand) stays."""
    sections = _task_sections(existing)
    drawn = _task_sections(new)
    kept = [task for task in sections if task not in drawn]
    sections.update(drawn)
    body = "\n".join(sections.values())
    return body + "\n" + _table_note(benched=_BENCH_COLUMN in body) + "\n", kept
