"""Numerical safety: skip the optimizer steps whose loss or gradients are not finite, count them, and
stop with a diagnosis (which MoE router, the data, or the backward pass) after too many in a row."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from lightning import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.optim import Optimizer

from moekit.moe import routing_modules

from .moe_stats import layer_label

__all__ = ["NonFiniteGuard", "NonFiniteTrainingError", "BadStep"]

log = logging.getLogger("moekit")

GUARD_KEY = "callbacks.non_finite_guard"
"""Where the guard sits in the training config (``configs/callbacks/default.yaml``), for the messages."""


class NonFiniteTrainingError(ValueError):
    """Training stopped: too many consecutive optimizer steps had a non-finite loss or gradients.

    A ``ValueError`` like the other user errors, since the fix is a setting (learning rate, z-loss,
    precision) or the data: the training script prints it as one paragraph and exits with status 1."""


@dataclass(frozen=True)
class BadStep:
    """What the guard found about one skipped step (read from the device only once the step was bad).

    Attributes:
        step: the optimizer step (``trainer.global_step`` when it was taken).
        loss: the training loss of the step (summed over accumulated micro-batches); None if unknown.
        batch_finite: whether every floating-point tensor of the step's batches was finite (None: the
            batches hold no floating-point tensors, e.g. token ids, or ``check_batch`` is off).
        router_layer: the first MoE layer (in module order, so forward order for a ViT or an LM) whose
            router produced non-finite logits in the step's last forward; None if every router was finite.
        router_layer_weights_finite: whether that layer's own parameters are all finite.
        grad_param: the first parameter with a non-finite gradient; None if all were finite.
        router_layer_input_finite: whether that layer's input in that forward was finite (None: unknown).
    """

    step: int
    loss: float | None
    batch_finite: bool | None
    router_layer: str | None
    router_layer_weights_finite: bool | None
    grad_param: str | None
    router_layer_input_finite: bool | None = None

    @property
    def cause(self) -> str:
        """The most upstream explanation found: the data, then a router, then the loss, then backward."""
        if self.batch_finite is False:
            return "the input batch holds NaN or inf values"
        if self.router_layer is not None:
            where = (
                f"the router of MoE layer {self.router_layer!r} produced non-finite logits "
                "(the first MoE layer to do so)"
            )
            if not self.router_layer_weights_finite:
                return f"{where}; its weights hold NaN/inf (an earlier update diverged)"
            if self.router_layer_input_finite is False:
                return f"{where}; its weights are finite but its input was not (an earlier block diverged)"
            if self.router_layer_input_finite:
                return (
                    f"{where}; its input and weights are finite, so the router's own computation overflowed "
                    "(its noise or scale: check settings such as moe.noise_std)"
                )
            return f"{where}; its weights are finite, so its input or its own computation overflowed"
        if self.loss is not None and not math.isfinite(self.loss):
            return f"the loss is {self.loss} while every router's logits are finite (the head or the loss overflowed)"
        param = f"the gradient of {self.grad_param!r}" if self.grad_param else "a gradient"
        return f"the loss is finite ({self.loss}) but {param} is not (the backward pass overflowed)"

    @property
    def fix(self) -> str:
        """What to try, most specific first."""
        data = "check the data and its transforms for NaN/inf (corrupt files, a normalisation dividing by a zero std)"
        model = (
            "lower the learning rate (task.optimizer.lr) or lengthen its warmup, enable the router z-loss "
            "(moe.z_loss_weight=1e-3, for routers that have it), keep gradient clipping on "
            "(trainer.gradient_clip_val=1.0), or train in float32 (trainer.precision=32-true) to rule out overflow"
        )
        return f"{data}; {model}" if self.batch_finite is False else f"{model}; {data}"


class NonFiniteGuard(Callback):
    """Skip every optimizer step whose loss or gradients are not finite, count the skips, and stop
    after ``max_consecutive_bad_steps`` bad steps in a row with a :class:`NonFiniteTrainingError` that
    says what went wrong first (the data, the router of a named MoE layer, the loss, or the backward
    pass) and what to change.

    How a step is skipped: in ``on_before_optimizer_step`` (after backward, after a grad scaler's
    unscaling, before gradient clipping and ``optimizer.step``) the guard checks that the loss of the
    step and the sum of all gradient entries are finite (NaN and inf propagate through a sum). A bad
    step's gradients are set to None, so clipping has nothing to clip and the optimizer leaves every
    parameter and its state (moments, step counts, weight decay) untouched; the learning-rate
    schedule and ``global_step`` still advance.
    Batch-norm running statistics, which the forward itself updates, are put back as they were before
    the step (a NaN batch would otherwise leave NaN running means for evaluation).
    :class:`~moekit.tasks.MoETask` then discards the step's loss-free balancing counts instead of
    updating the biases (the guard sets ``pl_module.step_skipped``).

    Cost: one host synchronisation per optimizer step (two flags; the same as a grad scaler's own
    check), one copy of the batch-norm running statistics per step if the network has any, and, under
    DDP, one all-reduce of the two flags so every rank skips the same steps. The MoE layers record the
    sum of their router logits on the device on every forward
    (:func:`~moekit.moe.routing.logit_checksum`); the guard reads them, the batch and the gradients'
    names only once a step is already bad. With gradient accumulation the routers' record is that of
    the step's last micro-batch.

    fp16 with a grad scaler (``trainer.precision=16-mixed`` on GPUs): a scaler skips the steps whose
    scaled gradients overflow and lowers its scale; that is expected now and then, so a step with
    non-finite gradients but a finite loss is counted apart, as ``train/scaler_skipped_steps``, and
    does not count towards the limit. A non-finite loss is a bad step under every precision. (On CPU
    Lightning turns ``16-mixed`` into ``bf16-mixed``, which has no scaler.)

    Logs ``train/skipped_steps`` (the total of bad steps skipped) every step, and
    ``train/scaler_skipped_steps`` when a scaler is in use. The counts, and the first and last bad steps
    of the current streak (for the message that stops it), are kept in checkpoints.

    Args:
        max_consecutive_bad_steps: stop after this many bad steps in a row; None skips bad steps
            without ever stopping.
        check_batch: keep a reference to the floating-point tensors of each batch so that a bad step
            can tell whether its input was finite (read only then).
    """

    def __init__(self, max_consecutive_bad_steps: int | None = 5, check_batch: bool = True) -> None:
        if max_consecutive_bad_steps is not None and (
            isinstance(max_consecutive_bad_steps, bool)
            or not isinstance(max_consecutive_bad_steps, int)
            or max_consecutive_bad_steps < 1
        ):
            raise ValueError(
                f"NonFiniteGuard: max_consecutive_bad_steps={max_consecutive_bad_steps!r} must be a positive int "
                "(e.g. 5), or null to skip bad steps without ever stopping"
            )
        self.max_consecutive_bad_steps = max_consecutive_bad_steps
        self.check_batch = check_batch
        self.skipped_steps = 0
        self.scaler_skipped_steps = 0
        self.consecutive_bad_steps = 0
        self.first_of_streak: BadStep | None = None
        self.last_bad_step: BadStep | None = None
        self._losses: list[Tensor] = []
        self._batch_tensors: list[Tensor] = []
        self._norm_stats: list[Tensor] | None = None  # the batch-norm buffers of the network
        self._norm_stats_copy: list[Tensor] = []
        self._step_started = False
        self._input_checksums: dict[str, Tensor] = {}  # routing module -> sum of its latest input
        self._hooks: list[Any] = []

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._norm_stats = [
            b
            for m in pl_module.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
            for b in m.buffers(recurse=False)
        ]
        self._norm_stats_copy = [b.detach().clone() for b in self._norm_stats]
        self._remove_hooks()
        net: nn.Module = getattr(pl_module, "net", pl_module)
        for name, module in routing_modules(net):
            self._hooks.append(module.register_forward_pre_hook(self._record_input(name)))

    def _record_input(self, name: str):
        """A pre-hook keeping the sum of a routing module's input on the device (finite exactly when every
        entry is), so a bad step can tell a diverged input from a router that overflowed by itself."""

        def hook(module: nn.Module, inputs: tuple) -> None:
            x = next((t for t in inputs if isinstance(t, Tensor) and t.is_floating_point()), None)
            if x is not None:
                self._input_checksums[name] = x.detach().float().sum()

        return hook

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._input_checksums.clear()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._remove_hooks()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._remove_hooks()

    # -- the checks ---------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.check_batch:
            self._batch_tensors.extend(_floating_tensors(batch))
        if not self._step_started and self._norm_stats:  # the first micro-batch of an optimizer step
            torch._foreach_copy_(self._norm_stats_copy, self._norm_stats)
        self._step_started = True

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        self._losses.append(loss.detach())

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        try:
            self._check_step(trainer, pl_module, optimizer)
        finally:
            self._losses.clear()
            self._batch_tensors.clear()
            self._step_started = False

    def _check_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        zero = torch.zeros((), device=pl_module.device)
        grad_bad = (~torch.isfinite(_checksum(grads, zero.device))).float() if grads else zero
        loss_bad = (~torch.isfinite(_checksum(self._losses, zero.device))).float() if self._losses else zero
        flags = trainer.strategy.reduce(torch.stack([grad_bad, loss_bad]), reduce_op="sum")
        any_grad_bad, any_loss_bad = (bool(v) for v in flags.tolist())  # the one host sync per step
        if not (any_grad_bad or any_loss_bad):
            self.consecutive_bad_steps = 0
            self.first_of_streak = None
            return
        if getattr(trainer.precision_plugin, "scaler", None) is not None and not any_loss_bad:
            self.scaler_skipped_steps += 1  # a loss-scale overflow: the scaler skips it and lowers its scale
            self._skip(pl_module, optimizer)
            return
        bad = self._diagnose(trainer, pl_module)
        self._skip(pl_module, optimizer)
        self.skipped_steps += 1
        self.consecutive_bad_steps += 1
        self.first_of_streak = self.first_of_streak or bad
        self.last_bad_step = bad
        limit = self.max_consecutive_bad_steps
        if limit is not None and self.consecutive_bad_steps >= limit:
            raise NonFiniteTrainingError(self._stop_message(limit))
        if trainer.is_global_zero:
            log.warning(
                "NonFiniteGuard: step %d skipped (%d in a row, %d in all): %s",
                bad.step,
                self.consecutive_bad_steps,
                self.skipped_steps,
                bad.cause,
            )

    def _skip(self, pl_module: LightningModule, optimizer: Optimizer) -> None:
        """Drop this step's gradients (the optimizer then updates nothing), put the batch-norm running
        statistics back, and tell the task (which then skips the loss-free balancing update)."""
        optimizer.zero_grad(set_to_none=True)
        if self._norm_stats:
            torch._foreach_copy_(self._norm_stats, self._norm_stats_copy)
        if hasattr(pl_module, "step_skipped"):
            pl_module.step_skipped = True

    def _diagnose(self, trainer: Trainer, pl_module: LightningModule) -> BadStep:
        """Read what the device knows about this bad step (host syncs, only on a bad step)."""
        net: nn.Module = getattr(pl_module, "net", pl_module)
        loss = float(_checksum(self._losses, pl_module.device)) if self._losses else None
        batch_finite = all(bool(torch.isfinite(t).all()) for t in self._batch_tensors) if self._batch_tensors else None
        router_layer, weights_finite, input_finite = None, None, None
        for name, layer in routing_modules(net):
            if layer.router_logits_finite() is False:
                router_layer = layer_label(name, layer)
                weights_finite = all(bool(torch.isfinite(p).all()) for p in layer.parameters())
                checksum = self._input_checksums.get(name)
                input_finite = None if checksum is None else bool(torch.isfinite(checksum))
                break
        grad_param = next(
            (n for n, p in net.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())),
            None,
        )
        return BadStep(trainer.global_step, loss, batch_finite, router_layer, weights_finite, grad_param, input_finite)

    def _stop_message(self, limit: int) -> str:
        last, first = self.last_bad_step, self.first_of_streak
        assert last is not None and first is not None
        streak = f"steps {first.step}-{last.step}" if first.step != last.step else f"step {last.step}"
        earlier = f" The first of them (step {first.step}): {first.cause}." if first.cause != last.cause else ""
        return (
            f"NonFiniteGuard: {limit} consecutive training steps ({streak}) had a non-finite loss or gradients and "
            f"were skipped ({self.skipped_steps} skipped in all), so training stops. At step {last.step} "
            f"{last.cause}.{earlier} What to do: {last.fix}. To skip bad steps without stopping, set "
            f"{GUARD_KEY}.max_consecutive_bad_steps=null; to allow more in a row, raise it."
        )

    # -- logging and checkpoints ----------------------------------------------------------------
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        pl_module.log("train/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False)
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            pl_module.log("train/scaler_skipped_steps", float(self.scaler_skipped_steps), on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        # The streak's first and last bad steps go with its length: a run resumed in the middle of a streak stops
        # at the same step, with the same message, as the run that never stopped.
        return {
            "skipped_steps": self.skipped_steps,
            "scaler_skipped_steps": self.scaler_skipped_steps,
            "consecutive_bad_steps": self.consecutive_bad_steps,
            "first_of_streak": None if self.first_of_streak is None else asdict(self.first_of_streak),
            "last_bad_step": None if self.last_bad_step is None else asdict(self.last_bad_step),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.scaler_skipped_steps = int(state_dict.get("scaler_skipped_steps", 0))
        self.consecutive_bad_steps = int(state_dict.get("consecutive_bad_steps", 0))
        first, last = state_dict.get("first_of_streak"), state_dict.get("last_bad_step")
        self.first_of_streak = None if first is None else BadStep(**first)
        self.last_bad_step = None if last is None else BadStep(**last)


def _checksum(tensors: list[Tensor], device: torch.device) -> Tensor:
    """The sum of every entry of ``tensors`` in float32 on ``device``: finite exactly when all are
    (finite entries would need a total above ~1e38 to overflow, itself a divergence). One reduction
    per tensor, no host sync; on CPU it is 14x cheaper than a max-abs (inf-norm) pass. FSDP-sharded
    tensors (DTensor) count their local shard: the caller reduces the verdict over ranks."""
    local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
    return torch.stack([t.detach().float().sum().to(device) for t in local]).sum()


def _floating_tensors(batch: Any) -> Iterator[Tensor]:
    """The floating-point tensors in a batch (nested tuples, lists and dicts)."""
    if isinstance(batch, Tensor):
        if batch.is_floating_point():
            yield batch
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            yield from _floating_tensors(item)
    elif isinstance(batch, dict):
        for item in batch.values():
            yield from _floating_tensors(item)
