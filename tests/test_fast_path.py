"""The machine's fast path by default: every command-line entry restarts itself with tcmalloc preloaded when it is
installed (``MOEKIT_ALLOCATOR=system`` keeps the system's; run records name it), and ``trainer.precision=auto``, the
experiments' setting, trains in bf16 only where that is fast (GPUs, CPUs with AMX)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import CONFIGS
from moekit.utils.allocator import find_tcmalloc
from moekit.utils.machine import machine_info, resolve_precision

pytestmark = pytest.mark.e2e  # starts processes

ENTRY = textwrap.dedent(
    """
    from pathlib import Path
    from moekit.cli import run_script
    from moekit.utils.allocator import active_allocator
    run_script(lambda cfg: print("allocator:", active_allocator()), "export", Path({configs!r}))
    """
)


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "entry.py"
    script.write_text(ENTRY.format(configs=str(CONFIGS)))
    environ = {k: v for k, v in os.environ.items() if k not in ("MOEKIT_NO_REEXEC", "LD_PRELOAD", "MOEKIT_ALLOCATOR")}
    return subprocess.run(
        [sys.executable, str(script), "ckpt_path=unused", f"paths.log_dir={tmp_path / 'logs'}"],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_scripts_restart_with_tcmalloc_unless_told_otherwise(tmp_path):
    default = _run(tmp_path)
    assert default.returncode == 0, default.stderr
    expected = "tcmalloc" if find_tcmalloc() else "system malloc"
    assert f"allocator: {expected}" in default.stdout
    system = _run(tmp_path, MOEKIT_ALLOCATOR="system")
    assert "allocator: system malloc" in system.stdout
    wrong = _run(tmp_path, MOEKIT_ALLOCATOR="jemalloc")
    assert wrong.returncode != 0 and "MOEKIT_ALLOCATOR='jemalloc'" in wrong.stderr and "'system'" in wrong.stderr


def test_run_records_name_the_allocator():
    assert machine_info()["allocator"] in ("tcmalloc", "system malloc")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [({"avx512f", "amx_bf16", "amx_tile"}, "bf16-mixed"), ({"avx512f", "avx512_bf16"}, "32-true"), (set(), "32-true")],
)
def test_precision_auto_takes_bf16_only_on_cpus_with_amx(flags, expected):
    precision, why = resolve_precision("auto", "cpu", flags)
    assert precision == expected and ("has AMX" in why) == (expected == "bf16-mixed")
    assert resolve_precision("bf16-mixed", "cpu", set()) == ("bf16-mixed", "as configured")


def test_the_experiments_train_in_the_machines_precision_and_record_it(fake_fashion, tmp_path, caplog):
    from conftest import compose_config, small_overrides
    from moekit.commands.train import train

    for experiment in ("soft_moe_vit", "moe_transformer_lm", "moe_lstm_lm"):
        composed = compose_config("train", [f"experiment={experiment}"], tmp_path / experiment)
        assert composed.trainer.precision == "auto", "the experiments leave the precision to the machine"
    overrides = [*small_overrides(fake_fashion), "trainer.fast_dev_run=true", "trainer.precision=auto"]
    cfg = compose_config("train", overrides, tmp_path)
    with caplog.at_level("INFO", logger="moekit"):
        train(cfg)
    expected, why = resolve_precision("auto", "cpu")
    assert f"trainer.precision=auto: {expected} ({why})" in caplog.text
    assert cfg.trainer.precision == expected
