"""The runs of a sweep grouped by configuration (their seeds together), with mean, median and range; a run
repeated (the same configuration and seed twice) counts once, as its newest record."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from moekit.analysis.records import RunResult

__all__ = [
    "Stat",
    "Group",
    "Metric",
    "Repeat",
    "summarize",
    "drop_repeats",
    "group_results",
    "setting_label",
    "figure_kind",
    "metrics_of",
]


@dataclass(frozen=True)
class Stat:
    """Mean, median and spread of one quantity over the seeds of a configuration.

    Metrics are shown at their mean, times at their median (:meth:`center`).

    Attributes:
        mean, median: the mean and the median; low, high: the smallest and the largest value (the error
        bars); std: the sample standard deviation (0 for one value); n: the number of values.
    """

    mean: float
    median: float
    low: float
    high: float
    std: float
    n: int

    def center(self, median: bool = False) -> float:
        """The median or the mean. Times use the median: a run slowed by other work on the machine
        moves the mean of its seeds, not their median."""
        return self.median if median else self.mean


def summarize(values: Iterable[float | None]) -> Stat | None:
    """:class:`Stat` of the values that are not None (None when none is). A NaN among them (a seed whose metric
    diverged) makes every field NaN, whatever the order of the runs: a mean, a median or a range that left it out
    would read as the configuration's result."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return None
    n = len(present)
    if any(math.isnan(v) for v in present):
        return Stat(mean=math.nan, median=math.nan, low=math.nan, high=math.nan, std=math.nan, n=n)
    mean = sum(present) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in present) / (n - 1)) if n > 1 else 0.0
    return Stat(mean=mean, median=statistics.median(present), low=min(present), high=max(present), std=std, n=n)


@dataclass(frozen=True)
class Group:
    """The runs (seeds) of one configuration: the same ``task_name``, family and setting."""

    task_name: str
    family: str
    setting: tuple[tuple[str, str], ...]
    runs: tuple[RunResult, ...]

    def stat(self, value: Callable[[RunResult], float | None]) -> Stat | None:
        """:class:`Stat` of ``value(run)`` over the runs."""
        return summarize(value(run) for run in self.runs)

    @property
    def seeds(self) -> list[int | None]:
        return sorted((run.seed for run in self.runs), key=lambda s: (s is None, s))


@dataclass(frozen=True)
class Repeat:
    """A record left out of the seeds of its configuration: ``left_out`` and ``kept`` are the same task, family,
    setting and seed (a job rerun into another folder, a copied run folder), and ``kept`` is the newer."""

    left_out: RunResult
    kept: RunResult


def _age(run: RunResult) -> tuple:
    """Sorts a run's records oldest first: by ``finished_at``; a record without it (written before moekit recorded
    it) before any with it, by its file's modification time (which a copy or a checkout resets); then by path."""
    stamp = run.finished_at if run.finished_at is not None else run.file_mtime
    return run.finished_at is not None, -math.inf if stamp is None else stamp, str(run.path)


def drop_repeats(results: Iterable[RunResult]) -> tuple[list[RunResult], list[Repeat]]:
    """``results`` (in their order) with only the newest record (:func:`_age`) of each task, family, setting and
    seed, and the records left out. Two records of one seed are one run made twice: counted as two seeds they
    would count it twice in ``n`` and pull the median and the range towards it. Runs without a seed (each draws
    its own) are all kept."""
    results = list(results)

    def seed_of(run: RunResult) -> tuple:
        return run.task_name, run.family, run.setting, run.seed

    newest: dict[tuple, RunResult] = {}
    for run in results:
        if run.seed is not None:
            newest[seed_of(run)] = max(newest.get(seed_of(run), run), run, key=_age)
    repeats = [Repeat(run, newest[seed_of(run)]) for run in results if newest.get(seed_of(run), run) is not run]
    return [run for run in results if newest.get(seed_of(run), run) is run], repeats


def group_results(results: Iterable[RunResult]) -> list[Group]:
    """One :class:`Group` per configuration, in order of task, family and setting (numbers in a
    setting by value: 8 experts before 16, width 64 before 128). A run recorded twice (the same seed) counts
    once: its newest record (:func:`drop_repeats`)."""
    buckets: dict[tuple, list[RunResult]] = {}
    for run in drop_repeats(results)[0]:
        buckets.setdefault((run.task_name, run.family, run.setting), []).append(run)
    return [Group(*key, runs=tuple(runs)) for key, runs in sorted(buckets.items(), key=lambda item: _order(item[0]))]


def _order(key: tuple[str, str, tuple[tuple[str, str], ...]]) -> tuple:
    """The sort key of a (task, family, setting) triple: numeric values compare as numbers, before words."""
    task, family, setting = key

    def value(text: str) -> tuple[int, float, str]:
        try:
            return (0, float(text), "")
        except ValueError:
            return (1, 0.0, text)

    return task, family, tuple((name, value(text)) for name, text in setting)


def setting_label(group: Group, groups: Sequence[Group]) -> str:
    """``group``'s overrides whose values differ between the groups of its task (``"moe=none,
    model.embed_dim=64"``); a ``results/`` model config shows without the folder."""
    same_task = [g for g in groups if g.task_name == group.task_name]
    varying = {k for g in same_task for k, v in g.setting if any(dict(h.setting).get(k) != v for h in same_task)}
    parts = [f"{k}={v.removeprefix('results/')}" for k, v in group.setting if k in varying]
    return ",".join(parts) or "-"


def figure_kind(task_name: str) -> str | None:
    """Which figure a results sweep gets: ``pareto``, ``scaling``, ``language``, ``ablations``
    (``results_ablation_*``), or None for runs of other experiments (table only)."""
    if task_name.startswith("results_ablation"):
        return "ablations"
    kind = task_name.removeprefix("results_")
    return kind if task_name.startswith("results_") and kind in ("pareto", "scaling", "language") else None


@dataclass(frozen=True)
class Metric:
    """A test metric as shown: its key in ``RunResult.test``, its label, and a display scale."""

    key: str
    label: str
    scale: float = 1.0


_IMAGE_METRICS = (Metric("acc", "test top-1 %", 100.0), Metric("acc_top5", "test top-5 %", 100.0))
_LM_METRICS = (Metric("ppl", "test ppl"), Metric("bpb", "test bits/byte"))


def metrics_of(runs: Iterable[RunResult]) -> tuple[Metric, ...]:
    """The test metrics to show: accuracy for image classifiers, perplexity for language models (told apart by
    the validation metrics too: a run with ``test=false`` records none)."""
    return _IMAGE_METRICS if any("acc" in run.test or "acc" in run.val for run in runs) else _LM_METRICS
