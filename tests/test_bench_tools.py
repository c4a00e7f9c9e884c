"""Option checks of the benchmark scripts without a test file of their own (scripts/bench_parallel.py,
scripts/bench_quant.py): a bad value is refused before any process starts or any checkpoint loads."""

import sys

import pytest

from moekit.analysis import bench_parallel, bench_quant

SMALL = ["--worlds", "2", "--layer", "top2", "--experts", "4", "--dim", "32", "--hidden", "64", "--warmup", "0"]


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--tokens", "100", "--steps", "1"], "--tokens=100 must be a positive multiple of 64"),
        (["--tokens", "128", "--steps", "0"], "--steps=0 must be positive"),
        (["--tokens", "128", "--steps", "1", "--worlds", "3"], "--worlds 3: each must be a divisor of --experts=4"),
    ],
)
def test_bench_parallel_refuses_what_it_cannot_measure(monkeypatch, capsys, bad, message):
    """--tokens 100 ran one sequence of 64 tokens a rank, yet printed "100 tokens per rank" and divided the bytes by
    100 for its MB / token column; --steps 0 died in the ranks on a median of no steps."""
    monkeypatch.setattr(sys, "argv", ["bench_parallel.py", *SMALL, *bad])
    with pytest.raises(SystemExit):
        bench_parallel.main()
    assert message in capsys.readouterr().err


def test_bench_quant_refuses_no_timing_rounds(tmp_path, capsys):
    """--rounds 0 would quantize every variant, then die on a median of no rounds."""
    with pytest.raises(SystemExit):
        bench_quant.main(["--ckpt", str(tmp_path / "missing.ckpt"), "--rounds", "0"])
    assert "--rounds=0 must be positive" in capsys.readouterr().err
