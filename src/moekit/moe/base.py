"""The base class of every MoE layer, the timm ``Mlp`` keyword contract, and the helpers that gather
auxiliary losses and routing statistics from a whole model.

Every layer maps ``[batch, tokens, dim] -> [batch, tokens, out_dim]`` and has one constructor, defined
here: the keywords of ``timm.layers.Mlp`` (so that ``timm.models.vision_transformer.Block(mlp_layer=...)``
can build it) plus the layer's settings as keywords (``num_experts=8, top_k=2, ...``), which fill the
small config dataclasses its pieces are built from (:attr:`MoELayer.configs`). After each forward a layer
holds:

* ``aux_losses``: ``{name: weighted scalar}`` - the terms to add to the training loss (only the losses
  whose weight is non-zero appear);
* ``stats``: ``{name: detached tensor}`` - routing statistics of that forward, computed on device
  without host synchronisation (scalars, or ``[num_experts]`` vectors such as ``expert_load``). They
  are computed when first read (a training loop that logs every N steps pays for them every N steps)
  from the routing tensors the forward kept;
* ``forward_tokens``: the tokens that forward routed (``batch * tokens``, padding included); the weight of its
  statistics when a reader averages them over forwards is their ``real_tokens`` (padding excluded);
* ``router_logit_checksum``: the sum of that forward's router logits as a device scalar (None for
  layers without learned logits), finite exactly when every logit was; :meth:`MoELayer.router_logits_finite`
  reads it (a host sync, for when a step has already gone bad).

:func:`collect_moe_outputs` gathers both from any model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from moekit.utils.machine import check_fits_in_memory

from .experts import FIT_FIX, experts_built_on_meta

__all__ = [
    "MoELayer",
    "MlpSpec",
    "split_settings",
    "MoEOutputs",
    "collect_moe_outputs",
    "moe_layers",
    "routing_modules",
    "RoutingModule",
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


def split_settings(owner: str, settings: Mapping[str, Any], configs: Sequence[type]) -> list[Any]:
    """Fill each config dataclass of ``configs`` with the ``settings`` named like its fields (a setting
    named in several configs fills each); an unknown setting is a ``ValueError`` listing the allowed ones."""
    fields = [{f.name for f in dataclasses.fields(config)} for config in configs]
    allowed = set().union(*fields)
    unknown = sorted(set(settings) - allowed)
    if unknown:
        raise ValueError(f"{owner}: unknown setting(s) {unknown}; allowed: {sorted(allowed)}")
    try:
        return [config(**{k: v for k, v in settings.items() if k in names}) for config, names in zip(configs, fields)]
    except ValueError as err:
        raise ValueError(f"{owner}: {err}") from None


class RoutingModule(nn.Module):
    """Base of every module that routes tokens (the MoE layers, Mixture-of-Depths routers): the record of its
    latest forward that :func:`collect_moe_outputs` and the routing monitor read - ``aux_losses``, ``stats``
    (computed when first read), ``forward_tokens`` and ``router_logit_checksum`` (see the module docstring) -
    and the once-per-optimizer-step hooks."""

    aux_losses: dict[str, Tensor]
    forward_tokens: int
    router_logit_checksum: Tensor | None
    _stats_fn: Callable[[], dict[str, Tensor]] | None
    _stats: dict[str, Tensor]
    _token_weights_fn: Callable[[], Tensor] | None

    def __init__(self, *, compute_stats: bool = True) -> None:
        super().__init__()
        self.compute_stats = compute_stats
        self.__dict__.update(self._no_record())

    @staticmethod
    def _no_record() -> dict[str, Any]:
        """The record before any forward."""
        record = dict(aux_losses={}, forward_tokens=0, router_logit_checksum=None)
        return {**record, "_stats_fn": None, "_stats": {}, "_token_weights_fn": None}

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``torch.save(model)``, a model sent to spawned processes) without the record of the latest
        forward: its statistics are closures over that forward's tensors, which pickle cannot take."""
        return {**super().__getstate__(), **self._no_record()}

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

    def token_expert_weights(self) -> Tensor | None:
        """``[N, E]``: how much of each expert's work each token of the latest evaluation forward made (tokens
        flattened batch-major): the kept assignments of tokens-choice and experts-choice routing, the dispatch
        weights summed over each expert's slots for Soft MoE. None in training, once read, or for a layer that
        does not record them. The routing report's per-class analysis reads it."""
        compute, self._token_weights_fn = self._token_weights_fn, None
        if compute is None:
            return None
        with torch.no_grad():
            return compute()

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
        token_weights: Callable[[], Tensor] | None = None,
    ) -> None:
        """Keep this forward's weighted aux losses, the function that computes its statistics
        (closing over detached routing tensors) for when they are read, its number of tokens, the
        :func:`~moekit.moe.routing.logit_checksum` of its router logits and, in evaluation, the function that
        computes :meth:`token_expert_weights`."""
        self.aux_losses = aux_losses
        self.router_logit_checksum = logit_checksum
        self.forward_tokens = forward_tokens
        self._stats_fn = stats if self.compute_stats else None
        self._stats = {}
        self._token_weights_fn = token_weights if self.compute_stats and not self.training else None

    def _token_mask(self, padding_mask: Tensor | None, batch: int, tokens: int) -> Tensor | None:
        """``padding_mask [batch, tokens]`` (True for real tokens) flattened to ``[batch * tokens]`` bool, after
        checking its shape; None stays None (every token is real)."""
        if padding_mask is None:
            return None
        if padding_mask.shape != (batch, tokens) or padding_mask.dtype != torch.bool:
            raise ValueError(
                f"{type(self).__name__}: padding_mask of shape {tuple(padding_mask.shape)} and dtype "
                f"{padding_mask.dtype} - expected a bool tensor [batch, tokens] = [{batch}, {tokens}], True for real "
                "tokens and False for padding"
            )
        return padding_mask.reshape(-1)

    def balancing_step(self) -> None:
        """Called once per optimizer step by :func:`update_balancing_biases`; modules with state that
        is updated outside autograd (loss-free balancing) override it."""

    def discard_balancing_step(self) -> None:
        """Called by :func:`discard_balancing_updates` instead of :meth:`balancing_step` when the
        optimizer step was skipped: drop what the skipped step's forwards accumulated."""


class MoELayer(RoutingModule):
    """Base of all MoE layers: the constructor, the latest ``aux_losses`` and ``stats``, the causality flag.

    ``Layer(in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, norm_layer=None,
    bias=True, drop=0., use_conv=False, *, compute_stats=True, device=None, dtype=None, **settings)``:
    the timm ``Mlp`` keywords size the experts (``hidden_features`` is each expert's hidden size; None: ``4 *
    in_features``, where timm's ``Mlp`` takes ``in_features``; ``norm_layer`` and ``use_conv`` must stay off), and the
    settings fill the layer's :attr:`configs` (see each layer's docstring), over its :attr:`defaults`.
    Subclasses implement :meth:`build` (make the router and experts from the configs) and
    ``forward(x: [batch, tokens, dim], ..., padding_mask=None) -> [batch, tokens, out_dim]``, which calls
    :meth:`_record`. ``padding_mask: [batch, tokens]`` bool (True for real tokens): padding gets no expert and a zero
    output, takes no capacity, and counts in no auxiliary loss or routing statistic.
    """

    configs: ClassVar[tuple[type, ...]] = ()
    """The config dataclasses the settings fill, in the order :meth:`build` takes them."""
    defaults: ClassVar[dict[str, Any]] = {}
    """Settings of this layer that differ from its configs' field defaults."""
    registry_name: ClassVar[str]
    merges_experts: ClassVar[bool] = False
    """Every token goes through all experts merged into one (Lory): expert parallelism cannot split the bank."""

    def __init__(
        self,
        in_features: int,
        hidden_features: int | None = None,
        out_features: int | None = None,
        act_layer: ActLayer = nn.GELU,
        norm_layer=None,
        bias=True,
        drop=0.0,
        use_conv: bool = False,
        *,
        compute_stats: bool = True,
        device=None,
        dtype=None,
        **settings: Any,
    ) -> None:
        super().__init__(compute_stats=compute_stats)
        name = type(self).__name__
        mlp = MlpSpec.from_mlp_kwargs(
            in_features, hidden_features, out_features, act_layer, norm_layer, bias, drop, use_conv, name
        )
        configs = split_settings(name, {**self.defaults, **settings}, self.configs)
        self.in_features = mlp.in_features
        self.out_features = mlp.out_features
        self._refuse_what_cannot_fit(mlp, configs, device, dtype)
        self.build(mlp, *configs, device=device, dtype=dtype)

    def _refuse_what_cannot_fit(self, mlp: MlpSpec, configs: Sequence[Any], device, dtype) -> None:
        """Build the layer on the meta device first (no memory, no random draws) and refuse it, before any weight
        is allocated, when its weights exceed the memory ``device`` has left: the router's and the slots' weights
        grow with the experts too. Skipped where the layer is meant for the meta device (its own ``device``,
        the default device, :func:`~moekit.moe.experts.experts_on_meta`)."""
        target = torch.device(device) if device is not None else torch.get_default_device()
        if target.type == "meta" or experts_built_on_meta():
            return
        before = {key: value.copy() if isinstance(value, dict) else value for key, value in vars(self).items()}
        self.build(mlp, *configs, device="meta", dtype=dtype)
        tensors = [*self.parameters(), *self.buffers()]
        what = f"{type(self).__name__}({self.extra_repr()}) with {sum(t.numel() for t in tensors):,} weights"
        vars(self).clear()  # the real build starts afresh: no modules, attributes or hooks of the measuring one
        vars(self).update(before)
        check_fits_in_memory(sum(t.numel() * t.element_size() for t in tensors), target, what, FIT_FIX)

    @classmethod
    def settings(cls) -> list[str]:
        """The names of the settings the layer takes besides the timm ``Mlp`` keywords."""
        return sorted({f.name for config in cls.configs for f in dataclasses.fields(config)})

    def build(self, mlp: MlpSpec, *configs: Any, device=None, dtype=None) -> None:
        """Create the layer's modules from the normalised ``Mlp`` keywords and its filled :attr:`configs`."""
        raise NotImplementedError

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

    def _check_input(self, x: Tensor) -> None:
        dim = self.in_features
        if x.dim() != 3 or x.shape[-1] != dim or 0 in x.shape[:2]:
            raise ValueError(
                f"{type(self).__name__}: input of shape {tuple(x.shape)} - expected [batch, tokens, {dim}] "
                f"(in_features={dim}) with batch and tokens at least 1; skip the layer for an empty batch"
            )


def moe_layers(model: nn.Module) -> Iterator[tuple[str, MoELayer]]:
    """Yield ``(qualified_name, layer)`` for every :class:`MoELayer` inside ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            yield name, module


def routing_modules(model: nn.Module) -> Iterator[tuple[str, RoutingModule]]:
    """Yield ``(qualified_name, module)`` for every :class:`RoutingModule` inside ``model``: the MoE layers
    and the Mixture-of-Depths routers."""
    for name, module in model.named_modules():
        if isinstance(module, RoutingModule):
            yield name, module


@dataclass
class MoEOutputs:
    """What :func:`collect_moe_outputs` returns.

    Attributes:
        aux_loss: the sum of every weighted auxiliary loss of every layer (a scalar; ``0.`` if none).
        aux_losses: ``{loss_name: sum over layers}`` - for logging each loss separately.
        layer_aux_losses: ``{layer_name: {loss_name: value}}``.
        layers: ``{layer_name: layer}``: every :class:`RoutingModule` (MoE layers, Mixture-of-Depths routers).
        stats: ``{layer_name: {stat_name: detached tensor}}``, computed when first read.
    """

    aux_loss: Tensor
    aux_losses: dict[str, Tensor] = field(default_factory=dict)
    layer_aux_losses: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    layers: dict[str, RoutingModule] = field(default_factory=dict, repr=False)

    @property
    def stats(self) -> dict[str, dict[str, Tensor]]:
        return {name: layer.stats for name, layer in self.layers.items() if layer.stats}


def collect_moe_outputs(model: nn.Module) -> MoEOutputs:
    """Gather the auxiliary losses and routing statistics that every MoE layer (and Mixture-of-Depths router)
    of ``model`` recorded during its latest forward.

    Use it right after the forward of a training step::

        logits = model(images)
        moe = collect_moe_outputs(model)
        loss = F.cross_entropy(logits, labels) + moe.aux_loss

    Each layer overwrites its record on every forward: one that did not run in the latest reports its previous values.
    """
    total: Tensor | None = None
    per_name: dict[str, Tensor] = {}
    per_layer: dict[str, dict[str, Tensor]] = {}
    layers: dict[str, RoutingModule] = {}
    device = None
    for name, layer in routing_modules(model):
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
    """Apply the per-step updates that live outside autograd (loss-free balancing biases, the global-batch
    Switch fractions) in every MoE layer of ``model``. Call once after each optimizer step; under
    ``torch.distributed`` the token counts are summed over ranks first so every rank applies the same update."""
    for _, layer in routing_modules(model):
        layer.balancing_step()


def discard_balancing_updates(model: nn.Module) -> None:
    """The counterpart of :func:`update_balancing_biases` for a skipped optimizer step (a non-finite
    loss or gradient): every MoE layer forgets the token counts of that step without updating."""
    for _, layer in routing_modules(model):
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
                "capacity_scope='position' (or 'group' without batch_priority), HashMoE, DenseMoE, LoryMoE, "
                "StrictlyBalancedMoE with balance_scope='position'."
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
