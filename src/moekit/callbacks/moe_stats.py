"""Expert-load statistics of every MoE layer in TensorBoard (and every other logger), aggregated on
device and reduced over ranks.

After each training batch :class:`ExpertLoadMonitor` adds what every MoE layer recorded in that
forward (``MoELayer.stats``: ``expert_load [E]`` and scalars, and ``MoELayer.aux_losses``) into
running sums kept as tensors on the layer's device: no host synchronisation per step. Every
``log_every_n_steps`` it sums them over ranks (one collective), divides, and logs the means over the
steps since the previous log:

* to every logger, ``moe/<layer>/<stat>``: each scalar statistic the layer records - for tokens-choice
  layers ``load_cv``, ``unused_experts``, ``dropped_fraction``, ``router_entropy``,
  ``mean_top_gate``, ...; for Soft MoE ``dispatch_entropy``, ``combine_entropy``,
  ``max_dispatch_weight``, ``tokens_per_slot``, ...; for a Mixture-of-Depths router
  (``moe/blocks.<i>.depth_router/...``) ``processed_fraction``, ``mean_gate`` and, in causal models,
  ``topc_agreement`` - each auxiliary loss (``moe/<layer>/aux/<name>``,
  weighted as in the training loss), and two figures of the interval's mean load:
  ``interval_load_cv`` and ``interval_unused_experts`` (the fraction of experts that got no token in the
  whole interval, on any rank);
* to TensorBoard loggers, a histogram of the fraction of tokens per expert
  (``moe/<layer>/expert_load``: bucket ``e`` centred on expert ``e``) and one image for all layers,
  ``moe/expert_load_heatmap`` (see :func:`load_heatmap`).

Validation figures are the same, accumulated over the whole validation epoch and logged at its end
under ``val_moe/``; the sanity-check validation is not logged.

Weighting: each forward counts with its number of real tokens (``stats["real_tokens"]``: padding counts in no
statistic; ``MoELayer.forward_tokens`` for a router that does not record it). The interval
figure of a per-token mean (router entropy, mean top gate, dropped fraction) is then the mean over
all tokens of the interval. ``expert_load`` is pooled: each forward's fractions count with the work it
routed (real tokens x ``mean_experts_per_token``, else x ``1 - dropped_fraction``), so the interval's load is
the share of all the interval's (kept) assignments each expert got, also when capacity drops a different
fraction in different forwards; so is a Mixture-of-Depths router's ``mean_gate`` (each forward counts with
the tokens its block processed). Figures of a whole forward (``load_cv``, ``unused_experts``) are averaged
with the token weights: the value of a typical forward, not of the interval as one batch - that is what
``interval_load_cv`` and ``interval_unused_experts`` give.

Checkpoints hold the sums of the training interval in progress (over all ranks; on resume the first rank takes
them): a run resumed inside an interval logs the figures of the uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning import Callback, LightningModule, Trainer
from lightning.fabric.loggers import TensorBoardLogger
from torch import Tensor, nn

from moekit.loggers import logging_step
from moekit.moe import RoutingModule, routing_modules
from moekit.moe.stats import REAL_TOKENS

__all__ = ["ExpertLoadMonitor", "RoutingStatsSums", "LayerFigures", "layer_label", "load_heatmap"]

SumOverRanks = Callable[[Tensor], Tensor]
"""Maps a tensor to its elementwise sum over all ranks (identity in a single process)."""

LOAD_KEY = "expert_load"
AUX_PREFIX = "aux/"
# Path segments that wrappers (FSDP, activation checkpointing, torch.compile) insert into module names.
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


@dataclass
class LayerFigures:
    """The figures of one MoE layer over an interval (or a validation epoch), over all ranks.

    Attributes:
        expert_load: ``[E]`` float CPU tensor, the share of the forwards' (kept) assignments each expert
            got, pooled over the forwards; None when the layer records no ``expert_load``.
        scalars: ``{name: value}``: every scalar statistic and ``aux/<loss>``, token-weighted means
            over the forwards, plus ``interval_load_cv`` and ``interval_unused_experts`` when
            ``expert_load`` is known.
        forwards: forwards that went into the figures (summed over ranks).
        tokens: tokens of those forwards (summed over ranks).
    """

    expert_load: Tensor | None
    scalars: dict[str, float] = field(default_factory=dict)
    forwards: int = 0
    tokens: int = 0


class RoutingStatsSums:
    """Token-weighted running sums of the routing statistics and auxiliary losses of MoE layers.

    The sums are tensors on the statistics' device, updated in place with no host synchronisation;
    the weights (token counts, known from shapes) are Python numbers. :meth:`compute` reduces both
    over ranks in one collective and returns the means.
    """

    def __init__(self) -> None:
        self._sums: dict[str, dict[str, Tensor]] = {}  # layer -> statistic -> sum of tokens * value
        self._tokens: dict[str, dict[str, float | Tensor]] = {}  # layer -> statistic -> sum of (real) tokens
        self._forwards: dict[str, int] = {}  # layer -> forwards added

    def __bool__(self) -> bool:
        return bool(self._forwards)

    def reset(self) -> None:
        self._sums.clear()
        self._tokens.clear()
        self._forwards.clear()

    def add(self, layer: str, stats: Mapping[str, Tensor], aux_losses: Mapping[str, Tensor], tokens: int) -> None:
        """Add one forward of ``layer``: its ``stats`` (``expert_load [E]`` and scalars), its weighted
        ``aux_losses`` (scalars; detached here) and its number of ``tokens`` (the weight). The weight is the
        forward's real tokens, ``stats["real_tokens"]`` (a device scalar: padding counts in no statistic), where
        the layer records it, else ``tokens``; ``expert_load``'s is the work it routed (:func:`_routed_work`)."""
        if not (isinstance(tokens, int) and tokens > 0):
            raise ValueError(
                f"RoutingStatsSums.add: tokens={tokens!r} for layer {layer!r} must be a positive int "
                "(the tokens of the forward, MoELayer.forward_tokens)"
            )
        real = stats.get(REAL_TOKENS)
        weight = tokens if real is None else real.detach().float()
        # a mean over a subset of the tokens counts with that subset: pooled over the interval
        subset_weights = {LOAD_KEY: _routed_work(stats, weight)}
        if "processed_fraction" in stats:  # Mixture-of-Depths: the mean gate of the processed tokens
            subset_weights["mean_gate"] = stats["processed_fraction"].detach().float() * weight
        sums = self._sums.setdefault(layer, {})
        weights = self._tokens.setdefault(layer, {})
        entries = [(k, v) for k, v in stats.items() if k != REAL_TOKENS]
        entries += [(AUX_PREFIX + name, value) for name, value in aux_losses.items()]
        for key, value in entries:
            w = subset_weights.get(key, weight)
            value = value.detach().float() * w
            if key in sums:
                if sums[key].shape != value.shape:
                    raise ValueError(
                        f"layer {layer!r} recorded {key} of shape {tuple(value.shape)} after "
                        f"{tuple(sums[key].shape)}; a layer's statistics must keep their shape within an interval"
                    )
                if sums[key].device != value.device:  # restored from a checkpoint onto the CPU
                    sums[key] = sums[key].to(value.device)
                sums[key].add_(value)
                weights[key] = weights[key] + w
            else:
                sums[key] = value  # a new tensor: never an alias of the layer's own record
                weights[key] = w
        self._forwards[layer] = self._forwards.get(layer, 0) + 1

    def compute(self, sum_over_ranks: SumOverRanks | None = None) -> dict[str, LayerFigures]:
        """The means of everything added since the last :meth:`reset`, ``{layer: LayerFigures}``.

        ``sum_over_ranks`` sums a tensor over all ranks (under DDP/FSDP: an all-reduce); every rank
        must call :meth:`compute` at the same point with the same layers and statistics (they run
        the same model). This is the one host synchronisation of an interval.
        """
        layout, values, reduced_weights, forwards = self._reduced(sum_over_ranks)
        if not layout:
            return {}
        figures = {layer: LayerFigures(expert_load=None, forwards=n) for layer, n in forwards.items()}
        for (layer, key), total, weight in zip(layout, values, reduced_weights):
            mean = (total / weight if weight > 0 else torch.zeros_like(total)).float()  # load: nothing kept
            figure = figures[layer]
            if key not in ("mean_gate", LOAD_KEY):  # these count a subset of the tokens
                figure.tokens = max(figure.tokens, round(weight))
            if key == LOAD_KEY:
                figure.expert_load = mean
            elif mean.numel() == 1:
                figure.scalars[key] = mean.item()
        for figure in figures.values():
            if figure.expert_load is not None:
                load = figure.expert_load.double()
                figure.scalars["interval_load_cv"] = (load.std(unbiased=False) / load.mean()).item()
                figure.scalars["interval_unused_experts"] = (load == 0).double().mean().item()
        return figures

    def _reduced(self, sum_over_ranks: SumOverRanks | None):
        """``(layout, sums, weights, forwards)``: the ``(layer, key)`` entries in order, their sums (float64 CPU
        tensors, flat) and weights, and each layer's forwards, all summed over ranks (one collective)."""
        layout = [(layer, key) for layer in sorted(self._sums) for key in sorted(self._sums[layer])]
        if not layout:
            return [], [], [], {}
        device = self._sums[layout[0][0]][layout[0][1]].device
        layers = sorted(self._forwards)
        weights = [self._tokens[layer][key] for layer, key in layout] + [float(self._forwards[x]) for x in layers]
        flat = torch.cat(
            [self._sums[layer][key].reshape(-1).to(device) for layer, key in layout]
            + [torch.as_tensor(w, dtype=torch.float32).reshape(1).to(device) for w in weights]
        )
        if sum_over_ranks is not None:
            flat = sum_over_ranks(flat)
        flat = flat.cpu().double()
        sizes = [self._sums[layer][key].numel() for layer, key in layout]
        reduced_weights = flat[sum(sizes) :].tolist()
        forwards = dict(zip(layers, (round(n) for n in reduced_weights[len(layout) :])))
        return layout, list(flat[: sum(sizes)].split(sizes)), reduced_weights[: len(layout)], forwards

    def state_dict(self, sum_over_ranks: SumOverRanks | None = None) -> dict[str, Any]:
        """The running sums over all ranks (``sum_over_ranks``: a collective, every rank calls it), on the CPU."""
        layout, values, weights, forwards = self._reduced(sum_over_ranks)
        sums: dict[str, dict[str, Tensor]] = {}
        tokens: dict[str, dict[str, float]] = {}
        for (layer, key), total, weight in zip(layout, values, weights):
            sums.setdefault(layer, {})[key] = total.float().reshape(self._sums[layer][key].shape)
            tokens.setdefault(layer, {})[key] = weight
        return {"sums": sums, "tokens": tokens, "forwards": forwards}

    def load_state_dict(self, state: Mapping[str, Any], keep: bool = True) -> None:
        """Restore :meth:`state_dict`'s sums (CPU tensors: each moves to the device of the first value added to it).
        ``keep=False`` (data-parallel ranks other than the first, the saved sums being those of all ranks) restores
        the same entries at zero, so the next :meth:`compute` counts the forwards before the checkpoint once."""
        self.reset()
        for layer, entries in state["sums"].items():
            for key, total in entries.items():
                self._sums.setdefault(layer, {})[key] = total.float().clone() if keep else torch.zeros_like(total)
                self._tokens.setdefault(layer, {})[key] = float(state["tokens"][layer][key]) if keep else 0.0
        self._forwards = {layer: int(n) if keep else 0 for layer, n in state["forwards"].items()}


def _routed_work(stats: Mapping[str, Tensor], tokens: float | Tensor) -> float | Tensor:
    """The assignments a forward of ``tokens`` real tokens routed, up to a factor fixed per layer (top-k): the
    weight of its ``expert_load``, which makes the interval's load the pooled share of the assignments."""
    per_token = stats.get("mean_experts_per_token")  # experts-choice, strictly balanced gating
    if per_token is None and "dropped_fraction" in stats:  # tokens-choice: of the assignments (0 for Soft MoE)
        per_token = 1.0 - stats["dropped_fraction"]
    return tokens if per_token is None else per_token.detach().float() * tokens


# Diverging colour map of the heatmap: blue (no tokens) - light grey (uniform load) - red (2x uniform or more).
_COLD = (0.23, 0.30, 0.75)
_NEUTRAL = (0.92, 0.92, 0.92)
_HOT = (0.71, 0.02, 0.15)


def load_heatmap(loads: Sequence[Tensor], max_width: int = 512) -> Tensor:
    """One image of the expert load of several layers: ``[3, H, W]`` float in ``[0, 1]``.

    Row ``l`` (top to bottom) is ``loads[l]`` (``[E_l]`` fractions of tokens), one cell per expert
    (left to right), coloured by the load relative to uniform ``r = load * E_l`` on a linear
    diverging scale: blue for ``r = 0`` (no token), light grey for ``r = 1``, red for ``r >= 2``.
    Layers with fewer experts than the widest are padded with black cells. Cells are scaled up to
    about ``max_width`` pixels in all (between 2 and 32 pixels wide, at least 16 high).
    """
    if not loads:
        raise ValueError("load_heatmap: loads is empty; pass one [num_experts] tensor per layer")
    width = max(load.numel() for load in loads)
    ratio = torch.full((len(loads), width), float("nan"))
    for row, load in enumerate(loads):
        ratio[row, : load.numel()] = load.detach().float().cpu().reshape(-1) * load.numel()
    colours = torch.tensor([_COLD, _NEUTRAL, _HOT])  # [3 anchors, RGB]
    position = (ratio / 2).clamp(0.0, 1.0).nan_to_num(0.0) * 2  # 0, 1, 2 at the anchors
    lower = position.floor().clamp(max=1).long()
    frac = (position - lower).unsqueeze(-1)
    rgb = colours[lower] * (1 - frac) + colours[lower + 1] * frac  # [L, E, 3]
    rgb[ratio.isnan()] = 0.0
    cell_w = max(2, min(32, max_width // width))
    cell_h = max(cell_w, 16)
    image = rgb.repeat_interleave(cell_h, dim=0).repeat_interleave(cell_w, dim=1)
    return image.permute(2, 0, 1).contiguous()


def layer_label(name: str, layer: nn.Module) -> str:
    """The name logs and reports give a routing module found at ``name`` in a model: the qualified name without the
    segments wrappers insert (a wrapped model logs under the same keys), or the module's class name where it is the
    model itself (one bare MoE layer, whose qualified name is empty)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS) or type(layer).__name__


class ExpertLoadMonitor(Callback):
    """Logs the expert load and routing statistics of every MoE layer (see the module docstring).

    Layers are named relative to ``pl_module.net`` when the module has one (the moekit tasks), else
    relative to the module: ``moe/blocks.3.mlp/load_cv``; a network that is one bare layer by its class
    (``moe/TopKMoE/load_cv``, :func:`layer_label`).

    Args:
        log_every_n_steps: optimizer steps per training interval; None uses the trainer's
            ``log_every_n_steps`` (0 there turns training logging off, as for Lightning's metrics).
    """

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        valid = isinstance(log_every_n_steps, int) and not isinstance(log_every_n_steps, bool) and log_every_n_steps > 0
        if log_every_n_steps is not None and not valid:
            raise ValueError(
                f"ExpertLoadMonitor: log_every_n_steps={log_every_n_steps!r} must be a positive int, "
                "or None (null) for the trainer's log_every_n_steps"
            )
        self.log_every_n_steps = log_every_n_steps
        self.train_sums = RoutingStatsSums()
        self.val_sums = RoutingStatsSums()
        self._layers: dict[str, RoutingModule] = {}
        self._last_record: dict[str, dict[str, Tensor]] = {}  # the stats dict each layer had when last added
        self._last_logged_step = -1
        self._sum_over_ranks: SumOverRanks | None = None  # of the fit in progress, for a checkpoint's sums
        self._restored: dict[str, Any] | None = None  # a checkpoint's state, until its fit starts training

    # -- gathering -------------------------------------------------------------------------------
    def watch(self, module: nn.Module) -> dict[str, RoutingModule]:
        """Watch the MoE layers and Mixture-of-Depths routers of ``module`` (of ``module.net`` when it has
        one), named without the segments wrappers insert; called at the start of training and of each
        validation epoch. Returns ``{name: layer}``."""
        root = module.net if isinstance(getattr(module, "net", None), nn.Module) else module
        self._layers = {layer_label(name, layer): layer for name, layer in routing_modules(root)}
        return self._layers

    def accumulate(self, sums: RoutingStatsSums) -> None:
        """Add the latest forward of every watched layer to ``sums``, skipping a layer that did not
        run since its record was last added (it keeps its previous record, which must not count twice)."""
        for name, layer in self._layers.items():
            record = layer.stats  # the same dict object until the layer's next forward
            if record is self._last_record.get(name) or layer.forward_tokens <= 0:
                continue
            self._last_record[name] = record
            sums.add(name, record, layer.aux_losses, layer.forward_tokens)

    # -- training --------------------------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.watch(pl_module)
        self.train_sums.reset()
        self._sum_over_ranks = _sum_over_ranks(trainer)
        state, self._restored = self._restored, None
        if state and state.get("train_sums"):  # the interval a checkpoint cut: its steps count in its figures
            self.train_sums.load_state_dict(state["train_sums"], keep=trainer.is_global_zero)
        # The step training starts from (a resumed run's) was logged before, or is 0: with gradient accumulation
        # its micro-batches before the first optimizer step of this run must not log a row of their own.
        self._last_logged_step = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if not self._layers or not every:
            return
        self.accumulate(self.train_sums)
        step = trainer.global_step  # optimizer steps done, this batch's included
        if step == 0 or step % every or step == self._last_logged_step or not self.train_sums:
            return
        self._last_logged_step = step
        figures = self.train_sums.compute(_sum_over_ranks(trainer))
        self.train_sums.reset()
        self._log(trainer, "moe", figures)

    def state_dict(self) -> dict[str, Any]:
        """The sums of the training interval in progress, over all ranks (a collective: Lightning builds a checkpoint
        on every rank), so that a run resumed from the checkpoint logs the figures of the uninterrupted run."""
        return {"train_sums": self.train_sums.state_dict(self._sum_over_ranks) if self.train_sums else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)  # applied when training starts: one rank keeps the sums of all ranks

    # -- validation ------------------------------------------------------------------------------
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.watch(pl_module)
        self.val_sums.reset()

    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not trainer.sanity_checking:
            self.accumulate(self.val_sums)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not self.val_sums:
            return
        figures = self.val_sums.compute(_sum_over_ranks(trainer))
        self.val_sums.reset()
        self._log(trainer, "val_moe", figures)

    # -- logging ---------------------------------------------------------------------------------
    def _log(self, trainer: Trainer, prefix: str, figures: Mapping[str, LayerFigures]) -> None:
        """Scalars to every logger, histograms and the heatmap to TensorBoard loggers, at the step
        Lightning logs its own metrics at (loggers write on rank 0 only)."""
        step = logging_step(trainer)
        scalars = {
            f"{prefix}/{layer}/{name}": value
            for layer, figure in figures.items()
            for name, value in figure.scalars.items()
        }
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=step)
        boards = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
        loads = {layer: figure.expert_load for layer, figure in figures.items() if figure.expert_load is not None}
        if not boards or not loads or not trainer.is_global_zero:
            return
        heatmap = load_heatmap([loads[name] for name in self._layers if name in loads])  # rows in model order
        for board in boards:
            writer = board.experiment
            for layer, load in loads.items():
                _add_expert_histogram(writer, f"{prefix}/{layer}/{LOAD_KEY}", load, step)
            writer.add_image(f"{prefix}/{LOAD_KEY}_heatmap", heatmap, step, dataformats="CHW")


def _sum_over_ranks(trainer: Trainer) -> SumOverRanks | None:
    if trainer.world_size <= 1:
        return None
    # on the strategy's device: sums restored from a checkpoint sit on the CPU until a forward adds to them (NCCL)
    return lambda tensor: trainer.strategy.reduce(tensor.to(trainer.strategy.root_device), reduce_op="sum")


def _add_expert_histogram(writer, tag: str, load: Tensor, step: int) -> None:
    """A TensorBoard histogram with one bucket per expert: bucket ``e`` spans ``[e - 0.5, e + 0.5]``
    and holds expert ``e``'s fraction of the tokens."""
    experts = torch.arange(load.numel(), dtype=torch.float64)
    weights = load.double()
    writer.add_histogram_raw(
        tag,
        min=-0.5,
        max=load.numel() - 0.5,
        num=weights.sum().item(),
        sum=(experts * weights).sum().item(),
        sum_squares=(experts.square() * weights).sum().item(),
        bucket_limits=(experts + 0.5).tolist(),
        bucket_counts=weights.tolist(),
        global_step=step,
    )
