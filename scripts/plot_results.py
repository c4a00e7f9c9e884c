"""Figures and a markdown table from the run records of a results sweep.

    python scripts/plot_results.py logs/results/pareto              # -> logs/results/pareto/figures/
    python scripts/plot_results.py logs/results --out docs/figures/results

Reads every ``results.json`` under the folder (each finished run of ``scripts/train.py`` writes one),
averages the runs that differ only in their seed (mean; error bars and table ranges are min-max), draws
the figure of each results sweep found (``pareto.png``, ``scaling.png``, ``language.png``,
``ablations.png``; see ``configs/experiment/results/``), and prints a markdown table, also written as
``results.md`` beside the figures. The logic is in :mod:`moekit.results`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moekit.results import load_results, markdown_table, plot_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a sweep folder (logs/results/<name>) or any folder of runs")
    parser.add_argument("--out", type=Path, default=None, help="where the figures go (default: <folder>/figures)")
    args = parser.parse_args(argv)
    try:
        results = load_results(args.folder)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    out = args.out or args.folder / "figures"
    table = markdown_table(results)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(table)
    for figure in plot_all(results, out):
        print(f"wrote {figure}")
    print(f"wrote {out / 'results.md'} ({len(results)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
