"""A sweep's report: its figures and ``results.md`` in one folder, and notes on what its times can be trusted for.

A folder that already holds figures keeps those of the sweeps not drawn now, and ``results.md`` keeps their
sections: one sweep can be redrawn from its archived records beside sweeps whose records are gone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moekit.analysis.aggregate import drop_repeats
from moekit.analysis.figures import plot_all
from moekit.analysis.records import RunResult
from moekit.analysis.tables import markdown_table, merge_markdown_tables
from moekit.utils.atomic import write_text_atomic

__all__ = ["Report", "write_report", "time_notes"]


@dataclass(frozen=True)
class Report:
    """What :func:`write_report` wrote: the table text (as in ``results.md``), the figures, the tasks whose
    sections were kept from an earlier ``results.md``, and the runs the table counts (a seed recorded twice once)."""

    table: str
    figures: list[Path]
    kept: list[str]
    runs: int


def write_report(results: Sequence[RunResult], out: str | Path) -> Report:
    """Draw the figure of every results sweep among ``results`` into ``out`` and write ``out/results.md``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table, kept = markdown_table(results), []
    table_file = out / "results.md"
    if table_file.exists():  # like the figures of sweeps not drawn now, their sections stay
        table, kept = merge_markdown_tables(table_file.read_text(), table)
    write_text_atomic(table_file, table)
    runs = len(drop_repeats(results)[0])
    return Report(table=table, figures=plot_all(results, out), kept=kept, runs=runs)


def time_notes(results: Sequence[RunResult], step_times_given: bool) -> list[str]:
    """Warnings about the time axes: sweeps whose runs have no benchmarked step time (when step times were
    given), and sweeps whose recorded times come from more than one machine (not comparable). A run recorded twice
    counts once, as its newest record: the one the tables and figures use (:func:`drop_repeats`)."""
    results, notes = drop_repeats(results)[0], []
    if step_times_given:
        missing = Counter(run.task_name for run in results if run.bench_step_seconds is None)
        for task, count in sorted(missing.items()):
            notes.append(
                f"{count} run(s) of {task} have no step time in the --step-times files, so its figure uses the "
                "recorded times; time their models with scripts/bench_models.py --json (the same models, batch "
                "size and precision, e.g. --vit-width 64 96 128 for the Pareto sweep)"
            )
    machines: dict[str, set[str]] = {}
    for run in results:
        if run.machine and run.bench_step_seconds is None:
            machines.setdefault(run.task_name, set()).add(run.machine)
    for task, names in sorted(machines.items()):
        if len(names) > 1:
            notes.append(
                f"the runs of {task} ran on {len(names)} machines ({'; '.join(sorted(names))}): the times they "
                "recorded are not comparable; give --step-times from one benchmark of their models"
            )
    return notes
