"""Analysis: run records, sweeps aggregated into tables and figures, and the benchmarks.

* :mod:`~moekit.analysis.records`: the ``results.json`` every training run writes, read back as rows.
* :mod:`~moekit.analysis.aggregate`: the runs of a sweep grouped by configuration, seeds together.
* :mod:`~moekit.analysis.tables`, :mod:`~moekit.analysis.figures`: a sweep's markdown tables and figures
  (``scripts/plot_results.py``).
* :mod:`~moekit.analysis.step_times`: step times measured side by side, matched to a sweep's runs.
* The benchmarks behind ``scripts/bench_*.py`` and ``scripts/soak.py``: :mod:`~moekit.analysis.bench_layers`,
  :mod:`~moekit.analysis.bench_models`, :mod:`~moekit.analysis.bench_callbacks`,
  :mod:`~moekit.analysis.bench_parallel`, :mod:`~moekit.analysis.bench_quant`, :mod:`~moekit.analysis.soak`.

This floor reads what the template writes; the library (:mod:`moekit.moe`, :mod:`moekit.models`) never
imports it.
"""
