"""Parameter and compute summary of a (MoE) model: total, expert and active parameters, forward FLOPs
(:func:`model_summary` for image models, :func:`lm_summary` for language models, per token).

FLOPs are measured, not estimated: :func:`model_summary` runs one eval-mode forward under
``torch.utils.flop_counter.FlopCounterMode``, so they count what actually runs (Soft MoE's slots,
experts-choice buffers, the tokens top-k routed, the routers, attention) - matmuls, convolutions and
attention only, as the counter does (norms, activations and softmaxes are not counted). Mixture-of-Depths
blocks are measured with their training-time top-C routing (:func:`moekit.moe.top_c_routing`), which
processes exactly ``C`` tokens per sequence; a causal model's per-token decisions process about as many.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moekit.moe import DepthRouter, ExpertBank, MoELayer, SoftMoE, depth_routers, moe_layers, top_c_routing
from moekit.moe.depth import capacity_tokens
from moekit.utils.format import si

from .flops import flop_counter

__all__ = [
    "MoELayerSummary",
    "DepthBlockSummary",
    "ModelSummary",
    "model_summary",
    "LMSummary",
    "lm_summary",
]


@dataclass(frozen=True)
class MoELayerSummary:
    """One MoE layer of a :class:`ModelSummary`.

    Attributes:
        name: qualified module name, e.g. ``"blocks.6.mlp"``.
        layer: registry name of the layer type (``"soft_moe"``, ``"top_k"``, ...).
        num_experts: routed experts.
        tokens: tokens per sequence the layer saw in the measured forward.
        expert_rows_per_token: expert-MLP applications per token in the measured forward: Soft MoE's slots and a
            group-scope capacity per sequence, a position-scope capacity or balance over each position's tokens of
            the batch, experts-choice and batch-wide capacities over all its tokens.
        expert_params: parameters of all its experts (shared experts included).
        params_per_expert: parameters of one routed expert.
        active_params_per_token: ``params_per_expert * expert_rows_per_token``, shared experts counted by their
            own parameters.
        flops_per_image: forward FLOPs of the whole layer (router, dispatch, experts, combine) per image
            (per sequence in :func:`lm_summary`).
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
class DepthBlockSummary:
    """One Mixture-of-Depths block of a :class:`ModelSummary` / :class:`LMSummary`.

    Attributes:
        name: qualified name of the routed block, e.g. ``"blocks.1"``.
        tokens: tokens per sequence its router chose among.
        processed_fraction: the share of a sequence's tokens the block processes: ``C / tokens``, or
            ``(P + C) / (P + tokens)`` with ``P`` prefix tokens (a class token) that always go through it.
        active_params_per_token: the block's parameters one processed token uses (its MoE layers counted
            by their active parameters); a token uses them with probability ``processed_fraction``.
    """

    name: str
    tokens: int
    processed_fraction: float
    active_params_per_token: float


@dataclass(frozen=True)
class ModelSummary:
    """What :func:`model_summary` returns; ``str(summary)`` is a short table.

    Attributes:
        input_size: ``(C, H, W)`` of the measured forward.
        total_params: every parameter.
        expert_params: parameters inside expert banks.
        active_params_per_token: parameters one token uses on average: everything outside the experts,
            plus per MoE layer one expert's parameters times its ``expert_rows_per_token``; a
            Mixture-of-Depths block's parameters weighted by the share of tokens it processes. Equals
            ``total_params`` for a dense model.
        flops_per_image: forward FLOPs per image (eval mode).
        moe_layers: one :class:`MoELayerSummary` per MoE layer, in module order.
        mod_blocks: one :class:`DepthBlockSummary` per Mixture-of-Depths block.
    """

    input_size: tuple[int, ...]
    total_params: int
    expert_params: int
    active_params_per_token: float
    flops_per_image: float
    moe_layers: tuple[MoELayerSummary, ...]
    mod_blocks: tuple[DepthBlockSummary, ...] = ()

    def format(self) -> str:
        lines = [
            f"input {'x'.join(map(str, self.input_size))}",
            f"  total params           {si(self.total_params):>9}",
            f"  expert params          {si(self.expert_params):>9}",
            f"  active params / token  {si(self.active_params_per_token):>9}",
            f"  FLOPs / image          {si(self.flops_per_image):>9}",
        ]
        lines += _layer_table(self.moe_layers, "FLOPs/img") + _depth_table(self.mod_blocks)
        return "\n".join(lines)

    __str__ = format


def _layer_table(layers: Sequence[MoELayerSummary], flops_header: str) -> list[str]:
    if not layers:
        return []
    width = max(len("MoE layer"), *(len(s.name) for s in layers))
    lines = [
        f"  {'MoE layer':<{width}}  {'type':<14} {'experts':>7} {'tokens':>6} {'rows/tok':>8} "
        f"{'params':>9} {'active/tok':>10} {flops_header:>9}"
    ]
    for s in layers:
        lines.append(
            f"  {s.name:<{width}}  {s.layer:<14} {s.num_experts:>7} {s.tokens:>6} "
            f"{s.expert_rows_per_token:>8.3g} {si(s.expert_params):>9} "
            f"{si(s.active_params_per_token):>10} {si(s.flops_per_image):>9}"
        )
    return lines


def _depth_table(blocks: Sequence[DepthBlockSummary]) -> list[str]:
    if not blocks:
        return []
    width = max(len("MoD block"), *(len(b.name) for b in blocks))
    lines = [f"  {'MoD block':<{width}}  {'tokens':>6} {'processed':>9} {'params/processed token':>22}"]
    for b in blocks:
        lines.append(
            f"  {b.name:<{width}}  {b.tokens:>6} {b.processed_fraction:>9.1%} {si(b.active_params_per_token):>22}"
        )
    return lines


def _param_count(params) -> int:
    return sum(p.numel() for p in params)


def _positive_ints(*values) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


@torch.no_grad()
def model_summary(model: nn.Module, input_size: Sequence[int], batch_size: int = 2) -> ModelSummary:
    """Count the parameters of ``model`` and measure its forward FLOPs on ``batch_size`` random
    images of ``input_size = (C, H, W)`` in eval mode (the model's mode is restored afterwards).

    Works for any image model; the MoE numbers come from the :class:`~moekit.moe.MoELayer` modules.
    Layers whose compute depends on the batch (capacity factors over all tokens of a forward) are
    measured at ``batch_size``.
    """
    if not isinstance(input_size, Sequence) or len(input_size) != 3 or not _positive_ints(*input_size, batch_size):
        raise ValueError(f"input_size={input_size!r}, batch_size={batch_size!r}: give positive ints, (C, H, W) and B")
    device, dtype = _device_and_dtype(model)
    measured = _measure(model, torch.randn(batch_size, *input_size, device=device, dtype=dtype))
    return ModelSummary(
        input_size=tuple(input_size),
        total_params=measured.total_params,
        expert_params=measured.expert_params,
        active_params_per_token=measured.active_params_per_token,
        flops_per_image=measured.flops / batch_size,
        moe_layers=measured.moe_layers,
        mod_blocks=measured.mod_blocks,
    )


@dataclass(frozen=True)
class LMSummary:
    """What :func:`lm_summary` returns; ``str(summary)`` is a short table.

    Attributes:
        seq_len: tokens per sequence of the measured forward.
        total_params: every parameter (a tied embedding/head matrix counts once).
        expert_params: parameters inside expert banks.
        active_params_per_token: parameters one token uses on average: everything outside the experts (the
            whole embedding matrix included, as is usual), plus per MoE layer one expert's parameters times its
            ``expert_rows_per_token``; a Mixture-of-Depths block's parameters weighted by the share of tokens
            it processes. Equals ``total_params`` for a dense model.
        flops_per_token: forward FLOPs per token (eval mode, sequences of ``seq_len`` tokens): matmuls
            and attention, the routers and the output projection included. Attention is counted as
            full ``seq_len x seq_len`` (as the FLOP counter does, causal or not), so it grows with
            ``seq_len``.
        moe_layers: one :class:`MoELayerSummary` per MoE layer; their ``flops_per_image`` is per
            sequence of ``seq_len`` tokens.
        mod_blocks: one :class:`DepthBlockSummary` per Mixture-of-Depths block.
    """

    seq_len: int
    total_params: int
    expert_params: int
    active_params_per_token: float
    flops_per_token: float
    moe_layers: tuple[MoELayerSummary, ...]
    mod_blocks: tuple[DepthBlockSummary, ...] = ()

    def format(self) -> str:
        lines = [
            f"sequences of {self.seq_len} tokens",
            f"  total params           {si(self.total_params):>9}",
            f"  expert params          {si(self.expert_params):>9}",
            f"  active params / token  {si(self.active_params_per_token):>9}",
            f"  FLOPs / token          {si(self.flops_per_token):>9}",
        ]
        lines += _layer_table(self.moe_layers, "FLOPs/seq") + _depth_table(self.mod_blocks)
        return "\n".join(lines)

    __str__ = format


@torch.no_grad()
def lm_summary(model: nn.Module, seq_len: int, batch_size: int = 2) -> LMSummary:
    """Count the parameters of a language model and measure its forward FLOPs per token on
    ``batch_size`` random sequences of ``seq_len`` token ids, in eval mode (the mode is restored).

    ``model(input_ids [batch, seq_len]) -> logits`` with a ``vocab_size`` attribute
    (:class:`~moekit.models.TransformerLM`, :class:`~moekit.models.LSTMMoELM`). LSTM layers are
    counted through their recurrent matmuls (``2 * 4 * hidden * (input + hidden)`` per token).

    Comparing dense and MoE models at equal cost: a top-1 MoE layer applies one expert per token, so
    ``TransformerLM(moe=None)`` with the same ``dim``, ``depth`` and ``mlp_ratio`` (the dense
    twin) has the same feed-forward FLOPs per token, up to the router's ``2 * dim * num_experts``.
    For top-``k`` (dropless) the twin needs ``k`` times the hidden size: ``mlp_ratio * k`` (or give the
    recipe ``granularity = k``: experts of ``hidden / k``, DeepSeek's fine-grained experts). The active
    parameters per token then match as well.
    """
    vocab_size = getattr(model, "vocab_size", None)
    if not isinstance(vocab_size, int):
        raise ValueError(f"{type(model).__name__} has no int vocab_size attribute; lm_summary needs a language model")
    if not _positive_ints(seq_len, batch_size):
        raise ValueError(f"seq_len={seq_len!r} and batch_size={batch_size!r} must be positive ints")
    max_seq_len = getattr(model, "max_seq_len", None)
    if max_seq_len is not None and seq_len > max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds the model's max_seq_len={max_seq_len}; measure at most that")
    device, _ = _device_and_dtype(model)
    input_ids = torch.randint(vocab_size, (batch_size, seq_len), device=device)
    measured = _measure(model, input_ids)
    return LMSummary(
        seq_len=seq_len,
        total_params=measured.total_params,
        expert_params=measured.expert_params,
        active_params_per_token=measured.active_params_per_token,
        flops_per_token=measured.flops / (batch_size * seq_len),
        moe_layers=measured.moe_layers,
        mod_blocks=measured.mod_blocks,
    )


@dataclass(frozen=True)
class _Measured:
    total_params: int
    expert_params: int
    active_params_per_token: float
    flops: float  # the whole batch
    moe_layers: tuple[MoELayerSummary, ...]
    mod_blocks: tuple[DepthBlockSummary, ...]


def _device_and_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    return device, dtype


def _measure(model: nn.Module, example: Tensor) -> _Measured:
    """One eval-mode forward of ``example`` (``[batch, ...]``) under the FLOP counter; the per-layer
    FLOPs are per example (divided by ``batch``)."""
    batch_size = example.shape[0]
    layers = list(moe_layers(model))
    shapes: dict[str, tuple[int, int]] = {}  # (batch, tokens) of each layer's input

    def record_tokens(name: str):
        def hook(module: nn.Module, inputs) -> None:
            x = next((x for x in inputs if isinstance(x, Tensor)), None)
            shapes[name] = tuple(x.shape[:2]) if x is not None and x.dim() == 3 else (0, 0)

        return hook

    was_training = model.training
    handles = [layer.register_forward_pre_hook(record_tokens(name)) for name, layer in layers]
    counter = flop_counter()
    try:
        model.eval()
        with counter, top_c_routing(model):
            model(example)
        flops = counter.get_flop_counts()
        root = type(model).__name__
        layer_summaries = tuple(
            _summarize_layer(name, layer, shapes.get(name, (0, 0)), flops.get(f"{root}.{name}", {}), batch_size)
            for name, layer in layers
        )
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)

    total = _param_count(model.parameters())
    experts = _param_count(p for m in model.modules() if isinstance(m, ExpertBank) for p in m.parameters())
    blocks = tuple(
        _summarize_depth_block(model, name, router, layer_summaries, batch_size)
        for name, router in depth_routers(model)
    )
    active = total - experts + sum(s.active_params_per_token for s in layer_summaries)
    active -= sum((1 - b.processed_fraction) * b.active_params_per_token for b in blocks)
    return _Measured(
        total_params=total,
        expert_params=experts,
        active_params_per_token=active,
        flops=counter.get_total_flops(),
        moe_layers=layer_summaries,
        mod_blocks=blocks,
    )


def _summarize_depth_block(
    model: nn.Module, router_name: str, router: DepthRouter, layers: Sequence[MoELayerSummary], batch_size: int
) -> DepthBlockSummary:
    """The routed block is the router's parent module; its parameters a processed token uses are its own
    (router and experts aside) plus the active parameters of its MoE layers."""
    name = router_name.rpartition(".")[0]
    block = model.get_submodule(name)
    tokens = router.forward_tokens // batch_size
    router_params = {id(p) for p in router.parameters()}
    own = _param_count(
        p
        for m in block.modules()
        if not isinstance(m, ExpertBank)
        for p in m.parameters(recurse=False)
        if id(p) not in router_params
    )
    inner = sum(s.active_params_per_token for s in layers if s.name.startswith(f"{name}."))
    prefix = getattr(block, "prefix_tokens", 0)  # a ViT's class token: always processed
    return DepthBlockSummary(
        name=name,
        tokens=tokens,
        processed_fraction=(prefix + capacity_tokens(router.capacity, tokens)) / (prefix + tokens) if tokens else 0.0,
        active_params_per_token=own + inner,
    )


def _competing_tokens(layer: MoELayer, batch: int, tokens: int) -> int:
    """The tokens of a ``[batch, tokens]`` forward among which the layer shares its experts' rows: a sequence (Soft
    MoE's slots, a group-scope capacity), one position's ``batch`` tokens (a position scope), or all of them."""
    scope = getattr(getattr(layer, "capacity", None), "capacity_scope", None) or getattr(layer, "balance_scope", None)
    if isinstance(layer, SoftMoE) or scope == "group":
        return tokens
    return batch if scope == "position" else batch * tokens


def _active_params(layer: MoELayer, params_per_expert: int, rows: float) -> float:
    """``params_per_expert * rows``, with always-on shared experts (part of ``rows``) counted by their own
    parameters: one MLP of ``n`` times the routed hidden size has one output bias, not ``n``."""
    shared = getattr(layer, "shared_experts", None)
    if not isinstance(shared, ExpertBank):
        return params_per_expert * rows
    shared_rows = shared.hidden_features / layer.experts.hidden_features
    return params_per_expert * (rows - shared_rows) + _param_count(shared.parameters())


def _summarize_layer(name: str, layer: MoELayer, shape: tuple[int, int], flops: dict, batch_size: int):
    routed = layer.experts
    params_per_expert = _param_count(routed.parameters()) // routed.num_experts
    batch, tokens = shape
    rows = float(layer.expert_rows_per_token(_competing_tokens(layer, batch, tokens))) if tokens else 0.0
    return MoELayerSummary(
        name=name,
        layer=getattr(layer, "registry_name", type(layer).__name__),
        num_experts=routed.num_experts,
        tokens=tokens,
        expert_rows_per_token=rows,
        expert_params=_param_count(p for m in layer.modules() if isinstance(m, ExpertBank) for p in m.parameters()),
        params_per_expert=params_per_expert,
        active_params_per_token=_active_params(layer, params_per_expert, rows) if tokens else 0.0,
        flops_per_image=sum(flops.values()) / batch_size,
    )
