"""Edges of the run records and the machine they name: pairing runs without a seed, the allocator read from the
process's libraries, ARM CPUs, and the commit of a moekit installed inside another project's checkout."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_results import _record, _results

from moekit.analysis.records import _git_commit
from moekit.analysis.tables import markdown_table
from moekit.utils import machine

SRC = Path(__file__).resolve().parents[1] / "src"


def _seedless(record: dict) -> dict:
    """``record`` as a run started with ``seed=null``: it drew a seed of its own, which the record does not hold."""
    overrides = [o for o in record["overrides"] if not o.startswith("seed=")]
    return {**record, "seed": None, "overrides": [*overrides, "seed=null"]}


def _section(table: str, title: str) -> list[str]:
    """The table rows (header and rule included) that follow the line ``title`` in a markdown text."""
    lines = table.splitlines()
    if title not in lines:
        return []
    rows = lines[lines.index(title) + 2 :]
    return rows[: next((i for i, line in enumerate(rows) if not line.startswith("|")), len(rows))]


def test_runs_without_a_seed_are_not_paired_with_a_dense_run():
    """Each seedless run drew its own seed: no dense run is of its seed, so it has no per-seed difference."""
    pareto = [
        _seedless(_record("results_pareto", family, 0, [f"model={model}", "model.embed_dim=64"], acc=acc))
        for family, model, accs in (("dense", "dense_vit", (0.80, 0.82)), ("soft_moe", "soft_moe_vit", (0.85, 0.87)))
        for acc in accs
    ]
    seeded = [_record("results_pareto", f, 0, [f"model={m}", "model.embed_dim=64"], acc=a) for f, m, a in (
        ("dense", "dense_vit", 0.80), ("soft_moe", "soft_moe_vit", 0.81))]  # fmt: skip
    table = markdown_table(_results(pareto + seeded))
    pairs = _section(table, "Against the dense run of the same width and seed:")
    assert pairs[2:] == ["| `model=soft_moe_vit` | 0 | 1.00x | 1.00x | +1.00 (+1.00) | 1 of 1 |"], table  # seed 0 alone
    assert "Against the dense run" not in markdown_table(_results(pareto))  # no pair at all: no section
    scaling = [
        _seedless(_record("results_scaling", family, 0, [f"model.num_experts={e}"], acc=acc, experts=e))
        for family, e, acc in (("dense", 0, 0.80), ("soft_moe", 8, 0.85), ("soft_moe", 16, 0.86))
    ]
    trends = _section(markdown_table(_results(scaling)), "Trends against the number of experts:")
    assert trends[2].split(" | ")[-2:] == ["-", "- |"], trends


def test_a_library_loaded_from_a_folder_named_after_a_malloc_is_not_that_malloc(tmp_path):
    """Only a mapped library's file name tells the allocator: glibc's malloc is still tuned, and recorded as such,
    in a process that loaded some library from a folder whose name holds ``jemalloc``."""
    dirs = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64")
    stub = next((Path(d) / "libdl.so.2" for d in dirs if (Path(d) / "libdl.so.2").is_file()), None)
    if stub is None or not Path("/proc/self/maps").exists():
        pytest.skip("needs Linux's libdl")
    folder = tmp_path / "jemalloc-tests"
    folder.mkdir()
    shutil.copy(stub, folder / stub.name)
    code = (
        "import ctypes, sys; ctypes.CDLL(sys.argv[1]); from moekit.utils import allocator as a; "
        "print(sorted(a._loaded_replacements()), a.tune_glibc_malloc(), a.active_allocator())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MOEKIT_ALLOCATOR")}
    run = subprocess.run(
        [sys.executable, "-c", code, str(folder / stub.name)],
        env={**env, "PYTHONPATH": str(SRC), "MOEKIT_NO_REEXEC": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    tuned = "True glibc malloc, tuned" if platform.libc_ver()[0] == "glibc" else "False system malloc"
    assert run.stdout.strip() == f"[] {tuned}", run.stdout  # neither tcmalloc nor jemalloc is loaded


ARM = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics asimddp sve bf16 i8mm
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: {part}
CPU revision\t: 1

processor\t: 1
CPU implementer\t: 0x41
CPU part\t: {part}
"""


def test_an_arm_cpu_is_named_by_its_implementer_and_part(tmp_path, monkeypatch):
    """Linux names no ARM CPU in ``/proc/cpuinfo``: its implementer and part tell a Neoverse N1 from a V1 in the run
    records (both were "unknown"), and ``Features`` are its flags; no x86 bf16 flag there, so ``auto`` keeps float32."""
    labels = []
    for part in ("0xd0c", "0xd40"):
        (tmp_path / "cpuinfo").write_text(ARM.format(part=part))
        monkeypatch.setattr(machine, "_CPUINFO", tmp_path / "cpuinfo")
        labels.append(machine.cpu_model())
        assert {"asimd", "sve", "bf16"} <= machine.cpu_flags()
        assert machine.resolve_precision("auto", "cpu")[0] == "32-true"
    assert labels == ["ARM CPU (implementer 0x41 part 0xd0c)", "ARM CPU (implementer 0x41 part 0xd40)"]
    x86 = "processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx512_bf16\n"
    (tmp_path / "cpuinfo").write_text(x86)
    assert (machine.cpu_model(), machine.cpu_flags()) == ("AMD EPYC 9R14 (family 25 model 17)", {"fpu", "avx512_bf16"})


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_commit_is_not_that_of_another_project_whose_checkout_holds_moekit(tmp_path):
    """moekit installed into a (git-ignored) virtual environment inside another project's checkout records no commit,
    not that project's; a folder the checkout tracks records its commit."""

    def git(*args: str) -> str:
        config = ["-c", "user.email=t@example.com", "-c", "user.name=t", "-c", "commit.gpgsign=false"]
        return subprocess.run(["git", *config, *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    (tmp_path / ".gitignore").write_text(".venv/\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "code.py").write_text("x = 1\n")
    git("add", ".gitignore", "pkg/code.py")
    git("commit", "-q", "-m", "start")
    installed = tmp_path / ".venv" / "site-packages" / "moekit" / "analysis"
    installed.mkdir(parents=True)
    (installed / "records.py").write_text("")
    head = git("rev-parse", "HEAD").strip()
    assert _git_commit(installed) is None
    assert _git_commit(tmp_path / "pkg") == head
