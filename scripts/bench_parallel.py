"""``python scripts/bench_parallel.py --help``; the code: :mod:`moekit.analysis.bench_parallel`."""

from moekit.analysis.bench_parallel import main

if __name__ == "__main__":
    raise SystemExit(main())
