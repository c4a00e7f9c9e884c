"""Image classification with MoE (or dense) timm models as a LightningModule.

Loss = cross-entropy (soft targets under mixup/cutmix) + the weighted auxiliary losses every MoE
layer recorded in the forward (:func:`moekit.moe.collect_moe_outputs`); each aux loss is logged on
its own. Metrics: top-1 and top-5 accuracy (torchmetrics for evaluation,
resumable epoch means for training). Optimizer: AdamW with parameter groups
(no weight decay on biases, the experts' included, nor on 1-d parameters: norms, the Soft MoE scale).
Schedules: warmup + cosine, reciprocal square root, or constant, stepped per optimizer step.

The network is given as a config (``{"_target_": ..., ...}``) so that a checkpoint alone rebuilds
it: ``ImageClassifier.load_from_checkpoint(path)``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from moekit.checkpoint import CLASS_NAMES_KEY, head_prefixes, load_weights, read_state_dict

from .base import MoETask, check_trained_architecture, plain, trained_network

__all__ = ["ImageClassifier"]

log = logging.getLogger("moekit")


class ImageClassifier(MoETask):
    """Classifier training/evaluation.

    Args:
        net: the network config (Hydra ``_target_`` dict), instantiated here.
        num_classes: classes of the task (checked against the network's head).
        optimizer: ``{name, lr, weight_decay, betas, eps, decay_1d}``.
        scheduler: :class:`~moekit.tasks.optim.ScheduleConfig` fields.
        label_smoothing: cross-entropy label smoothing.
        mixup: timm ``Mixup`` keywords (``mixup_alpha``, ``cutmix_alpha``, ``prob``, ...) or None; both alphas 0
            (and no ``cutmix_minmax``) is None too, as in timm's ``train.py``.
        compile: ``torch.compile`` the network in place (state-dict keys unchanged).
        fused_attention: set timm attention's ``fused_attn`` (``scaled_dot_product_attention``); False
            uses the explicit softmax(q k^T) v, which is faster in bf16 on CPU. None keeps timm's choice.
        init_from: weights to start from: our checkpoint, a safetensors or torch state dict.
        init_mode: ``"finetune"`` (load everything but a classifier head whose shape differs) or
            ``"upcycle"`` (a dense ViT's weights into this MoE ViT: experts copy the dense MLPs).
        freeze_backbone: train the classifier head only (linear probing): the backbone stays in eval mode
            (:meth:`train`).
        run_config: the resolved run configuration, stored with the checkpoint and logged.
    """

    def __init__(
        self,
        net: Mapping[str, Any],
        num_classes: int,
        optimizer: Mapping[str, Any] | None = None,
        scheduler: Mapping[str, Any] | None = None,
        label_smoothing: float = 0.0,
        mixup: Mapping[str, Any] | None = None,
        compile: bool = False,
        fused_attention: bool | None = None,
        init_from: str | None = None,
        init_mode: str = "finetune",
        freeze_backbone: bool = False,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        net, optimizer, scheduler, mixup, run_config = map(plain, (net, optimizer, scheduler, mixup, run_config))
        self.save_hyperparameters(
            {
                "net": net,
                "num_classes": num_classes,
                "optimizer": optimizer,
                "scheduler": scheduler,
                "label_smoothing": label_smoothing,
                "mixup": mixup,
                "compile": compile,
                "fused_attention": fused_attention,
                "init_from": init_from,
                "init_mode": init_mode,
                "freeze_backbone": freeze_backbone,
                "run_config": run_config,
            }
        )
        if init_mode not in ("finetune", "upcycle"):
            raise ValueError(f"init_mode={init_mode!r}; allowed: 'finetune', 'upcycle'")
        self.setup_training(net, optimizer, scheduler)
        head_classes = getattr(self.net, "num_classes", num_classes)
        if head_classes != num_classes:
            raise ValueError(
                f"the network has {head_classes} outputs but the data has num_classes={num_classes}; "
                "set model.num_classes to the dataset's class count"
            )
        self.label_smoothing = label_smoothing
        self.mixup = None
        if mixup:
            from timm.data import Mixup

            for key, where in (("label_smoothing", "task.label_smoothing"), ("num_classes", "the data")):
                if key in mixup:
                    raise ValueError(f"task.mixup.{key}={mixup[key]!r}: the mixed targets take it from {where}")
            self.mixup = Mixup(num_classes=num_classes, label_smoothing=label_smoothing, **mixup)
            alphas = {"mixup_alpha": self.mixup.mixup_alpha, "cutmix_alpha": self.mixup.cutmix_alpha}
            if min(alphas.values()) < 0:
                raise ValueError(f"task.mixup: {alphas} must be >= 0 (0 turns that kind of mixing off)")
            if max(alphas.values()) == 0 and self.mixup.cutmix_minmax is None:
                self.mixup = None  # nothing to mix (timm would fail at the first step): off, as timm's train.py has it
        if fused_attention is not None:
            for module in self.net.modules():
                if hasattr(module, "fused_attn"):
                    module.fused_attn = fused_attention
        if init_from:
            self._initialise_from(init_from, init_mode)
        if freeze_backbone:
            heads = head_prefixes(self.net)
            for name, param in self.net.named_parameters():
                param.requires_grad = name.startswith(heads)
            self.train()
        if compile:
            self.compile_net()
        top5 = min(5, num_classes)
        self.metrics = nn.ModuleDict(
            {
                f"{split}_acc{k}": MulticlassAccuracy(num_classes=num_classes, top_k=k, average="micro")
                for split in ("val", "test")
                for k in sorted({1, top5})
            }
        )
        self.top5 = top5
        self.class_names: list[str] | None = None  # label i's name, from the data or the checkpoint

    # ------------------------------------------------------------------------------------------
    def _initialise_from(self, path: str, mode: str) -> None:
        """Load ``path`` (fine-tune) or upcycle from it; in both modes a classifier head of other classes, or none (a
        backbone exported with ``num_classes=0``), is replaced by this task's fresh head."""
        state = read_state_dict(path)
        own = self.net.state_dict()
        heads = head_prefixes(self.net)
        head_changed = any(k.startswith(heads) and (k not in state or state[k].shape != own[k].shape) for k in own)
        if mode == "upcycle":
            from moekit.models.upcycle import upcycle_vit

            if head_changed:  # the fresh head stands in for the checkpoint's
                state = {k: v for k, v in state.items() if not k.startswith(heads)}
                state |= {k: v for k, v in own.items() if k.startswith(heads)}
                log.info("%s: the classifier head (%d classes) starts fresh", path, self.hparams.num_classes)
            upcycle_vit(self.net, state, architecture=trained_network(path))
            return
        check_trained_architecture(self.net, path)
        load_weights(self.net, state, source=path, skip_prefixes=heads if head_changed else ())

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        names = getattr(datamodule, "label_names", None) or self.class_names
        if names:  # for scripts/predict.py
            checkpoint[CLASS_NAMES_KEY] = list(names)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.class_names = checkpoint.get(CLASS_NAMES_KEY)

    def train(self, mode: bool = True) -> ImageClassifier:
        """With ``freeze_backbone`` the backbone stays in eval mode while the head trains: its batch norms keep
        their running statistics, dropout and stochastic depth stay off, and its MoE layers add no router noise
        and count no tokens for loss-free balancing, so the probed features are the loaded backbone's."""
        super().train(mode)
        if mode and self.hparams.get("freeze_backbone"):
            self.net.eval()
            for prefix in head_prefixes(self.net):
                self.net.get_submodule(prefix[:-1]).train()
        return self

    def _mix(self, images: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """timm's Mixup: mixed images and their soft targets (label smoothing included). It pairs each image with
        the batch flipped and refuses an odd batch, so an odd one (the last, partial batch of an epoch) mixes all
        but its last image, which keeps its own label, smoothed."""
        if images.shape[0] % 2 == 0:
            return self.mixup(images, labels)
        from timm.data.mixup import mixup_target

        even = images.shape[0] - 1
        last = mixup_target(labels[even:], self.mixup.num_classes, smoothing=self.mixup.label_smoothing)
        if even == 0:
            return images, last
        mixed, targets = self.mixup(images[:even], labels[:even])
        return torch.cat([mixed, images[even:]]), torch.cat([targets, last])

    def forward(self, images: Tensor) -> Tensor:
        """``images: [batch, channels, height, width]`` -> logits ``[batch, num_classes]``."""
        return self.net(images)

    def _shared_step(self, batch, split: str) -> Tensor:
        images, labels = batch
        targets = labels
        if split == "train" and self.mixup is not None:
            images, targets = self._mix(images, labels)
        logits = self(images)
        if targets.dim() == 2:  # soft targets from mixup (label smoothing included)
            task_loss = torch.sum(-targets * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()
        else:
            smoothing = self.label_smoothing if split == "train" else 0.0  # val/test: the plain cross-entropy
            task_loss = F.cross_entropy(logits.float(), targets, label_smoothing=smoothing)
        loss = self.add_aux_losses(split, task_loss, batch_size=images.shape[0])
        preds = logits.detach()
        for k in sorted({1, self.top5}):
            name = f"{split}/acc" if k == 1 else f"{split}/acc_top{k}"
            if split == "train":  # the fraction of images whose label is among the top k, as an epoch mean
                hits = (preds.topk(k, dim=-1).indices == labels[:, None]).any(dim=-1).float().mean()
                self.log_epoch_mean(name, hits, batch_size=images.shape[0])
                continue
            metric = self.metrics[f"{split}_acc{k}"]
            metric(preds, labels)
            self.log(name, metric, on_step=False, on_epoch=True, prog_bar=k == 1, batch_size=images.shape[0])
        return loss

    def training_step(self, batch, batch_idx: int) -> Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> Tensor:
        return self._shared_step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> Tensor:
        return self._shared_step(batch, "test")
