"""``python scripts/bench_moe.py --help``; the code: :mod:`moekit.analysis.bench_layers`."""

from moekit.analysis.bench_layers import main

if __name__ == "__main__":
    raise SystemExit(main())
