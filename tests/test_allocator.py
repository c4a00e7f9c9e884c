"""The scripts run with tcmalloc by default (moekit.utils.allocator): every command-line entry restarts itself with
the library preloaded when it is installed, ``MOEKIT_ALLOCATOR=system`` keeps the system's, and run records name it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import CONFIGS
from moekit.utils.allocator import find_tcmalloc
from moekit.utils.machine import machine_info

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
