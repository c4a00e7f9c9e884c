"""Progress as log lines, for output that is not a terminal: a batch job's log file, ``python train.py > out.txt``.

Lightning's rich progress bar draws nothing there, so a long run printed nothing between its start and its end.
:class:`ProgressLog` logs one line every ``every_n_steps`` optimizer steps (epoch, step, the progress bar's
metrics: loss, accuracy, throughput; the time left at the rate so far) and one line of validation metrics after
each validation. On a terminal the rich bar shows the same and the callback stays quiet (``when``).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from numbers import Number

from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

__all__ = ["ProgressLog"]

log = logging.getLogger("moekit")


def _duration(seconds: float) -> str:
    """``1:02:03`` / ``2:03``."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _metrics(metrics: dict, prefix: str) -> str:
    """``name value`` pairs of the scalar metrics (numbers or one-element tensors) whose name starts with
    ``prefix``, 4 significant digits."""
    pairs = []
    for name, value in metrics.items():
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        if name.startswith(prefix) and isinstance(value, Number):
            pairs.append(f"{name} {value:.4g}")
    return "  ".join(pairs)


class ProgressLog(Callback):
    """Logs the training progress every ``every_n_steps`` optimizer steps and the metrics of each validation.

    Args:
        every_n_steps: optimizer steps between two lines.
        when: ``"no_terminal"`` (only when stdout is not a terminal, where the rich bar shows nothing) or
            ``"always"``.
    """

    def __init__(self, every_n_steps: int = 50, when: str = "no_terminal") -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"ProgressLog: every_n_steps={every_n_steps!r}; give a whole number of steps >= 1")
        if when not in ("no_terminal", "always"):
            raise ValueError(f"ProgressLog: when={when!r}; allowed: 'no_terminal', 'always'")
        self.every_n_steps = every_n_steps
        self.when = when
        self.active = False
        self._start_time = 0.0
        self._start_step = 0
        self._last_step = -1

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.active = trainer.is_global_zero and (self.when == "always" or not sys.stdout.isatty())
        self._start_time, self._start_step = time.monotonic(), trainer.global_step
        self._last_step = trainer.global_step  # no line before this run's first optimizer step (accumulation)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if not self.active or step % self.every_n_steps or step == self._last_step:
            return
        self._last_step = step
        total = trainer.estimated_stepping_batches  # inf with no limit, -1 for data of no length and no max_steps
        known = math.isfinite(total) and total >= 0
        rate = (step - self._start_step) / max(time.monotonic() - self._start_time, 1e-9)
        left = f"  ETA {_duration((total - step) / rate)}" if known and rate > 0 else ""
        epochs = f"/{trainer.max_epochs - 1}" if trainer.max_epochs and trainer.max_epochs > 0 else ""  # as Lightning
        steps = f"/{int(total)}" if known else ""
        metrics = _metrics(trainer.progress_bar_metrics, "train/")
        log.info("epoch %d%s  step %d%s  %s%s", trainer.current_epoch, epochs, step, steps, metrics, left)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.active and trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            metrics = _metrics(trainer.callback_metrics, "val/")
            log.info("epoch %d  step %d  validation: %s", trainer.current_epoch, trainer.global_step, metrics)
