"""Kills at exact moments of a training run, for the kill-and-resume tests: a checkpoint IO plugin that SIGKILLs
its own process right after (or in the middle of) writing a checkpoint of a given step, and a callback that sends
its process a signal at the start of a given step. The runs get them through Hydra overrides
(:func:`kill_overrides`); the subprocesses import this module from ``tests/`` (``resume_helpers.start``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from lightning import Callback

from moekit.checkpoint import AtomicCheckpointIO


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillingCheckpointIO(AtomicCheckpointIO):
    """Writes checkpoints like :class:`~moekit.checkpoint.AtomicCheckpointIO`; at the write of ``filename`` whose
    ``global_step`` is ``step`` it SIGKILLs the process ``when="after"`` the rename (the checkpoint is complete)
    or ``when="during"`` the write (the temporary file is written, the rename never happens)."""

    def __init__(self, step: int, filename: str = "last.ckpt", when: str = "after"):
        super().__init__()
        self.step, self.filename, self.when = step, filename, when

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        target = Path(path).name == self.filename and checkpoint["global_step"] == self.step
        if target and self.when == "during":
            super().save_checkpoint(checkpoint, Path(path).with_name(f".{self.filename}.abcd1234.tmp"))
            _kill_self()
        super().save_checkpoint(checkpoint, path)
        if target:
            _kill_self()


class SignalAtStep(Callback):
    """Sends the process ``signal`` (a name) at the start of the training batch of optimizer step ``step``."""

    def __init__(self, step: int, signal: str = "SIGTERM"):
        self.step, self.signal = step, signal

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), getattr(signal, self.signal))


def kill_overrides(kind: str, step: int) -> list[str]:
    """Hydra overrides of a run that dies at ``step``: ``kill_after_write`` / ``kill_during_write`` (of
    ``last.ckpt``), or a signal name (``SIGTERM``) sent at the start of that step."""
    if kind.startswith("SIG"):
        callback = "+callbacks.kill"
        return [f"{callback}._target_=kill_points.SignalAtStep", f"{callback}.step={step}", f"{callback}.signal={kind}"]
    when = kind.removeprefix("kill_").removesuffix("_write")
    return [f"trainer.plugins=[{{_target_:kill_points.KillingCheckpointIO,step:{step},when:{when}}}]"]
