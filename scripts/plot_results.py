"""Figures and a markdown table from the run records of a results sweep.

    python scripts/plot_results.py logs/results/pareto              # -> logs/results/pareto/figures/
    python scripts/plot_results.py logs/results --out docs/figures/results
    python scripts/plot_results.py logs/results/pareto --step-times logs/bench_models/pareto.json

Reads every ``results.json`` under the folder (each finished run of ``scripts/train.py`` writes one),
averages the runs that differ only in their seed (the mean, times the median; error bars and table
ranges are min-max), draws the figure of each results sweep found (``pareto.png``, ``scaling.png``,
``language.png``, ``ablations.png``; see ``configs/results/``), and prints a markdown
table, also written as ``results.md`` beside the figures. A folder that already holds figures keeps those
of the sweeps not drawn now, and ``results.md`` keeps their sections (the script names them): one sweep
can be redrawn from its archived records beside sweeps whose records are gone. The code:
:mod:`moekit.analysis.report`.

``--step-times`` takes files of ``scripts/bench_models.py --json``: each run then gets its model's
benchmarked step time, and the time axes use it (steps x step time) instead of the times the runs
recorded, which are not comparable across sessions or beside other work on the machine. A benchmark
that times many models in turn in one process puts some sparse routers' steps off by 15-40%
(docs/results.md): time the models of a figure in small groups.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moekit.analysis.records import load_results
from moekit.analysis.report import time_notes, write_report
from moekit.analysis.step_times import attach_step_times, load_step_times


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
    for note in time_notes(results, step_times_given=bool(args.step_times)):
        print(f"note: {note}", file=sys.stderr)
    out = args.out or args.folder / "figures"
    if out.exists() and not out.is_dir():
        print(f"error: --out {str(out)!r} is a file; give a folder for the figures and results.md", file=sys.stderr)
        return 1
    report = write_report(results, out)
    print(report.table)
    if report.kept:
        print(f"kept from the existing {out / 'results.md'}: the sections of {', '.join(report.kept)}", file=sys.stderr)
    for figure in report.figures:
        print(f"wrote {figure}")
    repeats = len(results) - report.runs
    left_out = f"; {repeats} earlier record(s) of the same seeds left out" if repeats else ""
    print(f"wrote {out / 'results.md'} ({report.runs} runs{left_out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
