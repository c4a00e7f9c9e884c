"""What every moekit task shares, whatever the data: the network built from its config, AdamW with
parameter groups and a per-step schedule, the MoE auxiliary losses added to the task loss and logged
one by one, and loss-free balancing updated once per optimizer step. The routing statistics of each
MoE layer are logged by the :class:`~moekit.callbacks.ExpertLoadMonitor` callback.

Subclasses (:class:`~moekit.tasks.ImageClassifier`, :class:`~moekit.tasks.LanguageModel`) compute
their task loss and metrics and call :meth:`MoETask.add_aux_losses`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from hydra.utils import instantiate
from lightning import LightningModule
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from moekit.checkpoint import TASK_KEY
from moekit.moe import collect_moe_outputs, discard_balancing_updates, update_balancing_biases

from .optim import ScheduleConfig, build_optimizer, lr_lambda, param_groups

__all__ = ["MoETask", "plain"]


def plain(config: Any) -> Any:
    """DictConfig -> plain containers (resolved), so hyperparameters pickle and log cleanly."""
    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)
    return config


class MoETask(LightningModule):
    """Base of the tasks. ``self.net`` is the network; subclasses call :meth:`setup_training` in
    their ``__init__`` after ``save_hyperparameters``.

    Optimizer config: ``{name: adamw|sgd, lr, weight_decay, betas, eps, decay_1d}``; scheduler config:
    the fields of :class:`~moekit.tasks.optim.ScheduleConfig`.
    """

    net: nn.Module
    step_skipped: bool = False
    """Set by :class:`~moekit.callbacks.NonFiniteGuard` when it drops the gradients of the current
    optimizer step (or a fp16 grad scaler skips it): :meth:`optimizer_step` then discards the step's
    loss-free balancing counts instead of updating the biases, and clears the flag."""

    def setup_training(self, net: Mapping[str, Any], optimizer: Mapping | None, scheduler: Mapping | None) -> None:
        """Instantiate ``net`` (a Hydra ``_target_`` dict) and keep the optimizer/schedule settings."""
        self.net = instantiate(net)
        self.optimizer_config = {"name": "adamw", "lr": 1e-3, "weight_decay": 0.05, **(optimizer or {})}
        self.schedule = ScheduleConfig(**(scheduler or {}))

    def add_aux_losses(self, split: str, task_loss: Tensor, batch_size: int) -> Tensor:
        """Task loss (a cross-entropy) + the weighted MoE auxiliary losses of the latest forward. Logs
        ``<split>/loss``, ``<split>/ce`` and each aux loss summed over layers (``<split>/aux/<name>``,
        ``<split>/aux/total``)."""
        moe = collect_moe_outputs(self.net)
        loss = task_loss + moe.aux_loss
        # Training logs per step (rank 0's values); evaluation logs epoch means reduced over ranks.
        on_step = split == "train"
        log = dict(on_step=on_step, on_epoch=True, batch_size=batch_size, sync_dist=not on_step)
        self.log(f"{split}/loss", loss, prog_bar=True, **log)
        self.log(f"{split}/ce", task_loss, **log)
        for name, value in moe.aux_losses.items():
            self.log(f"{split}/aux/{name}", value, **log)
        if moe.aux_losses:
            self.log(f"{split}/aux/total", moe.aux_loss, **log)
        return loss

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
        (each rank holds only some); everything else clips as Lightning does."""
        clip_norm = getattr(self.trainer.strategy, "clip_gradient_norm", None)
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm") and clip_norm is not None:
            if clip_norm(optimizer, gradient_clip_val) is not None:
                return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        config = dict(self.optimizer_config)
        weight_decay = config.pop("weight_decay")
        decay_1d = config.pop("decay_1d", False)
        optimizer = build_optimizer(param_groups(self.net, weight_decay, decay_1d), **config)
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(self.schedule, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[TASK_KEY] = f"{type(self).__module__}:{type(self).__qualname__}"
