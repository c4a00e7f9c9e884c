"""Capacity tuning: hold a target dropped-token fraction at the lowest capacity factor that meets it.

:class:`CapacityTuner` adjusts the training ``capacity_factor`` of every capacity-limited MoE layer
(tokens-choice layers with a capacity - :class:`~moekit.moe.TopKMoE`,
:class:`~moekit.moe.HierarchicalMoE` - and :class:`~moekit.moe.ExpertsChoiceMoE`), one factor per
layer: deeper layers route differently and need different capacities.

Each training batch (a "step" below; a micro-batch under gradient accumulation) it reads
``layer.stats["dropped_fraction"]`` of every such layer - for tokens-choice
the fraction of token -> expert assignments dropped by capacity, for experts-choice the fraction of
tokens no expert picked, both over the real tokens - and the step's real tokens (``stats["real_tokens"]``) into a
ring buffer on the layer's device (no host synchronisation). Every ``update_every`` steps it reads the buffer once
and decides, per layer, on the smoothed drop rate ``d``: the dropped fraction of all real tokens of the last
``window`` steps measured at the layer's current factor ``f`` (each step weighted by its real tokens, so that a
batch of mostly padding counts for its few real tokens, as in :class:`~moekit.callbacks.ExpertLoadMonitor`):

* **up** when ``d > target_drop``: ``f <- f * max(increase, r)`` with ``r`` the smallest scale that could
  bring the drop rate down to the target (tokens-choice: ``(1 - target) / (1 - d)``, because scaling every
  expert's capacity by ``r`` keeps at most ``r`` times as many assignments; experts-choice:
  ``1 + (d - target) / f``, because the ``(r - 1) * f * tokens`` extra picks must at least cover the
  ``(d - target) * tokens`` missing tokens). Far above target it jumps far, without passing the
  smallest factor that works (up to the rounding of capacities to whole tokens). ``f`` is remembered
  as failed;
* **down**, slowly, when ``d <= hysteresis * target_drop`` (comfortably below; the band between
  ``hysteresis * target`` and ``target`` holds) for ``patience`` consecutive decisions:
  ``f <- f * decrease``, unless that would reach the latest failed factor (then the layer stays: it
  sits within one ``decrease`` step of the smallest factor that meets the target). A failed factor is
  forgotten after ``retry_after`` steps, so a router that balances better as it trains lets the
  factor fall further;
* then clamp to ``[min_factor, max_factor]`` (experts-choice also to ``num_experts``).

After a change the layer's window restarts: it decides again only once ``window`` steps have been
measured at the new factor (the cool-down). Evaluation uses its own factor: ``eval_capacity_factor``
sets every tuned layer's ``eval_capacity_factor`` (V-MoE raises capacity at inference); None keeps
the layers' own.

Logged every ``update_every`` steps to every logger: ``capacity/<layer>/factor`` (the factor the
drop rate was measured at) and ``capacity/<layer>/drop_rate`` (the smoothed drop rate), at the step
Lightning logs the same batch's metrics at (as :class:`~moekit.callbacks.ExpertLoadMonitor` does).

The factors, windows and counters are saved in checkpoints (:meth:`CapacityTuner.state_dict`), so a
resumed run continues exactly as an uninterrupted one (on one device; under data parallelism the
windows are averaged over ranks at every update - the drop rate is then over all ranks' real tokens, and every
rank takes the same decision - and rank 0's copy is saved).

The tuned factors live in the layers' attributes, not in their state dict: a checkpoint evaluated
without the callback (``scripts/eval.py``) uses the model config's ``eval_capacity_factor``. Under
``torch.compile`` a tokens-choice layer reads its factors from a buffer, as data, so a new factor does not
recompile it; an experts-choice layer's factor sets the shape of its top-C choice, and it recompiles.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from lightning import Callback, LightningModule, Trainer
from torch import Tensor, nn

from moekit.loggers import logging_step
from moekit.moe import ExpertsChoiceMoE, MoELayer, moe_layers
from moekit.moe.stats import REAL_TOKENS

from .moe_stats import layer_label

__all__ = ["CapacityTuner", "capacity_limited_layers"]


def capacity_limited_layers(model: nn.Module) -> dict[str, MoELayer]:
    """``{name: layer}`` (names as :func:`~moekit.callbacks.moe_stats.layer_label` gives them) of the MoE layers of
    ``model`` with a numeric ``capacity_factor``: tokens-choice
    layers with a capacity limit and experts-choice layers (dropless, Soft MoE, dense, hash and BASE
    layers have none)."""
    found = {}
    for name, layer in moe_layers(model):
        factor = getattr(layer, "capacity_factor", None)
        if isinstance(factor, (int, float)) and not isinstance(factor, bool):
            found[layer_label(name, layer)] = layer
    return found


@dataclass
class _LayerState:
    """What the tuner knows about one layer (all host-side Python numbers).

    Attributes:
        factor: the training capacity factor in use.
        fresh: steps measured at ``factor`` since it was set (the window holds ``min(fresh, window)``).
        below: consecutive decisions with the smoothed drop rate at or below ``hysteresis * target``.
        failed_factor: the latest factor whose smoothed drop rate exceeded the target (0: none).
        failed_step: the step it failed at.
        drop_rate: the latest smoothed drop rate (None before the first reading).
    """

    factor: float
    fresh: int = 0
    below: int = 0
    failed_factor: float = 0.0
    failed_step: int = 0
    drop_rate: float | None = None


class CapacityTuner(Callback):
    """Tune each capacity-limited MoE layer's training capacity factor to hold ``target_drop``.

    Args:
        target_drop: the dropped fraction to stay at or below, in ``(0, 1)``.
        min_factor, max_factor: bounds of every factor (experts-choice layers also stop at
            ``num_experts``). A layer's configured factor, or a factor restored from a checkpoint,
            outside them is clamped at the start.
        window: steps in the moving average of the drop rate; also the cool-down after a change.
        update_every: steps between two decisions (and the only host reads of the drop rates).
        increase: smallest multiplicative step up (> 1).
        decrease: multiplicative step down (in ``(0, 1)``); the tuner settles within this ratio of the
            smallest factor meeting the target.
        patience: consecutive decisions comfortably below target before a step down.
        hysteresis: "comfortably below" means ``drop_rate <= hysteresis * target_drop``, in ``(0, 1]``.
        retry_after: steps after which a factor that exceeded the target may be tried again.
        eval_capacity_factor: the capacity factor of every tuned layer in eval mode (validation,
            test); None keeps each layer's own ``eval_capacity_factor``.

    Without Lightning: :meth:`bind` a model, then call :meth:`step` after each training forward.
    """

    def __init__(
        self,
        target_drop: float = 0.01,
        min_factor: float = 0.5,
        max_factor: float = 4.0,
        window: int = 50,
        update_every: int = 10,
        increase: float = 1.2,
        decrease: float = 0.95,
        patience: int = 3,
        hysteresis: float = 0.8,
        retry_after: int = 500,
        eval_capacity_factor: float | None = None,
    ) -> None:
        def number(value: Any) -> bool:  # YAML hands over strings ("1%", "same") and nulls as readily as numbers
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        def count(value: Any, low: int) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= low

        checks = (
            (
                "target_drop",
                target_drop,
                number(target_drop) and 0 < target_drop < 1,
                "a fraction in (0, 1), e.g. 0.01",
            ),
            ("min_factor", min_factor, number(min_factor) and min_factor > 0, "a finite number > 0"),
            (
                "max_factor",
                max_factor,
                number(max_factor) and number(min_factor) and max_factor >= min_factor,
                f"a finite number >= min_factor={min_factor}",
            ),
            ("window", window, count(window, 1), "an int >= 1 (steps)"),
            ("update_every", update_every, count(update_every, 1), "an int >= 1"),
            ("increase", increase, number(increase) and increase > 1, "a finite number > 1, e.g. 1.2"),
            ("decrease", decrease, number(decrease) and 0 < decrease < 1, "in (0, 1), e.g. 0.95"),
            ("patience", patience, count(patience, 1), "an int >= 1"),
            ("hysteresis", hysteresis, number(hysteresis) and 0 < hysteresis <= 1, "in (0, 1], e.g. 0.8"),
            ("retry_after", retry_after, count(retry_after, 0), "an int >= 0 (steps)"),
            (
                "eval_capacity_factor",
                eval_capacity_factor,
                eval_capacity_factor is None or (number(eval_capacity_factor) and eval_capacity_factor > 0),
                "a finite number > 0, or null to keep each layer's own eval_capacity_factor",
            ),
        )
        for name, value, ok, need in checks:
            if not ok:
                raise ValueError(f"CapacityTuner: {name}={value!r} must be {need}")
        self.target_drop = float(target_drop)
        self.min_factor = float(min_factor)
        self.max_factor = float(max_factor)
        self.window = window
        self.update_every = update_every
        self.increase = float(increase)
        self.decrease = float(decrease)
        self.patience = patience
        self.hysteresis = float(hysteresis)
        self.retry_after = retry_after
        self.eval_capacity_factor = None if eval_capacity_factor is None else float(eval_capacity_factor)

        self._model: nn.Module | None = None
        self._layers: dict[str, MoELayer] = {}
        self._states: dict[str, _LayerState] = {}
        # [2, layers, window] on the layers' device: [0] dropped fraction x real tokens, [1] real tokens, per step
        self._buffer: Tensor | None = None
        self._steps = 0  # training forwards observed
        self._pending_state: dict[str, Any] | None = None  # loaded before the model was bound

    # ------------------------------------------------------------------------------------------
    @property
    def factors(self) -> dict[str, float]:
        """``{layer: current training capacity factor}``."""
        return {name: state.factor for name, state in self._states.items()}

    @property
    def drop_rates(self) -> dict[str, float | None]:
        """``{layer: latest smoothed drop rate}`` (None before the first reading)."""
        return {name: state.drop_rate for name, state in self._states.items()}

    def bind(self, model: nn.Module) -> None:
        """Find the capacity-limited layers of ``model``, clamp their training factors into the
        bounds and set their eval factors. Binding the same model again only re-applies the factors.

        Raises:
            ValueError: ``model`` has no capacity-limited MoE layer.
        """
        if model is self._model:
            self._apply_factors()
            return
        layers = capacity_limited_layers(model)
        if not layers:
            found = sorted({type(layer).__name__ for _, layer in moe_layers(model)})
            raise ValueError(
                "CapacityTuner: the model has no capacity-limited MoE layer "
                f"(MoE layers found: {found or 'none'}). It tunes tokens-choice layers with a capacity_factor "
                "(e.g. moe=switch, or moe.capacity_factor=1.25 with moe=mixtral) and experts-choice layers; "
                "remove the callback for dropless, Soft MoE or dense models."
            )
        if self.eval_capacity_factor is not None:
            for name, layer in layers.items():
                self._check_factor(name, layer, self.eval_capacity_factor, "eval_capacity_factor")
        self._model = model
        self._layers = layers
        self._states = {
            name: _LayerState(factor=self._clamp(layer, layer.capacity_factor)) for name, layer in layers.items()
        }
        self._buffer = None
        self._steps = 0
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        self._apply_factors()

    def step(self, reduce: Callable[[Tensor], Tensor] | None = None) -> dict[str, float] | None:
        """Record the drop rates of the latest training forward; every ``update_every`` calls, decide.

        Args:
            reduce: averages a tensor over data-parallel ranks (Lightning: ``trainer.strategy.reduce``).

        Returns:
            The metrics of a decision (``capacity/<layer>/factor``, ``capacity/<layer>/drop_rate``), else None.
        """
        self.observe()
        if self._steps % self.update_every == 0:
            return self.update(reduce)
        return None

    def observe(self) -> None:
        """Write every tuned layer's ``dropped_fraction`` of its latest forward, weighted by the forward's real tokens,
        and those tokens into the window (on device)."""
        if self._model is None:
            raise RuntimeError("CapacityTuner.observe() before bind(model)")
        drops, weights = [], []
        for name, layer in self._layers.items():
            stats = layer.stats
            value = stats.get("dropped_fraction")
            if value is None:
                raise ValueError(
                    f"CapacityTuner: layer '{name}' recorded no dropped_fraction in its latest forward; "
                    "build it with compute_stats=True (the default) and call step() after a training forward"
                )
            value = value.detach().float().reshape(())
            real = stats.get(REAL_TOKENS)  # padding counts in no statistic; a layer without the count: 1 per forward
            weight = value.new_ones(()) if real is None else real.detach().float().reshape(()).to(value.device)
            drops.append(value * weight)
            weights.append(weight)
        stacked = torch.stack([torch.stack(drops), torch.stack(weights)])  # [2, layers]
        if self._buffer is None:
            self._buffer = stacked.new_zeros(2, len(drops), self.window)
        elif self._buffer.device != stacked.device:  # restored (on the CPU) before the model moved to its device
            self._buffer = self._buffer.to(stacked.device)
        self._buffer[:, :, self._steps % self.window] = stacked
        self._steps += 1
        for state in self._states.values():
            state.fresh += 1

    def update(self, reduce: Callable[[Tensor], Tensor] | None = None) -> dict[str, float]:
        """Read the windows (one host synchronisation), decide every layer's factor, return the metrics."""
        if self._buffer is None:
            return {}
        if reduce is not None:
            self._buffer = reduce(self._buffer)
        windows = self._buffer.cpu()
        metrics: dict[str, float] = {}
        for row, (name, state) in enumerate(self._states.items()):
            measured = min(state.fresh, self.window)
            if measured == 0:
                continue
            recent = [(self._steps - 1 - i) % self.window for i in range(measured)]
            dropped, real = windows[:, row, recent].double().sum(dim=1).tolist()
            if real <= 0:  # nothing but padding since the last change: nothing measured
                continue
            state.drop_rate = dropped / real
            metrics[f"capacity/{name}/factor"] = state.factor
            metrics[f"capacity/{name}/drop_rate"] = state.drop_rate
            if state.fresh >= self.window:
                self._decide(name, state)
        return metrics

    # ------------------------------------------------------------------------------------------
    def _decide(self, name: str, state: _LayerState) -> None:
        layer, drop, factor = self._layers[name], state.drop_rate, state.factor
        if drop > self.target_drop:
            new = self._clamp(layer, factor * max(self.increase, self._rescue_scale(layer, factor, drop)))
            state.failed_factor, state.failed_step, state.below = factor, self._steps, 0
        elif drop <= self.hysteresis * self.target_drop:
            state.below += 1
            if state.below < self.patience:
                return
            if self._steps - state.failed_step >= self.retry_after:
                state.failed_factor = 0.0
            new = self._clamp(layer, factor * self.decrease)
            if new <= state.failed_factor:
                return  # the next step down is known to drop too much: stay
        else:
            state.below = 0  # inside the band: hold
            return
        if new != factor:
            state.factor, state.fresh, state.below = new, 0, 0
            layer.capacity_factor = new

    def _rescue_scale(self, layer: MoELayer, factor: float, drop: float) -> float:
        """The smallest scale of ``factor`` that could bring ``drop`` down to the target."""
        if isinstance(layer, ExpertsChoiceMoE):
            return 1.0 + (drop - self.target_drop) / factor
        return (1.0 - self.target_drop) / max(1.0 - drop, 1e-6)

    def _upper(self, layer: MoELayer) -> float:
        if isinstance(layer, ExpertsChoiceMoE):
            return min(self.max_factor, float(layer.num_experts))
        return self.max_factor

    def _clamp(self, layer: MoELayer, factor: float) -> float:
        return float(min(max(factor, self.min_factor), self._upper(layer)))

    def _check_factor(self, name: str, layer: MoELayer, factor: float, what: str) -> None:
        if isinstance(layer, ExpertsChoiceMoE) and factor > layer.num_experts:
            raise ValueError(
                f"CapacityTuner: {what}={factor} exceeds num_experts={layer.num_experts} of experts-choice layer "
                f"'{name}' (at most every expert per token); use a value <= {layer.num_experts}"
            )

    def _apply_factors(self) -> None:
        for name, layer in self._layers.items():
            layer.capacity_factor = self._states[name].factor
            if self.eval_capacity_factor is not None:
                layer.eval_capacity_factor = self.eval_capacity_factor

    # ------------------------------------------------------------------------------------------
    # Lightning hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.bind(getattr(pl_module, "net", pl_module))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        metrics = self.step(reduce=lambda t: trainer.strategy.reduce(t, reduce_op="mean"))
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=logging_step(trainer))

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self._steps,
            "buffer": None if self._buffer is None else self._buffer.detach().cpu().clone(),
            "layers": {name: asdict(state) for name, state in self._states.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._model is None:  # restored before setup(): apply once bound
            self._pending_state = state_dict
            return
        saved = state_dict["layers"]
        if set(saved) != set(self._states):
            raise ValueError(
                f"CapacityTuner: the checkpoint tuned layers {sorted(saved)} but the model's capacity-limited "
                f"layers are {sorted(self._states)}; resume with the same model config"
            )
        self._states = {name: _LayerState(**saved[name]) for name in self._states}
        for name, state in self._states.items():  # bounds changed since the checkpoint: clamp, as bind() does
            factor = self._clamp(self._layers[name], state.factor)
            if factor != state.factor:
                state.factor, state.fresh, state.below = factor, 0, 0
        self._steps = int(state_dict["steps"])
        buffer = state_dict["buffer"]
        if buffer is not None:
            if buffer.dim() == 2:  # a checkpoint of the unweighted windows: drop fractions, each step weighing 1
                buffer = torch.stack([buffer, torch.ones_like(buffer)])
            if buffer.shape != (2, len(self._states), self.window):
                raise ValueError(
                    f"CapacityTuner: the checkpoint's drop-rate window holds {buffer.shape[-1]} steps but the callback "
                    f"has window={self.window}; resume with window={buffer.shape[-1]}"
                )
            # on the CPU: Lightning restores callbacks before it moves the model to its device; observe() moves it
            buffer = buffer.cpu()
        self._buffer = buffer
        self._apply_factors()

    def __repr__(self) -> str:
        return (
            f"CapacityTuner(target_drop={self.target_drop}, factors in [{self.min_factor}, {self.max_factor}], "
            f"window={self.window}, update_every={self.update_every})"
        )
