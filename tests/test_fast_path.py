"""The machine's fast path by default: every command-line entry restarts itself with tcmalloc preloaded when it is
installed, and any process that imports ``moekit.moe`` without it (a notebook, a user's script) has glibc's malloc
keep large freed blocks (``MOEKIT_ALLOCATOR=system`` keeps the system's defaults; run records name the allocator);
and importing moekit before torch shortens OpenMP's idle spin (a warning where torch came first). (The precision
``auto`` chooses: test_precision_choice.py.)"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import CONFIGS
from moekit.utils.allocator import TUNED, find_tcmalloc
from moekit.utils.machine import machine_info
from moekit.utils.openmp import SPIN_ROUNDS

pytestmark = pytest.mark.e2e  # starts processes

ENTRY = textwrap.dedent(
    """
    from pathlib import Path
    from moekit.cli import run_script
    from moekit.utils.allocator import active_allocator
    run_script(lambda cfg: print("allocator:", active_allocator()), "export", Path({configs!r}))
    """
)


# A user's own script: the layer library imported, then a large block (a 256 MB expert gradient's kind) allocated,
# written and freed step after step; prints the page faults of steps 10-19 and the allocator.
REUSE = textwrap.dedent(
    """
    import resource
    import torch
    import moekit.moe
    from moekit.utils.allocator import active_allocator

    def step():
        block = torch.empty(16 << 20)  # 64 MB
        block.fill_(1.0)

    for _ in range(10):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, active_allocator())
    """
)


# Torch's OpenMP team after a parallel region, imported after moekit or before it: prints the CPU seconds the team's
# idle threads burn over 20 sleeps of 20 ms, each after a parallel op, and the spin setting moekit reports.
SPIN = textwrap.dedent(
    """
    import resource, sys, time
    if sys.argv[1] == "moekit":
        import moekit, torch
    else:
        import torch, moekit
    from moekit.utils.openmp import spin_setting

    x = torch.ones(1 << 22)

    def others():  # CPU seconds of the process's threads but this one: the team's
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime - time.thread_time()

    idle = 0.0
    for _ in range(20):
        x.mul_(1.0)  # a parallel region
        before = others()
        time.sleep(0.02)
        idle += others() - before
    print(idle, spin_setting())
    """
)


def _clean_env(**env: str) -> dict[str, str]:
    drop = ("MOEKIT_NO_REEXEC", "LD_PRELOAD", "MOEKIT_ALLOCATOR", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **env}


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "entry.py"
    script.write_text(ENTRY.format(configs=str(CONFIGS)))
    return subprocess.run(
        [sys.executable, str(script), "ckpt_path=unused", f"paths.log_dir={tmp_path / 'logs'}"],
        env=_clean_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_scripts_restart_with_tcmalloc_unless_told_otherwise(tmp_path):
    default = _run(tmp_path)
    assert default.returncode == 0, default.stderr
    expected = "tcmalloc" if find_tcmalloc() else TUNED
    assert f"allocator: {expected}" in default.stdout
    in_process = _run(tmp_path, MOEKIT_ALLOCATOR="glibc")  # no restart, tcmalloc or not
    assert f"allocator: {TUNED}" in in_process.stdout
    system = _run(tmp_path, MOEKIT_ALLOCATOR="system")
    assert "allocator: system malloc" in system.stdout
    wrong = _run(tmp_path, MOEKIT_ALLOCATOR="jemalloc")
    assert wrong.returncode != 0 and "MOEKIT_ALLOCATOR='jemalloc'" in wrong.stderr and "'system'" in wrong.stderr


def test_a_preload_the_loader_could_not_find_is_not_reported_as_tcmalloc():
    code = "from moekit.utils.allocator import active_allocator; print(active_allocator())"
    run = subprocess.run(
        [sys.executable, "-c", code],
        env=_clean_env(LD_PRELOAD="/nonexistent/libtcmalloc_minimal.so.4", MOEKIT_NO_REEXEC="1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0 and run.stdout.strip() == "system malloc", run.stdout + run.stderr


def test_the_training_script_keeps_the_system_allocator_when_told(fake_fashion, tmp_path):
    """``MOEKIT_ALLOCATOR=system python scripts/train.py``: the run record says the system malloc (the script once
    restarted itself under tcmalloc before reading the variable)."""
    from conftest import REPO, small_overrides

    out = tmp_path / "run"
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train.py"), *small_overrides(fake_fashion), "trainer.max_steps=1",
         "test=false", f"paths.output_dir={out}"],
        env=_clean_env(MOEKIT_ALLOCATOR="system", HYDRA_FULL_ERROR="0"),
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((out / "results.json").read_text())["machine"]["allocator"] == "system malloc"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's malloc")
def test_importing_the_layers_keeps_large_freed_blocks_for_reuse():
    """Without tcmalloc (a notebook, a user's script), importing moekit.moe has glibc's malloc reuse a freed 64 MB
    block: no page faults once the heap holds it; with MOEKIT_ALLOCATOR=system every step faults all its pages."""
    faults = {}
    for choice in ("tcmalloc", "system"):
        run = subprocess.run(
            [sys.executable, "-c", REUSE], env=_clean_env(MOEKIT_ALLOCATOR=choice), capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        count, allocator = run.stdout.strip().split(" ", 1)
        faults[allocator] = int(count)
    pages = 10 * (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert faults[TUNED] < pages / 100, faults
    assert faults["system malloc"] > pages / 2, faults


def test_run_records_name_the_allocator():
    assert machine_info()["allocator"] in ("tcmalloc", TUNED, "system malloc")


def _libgomp_team() -> bool:
    """Whether a fresh process here runs torch's ops on a libgomp team of two or more threads (this one may have
    fewer: pytest-xdist's workers split the cores)."""
    maps = Path("/proc/self/maps")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores > 1 and maps.exists() and "libgomp" in maps.read_text()


@pytest.mark.skipif(not _libgomp_team(), reason="torch's OpenMP team here is not libgomp's, or has one thread")
def test_importing_moekit_first_stops_openmps_idle_threads_from_spinning():
    """libgomp's idle threads spin for milliseconds after each parallel region, taking cores from the expert
    threads (moekit.moe.cpu_threads); imported before torch, moekit shortens the spin to SPIN_ROUNDS. Measured up to
    three times: a busy neighbour (a parallel test worker on the same cores) takes CPU from the spinning threads (the
    default's idle seconds fell from 0.054 alone to 0.017 there, against 0.005-0.007 for moekit's)."""
    ours = f"GOMP_SPINCOUNT={SPIN_ROUNDS}"
    for _ in range(3):
        idle = {}
        for first in ("moekit", "torch"):
            run = subprocess.run(
                [sys.executable, "-c", SPIN, first], env=_clean_env(), capture_output=True, text=True, timeout=120
            )
            assert run.returncode == 0, run.stderr
            seconds, setting = run.stdout.strip().split(" ", 1)
            idle[setting] = float(seconds)
        assert set(idle) == {ours, "OpenMP's default"}, idle
        if idle[ours] < idle["OpenMP's default"] / 5:
            break
    assert idle[ours] < idle["OpenMP's default"] / 5, idle


@pytest.mark.skipif(not _libgomp_team(), reason="torch's OpenMP team here is not libgomp's, or has one thread")
def test_the_expert_threads_say_when_openmps_default_spin_slows_them():
    """A process that imported torch first is told, once, when a layer first starts its expert threads; one that
    imported moekit first, or set GOMP_SPINCOUNT itself, is not."""
    code = textwrap.dedent(
        """
        import sys
        if sys.argv[1] == "torch":
            import torch
        import moekit.moe, torch
        layer = moekit.moe.TopKMoE(32, 32, num_experts=64, top_k=2)  # 64 experts: over both cores' threads
        for _ in range(2):
            layer(torch.randn(1, 1024, 32)).sum().backward()
        """
    )

    def warnings_of(first: str, **env: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", code, first], env=_clean_env(**env), capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stderr
        return run.stderr.count("torch was imported before moekit")

    assert warnings_of("torch") == 1
    assert warnings_of("moekit") == 0
    assert warnings_of("torch", GOMP_SPINCOUNT="300000") == 0


def test_a_users_openmp_wait_policy_is_left_alone():
    code = "import os, moekit.utils.openmp as omp; print(os.environ.get('GOMP_SPINCOUNT'), omp.spin_setting())"
    run = subprocess.run(
        [sys.executable, "-c", code], env=_clean_env(OMP_WAIT_POLICY="ACTIVE"), capture_output=True, text=True
    )
    assert run.stdout.split() == ["None", "OMP_WAIT_POLICY=ACTIVE"], run.stderr


def test_the_cpu_is_named_with_its_family_and_model(tmp_path, monkeypatch):
    """The pool's virtual machines call a Zen 1 and a Zen 4 EPYC both "AMD EPYC", at half and full speed: records,
    benchmark headers and the tables' machine counts tell them apart by the x86 family and model (the first
    processor's; nothing added where /proc/cpuinfo has none, as on ARM)."""
    from moekit.utils import machine

    block = "processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: {f}\nmodel\t\t: {m}\nmodel name\t: AMD EPYC\n"
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(machine, "_CPUINFO", cpuinfo)
    cpuinfo.write_text(block.format(n=0, f=23, m=1) + "\n" + block.format(n=1, f=25, m=17))
    assert machine.cpu_model() == "AMD EPYC (family 23 model 1)"
    zen1 = machine.machine_label({"cpu": machine.cpu_model(), "torch_threads": 2})
    cpuinfo.write_text(block.format(n=0, f=25, m=17))
    assert machine.cpu_model() == "AMD EPYC (family 25 model 17)"
    assert machine.machine_label({"cpu": machine.cpu_model(), "torch_threads": 2}) != zen1
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Neoverse-V2\n")
    assert machine.cpu_model() == "Neoverse-V2"


# What a restarted program reports: its arguments, the interpreter's -W options and the allocator; exits with status 3.
REPORT = (
    "import sys\nfrom moekit.utils.allocator import active_allocator, use_fast_allocator\nuse_fast_allocator()\n"
    "print(repr(sys.argv[1:]), sys.warnoptions, active_allocator())\nraise SystemExit(3)\n"
)


@pytest.mark.skipif(find_tcmalloc() is None, reason="restarts with tcmalloc")
def test_a_restart_under_tcmalloc_runs_the_same_command_line(tmp_path):
    """``python -c``, ``python -m package.module`` (relative imports) and the interpreter's options survive the restart,
    as do arguments with spaces, quotes and non-ASCII and the exit status; a program read from stdin, which cannot run
    again, is not restarted (glibc's malloc is tuned instead)."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text("from . import __name__ as _package\n" + REPORT)
    args = ["a b", 'say "hi"', "ü…"]

    def report(*command: str, stdin: str | None = None) -> str:
        run = subprocess.run(
            [sys.executable, "-W", "ignore::UserWarning", *command, *args],
            cwd=tmp_path,
            env=_clean_env(),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 3, run.stderr
        return run.stdout.strip()

    assert report("-c", REPORT) == f"{args!r} ['ignore::UserWarning'] tcmalloc"
    assert report("-m", "pkg.mod") == f"{args!r} ['ignore::UserWarning'] tcmalloc"
    assert report("-", stdin=REPORT) == f"{args!r} ['ignore::UserWarning'] {TUNED}"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's malloc")
@pytest.mark.parametrize("library", ["missing", "not a library"])
def test_a_tcmalloc_that_does_not_load_leaves_glibcs_malloc_tuned(tmp_path, library):
    """A script restarted with a tcmalloc the loader cannot load (missing, broken) runs on glibc's malloc, tuned, and
    says so."""
    path = tmp_path / "libtcmalloc_minimal.so.4"
    if library == "not a library":
        path.write_bytes(b"\0" * 64)
    script = tmp_path / "script.py"
    script.write_text(
        f"import moekit.utils.allocator as allocator\nallocator.find_tcmalloc = lambda: {str(path)!r}\n" + REPORT
    )
    run = subprocess.run([sys.executable, str(script)], env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert run.returncode == 3, run.stderr
    assert run.stdout.strip().endswith(f"[] {TUNED}"), run.stdout + run.stderr


def _small_library() -> Path | None:
    """A shared library that does nothing when preloaded (glibc's libdl stub), or None."""
    dirs = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64")
    return next((Path(d) / "libdl.so.2" for d in dirs if (Path(d) / "libdl.so.2").is_file()), None)


@pytest.mark.skipif(_small_library() is None or not Path("/proc/self/maps").exists(), reason="needs Linux's libdl")
def test_a_jemalloc_the_user_preloaded_is_kept_and_named(tmp_path):
    """A script started with jemalloc in ``LD_PRELOAD`` keeps it (no restart putting tcmalloc before it) and records
    ``jemalloc``, not the system malloc."""
    jemalloc = tmp_path / "libjemalloc.so.2"  # stands in for jemalloc: its name is what the loader maps
    shutil.copy(_small_library(), jemalloc)
    script = tmp_path / "script.py"
    script.write_text("import os\n" + REPORT.replace("sys.warnoptions", "os.environ['LD_PRELOAD']"))
    run = subprocess.run(
        [sys.executable, str(script)], env=_clean_env(LD_PRELOAD=str(jemalloc)), capture_output=True, text=True
    )
    assert run.returncode == 3, run.stderr
    assert run.stdout.split() == ["[]", str(jemalloc), "jemalloc"], run.stdout + run.stderr


@pytest.mark.skipif(find_tcmalloc() is None, reason="restarts with tcmalloc")
def test_no_restart_where_the_loader_ignores_ld_preload(tmp_path):
    """macOS's loader ignores ``LD_PRELOAD``: a restart there would run on the system malloc, recorded as tcmalloc
    (the run record could not check). The script runs on, with glibc's malloc tuned where there is one."""
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys\nsys.platform = 'darwin'\n" + REPORT.replace("sys.warnoptions", "'LD_PRELOAD' in os.environ")
    )
    run = subprocess.run([sys.executable, str(script)], env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert run.returncode == 3, run.stderr
    assert run.stdout.strip().split(" ", 2)[1:] == [
        "False",
        TUNED if platform.libc_ver()[0] == "glibc" else "system malloc",
    ]


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_containers_memory_limit_bounds_what_the_layers_may_allocate(tmp_path, monkeypatch, version):
    """In a container or batch job whose cgroup limits memory below the host's, a layer too large for the limit is
    refused with the limit's figure (the host's MemAvailable would let it reach the OOM killer); the file cache,
    less shared memory, counts as free."""
    from moekit.utils import machine

    mib = 1 << 20  # limits far below any host's free memory
    if version == "v2":  # the job's own cgroup, under a parent without a limit
        cgroup, folder = "0::/job.slice/step\n", tmp_path / "job.slice" / "step"
        files = {
            "memory.max": 64 * mib,
            "memory.current": 24 * mib,
            "memory.stat": f"anon 5\nfile {10 * mib}\nshmem {2 * mib}\n",
        }
        folder.mkdir(parents=True)
        (tmp_path / "memory.max").write_text("max\n")
    else:  # a container without a cgroup namespace: its cgroup is the mount's root
        cgroup, folder = "4:memory:/docker/0123abcd\n1:cpu:/\n", tmp_path / "memory"
        files = {
            "memory.limit_in_bytes": 64 * mib,
            "memory.usage_in_bytes": 16 * mib,
            "memory.stat": "cache 5\ntotal_cache 0\n",
        }
        folder.mkdir()
    for name, value in files.items():
        (folder / name).write_text(f"{value}\n")
    (tmp_path / "self_cgroup").write_text(cgroup)
    monkeypatch.setattr(machine, "_CGROUP_ROOT", tmp_path, raising=False)
    monkeypatch.setattr(machine, "_PROC_CGROUP", tmp_path / "self_cgroup", raising=False)
    assert machine.available_memory("cpu") == 48 * mib
    with pytest.raises(ValueError, match="but 48.0 MiB are available on cpu"):
        machine.check_fits_in_memory(49 * mib, "cpu", "256 experts", "use fewer experts")
    machine.check_fits_in_memory(47 * mib, "cpu", "256 experts", "use fewer experts")
