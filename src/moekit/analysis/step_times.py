"""Step times measured side by side (``scripts/bench_models.py --json``), matched to a sweep's runs.

Wall times recorded by runs of different sessions (or beside other work) are not comparable: the machine's
speed drifts. :func:`load_step_times` reads the benchmark's file and :func:`attach_step_times` gives each run
the step time of its model (matched by :func:`~moekit.analysis.records.step_time_key`: the resolved model
config, the batch size and the precision), which the figures then use in place of the recorded times.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from moekit.analysis.records import RunResult, step_time_key

__all__ = ["STEP_TIMES_KIND", "StepTime", "load_step_times", "attach_step_times"]

STEP_TIMES_KIND = "moekit.bench_models"


@dataclass(frozen=True)
class StepTime:
    """One model's benchmarked training step.

    Attributes:
        name: the benchmark's row (``soft_moe_vit``, ``soft_moe_vit num_experts=32``, ...).
        seconds: the median seconds of a training step.
        examples_per_step: images (or tokens) in the step's batch.
        source: the file it was read from.
    """

    name: str
    seconds: float
    examples_per_step: int
    source: Path


def load_step_times(paths: Iterable[str | os.PathLike]) -> dict[str, StepTime]:
    """The step times of ``scripts/bench_models.py --json`` files, by :func:`step_time_key`.

    Raises:
        FileNotFoundError: a file does not exist.
        ValueError: a file is not such a benchmark file, or two rows time the same model (the message
            names both: give each model's step time once).
    """
    times: dict[str, StepTime] = {}
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(
                f"{str(path)!r} does not exist; write one with python scripts/bench_models.py --json {path}"
            )
        try:
            data = json.loads(path.read_text())
            if data.get("kind") != STEP_TIMES_KIND:
                raise ValueError(f"its kind is {data.get('kind')!r}, not {STEP_TIMES_KIND!r}")
            entries = [
                (
                    step_time_key(row["model_config"], row["batch_size"], row["precision"]),
                    StepTime(row["name"], float(row["seconds_per_step"]), int(row["examples_per_step"]), path),
                )
                for table in data["tables"]
                for row in table["rows"]
            ]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(
                f"{str(path)!r} is not a step-time file of scripts/bench_models.py --json ({type(err).__name__}: {err})"
            ) from None
        for key, step in entries:
            if key in times:
                first = times[key]
                raise ValueError(
                    f"the model of {step.name!r} ({path}) is timed twice: also {first.name!r} ({first.source}); "
                    "give each model's step time once"
                )
            times[key] = step
    return times


def attach_step_times(results: Sequence[RunResult], step_times: Mapping[str, StepTime]) -> list[RunResult]:
    """``results`` with ``bench_step_seconds`` set from the step time of each run's model, where the
    step times have one (:attr:`RunResult.step_key`); the other runs are returned unchanged."""
    attached = []
    for run in results:
        step = step_times.get(run.step_key)
        if step is not None:
            run = replace(run, bench_step_seconds=step.seconds, bench_examples_per_step=step.examples_per_step)
        attached.append(run)
    return attached
