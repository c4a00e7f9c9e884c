"""What every moekit task shares, whatever the data: the network built from its config, AdamW with
parameter groups and a per-step schedule, the MoE auxiliary losses added to the task loss and logged
one by one, and loss-free balancing updated once per optimizer step. The routing statistics of each
MoE layer are logged by the :class:`~moekit.callbacks.ExpertLoadMonitor` callback.

Subclasses (:class:`~moekit.tasks.ImageClassifier`, :class:`~moekit.tasks.LanguageModel`) compute
their task loss and metrics and call :meth:`MoETask.add_aux_losses`.
"""

from __future__ import annotations

import logging
import math
import os
import time
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from lightning import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from moekit.checkpoint import SHARDED_METADATA, TASK_KEY, CheckpointError, is_sharded_checkpoint
from moekit.loggers import log_before_checkpoint, log_positions, resume_logs
from moekit.models import compile_network
from moekit.models.architecture import checkpoint_differences
from moekit.moe import collect_moe_outputs, discard_balancing_updates, update_balancing_biases
from moekit.resume import FIT_STARTED_KEY

from .epoch_means import EpochMeans
from .optim import ScheduleConfig, clip_grad_norm, lr_lambda, optimizer_for

__all__ = ["MoETask", "check_trained_architecture", "plain", "trained_network"]

log = logging.getLogger("moekit")

EPOCH_MEANS_KEY = "moekit_epoch_means"  # checkpoint entries: the training-epoch means,
LOG_POSITIONS_KEY = "moekit_log_positions"  # and how far the logs went (moekit.loggers.log_positions)


def _epoch_cut_short(trainer: Any) -> bool:
    """A checkpoint is being written at the end of a training epoch that stopped before its last batch."""
    fit_loop = trainer.fit_loop
    epochs = fit_loop.epoch_progress.current
    at_epoch_end = trainer.state.fn == TrainerFn.FITTING and epochs.processed == epochs.completed + 1
    return at_epoch_end and not fit_loop.epoch_loop._num_ready_batches_reached()


def _reopen_epoch(checkpoint: dict[str, Any]) -> None:
    """Record the epoch being ended as not processed, the state of a checkpoint written inside an epoch (after a
    validation), so that Lightning resumes at its next batch instead of counting it done. The data side is there
    already: the sampler's state holds the batches consumed (:mod:`moekit.data.resumable`)."""
    if "loops" not in checkpoint:  # a weights-only checkpoint
        return
    progress = checkpoint["loops"]["fit_loop"]["epoch_progress"]
    for counts in (progress["total"], progress["current"]):
        counts["processed"] -= 1


def trained_network(path: str | os.PathLike) -> nn.Module | None:
    """The network a moekit checkpoint (a ``.ckpt`` file or sharded folder) was trained as, rebuilt on the meta device
    from the config it saved (``hyper_parameters["net"]``): for the checks of what weights do not show
    (:mod:`moekit.models.architecture`). None for weights without that config."""
    path = Path(path)
    file = path / SHARDED_METADATA if is_sharded_checkpoint(path) else path
    if not zipfile.is_zipfile(file):  # safetensors, a missing file: read_state_dict says what is wrong with it
        return None
    try:
        checkpoint = torch.load(file, map_location="cpu", weights_only=False, mmap=True)
    except Exception:
        return None
    config = checkpoint.get("hyper_parameters", {}).get("net") if isinstance(checkpoint, Mapping) else None
    if not isinstance(config, Mapping) or "_target_" not in config:
        return None
    try:
        with torch.device("meta"):
            return instantiate(config)
    except Exception as err:  # a config of another moekit version
        log.warning(
            "%s: the network it saved could not be rebuilt from its config (%s: %s); starting from it checks the "
            "weights' names and shapes only",
            path,
            type(err).__name__,
            err,
        )
        return None


def check_trained_architecture(net: nn.Module, path: str | os.PathLike) -> None:
    """Refuse to fine-tune ``net`` from the moekit checkpoint ``path`` when the network that trained it computes
    otherwise with weights of the same shapes (other attention heads, norm epsilons, activations: what the key-by-key
    load cannot see; :func:`~moekit.models.architecture.checkpoint_differences`). Plain weights are not checked."""
    trained = trained_network(path)
    differences = checkpoint_differences(net, trained) if trained is not None else []
    if differences:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was trained by a network that computes otherwise than this one with weights of "
            f"the same shapes - architecture differences {differences}. Build the model with the configuration the "
            "checkpoint was trained with (its run's results.json names it)"
        )


def plain(config: Any) -> Any:
    """DictConfig -> plain containers (resolved), so hyperparameters pickle and log cleanly."""
    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)
    return config


class MoETask(LightningModule):
    """Base of the tasks. ``self.net`` is the network; subclasses call :meth:`setup_training` in
    their ``__init__`` after ``save_hyperparameters``.

    Optimizer config: ``{name: adamw|sgd|muon, lr, weight_decay, betas, eps, decay_1d}``; scheduler config:
    the fields of :class:`~moekit.tasks.optim.ScheduleConfig`.
    """

    net: nn.Module
    frames_before_compile: int | None = None
    """Dynamo's count of compiled frames when :meth:`compile_net` ran, until the first training batch checks it."""
    step_skipped: bool = False
    """Set by :class:`~moekit.callbacks.NonFiniteGuard` when it drops the gradients of the current
    optimizer step (or a fp16 grad scaler skips it): :meth:`optimizer_step` then discards the step's
    loss-free balancing counts instead of updating the biases, and clears the flag."""
    fit_started_at: float | None = None
    """When this process's ``trainer.fit`` started (``time.time()``), written into each checkpoint it saves: which
    process wrote a checkpoint decides what ``ckpt_path=last`` resumes
    (:func:`moekit.resume.find_resume_checkpoint`)."""

    def setup_training(self, net: Mapping[str, Any], optimizer: Mapping | None, scheduler: Mapping | None) -> None:
        """Instantiate ``net`` (a Hydra ``_target_`` dict) and keep the optimizer/schedule settings."""
        self.net = instantiate(net)
        self.optimizer_config = {"name": "adamw", "lr": 1e-3, "weight_decay": 0.05, **(optimizer or {})}
        self.schedule = ScheduleConfig(**(scheduler or {}))
        self.epoch_means = EpochMeans()

    def compile_net(self) -> None:
        """``torch.compile`` the network in place (:func:`~moekit.models.compile_network`). The first training
        batch warns if Dynamo compiled no frame (as torch 2.11 on a frame it had first met under a dispatch mode); the
        run goes on, eagerly."""
        from torch._dynamo.utils import counters

        compile_network(self.net)
        self.frames_before_compile = counters["frames"]["ok"]

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.frames_before_compile is not None:
            from torch._dynamo.utils import counters

            if counters["frames"]["ok"] == self.frames_before_compile:
                log.warning(
                    "task.compile=true, yet Dynamo compiled no frame by the end of the first training step (torch "
                    "%s): the network runs eagerly (TORCH_LOGS=+dynamo shows why)",
                    torch.__version__,
                )
            self.frames_before_compile = None

    def add_aux_losses(self, split: str, task_loss: Tensor, batch_size: int | Tensor) -> Tensor:
        """Task loss (a cross-entropy) + the weighted MoE auxiliary losses of the latest forward. Logs
        ``<split>/loss``, ``<split>/ce`` and each aux loss summed over layers (``<split>/aux/<name>``,
        ``<split>/aux/total``): training per step (``_step``, rank 0's values) and as epoch means (``_epoch``,
        :meth:`log_epoch_mean`), evaluation as epoch means; epoch means are reduced over ranks."""
        moe = collect_moe_outputs(self.net)
        loss = task_loss + moe.aux_loss
        values = {"loss": loss, "ce": task_loss, **{f"aux/{name}": value for name, value in moe.aux_losses.items()}}
        if moe.aux_losses:
            values["aux/total"] = moe.aux_loss
        for name, value in values.items():
            if split == "train":
                self.log(f"train/{name}_step", value, on_step=True, on_epoch=False, prog_bar=name == "loss")
                self.log_epoch_mean(f"train/{name}_epoch", value, batch_size)
            else:
                log = dict(on_epoch=True, batch_size=batch_size, sync_dist=True, prog_bar=name == "loss")
                self.log(f"{split}/{name}", value, **log)
        return loss

    def log_epoch_mean(self, name: str, value: Tensor, batch_size: int | Tensor) -> None:
        """Log the mean of ``value`` over the training epoch as ``name`` (:class:`~moekit.tasks.epoch_means.EpochMeans`:
        unlike Lightning's ``on_epoch`` means it survives a resume in the middle of the epoch)."""
        self.epoch_means.update(name, value, batch_size, self.current_epoch)

    def on_train_epoch_end(self) -> None:
        if self.epoch_means.epoch != self.current_epoch:  # no training batch in this epoch
            return
        # The same value on every rank; sync_dist (their mean) keeps Lightning from warning that it is not synced.
        for name, mean in self._global_epoch_means().compute().items():
            self.log(name, mean, on_step=False, on_epoch=True, sync_dist=True, prog_bar=name == "train/acc")

    def _global_epoch_means(self) -> EpochMeans:
        """:attr:`epoch_means` summed over the data-parallel ranks (a collective: every rank calls it at the same
        point, the epoch's end or a checkpoint, which Lightning writes on every rank); itself in one process."""
        if self._trainer is None or self.trainer.world_size == 1:
            return self.epoch_means
        strategy = self.trainer.strategy
        return self.epoch_means.reduced(lambda sums: strategy.reduce(sums, reduce_op="sum"), strategy.root_device)

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.step_skipped:  # the weights did not move: neither do the balancing biases
            self.step_skipped = False
            discard_balancing_updates(self.net)
        else:
            update_balancing_biases(self.net)  # loss-free balancing: once per optimizer step

    def configure_model(self) -> None:
        """moekit's strategies (:mod:`moekit.parallel.strategies`) shard the network here: experts over
        expert-parallel groups, FSDP units. Runs before the optimizer is built."""
        parallelize = getattr(self.trainer.strategy, "parallelize", None)
        if parallelize is not None:
            parallelize(self)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Norm clipping under expert parallelism takes the norm over all experts of the expert group
        (each rank holds only some). A fused optimizer is clipped here, by the norm inside its step
        (:func:`~moekit.tasks.optim.clip_grad_norm`): Lightning refuses to clip one under mixed precision, as it
        would unscale a float16 scaler's gradients itself, and float16 runs build none (:meth:`configure_optimizers`).
        Everything else clips as Lightning does."""
        clip_norm = getattr(self.trainer.strategy, "clip_gradient_norm", None)
        norm = gradient_clip_algorithm in (None, "norm")
        if gradient_clip_val and norm and clip_norm is not None:
            if clip_norm(optimizer, gradient_clip_val) is not None:
                return
        if gradient_clip_val and getattr(optimizer, "_step_supports_amp_scaling", False):
            if norm:
                clip_grad_norm(optimizer, gradient_clip_val)  # inside the fused step
            else:
                params = [p for group in optimizer.param_groups for p in group["params"]]
                torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        precision = str(self.trainer.precision)  # Muon's Newton-Schulz dtype follows it on some CPUs
        if precision == "16-true":
            raise ValueError(
                "trainer.precision=16-true trains float16 weights with no float32 copy and no loss scaling: the "
                "optimizer's updates and second moments underflow or overflow (a ViT's weights turn NaN at the first "
                "step); train with trainer.precision=16-mixed (float16 autocast with a gradient scaler), bf16-mixed "
                "or bf16-true"
            )
        fused = not precision.startswith("16")  # a float16 GradScaler unscales before clipping
        optimizer = optimizer_for(self.net, self.optimizer_config, fused=fused, run_precision=precision)
        if hasattr(optimizer, "summary"):  # Muon: which parameters it trains, its Newton-Schulz dtype
            log.info("task.optimizer.name=%s: %s", self.optimizer_config["name"], optimizer.summary())
        total = self.trainer.estimated_stepping_batches  # inf (or -1 for data of no length) when nothing limits it
        total = int(total) if 0 <= total < math.inf else math.inf
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(self.schedule, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_start(self) -> None:
        self.fit_started_at = time.time()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[TASK_KEY] = f"{type(self).__module__}:{type(self).__qualname__}"
        if self.fit_started_at is not None:
            checkpoint[FIT_STARTED_KEY] = self.fit_started_at
        checkpoint[EPOCH_MEANS_KEY] = self._global_epoch_means().state_dict()  # the sums of all ranks
        if self._trainer is not None:  # the logs up to this moment are on disk, and where they end is recorded
            if _epoch_cut_short(self.trainer):
                # Training stopped inside the epoch (max_steps, max_time, an early stop): resume inside it, and
                # leave the logs before this partial epoch's row, which the resumed run logs whole.
                _reopen_epoch(checkpoint)
            else:
                log_before_checkpoint(self.trainer)
            checkpoint[LOG_POSITIONS_KEY] = log_positions(self.trainer)

    def on_train_start(self) -> None:
        """Set each learning rate from the schedule of this run at the step it starts from: a run resumed with a
        longer ``max_steps`` (a new schedule) would otherwise take its first step at the old schedule's rate,
        restored with the optimizer. The same value as the scheduler's own for a fresh run or an unchanged one."""
        for config in self.trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
                rates = zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas)
                for group, base_lr, factor in rates:
                    group["lr"] = base_lr * factor(scheduler.last_epoch)
                scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if EPOCH_MEANS_KEY in checkpoint:
            # The sums of all ranks (or of the one process that wrote the file): counted once, by rank 0.
            self.epoch_means.load_state_dict(checkpoint[EPOCH_MEANS_KEY], keep=self.global_rank == 0)
        if self._trainer is not None and self.trainer.state.fn == TrainerFn.FITTING:  # a resume, not a test
            resume_logs(self.trainer, checkpoint.get(LOG_POSITIONS_KEY, {}))
