"""The tests' child processes, forked from one fork server per pytest worker (tests only).

A new interpreter that imports torch, Lightning and moekit spends about 6 s of a core on the imports alone, more
than a tiny training run itself: with a new interpreter for every script a test ran, the whole suite took 11 min 7 s
on a 2-core AMD EPYC (Zen 4), and 6 min 46 s with the scripts forked from a fork server. multiprocessing's
``forkserver`` is a process started once per pytest worker, which imports :data:`PRELOAD` and then only forks. A
child forked from it starts with those modules imported, and with nothing a test left in the test process: no OpenMP
pool or autograd threads that do not survive a fork (a rank forked from the test process after tests/test_compile.py's
tracing could abort in its backward pass), no deterministic mode, no process group.

:class:`Child` and :func:`run_script` run a script there as ``python <script> <args>`` would: its own working
directory, environment, ``sys.argv``, standard output and error, its exit status (a ``SystemExit``'s code; 1 and the
traceback on stderr for an exception), its non-daemon threads and ``atexit`` functions at the end. Tests of what
happens before those imports (the allocator's restart under tcmalloc, the imports themselves) start a new interpreter
instead.
"""

import atexit
import io
import multiprocessing as mp
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

# moekit first, as the scripts import it: it sets OpenMP's idle spin before torch loads OpenMP.
PRELOAD = [
    "moekit",
    "torch",
    "lightning",
    "moekit.moe",
    "moekit.tasks",
    "moekit.commands.train",
    "distributed",
    "fork_server",
]


def context() -> mp.context.ForkServerContext:
    """The fork server's multiprocessing context, which starts the server (with :data:`PRELOAD`) on first use."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _exit_code(code: object) -> int:
    """The status an interpreter exits with for ``SystemExit(code)``, printing a non-integer code as Python does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _streams(env: dict[str, str]) -> None:
    """New ``sys.stdout`` and ``sys.stderr`` on file descriptors 1 and 2, buffered as an interpreter started with
    ``env`` buffers them (``PYTHONUNBUFFERED``: output written at once, kept by a process that is killed)."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw),
            encoding=old.encoding,
            errors=old.errors,
            line_buffering=name == "stderr" and not unbuffered,
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _script(script: str, args: list[str], cwd: str, env: dict[str, str], out: str, err: str, session: bool) -> None:
    if session:
        os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(file, fd)
        os.close(file)
    _streams(env)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))  # as for `python <script>`
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # then atexit, as an interpreter's own exit does: wait for its non-daemon threads
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Child:
    """``python <script> <args>`` forked from the fork server, with the part of :class:`subprocess.Popen`'s interface
    the tests use: ``pid``, ``returncode`` (negative: the signal that ended it), ``poll``, ``send_signal``, ``kill``
    and ``communicate``, which returns its standard output and error (None with ``stderr_to_stdout``)."""

    def __init__(
        self,
        script: Path,
        args: list[str],
        cwd: Path,
        env: dict[str, str],
        stderr_to_stdout: bool = False,
        new_session: bool = False,
    ):
        self.args = [str(script), *args]
        self._folder = tempfile.TemporaryDirectory()
        self._out = os.path.join(self._folder.name, "stdout")
        self._err = self._out if stderr_to_stdout else os.path.join(self._folder.name, "stderr")
        target = (str(script), list(args), str(cwd), dict(env), self._out, self._err, new_session)
        self._process = context().Process(target=_script, args=target)
        self._process.start()
        self.pid = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self._process.exitcode
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Wait for the process to end; raises ``subprocess.TimeoutExpired`` (leaving it running) after ``timeout``
        seconds."""
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        read = lambda path: Path(path).read_text(encoding="utf-8", errors="replace")  # noqa: E731
        output = read(self._out), None if self._err == self._out else read(self._err)
        self._folder.cleanup()
        return output


def run_script(
    script: Path, args: list[str], cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """``python <script> <args>`` in ``cwd`` with ``env``, forked from the fork server; its exit status and output.
    Raises ``subprocess.TimeoutExpired`` (after killing it) if it runs longer than ``timeout`` seconds."""
    child = Child(script, args, cwd, env)
    try:
        out, err = child.communicate(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)
