"""``python scripts/bench_callbacks.py --help``; the code: :mod:`moekit.analysis.bench_callbacks`."""

from moekit.analysis.bench_callbacks import main

if __name__ == "__main__":
    raise SystemExit(main())
