"""Figures and a markdown table from the run records of a results sweep.

    python scripts/plot_results.py logs/results/pareto              # -> logs/results/pareto/figures/
    python scripts/plot_results.py logs/results --out docs/figures/results
    python scripts/plot_results.py logs/results/pareto --step-times logs/bench_models/pareto.json

Reads every ``results.json`` under the folder (each finished run of ``scripts/train.py`` writes one),
averages the runs that differ only in their seed (the mean, times the median; error bars and table
ranges are min-max), draws the figure of each results sweep found (``pareto.png``, ``scaling.png``,
``language.png``, ``ablations.png``; see ``configs/experiment/results/``), and prints a markdown
table, also written as ``results.md`` beside the figures. A folder that already holds figures keeps those
of the sweeps not drawn now, and ``results.md`` keeps their sections (the script names them): one sweep
can be redrawn from its archived records beside sweeps whose records are gone. The logic is in
:mod:`moekit.results`.

``--step-times`` takes files of ``scripts/bench_models.py --json``: each run then gets its model's
benchmarked step time, and the time axes use it (steps x step time) instead of the times the runs
recorded, which are not comparable across sessions or beside other work on the machine. A benchmark
that times many models in turn in one process puts some sparse routers' steps off by 15-40%
(README, Results): time the models of a figure in small groups.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from moekit.results import (
    RunResult,
    attach_step_times,
    load_results,
    load_step_times,
    markdown_table,
    merge_markdown_tables,
    plot_all,
)


def report_missing_step_times(results: list[RunResult]) -> None:
    """Say which sweeps' runs have no benchmarked step time (their figures keep the recorded times)."""
    missing = Counter(run.task_name for run in results if run.bench_step_seconds is None)
    for task, count in sorted(missing.items()):
        print(
            f"note: {count} run(s) of {task} have no step time in the --step-times files, so its figure uses the "
            "recorded times; time their models with scripts/bench_models.py --json (the same models, batch size "
            "and precision, e.g. --vit-width 64 96 128 for the Pareto sweep)",
            file=sys.stderr,
        )


def report_mixed_machines(results: list[RunResult]) -> None:
    """Say which sweeps' runs come from more than one machine (CPU model, threads, GPU) and draw a time
    axis from the times they recorded: those times are not comparable."""
    machines: dict[str, set[str]] = {}
    for run in results:
        if run.machine and run.bench_step_seconds is None:
            machines.setdefault(run.task_name, set()).add(run.machine)
    for task, names in sorted(machines.items()):
        if len(names) > 1:
            print(
                f"note: the runs of {task} ran on {len(names)} machines ({'; '.join(sorted(names))}): the times "
                "they recorded are not comparable; give --step-times from one benchmark of their models",
                file=sys.stderr,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a sweep folder (logs/results/<name>) or any folder of runs")
    parser.add_argument("--out", type=Path, default=None, help="where the figures go (default: <folder>/figures)")
    parser.add_argument(
        "--step-times", type=Path, nargs="+", help="scripts/bench_models.py --json files: time axes from them"
    )
    args = parser.parse_args(argv)
    try:
        results = load_results(args.folder)
        if args.step_times:
            results = attach_step_times(results, load_step_times(args.step_times))
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.step_times:
        report_missing_step_times(results)
    report_mixed_machines(results)
    out = args.out or args.folder / "figures"
    table = markdown_table(results)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    table_file = out / "results.md"
    if table_file.exists():  # like the figures of sweeps not drawn now, their sections stay
        table, kept = merge_markdown_tables(table_file.read_text(), table)
        if kept:
            print(f"kept from the existing {table_file}: the sections of {', '.join(kept)}", file=sys.stderr)
    table_file.write_text(table)
    for figure in plot_all(results, out):
        print(f"wrote {figure}")
    print(f"wrote {out / 'results.md'} ({len(results)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
