"""Copy the run records of a sweep into a folder that is committed with the figures.

    python scripts/archive_runs.py logs/results docs/figures/results/runs
    python scripts/plot_results.py docs/figures/results/runs --out docs/figures/results

``logs/`` holds each run's checkpoints and TensorBoard events and is not kept across machines; its
``results.json`` files are what the figures and tables are drawn from. This copies every one under the
source to the same relative folder under the destination (a few kilobytes a run), so the figures can be
redrawn, and a sweep extended by another seed, in a later session. A record that differs from one
already archived for the same setting and seed is refused unless ``--replace``. The logic is
:func:`moekit.analysis.records.archive_records`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moekit.analysis.records import archive_records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a sweep folder or logs/results")
    parser.add_argument("dest", type=Path, help="the archive, e.g. docs/figures/results/runs")
    parser.add_argument(
        "--replace", action="store_true", help="overwrite an archived record of the same setting and seed"
    )
    args = parser.parse_args(argv)
    try:
        written = archive_records(args.source, args.dest, replace=args.replace)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    print(f"{len(written)} record(s) archived in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
