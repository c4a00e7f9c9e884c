"""``python scripts/bench_quant.py --help``; the code: :mod:`moekit.analysis.bench_quant`."""

from moekit.analysis.bench_quant import main

if __name__ == "__main__":
    raise SystemExit(main())
