"""Pre-emption and Ctrl-C: on SIGTERM, SIGUSR1, SIGUSR2 or SIGINT, write ``last.ckpt`` at the next step boundary
and exit.

Clusters announce the end of a job with a signal (SLURM: SIGTERM at the time limit or on pre-emption,
SIGUSR1 ahead of it with ``--signal=USR1@<seconds>``; a job of Hydra's submitit launcher: SIGUSR2
``signal_delay_s`` ahead of it). :class:`PreemptionCheckpoint` catches them while ``fit`` trains: the optimizer step
in progress finishes (under gradient accumulation, its last micro-batch), the callback writes ``<dirpath>/last.ckpt``
(atomically, through the trainer's ``AtomicCheckpointIO``; after the validation or epoch end that follows the step, if
one does: :class:`~moekit.callbacks.step_checkpoint.SafeStepSave`) and raises :class:`Preempted`, a ``SystemExit``
with status ``128 + signal number`` (143 for SIGTERM, 138 for SIGUSR1), the shell's convention for "ended by a
signal", so a job script can tell a pre-empted run from a finished one. Resubmitting with
``ckpt_path=<dirpath>/last.ckpt`` continues exactly where it stopped (see ``moekit.data.resumable``); the log line
gives the whole command. Ctrl-C (SIGINT, 130) does the same; a second Ctrl-C before the step ends stops at
once, without a checkpoint (Lightning's interrupt handling, exit status 1).

The handlers are installed in ``on_train_start`` and the previous ones are put back when training ends
or fails. While training they replace the previous handlers rather than chain to them: Lightning's own
SIGTERM handler would otherwise stop the run at the next epoch or validation boundary without writing
a checkpoint. Once the checkpoint is written, the signal goes on to the handler the process's launcher
installed before training, if any (a Python function other than Lightning's or Python's Ctrl-C handler):
submitit's, for SIGUSR2, then requeues the job and exits, and the requeued job, run with ``ckpt_path=auto``,
resumes from the checkpoint; a handler that returns leaves the exit to this callback. A signal that arrives
during validation takes effect after the next training step (one after the last step is ignored: the run is
finishing anyway). With Lightning's SLURM auto-requeue (SIGUSR1), leave SIGUSR1 out of ``signals``. With
several processes (DDP, FSDP) the ranks agree after every optimizer step (one all-reduce of the caught signal number, a
host sync): a signal reaching any rank makes all of them save the checkpoint together and exit.
"""

from __future__ import annotations

import logging
import shlex
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from lightning import LightningModule, Trainer

from .step_checkpoint import SafeStepSave

__all__ = ["PreemptionCheckpoint", "Preempted", "resume_command"]

log = logging.getLogger("moekit")


class Preempted(SystemExit):
    """Training stopped by a signal after writing a checkpoint; ``code`` is ``128 + signal number``."""

    def __init__(self, signum: int, checkpoint: Path):
        super().__init__(128 + signum)
        self.signum = signum
        self.checkpoint = checkpoint


def resume_command(checkpoint: Path) -> str:
    """The command line that continues this run in its own folder (one set of logs, as if never stopped): the
    script with its overrides, the run's folder (``hydra.run.dir``, unless ``paths.output_dir`` was given) and
    ``ckpt_path`` set to ``checkpoint`` (``ckpt_path=<checkpoint>`` alone outside a Hydra script)."""
    from hydra.core.hydra_config import HydraConfig

    resume = f"ckpt_path={shlex.quote(str(checkpoint))}"
    if not HydraConfig.initialized() or not sys.argv or not sys.argv[0].endswith(".py"):
        return resume
    hydra_cfg = HydraConfig.get()
    overrides = [o for o in hydra_cfg.overrides.task if not o.lstrip("+~").startswith("ckpt_path=")]
    if not any(o.lstrip("+~").startswith("paths.output_dir=") for o in overrides):
        overrides.append(f"hydra.run.dir={hydra_cfg.runtime.output_dir}")
    return " ".join(["python", shlex.quote(sys.argv[0]), *map(shlex.quote, overrides), resume])


def _is_launcher_handler(handler: Any) -> bool:
    """A handler installed before training that should see the signal after the checkpoint (submitit's): a Python
    callable, but not Python's Ctrl-C handler nor Lightning's (which would end the run at the next boundary)."""
    if not callable(handler) or handler is signal.default_int_handler:
        return False
    return not str(getattr(handler, "__module__", "")).startswith(("lightning", "pytorch_lightning"))


def _handler_name(handler: Any) -> str:
    name = getattr(handler, "__qualname__", type(handler).__qualname__)
    return f"{getattr(handler, '__module__', '?')}.{name}"


class PreemptionCheckpoint(SafeStepSave):
    """On one of ``signals``, save ``<dirpath>/<filename>.ckpt`` after the current training step and exit.

    Args:
        dirpath: the checkpoint folder (Hydra: ``${paths.output_dir}/checkpoints``).
        filename: file name without ``.ckpt``; ``last`` overwrites the periodic ``last.ckpt``.
        signals: signal names, e.g. ``["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"]``.
    """

    def __init__(self, dirpath: str, filename: str = "last", signals: tuple[str, ...] | list[str] = ("SIGTERM",)):
        names = list(signals)
        unknown = [name for name in names if not isinstance(getattr(signal, str(name), None), signal.Signals)]
        if unknown or not names:
            raise ValueError(
                f"PreemptionCheckpoint: signals={names!r}; give one or more signal names such as "
                "['SIGTERM', 'SIGUSR1']" + (f" ({unknown} are not signals of this platform)" if unknown else "")
            )
        super().__init__(dirpath, filename)
        self.signals = [getattr(signal, name) for name in names]
        self.received: int | None = None  # the signal number caught, if any
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received is not None:  # a second Ctrl-C: stop at once
            self._restore()
            raise KeyboardInterrupt
        if self.received is None:
            self.received = signum
            if signum == signal.SIGINT:
                log.warning("Ctrl-C: saving %s after this step; press Ctrl-C again to stop at once", self.path)

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "PreemptionCheckpoint: not in the main thread, so no signal handlers; pre-emption is not caught"
            )
            return
        self.received = None
        for signum in self.signals:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handler)

    def _restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    # ------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._install()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if not self.optimizer_step_ended(trainer):  # mid gradient accumulation: wait for the optimizer step
            return
        signum = self.received
        if trainer.world_size > 1:  # every rank takes part in saving: agree on the signal first
            caught = torch.tensor(float(signum or 0), device=pl_module.device)
            signum = int(trainer.strategy.reduce(caught, reduce_op="max").item()) or None
        if signum is not None and not self._deferred:
            self.received = signum  # under DDP, maybe another rank's
            self.save_after_step(trainer)

    def save(self, trainer: Trainer) -> None:
        """Write the checkpoint, say how to resume, and exit with ``128 + signal number``."""
        super().save(trainer)
        signum = self.received  # set by on_train_batch_end before it asks for the save
        log.warning(
            "received %s: saved %s at step %d; resume with: %s",
            signal.Signals(signum).name,
            self.path,
            trainer.global_step,
            resume_command(self.path),
        )
        launcher_handler = self._previous.get(signum)
        self._restore()
        if _is_launcher_handler(launcher_handler):
            log.warning("handing %s on to %s", signal.Signals(signum).name, _handler_name(launcher_handler))
            launcher_handler(signum, None)  # submitit's requeues the job and exits
        raise Preempted(signum, self.path)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore()
