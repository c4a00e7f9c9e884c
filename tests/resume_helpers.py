"""Helpers of the kill-and-resume tests: run ``scripts/train.py`` in a process of its own, wait for a file
or a logged step, SIGKILL it, and compare the final training state and test metrics of two runs."""

from __future__ import annotations

import collections
import csv
import io
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import fork_server
from conftest import REPO, script_env
from moekit.checkpoint import WRITE_DELAY_ENV
from moekit.loggers import read_metrics_csv

TIMING_SUFFIX = "_per_sec"  # wall-clock columns and tags: the only ones that may differ between runs


def train_command(*overrides: str) -> list[str]:
    """The command line of ``scripts/train.py`` with these Hydra overrides."""
    return [sys.executable, str(REPO / "scripts" / "train.py"), *overrides]


def start(args: list[str], write_delay: float = 0.0) -> fork_server.Child:
    """Start ``args`` (``[sys.executable, <script>, *arguments]``) in the repository root, forked from the tests' fork
    server, stdout and stderr together; every checkpoint write pauses ``write_delay`` seconds before its rename
    (``moekit.checkpoint``)."""
    assert args[0] == sys.executable, args
    env = script_env(PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"), env.get("PYTHONPATH")]))  # kill_points
    if write_delay:
        env[WRITE_DELAY_ENV] = str(write_delay)
    return fork_server.Child(Path(args[1]), args[2:], cwd=REPO, env=env, stderr_to_stdout=True)


def finish(proc: fork_server.Child, timeout: float = 240) -> tuple[int, str]:
    """Wait for ``proc``: its exit status and output."""
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def wait_for(condition: Callable[[], bool], proc: fork_server.Child, what: str, timeout: float = 180) -> None:
    """Poll ``condition`` every 10 ms until it holds; fail if ``proc`` ends first or after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (status {proc.returncode}) before {what}:\n{proc.communicate()[0]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def kill(proc: fork_server.Child) -> None:
    """SIGKILL ``proc`` and check that the signal is what ended it."""
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def printed_test_metrics(output: str) -> dict[str, float]:
    """The ``test/*`` metrics of the table Lightning prints after testing."""
    metrics = dict(re.findall(r"(test/\w+)\s*│\s*([-+0-9.e]+)", output))
    assert "test/loss" in metrics, f"no test metrics in the output:\n{output[-3000:]}"
    return {k: float(v) for k, v in metrics.items()}


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_training_state(resumed: dict, reference: dict, global_step: int) -> None:
    """Both checkpoints are at ``global_step`` with equal weights (every tensor), optimizer state and
    learning-rate schedule."""
    assert resumed["global_step"] == reference["global_step"] == global_step
    assert resumed["state_dict"].keys() == reference["state_dict"].keys()
    different = [k for k, v in reference["state_dict"].items() if not torch.equal(v, resumed["state_dict"][k])]
    assert not different, f"weights differ from the uninterrupted run: {different}"
    ref_states = reference["optimizer_states"][0]["state"]
    res_states = resumed["optimizer_states"][0]["state"]
    assert ref_states.keys() == res_states.keys()
    for param, ref_state in ref_states.items():
        assert ref_state.keys() == res_states[param].keys()
        for key, value in ref_state.items():
            assert torch.equal(value, res_states[param][key]), f"optimizer state {key!r} of parameter {param} differs"
    assert resumed["lr_schedulers"] == reference["lr_schedulers"]


def logged_steps(metrics_csv: Path) -> list[int]:
    """The ``step`` of every complete row of a ``metrics.csv`` that may be being written (empty while
    the file does not exist)."""
    try:
        text = metrics_csv.read_text()
    except FileNotFoundError:
        return []
    text = text[: text.rfind("\n") + 1]
    return [int(row["step"]) for row in csv.DictReader(io.StringIO(text)) if row.get("step", "").isdigit()]


def metrics_rows(run: Path) -> list[dict[str, str]]:
    """The rows of a run's ``csv/metrics.csv`` without the wall-clock columns and without the cells a
    row leaves empty; checks that the file has one header line."""
    text = (run / "csv" / "metrics.csv").read_text()
    header, rows = read_metrics_csv(text)
    assert text.count(",".join(header)) == 1, "the header must appear once"
    return [{k: v for k, v in row.items() if v != "" and not k.endswith(TIMING_SUFFIX)} for row in rows]


def tensorboard_scalars(run: Path) -> dict[tuple[str, int], list[float]]:
    """``{(tag, step): [values]}`` over the run's event files (wall-clock tags left out)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    scalars = collections.defaultdict(list)
    for path in sorted((run / "tensorboard").glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "scalars" and not value.tag.endswith(TIMING_SUFFIX):
                    scalars[value.tag, event.step].append(value.tensor.float_val[0])
    return dict(scalars)
