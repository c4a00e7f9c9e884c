"""A routing report after the test phase of a run whose model has MoE layers: how each layer used its experts on
the test split.

:class:`RoutingReport` gathers, over the test phase, what every MoE layer records per forward (the
:class:`~moekit.callbacks.moe_stats.RoutingStatsSums` of the expert-load monitor, reduced over ranks) and writes
``routing_report.md`` and ``routing_report.png`` (one row of experts per layer, coloured by load relative to
uniform: blue no tokens, grey uniform, red twice uniform or more) into the run folder; ``scripts/train.py`` puts
the same figures in ``results.json`` (``routing``). Per layer:

- ``unused experts``: experts that received no token of the whole test split;
- ``load CV`` and ``max / mean``: the coefficient of variation of the experts' shares and the busiest expert's
  share over the uniform one (0 and 1 for a perfectly even load);
- ``effective experts``: ``exp(entropy of the shares)``, the number of equally busy experts with the same spread;
- ``dropped``: the layer's ``dropped_fraction`` - tokens-choice: the fraction of routed assignments capacity dropped;
  experts-choice and strictly balanced: the fraction of tokens no expert took; ``router entropy``: the mean entropy
  of the per-token router distribution (tokens-choice layers), or of the slots' dispatch weights (Soft MoE).
- ``tokens``: the real tokens of the test split (padding excluded, as from every figure) the layer routed.

For image classifiers the report also says which classes each expert serves (the V-MoE paper's analysis): the
tokens each expert took (Soft MoE: its slots' dispatch weights), counted by the label of their image; per
layer, each expert's main class and its share, and how many experts take most of their work from one class
(``routing_classes.png``: per layer, a class x expert block, darker for a larger share of the expert's tokens).

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
CLASSES_FILE = "routing_classes.png"


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
    top_class: list[str] | None = None  # each expert's main class (image classifiers)
    top_class_share: list[float] | None = None  # the share of the expert's tokens from that class

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
        self._class_expert: dict[str, Tensor] = {}  # layer -> [classes, experts] weight of each class's tokens
        self._layers: dict = {}

    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._layers = self._gather.watch(pl_module)
        self._sums.reset()
        self._class_expert = {}

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._gather.accumulate(self._sums)
        num_classes = getattr(getattr(pl_module, "net", None), "num_classes", None)
        labels = batch[1] if isinstance(batch, (tuple, list)) and len(batch) == 2 else None
        if not num_classes or not isinstance(labels, Tensor) or labels.dim() != 1:
            return  # not an image classifier: no classes to count
        for name, layer in self._layers.items():
            weights_NE = layer.token_expert_weights()
            if weights_NE is None or weights_NE.shape[0] % labels.numel():
                continue
            tokens_per_image = weights_NE.shape[0] // labels.numel()
            classes_N = labels.repeat_interleave(tokens_per_image)  # tokens are flattened batch-major
            counts_CE = self._class_expert.setdefault(
                name, torch.zeros(num_classes, weights_NE.shape[1], dtype=torch.float64, device=weights_NE.device)
            )
            counts_CE.index_add_(0, classes_N, weights_NE.double())

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._sums:
            return
        figures = self._sums.compute(_sum_over_ranks(trainer))
        self.layers = {}
        for name in self._layers:  # model order; Mixture-of-Depths routers have no experts
            figure = figures.get(name)
            if figure is not None and figure.expert_load is not None:
                self.layers[name] = layer_routing(figure.expert_load, figure.scalars, figure.tokens)
                if name in self._class_expert:
                    names = getattr(pl_module, "class_names", None) or getattr(trainer.datamodule, "label_names", None)
                    self._add_classes(self.layers[name], _sum_over_ranks(trainer), self._class_expert[name], names)
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

    @staticmethod
    def _add_classes(layer: LayerRouting, reduce, counts_CE: Tensor, names) -> None:
        """Each expert's main class and its share, from the class x expert weights ``counts_CE``."""
        counts_CE = (reduce(counts_CE) if reduce is not None else counts_CE).cpu()
        names = list(names or []) or [str(c) for c in range(counts_CE.shape[0])]
        shares_CE = counts_CE / counts_CE.sum(0, keepdim=True).clamp_min(1e-12)
        share_E, class_E = shares_CE.max(0)
        layer.top_class = [names[c] for c in class_E.tolist()]
        layer.top_class_share = share_E.tolist()
        layer.class_shares = shares_CE  # for the picture; not in the record

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
        classes = {name: r for name, r in self.layers.items() if r.top_class is not None}
        if classes:
            lines += ["", "## The classes each expert serves", ""]
            for name, r in classes.items():
                ranked = sorted(range(r.experts), key=lambda e: -r.top_class_share[e])
                specialised = sum(share > 0.5 for share in r.top_class_share)
                examples = ", ".join(f"{e}: {r.top_class[e]} {r.top_class_share[e]:.0%}" for e in ranked[:8])
                lines.append(
                    f"- `{name}`: {specialised} of {r.experts} experts take more than half of their tokens from one "
                    f"class; the most specialised (expert: main class, its share) {examples}"
                )
            lines += ["", f"![classes per expert]({CLASSES_FILE})"]
        lines += [
            "",
            f"![expert load]({HEATMAP_FILE})",
            "",
            "One row per layer (in model order), one cell per expert: blue got no token, grey the uniform share, "
            "red twice the uniform share or more.",
            "",
        ]
        write_text_atomic(self.dirpath / REPORT_FILE, "\n".join(lines))
        heatmap = load_heatmap([torch.tensor(r.expert_load) for r in self.layers.values()])  # [3, H, W] in [0, 1]
        _save_png(self.dirpath / HEATMAP_FILE, (heatmap.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy())
        blocks = [getattr(r, "class_shares", None) for r in classes.values()]
        if blocks:  # per layer a [classes, experts] block, white 0 to black 1, a white row between layers
            width = max(b.shape[1] for b in blocks)
            rows = [torch.cat([b, torch.zeros(1, b.shape[1])]) for b in blocks]
            grid = torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in rows])
            cell = max(2, min(16, 512 // width))
            image = (255 * (1 - grid)).round().to(torch.uint8).repeat_interleave(cell, 0).repeat_interleave(cell, 1)
            _save_png(self.dirpath / CLASSES_FILE, image.numpy())


def _save_png(path: Path, pixels) -> None:
    from PIL import Image

    with atomic_write(path, "wb") as file:
        Image.fromarray(pixels).save(file, format="PNG")
