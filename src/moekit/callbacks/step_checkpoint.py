"""``last.ckpt`` every N optimizer steps, written where a resume loses nothing.

Lightning resumes a checkpoint written in ``on_train_batch_end`` by going on with the next batch: whatever the
loop would have done between the two is skipped. After most batches that is nothing, but after a batch that is
followed by validation (``val_check_interval``, or the epoch's last batch) or by the epoch's end, the resumed run
would skip that validation and the epoch's end (its means, its epoch checkpoint, the best-checkpoint choice).
:class:`SafeStepSave` therefore writes a step's checkpoint at the step's end when nothing follows it, and
otherwise right after what follows (``on_validation_end`` or ``on_train_epoch_end``, whichever comes first),
which Lightning resumes from correctly. :class:`StepCheckpoint` (every N steps) and
:class:`~moekit.callbacks.PreemptionCheckpoint` (on a signal) are built on it.

Both are ``Checkpoint`` callbacks, so Lightning runs them after the other callbacks of a hook: every other
callback has logged its row for the step when the checkpoint is written.
"""

from __future__ import annotations

from pathlib import Path

from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.trainer.states import TrainerFn

__all__ = ["SafeStepSave", "StepCheckpoint", "work_follows_step"]


def work_follows_step(trainer: Trainer) -> bool:
    """Whether the training batch that just ended is followed by validation or by its epoch's end (asked in
    ``on_train_batch_end``; Lightning's own test for validation)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    return epoch_loop.batch_progress.is_last_batch or epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)


class SafeStepSave(Checkpoint):
    """Writes ``<dirpath>/<filename>.ckpt`` for the step that just ended, at the first moment a resume from it
    loses nothing (see the module docstring). Subclasses call :meth:`save_after_step` in ``on_train_batch_end``
    and may extend :meth:`save`."""

    def __init__(self, dirpath: str, filename: str = "last"):
        if not filename or "/" in filename:
            raise ValueError(f"{type(self).__name__}: filename={filename!r} must be a plain file name such as 'last'")
        self.dirpath = Path(dirpath)
        self.filename = filename
        self._deferred = False
        self._step_seen = -1  # the optimizer step at the last training batch's end

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._step_seen = trainer.global_step  # a resumed run starts at the saved step

    def optimizer_step_ended(self, trainer: Trainer) -> bool:
        """Whether the training batch that just ended finished an optimizer step (asked once per batch, in
        ``on_train_batch_end``): False between the micro-batches of gradient accumulation."""
        ended, self._step_seen = trainer.global_step != self._step_seen, trainer.global_step
        return ended

    @property
    def path(self) -> Path:
        return self.dirpath / f"{self.filename}.ckpt"

    def save(self, trainer: Trainer) -> None:
        # a full, resumable checkpoint; saying so keeps Lightning from logging, at every save, that it assumed it
        trainer.save_checkpoint(self.path, weights_only=False)

    def save_after_step(self, trainer: Trainer) -> None:
        """Save now, or after the validation or epoch end that follows this step."""
        if work_follows_step(trainer):
            self._deferred = True
        else:
            self.save(trainer)

    def _save_deferred(self, trainer: Trainer) -> None:
        if self._deferred and trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._deferred = False
            self.save(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save_deferred(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save_deferred(trainer)


class StepCheckpoint(SafeStepSave):
    """``<dirpath>/<filename>.ckpt`` every ``every_n_train_steps`` optimizer steps (written atomically, through the
    trainer's ``AtomicCheckpointIO``): resume with ``ckpt_path=<dirpath>/last.ckpt``.

    Args:
        dirpath: the checkpoint folder (Hydra: ``${paths.output_dir}/checkpoints``).
        filename: file name without ``.ckpt``; ``last`` shares the file with the epoch-end ``last.ckpt``.
        every_n_train_steps: optimizer steps between two checkpoints (0: none).
    """

    def __init__(self, dirpath: str, filename: str = "last", every_n_train_steps: int = 100):
        if isinstance(every_n_train_steps, bool) or not isinstance(every_n_train_steps, int) or every_n_train_steps < 0:
            raise ValueError(
                f"StepCheckpoint: every_n_train_steps={every_n_train_steps!r}; give a whole number of optimizer "
                "steps >= 1 (0 turns the step checkpoints off)"
            )
        super().__init__(dirpath, filename)
        self.every_n_train_steps = every_n_train_steps

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if not self.optimizer_step_ended(trainer) or not self.every_n_train_steps or trainer.fast_dev_run:
            return
        if trainer.global_step % self.every_n_train_steps == 0:
            self.save_after_step(trainer)
