"""The soak test (``scripts/soak.py``, :mod:`moekit.analysis.soak`): the verdict's arithmetic, a smoke run of
the script, and the soak itself
(marked ``soak``: minutes long, deselected by default; ``pytest -m soak`` runs it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import moekit.analysis.soak as soak_module
from conftest import REPO

SOAK_SCRIPT = REPO / "scripts" / "soak.py"
MIB = 2**20


@pytest.fixture(scope="module")
def soak() -> ModuleType:
    return soak_module


def _records(soak: ModuleType, steps: int, every: int, rss_mib, seconds_per_step) -> list:
    """Records every ``every`` steps; RSS and the time a step takes are functions of the step."""
    records, clock = [], 0.0
    for step in range(every, steps + 1, every):
        clock += every * seconds_per_step(step)
        records.append(soak.Record(step, clock, int(rss_mib(step) * MIB)))
    return records


def test_verdict_compares_the_first_and_last_quarter_after_the_warmup(soak):
    # 1,000 MiB, a spike during the warm-up, then 1 MiB more every 100 steps; 10 ms steps turning into
    # 20 ms steps from step 1,400 on.
    records = _records(
        soak,
        steps=1800,
        every=50,
        rss_mib=lambda step: 5000 if step <= 100 else 1000 + step // 100,
        seconds_per_step=lambda step: 0.01 if step <= 1400 else 0.02,
    )
    result = soak.verdict(records, warmup=200, max_growth=0.05, min_throughput_ratio=0.8)
    assert (result.first.start, result.first.end, result.last.start, result.last.end) == (200, 600, 1400, 1800)
    # the quarters hold the 8 records of (200, 600] and of (1400, 1800]: medians 1,004 and 1,016 MiB
    assert result.first.rss_median == pytest.approx((1000 + 4) * MIB, abs=0.5 * MIB)
    assert result.growth == pytest.approx(12 * MIB, abs=1 * MIB)
    assert result.growth_fraction == pytest.approx(result.growth / result.first.rss_median)
    assert result.first.steps_per_sec == pytest.approx(100.0)
    assert result.last.steps_per_sec == pytest.approx(50.0)
    assert result.throughput_ratio == pytest.approx(0.5)
    assert result.memory_ok and not result.throughput_ok and not result.passed


def test_verdict_fails_on_memory_growth_above_the_bound(soak):
    records = _records(
        soak, steps=1000, every=50, rss_mib=lambda step: 1000 + step / 5, seconds_per_step=lambda step: 0.01
    )
    result = soak.verdict(records, warmup=0, max_growth=0.05, min_throughput_ratio=0.8)
    assert result.growth_fraction > 0.05  # medians 1,040 and 1,180 MiB
    assert not result.memory_ok and result.throughput_ok and not result.passed
    assert soak.verdict(records, warmup=0, max_growth=0.2, min_throughput_ratio=0.8).passed


def test_bad_options_are_refused(soak, capsys):
    for argv in (["--steps", "100", "--warmup", "100"], ["--steps", "300", "--every", "50"], ["--every", "0"]):
        with pytest.raises(SystemExit):
            soak.parse_args(argv)
        err = capsys.readouterr().err
        assert "must be" in err or "needs at least 9 records" in err, err


def _run_soak(tmp_path: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, str(SOAK_SCRIPT), "--json", str(report), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert report.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    return result, json.loads(report.read_text())


@pytest.mark.slow
@pytest.mark.e2e
def test_soak_script_runs_the_training_template_and_records_every_k_steps(tmp_path):
    tiny = ["--steps", "60", "--warmup", "10", "--every", "5", "--steps-per-epoch", "20", "--batch-size", "16"]
    result, report = _run_soak(
        tmp_path, *tiny, "--embed-dim", "32", "--depth", "2", "--output-dir", str(tmp_path), timeout=300
    )
    assert [r["step"] for r in report["records"]] == list(range(5, 61, 5))
    assert all(r["rss"] > 100 * MIB for r in report["records"])
    times = [r["time"] for r in report["records"]]
    assert times == sorted(times)
    assert "verdict: " in result.stdout and "| first |" in result.stdout
    assert result.returncode == (0 if report["verdict"]["memory_ok"] and report["verdict"]["throughput_ok"] else 1)
    # the template's own run: 3 epochs with validation, checkpoints and both loggers
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
    assert "val/acc" in (tmp_path / "run" / "csv" / "metrics.csv").read_text()
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.*"))


@pytest.mark.soak
def test_soak_memory_stays_flat_and_throughput_does_not_decay(tmp_path):
    """2,400 steps (about 5 minutes on 2 cores): after 200 warm-up steps the median RSS of the last
    quarter is within 5% (and 64 MiB) of the first quarter's, and the last quarter runs at >= 0.8x."""
    result, report = _run_soak(tmp_path, "--steps", "2400", "--warmup", "200", timeout=1800)
    verdict = report["verdict"]
    summary = result.stdout[-2500:]
    assert verdict["growth"] <= 0.05 * verdict["first"]["rss_median"], summary
    assert verdict["growth"] <= 64 * MIB, summary
    assert verdict["throughput_ratio"] >= 0.8, summary
    assert result.returncode == 0, summary


@pytest.mark.parametrize(
    "steps, warmup, every", [(400, 0, 50), (449, 1, 50), (450, 1, 50), (450, 50, 50), (460, 60, 50), (45, 0, 5)]
)
def test_options_are_accepted_exactly_when_the_run_gives_the_verdict_its_records(soak, steps, warmup, every):
    """parse_args refuses a run whose records (every ``every`` steps from ``every`` on) leave the verdict fewer
    than 9 after the warm-up, before the run rather than after it; it accepts every run that has them."""
    records = _records(soak, steps=steps, every=every, rss_mib=lambda step: 1000, seconds_per_step=lambda step: 0.01)
    try:
        soak.verdict(records, warmup=warmup, max_growth=0.05, min_throughput_ratio=0.8)
        enough = True
    except ValueError:
        enough = False
    argv = ["--steps", str(steps), "--warmup", str(warmup), "--every", str(every)]
    if enough:
        soak.parse_args(argv)
    else:
        with pytest.raises(SystemExit):
            soak.parse_args(argv)
