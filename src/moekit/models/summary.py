"""Parameter and compute summary of a (MoE) model: total, expert and active parameters, forward FLOPs.

FLOPs are measured, not estimated: :func:`model_summary` runs one eval-mode forward under
``torch.utils.flop_counter.FlopCounterMode``, so they count what actually runs (Soft MoE's slots,
experts-choice buffers, the tokens top-k routed, the routers, attention) - matmuls, convolutions and
attention only, as the counter does (norms, activations and softmaxes are not counted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from moekit.moe import ExpertBank, MoELayer, moe_layers

__all__ = ["MoELayerSummary", "ModelSummary", "model_summary"]


@dataclass(frozen=True)
class MoELayerSummary:
    """One MoE layer of a :class:`ModelSummary`.

    Attributes:
        name: qualified module name, e.g. ``"blocks.6.mlp"``.
        layer: registry name of the layer type (``"soft_moe"``, ``"top_k"``, ...).
        num_experts: routed experts.
        tokens: tokens per sequence the layer saw in the measured forward.
        expert_rows_per_token: expert-MLP applications per token (``layer.expert_rows_per_token(tokens)``).
        expert_params: parameters of all its experts (shared experts included).
        params_per_expert: parameters of one routed expert.
        active_params_per_token: ``params_per_expert * expert_rows_per_token``.
        flops_per_image: forward FLOPs of the whole layer (router, dispatch, experts, combine) per image.
    """

    name: str
    layer: str
    num_experts: int
    tokens: int
    expert_rows_per_token: float
    expert_params: int
    params_per_expert: int
    active_params_per_token: float
    flops_per_image: float


@dataclass(frozen=True)
class ModelSummary:
    """What :func:`model_summary` returns; ``str(summary)`` is a short table.

    Attributes:
        input_size: ``(C, H, W)`` of the measured forward.
        total_params: every parameter.
        expert_params: parameters inside expert banks.
        active_params_per_token: parameters one token uses: everything outside the experts, plus per MoE
            layer one expert's parameters times its ``expert_rows_per_token``. Equals ``total_params``
            for a dense model.
        flops_per_image: forward FLOPs per image (eval mode).
        moe_layers: one :class:`MoELayerSummary` per MoE layer, in module order.
    """

    input_size: tuple[int, ...]
    total_params: int
    expert_params: int
    active_params_per_token: float
    flops_per_image: float
    moe_layers: tuple[MoELayerSummary, ...]

    def format(self) -> str:
        lines = [
            f"input {'x'.join(map(str, self.input_size))}",
            f"  total params           {_human(self.total_params):>9}",
            f"  expert params          {_human(self.expert_params):>9}",
            f"  active params / token  {_human(self.active_params_per_token):>9}",
            f"  FLOPs / image          {_human(self.flops_per_image):>9}",
        ]
        if self.moe_layers:
            width = max(len("MoE layer"), *(len(s.name) for s in self.moe_layers))
            lines.append(
                f"  {'MoE layer':<{width}}  {'type':<14} {'experts':>7} {'tokens':>6} {'rows/tok':>8} "
                f"{'params':>9} {'active/tok':>10} {'FLOPs/img':>9}"
            )
            for s in self.moe_layers:
                lines.append(
                    f"  {s.name:<{width}}  {s.layer:<14} {s.num_experts:>7} {s.tokens:>6} "
                    f"{s.expert_rows_per_token:>8.3g} {_human(s.expert_params):>9} "
                    f"{_human(s.active_params_per_token):>10} {_human(s.flops_per_image):>9}"
                )
        return "\n".join(lines)

    __str__ = format


def _human(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.4g}"


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# The CPU kernel of F.scaled_dot_product_attention, which FlopCounterMode has no formula for.
_EXTRA_FLOP_FORMULAS = {
    op: _cpu_sdpa_flops
    for op in (getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None),)
    if op is not None
}


def _param_count(params) -> int:
    return sum(p.numel() for p in params)


def _first_tensor(inputs: Sequence) -> Tensor | None:
    return next((x for x in inputs if isinstance(x, Tensor)), None)


@torch.no_grad()
def model_summary(model: nn.Module, input_size: Sequence[int], batch_size: int = 2) -> ModelSummary:
    """Count the parameters of ``model`` and measure its forward FLOPs on ``batch_size`` random
    images of ``input_size = (C, H, W)`` in eval mode (the model's mode is restored afterwards).

    Works for any image model; the MoE numbers come from the :class:`~moekit.moe.MoELayer` modules.
    Layers whose compute depends on the batch (capacity factors over all tokens of a forward) are
    measured at ``batch_size``.
    """
    if len(input_size) != 3:
        raise ValueError(f"input_size={tuple(input_size)} must be (channels, height, width)")
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    layers = list(moe_layers(model))
    tokens: dict[str, int] = {}

    def record_tokens(name: str):
        def hook(module: nn.Module, inputs) -> None:
            x = _first_tensor(inputs)
            tokens[name] = x.shape[1] if x is not None and x.dim() == 3 else 0

        return hook

    was_training = model.training
    handles = [layer.register_forward_pre_hook(record_tokens(name)) for name, layer in layers]
    counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS)
    try:
        model.eval()
        with counter:
            model(torch.randn(batch_size, *input_size, device=device, dtype=dtype))
        flops = counter.get_flop_counts()
        root = type(model).__name__
        layer_summaries = tuple(
            _summarize_layer(name, layer, tokens.get(name, 0), flops.get(f"{root}.{name}", {}), batch_size)
            for name, layer in layers
        )
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)

    total = _param_count(model.parameters())
    experts = _param_count(p for m in model.modules() if isinstance(m, ExpertBank) for p in m.parameters())
    return ModelSummary(
        input_size=tuple(input_size),
        total_params=total,
        expert_params=experts,
        active_params_per_token=total - experts + sum(s.active_params_per_token for s in layer_summaries),
        flops_per_image=counter.get_total_flops() / batch_size,
        moe_layers=layer_summaries,
    )


def _summarize_layer(name: str, layer: MoELayer, tokens: int, flops: dict, batch_size: int) -> MoELayerSummary:
    routed = layer.experts
    params_per_expert = _param_count(routed.parameters()) // routed.num_experts
    rows = float(layer.expert_rows_per_token(tokens)) if tokens else 0.0
    return MoELayerSummary(
        name=name,
        layer=getattr(layer, "registry_name", type(layer).__name__),
        num_experts=routed.num_experts,
        tokens=tokens,
        expert_rows_per_token=rows,
        expert_params=_param_count(p for m in layer.modules() if isinstance(m, ExpertBank) for p in m.parameters()),
        params_per_expert=params_per_expert,
        active_params_per_token=params_per_expert * rows,
        flops_per_image=sum(flops.values()) / batch_size,
    )
