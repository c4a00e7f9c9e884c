"""``make gpu-check`` (scripts/gpu_check.sh) on a machine without CUDA: what it refuses, and how it says so, before
it runs any section."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _run(tmp_path, **env: str) -> subprocess.CompletedProcess:
    report = tmp_path / "report.md"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_REPORT": str(report), **env}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def test_a_section_that_does_not_exist_is_named_with_the_choices(tmp_path):
    result = _run(tmp_path, GPU_CHECK_SECTIONS="compiled batch")
    assert result.returncode == 2
    assert "no section 'batch'; choose from: tier models compiled layers" in result.stderr
    assert not (tmp_path / "report.md").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the check would run")
def test_without_cuda_it_stops_before_writing_a_report(tmp_path):
    result = _run(tmp_path, GPU_CHECK_SECTIONS="compiled layers")
    assert result.returncode == 1
    assert "make gpu-check needs a CUDA device" in result.stderr + result.stdout
    assert not (tmp_path / "report.md").exists()
