"""``python scripts/soak.py --help``; the code: :mod:`moekit.analysis.soak`."""

from moekit.analysis.soak import main

if __name__ == "__main__":
    raise SystemExit(main())
