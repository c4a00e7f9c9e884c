"""The base class of every MoE layer, the timm ``Mlp`` keyword contract, and the helpers that gather
auxiliary losses and routing statistics from a whole model.

Every layer maps ``[batch, tokens, dim] -> [batch, tokens, out_dim]`` and accepts the constructor
keywords of ``timm.layers.Mlp`` so that ``timm.models.vision_transformer.Block(mlp_layer=...)`` can
build it. After each forward a layer holds:

* ``aux_losses``: ``{name: weighted scalar}`` - the terms to add to the training loss (only the losses
  whose weight is non-zero appear);
* ``stats``: ``{name: detached tensor}`` - routing statistics of that forward, computed on device
  without host synchronisation (scalars, or ``[num_experts]`` vectors such as ``expert_load``). They
  are computed when first read (a training loop that logs every N steps pays for them every N steps)
  from the routing tensors the forward kept;
* ``forward_tokens``: the tokens that forward routed (``batch * tokens``, padding included), the
  weight of its statistics when a reader averages them over forwards of different sizes;
* ``router_logit_checksum``: the sum of that forward's router logits as a device scalar (None for
  layers without learned logits), finite exactly when every logit was; :meth:`MoELayer.router_logits_finite`
  reads it (a host sync, for when a step has already gone bad).

:func:`collect_moe_outputs` gathers both from any model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

__all__ = [
    "MoELayer",
    "MlpSpec",
    "MoEOutputs",
    "collect_moe_outputs",
    "moe_layers",
    "update_balancing_biases",
    "discard_balancing_updates",
    "require_causal",
    "register_moe_layer",
    "get_moe_layer",
    "list_moe_layers",
]

ActLayer = str | type[nn.Module] | Callable[[], nn.Module]


def _pair(value, name: str):
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name}={value!r}: expected a single value or a pair (first layer, second layer)")
        return tuple(value)
    return value, value


@dataclass(frozen=True)
class MlpSpec:
    """The timm ``Mlp`` keywords, normalised: hidden/out sizes resolved, ``bias`` and ``drop`` as pairs."""

    in_features: int
    hidden_features: int
    out_features: int
    act_layer: ActLayer
    bias: tuple[bool, bool]
    drop: tuple[float, float]

    @classmethod
    def from_mlp_kwargs(
        cls,
        in_features: int,
        hidden_features: int | None,
        out_features: int | None,
        act_layer: ActLayer,
        norm_layer,
        bias,
        drop,
        use_conv: bool,
        layer_name: str,
    ) -> MlpSpec:
        if not isinstance(in_features, int) or in_features <= 0:
            raise ValueError(f"{layer_name}: in_features={in_features!r} must be a positive int (the token dim)")
        hidden = in_features * 4 if hidden_features is None else hidden_features
        out = in_features if out_features is None else out_features
        for name, value in (("hidden_features", hidden), ("out_features", out)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{layer_name}: {name}={value!r} must be a positive int")
        if use_conv:
            raise ValueError(
                f"{layer_name}: use_conv=True is not supported; MoE layers take token sequences "
                "[batch, tokens, dim]. Use use_conv=False."
            )
        if norm_layer is not None:
            raise ValueError(
                f"{layer_name}: norm_layer={norm_layer!r} (a norm inside the MLP) is not supported by MoE experts. "
                "Pass norm_layer=None (for timm Blocks: scale_mlp_norm=False)."
            )
        bias_pair = tuple(bool(b) for b in _pair(bias, "bias"))
        drop_pair = tuple(float(d) for d in _pair(drop, "drop"))
        for d in drop_pair:
            if not 0.0 <= d < 1.0:
                raise ValueError(f"{layer_name}: drop={drop!r} must lie in [0, 1)")
        return cls(in_features, hidden, out, act_layer, bias_pair, drop_pair)

    def expert_bank(
        self,
        num_experts: int,
        hidden_features: int | None = None,
        *,
        gated: bool = False,
        init: str = "independent",
        init_std: float | None = None,
        kernel: str = "auto",
        device=None,
        dtype=None,
    ):
        """An :class:`~moekit.moe.experts.ExpertBank` of ``num_experts`` MLPs with these sizes,
        activation, biases and dropout (``hidden_features`` overrides the hidden size)."""
        from .experts import ExpertBank

        return ExpertBank(
            num_experts,
            self.in_features,
            hidden_features or self.hidden_features,
            self.out_features,
            act_layer=self.act_layer,
            gated=gated,
            bias=self.bias,
            drop=self.drop,
            init=init,
            init_std=init_std,
            kernel=kernel,
            device=device,
            dtype=dtype,
        )


class MoELayer(nn.Module):
    """Base of all MoE layers: holds the latest ``aux_losses`` and ``stats`` and the causality flag.

    Subclasses implement ``forward(x: [batch, tokens, dim], ...) -> [batch, tokens, out_dim]`` and
    call :meth:`_record` once per forward.
    """

    def __init__(self, compute_stats: bool = True) -> None:
        super().__init__()
        self.compute_stats = compute_stats
        self.aux_losses: dict[str, Tensor] = {}
        self.forward_tokens = 0
        self.router_logit_checksum: Tensor | None = None
        self._stats_fn: Callable[[], dict[str, Tensor]] | None = None
        self._stats: dict[str, Tensor] = {}

    @property
    def causal_safe(self) -> bool:
        """True when the output of each token depends on that token alone (given the weights), so
        the layer can sit in a causal language model. Layers that mix tokens (Soft MoE, experts-choice,
        BASE, capacity limits over a batch) return False."""
        return False

    def expert_rows_per_token(self, num_tokens: int) -> float:
        """Average number of expert-MLP applications per token in a forward over ``num_tokens``
        tokens (per sequence for Soft MoE): the layer's compute in units of one expert MLP per token,
        e.g. ``k`` for dropless top-k, ``slots / tokens`` for Soft MoE. Shared experts count too."""
        raise NotImplementedError

    @property
    def stats(self) -> dict[str, Tensor]:
        """Routing statistics of the latest forward (``{}`` when ``compute_stats`` is False).

        Every read until the next forward returns the same dict object, and each forward starts a
        new one: a reader that keeps the dict it saw can tell a new forward from an old record."""
        if self._stats_fn is not None:
            compute, self._stats_fn = self._stats_fn, None  # drop the kept routing tensors
            with torch.no_grad():
                self._stats = {k: v.detach() for k, v in compute().items()}
        return self._stats

    def router_logits_finite(self) -> bool | None:
        """Whether every router logit of the latest forward was finite (None: no forward yet, or a
        layer without learned logits). Synchronises with the device: read it when a step went bad."""
        if self.router_logit_checksum is None:
            return None
        return bool(torch.isfinite(self.router_logit_checksum))

    def _record(
        self,
        aux_losses: dict[str, Tensor],
        stats: Callable[[], dict[str, Tensor]],
        forward_tokens: int,
        logit_checksum: Tensor | None = None,
    ) -> None:
        """Keep this forward's weighted aux losses, the function that computes its statistics
        (closing over detached routing tensors) for when they are read, its number of tokens and the
        :func:`~moekit.moe.routers.logit_checksum` of its router logits."""
        self.aux_losses = aux_losses
        self.router_logit_checksum = logit_checksum
        self.forward_tokens = forward_tokens
        self._stats_fn = stats if self.compute_stats else None
        self._stats = {}

    @staticmethod
    def _check_input(x: Tensor, dim: int, layer_name: str) -> None:
        if x.dim() != 3 or x.shape[-1] != dim:
            raise ValueError(
                f"{layer_name}: input of shape {tuple(x.shape)} - expected [batch, tokens, {dim}] (in_features={dim})"
            )

    def balancing_step(self) -> None:
        """Called once per optimizer step by :func:`update_balancing_biases`; layers with state that
        is updated outside autograd (loss-free balancing) override it."""

    def discard_balancing_step(self) -> None:
        """Called by :func:`discard_balancing_updates` instead of :meth:`balancing_step` when the
        optimizer step was skipped: drop what the skipped step's forwards accumulated."""


def moe_layers(model: nn.Module) -> Iterator[tuple[str, MoELayer]]:
    """Yield ``(qualified_name, layer)`` for every :class:`MoELayer` inside ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            yield name, module


@dataclass
class MoEOutputs:
    """What :func:`collect_moe_outputs` returns.

    Attributes:
        aux_loss: the sum of every weighted auxiliary loss of every layer (a scalar; ``0.`` if none).
        aux_losses: ``{loss_name: sum over layers}`` - for logging each loss separately.
        layer_aux_losses: ``{layer_name: {loss_name: value}}``.
        layers: ``{layer_name: layer}``.
        stats: ``{layer_name: {stat_name: detached tensor}}``, computed when first read.
    """

    aux_loss: Tensor
    aux_losses: dict[str, Tensor] = field(default_factory=dict)
    layer_aux_losses: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    layers: dict[str, MoELayer] = field(default_factory=dict, repr=False)

    @property
    def stats(self) -> dict[str, dict[str, Tensor]]:
        return {name: layer.stats for name, layer in self.layers.items() if layer.stats}


def collect_moe_outputs(model: nn.Module) -> MoEOutputs:
    """Gather the auxiliary losses and routing statistics that every MoE layer of ``model`` recorded
    during its latest forward.

    Use it right after the forward of a training step::

        logits = model(images)
        moe = collect_moe_outputs(model)
        loss = F.cross_entropy(logits, labels) + moe.aux_loss

    Each layer overwrites its record on every forward, so a layer that did not run in the latest
    forward still reports its previous values.
    """
    total: Tensor | None = None
    per_name: dict[str, Tensor] = {}
    per_layer: dict[str, dict[str, Tensor]] = {}
    layers: dict[str, MoELayer] = {}
    device = None
    for name, layer in moe_layers(model):
        layers[name] = layer
        if layer.aux_losses:
            per_layer[name] = dict(layer.aux_losses)
            for loss_name, value in layer.aux_losses.items():
                per_name[loss_name] = per_name[loss_name] + value if loss_name in per_name else value
                total = value if total is None else total + value
        if device is None:
            param = next(layer.parameters(), None)
            device = param.device if param is not None else None
    if total is None:
        total = torch.zeros((), device=device)
    return MoEOutputs(aux_loss=total, aux_losses=per_name, layer_aux_losses=per_layer, layers=layers)


def update_balancing_biases(model: nn.Module) -> None:
    """Apply the per-step updates that live outside autograd (loss-free balancing biases) in every
    MoE layer of ``model``. Call once after each optimizer step; under ``torch.distributed`` the token
    counts are summed over ranks first so every rank applies the same update."""
    for _, layer in moe_layers(model):
        layer.balancing_step()


def discard_balancing_updates(model: nn.Module) -> None:
    """The counterpart of :func:`update_balancing_biases` for a skipped optimizer step (a non-finite
    loss or gradient): every MoE layer forgets the token counts of that step without updating."""
    for _, layer in moe_layers(model):
        layer.discard_balancing_step()


def require_causal(model: nn.Module) -> None:
    """Raise ``ValueError`` naming the first MoE layer of ``model`` whose routing mixes tokens and so
    would let a token see the future in a causal language model."""
    for name, layer in moe_layers(model):
        if not layer.causal_safe:
            raise ValueError(
                f"MoE layer '{name}' ({type(layer).__name__}) is not causal: its routing of a token depends on "
                "other tokens of the batch, including later ones. In a causal model use a per-token router: "
                "TopKMoE or HierarchicalMoE either dropless (capacity_factor=None) or with "
                "capacity_scope='position', HashMoE, DenseMoE."
            )


# ---------------------------------------------------------------------------------------------
# Registry: name -> layer class, so configs and model builders can say `moe_layer="soft_moe"`.
# ---------------------------------------------------------------------------------------------
_MOE_LAYERS: dict[str, type] = {}


def register_moe_layer(name: str):
    def decorator(cls):
        if name in _MOE_LAYERS:
            raise ValueError(f"MoE layer name {name!r} is already registered to {_MOE_LAYERS[name].__name__}")
        _MOE_LAYERS[name] = cls
        cls.registry_name = name
        return cls

    return decorator


def get_moe_layer(name: str) -> type:
    """Look up an MoE layer class by its registry name (see :func:`list_moe_layers`)."""
    try:
        return _MOE_LAYERS[name]
    except KeyError:
        raise ValueError(f"unknown MoE layer {name!r}; registered layers: {sorted(_MOE_LAYERS)}") from None


def list_moe_layers() -> Sequence[str]:
    return sorted(_MOE_LAYERS)
