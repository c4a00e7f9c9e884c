"""A routing report at the end of every run: how each MoE layer used its experts on the test split.

:class:`RoutingReport` gathers, over the test phase, what every MoE layer records per forward (the
:class:`~moekit.callbacks.moe_stats.RoutingStatsSums` of the expert-load monitor, reduced over ranks) and writes
``routing_report.md`` and ``routing_report.png`` (one row of experts per layer, coloured by load relative to
uniform: blue no tokens, grey uniform, red twice uniform or more) into the run folder; ``scripts/train.py`` puts
the same figures in ``results.json`` (``routing``). Per layer:

- ``unused experts``: experts that received no token of the whole test split;
- ``load CV`` and ``max / mean``: the coefficient of variation of the experts' shares and the busiest expert's
  share over the uniform one (1 and 1 for a perfectly even load);
- ``effective experts``: ``exp(entropy of the shares)``, the number of equally busy experts with the same spread;
- ``dropped``: the fraction of routed assignments capacity dropped; ``router entropy``: the mean entropy of the
  per-token router distribution (tokens-choice layers), or of the slots' dispatch weights (Soft MoE).

A layer whose effective experts fall to a quarter of its experts or fewer (1.5 at most for 2 to 6 experts) has
collapsed onto a few of them; the run ends with a warning naming it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from lightning import Callback, LightningModule, Trainer
from torch import Tensor

from moekit.utils.atomic import atomic_write, write_text_atomic

from .moe_stats import ExpertLoadMonitor, RoutingStatsSums, _sum_over_ranks, load_heatmap

__all__ = ["LayerRouting", "RoutingReport", "layer_routing"]

log = logging.getLogger("moekit")

REPORT_FILE = "routing_report.md"
HEATMAP_FILE = "routing_report.png"


@dataclass
class LayerRouting:
    """The routing of one MoE layer over the test split (see the module docstring)."""

    experts: int
    tokens: int
    unused_experts: int
    load_cv: float
    max_over_mean: float
    effective_experts: float
    dropped_fraction: float | None
    router_entropy: float | None
    expert_load: list[float]

    @property
    def collapsed(self) -> bool:
        return self.experts > 1 and self.effective_experts <= max(1.5, self.experts / 4)


def layer_routing(load: Tensor, scalars: dict[str, float], tokens: int) -> LayerRouting:
    """The figures of a layer from its expert shares ``load`` (``[E]``, summing to 1) and its mean statistics."""
    load = load.double()
    experts = load.numel()
    share = load / load.sum().clamp_min(1e-12)
    entropy = -(share * share.clamp_min(1e-300).log()).sum().item()
    return LayerRouting(
        experts=experts,
        tokens=tokens,
        unused_experts=int((share == 0).sum()),
        load_cv=(share.std(unbiased=False) / share.mean()).item(),
        max_over_mean=(share.max() * experts).item(),
        effective_experts=math.exp(entropy),
        dropped_fraction=scalars.get("dropped_fraction"),
        router_entropy=scalars.get("router_entropy", scalars.get("dispatch_entropy")),
        expert_load=share.tolist(),
    )


def _cell(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}g}"


class RoutingReport(Callback):
    """Writes ``<dirpath>/routing_report.md`` and ``.png`` after the test phase (see the module docstring).

    Args:
        dirpath: the run folder (Hydra: ``${paths.output_dir}``).
    Attributes:
        layers: ``{layer: LayerRouting}`` of the latest test, in model order (empty before one).
    """

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)
        self.layers: dict[str, LayerRouting] = {}
        self._gather = ExpertLoadMonitor()
        self._sums = RoutingStatsSums()

    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._gather.watch(pl_module)
        self._sums.reset()

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._gather.accumulate(self._sums)

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._sums:
            return
        figures = self._sums.compute(_sum_over_ranks(trainer))
        self.layers = {}
        for name in self._gather.watch(pl_module):  # model order; Mixture-of-Depths routers have no experts
            figure = figures.get(name)
            if figure is not None and figure.expert_load is not None:
                self.layers[name] = layer_routing(figure.expert_load, figure.scalars, figure.tokens)
        if not self.layers or not trainer.is_global_zero:
            return
        self.write()
        for name, layer in self.layers.items():
            if layer.collapsed:
                busiest = sorted(layer.expert_load, reverse=True)[: max(1, round(layer.effective_experts))]
                log.warning(
                    "routing collapse in %s: its %d busiest of %d experts took %.0f%% of the test tokens (effective "
                    "experts %.1f); raise the recipe's balancing-loss weight (e.g. moe.switch_loss_weight) or its "
                    "router noise; details in %s",
                    name,
                    len(busiest),
                    layer.experts,
                    100 * sum(busiest),
                    layer.effective_experts,
                    self.dirpath / REPORT_FILE,
                )

    def summary(self) -> dict[str, dict]:
        """The figures for the run record: ``{layer: {figure: value}}``."""
        return {name: asdict(layer) for name, layer in self.layers.items()}

    def write(self) -> None:
        lines = [
            "# Routing on the test split",
            "",
            "| layer | experts | tokens | unused experts | load CV | max / mean | effective experts | dropped | "
            "router entropy |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in self.layers.items():
            flag = " (collapsed)" if r.collapsed else ""
            lines.append(
                f"| `{name}`{flag} | {r.experts} | {r.tokens} | {r.unused_experts} | {_cell(r.load_cv)} | "
                f"{_cell(r.max_over_mean)} | {_cell(r.effective_experts)} | {_cell(r.dropped_fraction)} | "
                f"{_cell(r.router_entropy)} |"
            )
        lines += [
            "",
            f"![expert load]({HEATMAP_FILE})",
            "",
            "One row per layer (in model order), one cell per expert: blue got no token, grey the uniform share, "
            "red twice the uniform share or more.",
            "",
        ]
        write_text_atomic(self.dirpath / REPORT_FILE, "\n".join(lines))
        from PIL import Image

        heatmap = load_heatmap([torch.tensor(r.expert_load) for r in self.layers.values()])  # [3, H, W] in [0, 1]
        pixels = (heatmap.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
        with atomic_write(self.dirpath / HEATMAP_FILE, "wb", suffix=".tmp") as file:
            Image.fromarray(pixels).save(file, format="PNG")
