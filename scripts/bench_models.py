"""``python scripts/bench_models.py --help``; the code: :mod:`moekit.analysis.bench_models`."""

from moekit.analysis.bench_models import main

if __name__ == "__main__":
    raise SystemExit(main())
