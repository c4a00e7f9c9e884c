"""Causal language models with MoE feed-forwards.

* :class:`TransformerLM` - a decoder-only, pre-norm Transformer (GPT-2 layout) whose feed-forwards
  are MoE layers of :mod:`moekit.moe` in the chosen blocks, with rotary or learned positions and a
  key/value cache for incremental decoding. ``moe_layer=None`` is its dense twin.
* :class:`LSTMMoELM` - the language model of Shazeer et al. 2017 ("Outrageously Large Neural
  Networks"): embedding -> LSTM -> MoE applied at every position -> LSTM -> softmax, whose state
  can be carried across calls.

Both map ``input_ids: [batch, tokens]`` (long) to logits ``[batch, tokens, vocab_size]`` and take an
optional cache (:meth:`init_cache`) that the forward extends in place, so
``model(ids[:, :t], cache); model(ids[:, t:], cache)`` computes the logits of ``model(ids)`` in two
pieces. Both refuse, at construction, MoE layers whose routing of a token looks at other tokens
(:func:`moekit.moe.require_causal`): Soft MoE, experts-choice, BASE, and tokens-choice capacity
over the whole batch. Tokens-choice layers with a capacity are causal with
``capacity_scope="position"`` (each position's tokens compete among themselves only), which also
makes cached decoding drop exactly what the full forward drops.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from timm.layers import Mlp, SwiGLU, get_act_layer
from torch import Tensor, nn

from moekit.moe import ExpertBank, HashMoE, MoELayer, get_moe_layer, require_causal

from .placement import EXPERT_INIT_STD, MLP_KEYWORDS, MoEBlocks, moe_layer_kwargs, resolve_moe_blocks

__all__ = ["LMCache", "LSTMCache", "TransformerLM", "LSTMMoELM", "check_seq_len"]

PosEmbedding = Literal["rope", "learned"]
NormName = Literal["layernorm", "rmsnorm"]

INIT_STD = 0.02
"""GPT-2's std for the weights of every linear and embedding layer."""

_LM_DERIVED = MLP_KEYWORDS | {"gated", "vocab_size"}


def check_seq_len(length: int, max_seq_len: int | None) -> None:
    """Raise ``ValueError`` when a sequence of ``length`` tokens does not fit ``max_seq_len``."""
    if max_seq_len is not None and length > max_seq_len:
        raise ValueError(
            f"sequence length {length} exceeds max_seq_len={max_seq_len}; use shorter inputs or a model with "
            f"max_seq_len >= {length}"
        )


def _check_input_ids(input_ids: Tensor, name: str) -> None:
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"{name}: input_ids of shape {shape}; expected [batch, tokens] token ids")
    if input_ids.dtype not in (torch.long, torch.int32):
        raise ValueError(f"{name}: input_ids have dtype {input_ids.dtype}; expected torch.long token ids")
    if input_ids.shape[1] == 0:
        raise ValueError(f"{name}: input_ids hold no tokens (shape {tuple(input_ids.shape)}); pass at least one")


def _check_positive_int(value, name: str, owner: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}: {name}={value!r} must be a positive int")


def _check_dropout(value, owner: str) -> None:
    if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{owner}: dropout={value!r} must lie in [0, 1)")


# ---------------------------------------------------------------------------------------------
# Caches
# ---------------------------------------------------------------------------------------------
@dataclass
class LMCache:
    """Keys and values of a :class:`TransformerLM` for incremental decoding (one batch, one position).

    Attributes:
        keys, values: one pre-allocated ``[batch, heads, max_seq_len, head_dim]`` buffer per block;
            positions ``0 .. position - 1`` hold the (rotated, for RoPE) keys and the values of the
            tokens seen so far.
        position: tokens stored so far = the position of the next token.

    Pre-allocated rather than grown by ``torch.cat`` each step, by measurement (2-core CPU, dim 256,
    depth 4, top-2 MoE in every block, greedy decoding): equal up to 256 tokens (batch 1: 3.0 vs 3.1
    ms/token), 28-37% faster for 1008 tokens at batch 8 (7.0 vs 9.8-11.1 ms/token), where the
    concatenation copies the whole cache every step.
    """

    keys: list[Tensor]
    values: list[Tensor]
    position: int = 0

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]


@dataclass
class LSTMCache:
    """The recurrent state of an :class:`LSTMMoELM` after the tokens seen so far.

    Attributes:
        hidden, cell: ``[lstm_layers, batch, dim]``, the ``(h, c)`` of every LSTM layer, in model order.
        position: tokens seen so far.
    """

    hidden: Tensor
    cell: Tensor
    position: int = 0

    @property
    def batch_size(self) -> int:
        return self.hidden.shape[1]


def _check_cache_batch(cache, batch: int, name: str) -> None:
    if cache.batch_size != batch:
        raise ValueError(
            f"{name}: the cache holds {cache.batch_size} sequences but input_ids has batch {batch}; "
            f"make the cache with init_cache(batch_size={batch})"
        )


# ---------------------------------------------------------------------------------------------
# MoE layer construction (shared by both models)
# ---------------------------------------------------------------------------------------------
def _moe_layer_factory(
    moe_layer: str,
    num_experts: int | None,
    moe_kwargs: Mapping[str, Any] | None,
    *,
    gated: bool,
    vocab_size: int,
    model_name: str,
    derived_from: str,
    defaults: Mapping[str, Any] | None = None,
    expert_init_std: float | None = EXPERT_INIT_STD,
) -> tuple[type, dict[str, Any]]:
    """``(layer class, its keywords besides the timm Mlp ones)`` for an LM's MoE layer: ``moe_kwargs``
    checked against the layer, ``num_experts``, ``gated``, hash routing's ``vocab_size`` and the
    model's ``defaults`` for the keywords the user left unset."""
    layer_cls = get_moe_layer(moe_layer)
    kwargs = moe_layer_kwargs(
        layer_cls,
        moe_layer,
        num_experts,
        moe_kwargs,
        model_name=model_name,
        derived_keywords=_LM_DERIVED,
        derived_from=derived_from,
        expert_init_std=expert_init_std,
    )
    accepted = inspect.signature(layer_cls).parameters
    for key, value in (defaults or {}).items():
        if key in accepted:
            kwargs.setdefault(key, value)
    if "gated" in accepted:
        kwargs["gated"] = gated
    elif gated:
        raise ValueError(
            f"gated=True but moe_layer={moe_layer!r} ({layer_cls.__name__}) has no gated experts; "
            "use gated=False or a layer with a gated keyword"
        )
    if "vocab_size" in accepted:
        kwargs["vocab_size"] = vocab_size
    return layer_cls, kwargs


def _takes_token_ids(layer: nn.Module) -> bool:
    return isinstance(layer, HashMoE)


@torch.no_grad()
def _normal_init_experts(bank: ExpertBank, std: float, out_std: float) -> None:
    """Draw ``fc1`` from ``N(0, std)`` and ``fc2`` from ``N(0, out_std)`` (zero biases) as GPT-2 draws
    its dense MLP, keeping the bank's ``init`` mode (``"shared"``: every expert a copy of expert 0)."""
    count = 1 if bank.init == "shared" else bank.num_experts
    for weight, bias, weight_std in (
        (bank.fc1_weight, bank.fc1_bias, std),
        (bank.fc2_weight, bank.fc2_bias, out_std),
    ):
        weight[:count].normal_(0.0, weight_std)
        if count == 1:
            weight.copy_(weight[:1].expand_as(weight))
        if bias is not None:
            bias.zero_()


# ---------------------------------------------------------------------------------------------
# Transformer
# ---------------------------------------------------------------------------------------------
class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021), rotate-half layout: the first and second halves of
    each head's channels form the pairs rotated by ``position * base^(-2i / head_dim)``.

    ``forward(x: [batch, heads, tokens, head_dim], start)`` rotates tokens at positions
    ``start .. start + tokens - 1``; the rotation is applied in float32 (then cast back to ``x``'s dtype).
    """

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding: head_dim={head_dim} must be even (dim / num_heads)")
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # [max_seq_len, hd / 2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: Tensor, start: int) -> Tensor:
        tokens = x.shape[-2]
        cos = self.cos[start : start + tokens].float()
        sin = self.sin[start : start + tokens].float()
        first, second = x.float().chunk(2, dim=-1)
        rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
        return rotated.to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``.

    ``forward(x: [batch, tokens, dim], start, kv_cache)`` -> ``[batch, tokens, dim]``. The tokens sit
    at positions ``start ..``; with ``kv_cache = (keys, values)`` buffers of
    ``[batch, heads, max_seq_len, head_dim]`` their keys and values are written at those positions
    and the queries attend to everything stored up to themselves.
    """

    def __init__(self, dim: int, num_heads: int, *, bias: bool, dropout: float, rope: RotaryEmbedding | None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.dropout = dropout
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.proj_drop = nn.Dropout(dropout)
        self.rope = rope

    def forward(self, x: Tensor, start: int = 0, kv_cache: tuple[Tensor, Tensor] | None = None) -> Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).view(batch, tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [batch, heads, tokens, head_dim]
        if self.rope is not None:
            q, k = self.rope(q, start), self.rope(k, start)
        dropout_p = self.dropout if self.training else 0.0
        if kv_cache is None:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            key_buffer, value_buffer = kv_cache
            end = start + tokens
            key_buffer[:, :, start:end] = k
            value_buffer[:, :, start:end] = v
            k = key_buffer[:, :, :end].to(q.dtype)
            v = value_buffer[:, :, :end].to(q.dtype)
            if start == 0:
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
            else:  # query i (position start + i) sees keys 0 .. start + i; one query sees all of them
                mask = None
                if tokens > 1:
                    query_pos = torch.arange(start, end, device=x.device).unsqueeze(1)
                    mask = torch.arange(end, device=x.device).unsqueeze(0) <= query_pos
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        out = out.transpose(1, 2).reshape(batch, tokens, dim)
        return self.proj_drop(self.proj(out))


def _make_norm(norm: str, dim: int, bias: bool) -> nn.Module:
    if norm == "layernorm":
        return nn.LayerNorm(dim, bias=bias)
    return nn.RMSNorm(dim)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``; ``mlp`` is a dense MLP or
    an MoE layer (hash layers also get the token ids). ``[batch, tokens, dim] -> [batch, tokens, dim]``."""

    def __init__(self, attn: CausalSelfAttention, mlp: nn.Module, *, dim: int, norm: str, bias: bool) -> None:
        super().__init__()
        self.norm1 = _make_norm(norm, dim, bias)
        self.attn = attn
        self.norm2 = _make_norm(norm, dim, bias)
        self.mlp = mlp
        self.mlp_takes_token_ids = _takes_token_ids(mlp)

    def forward(
        self, x: Tensor, token_ids: Tensor, start: int = 0, kv_cache: tuple[Tensor, Tensor] | None = None
    ) -> Tensor:
        x = x + self.attn(self.norm1(x), start, kv_cache)
        h = self.norm2(x)
        return x + (self.mlp(h, token_ids=token_ids) if self.mlp_takes_token_ids else self.mlp(h))


class TransformerLM(nn.Module):
    """Decoder-only Transformer language model with MoE feed-forwards.

    ``token embedding (+ learned positions) -> dropout -> depth x pre-norm block -> norm -> head``;
    every block is causal self-attention then a feed-forward: an MoE layer in ``moe_blocks``, a dense
    MLP of the same hidden size elsewhere (timm ``Mlp``, or ``SwiGLU`` when ``gated``).

    Args:
        vocab_size: token vocabulary.
        max_seq_len: the longest sequence (prompt + generated tokens with a cache); longer inputs raise.
        dim, depth, num_heads: width, blocks, attention heads (``dim`` divisible by ``num_heads``; with
            RoPE the head size must be even).
        mlp_ratio: feed-forward hidden size ``int(dim * mlp_ratio)``, of the dense MLPs and of each
            expert (unless ``moe_kwargs`` sets ``expert_hidden_features``).
        gated: GLU feed-forwards and experts, ``act(x W_gate) * (x W_up)``: SwiGLU with the default
            activation (Mixtral's experts).
        act_layer: the activation (a timm name); None = ``"gelu"``, or ``"silu"`` when ``gated``.
        bias: biases of the linear layers and LayerNorms.
        dropout: after the embeddings, on the attention probabilities, after the attention projection,
            and inside the feed-forwards (timm ``Mlp``'s ``drop``: after the activation and after fc2).
        tie_embeddings: the head reuses the token-embedding matrix.
        norm: ``"layernorm"`` or ``"rmsnorm"``.
        pos_embedding: ``"rope"`` (rotary, applied to queries and keys) or ``"learned"`` (absolute,
            added to the token embeddings).
        moe_layer: registry name of the MoE layer (:func:`moekit.moe.list_moe_layers`), built with the
            timm ``Mlp`` keywords (``in_features=dim``, ``hidden_features``, ``act_layer``, ``bias``,
            ``drop=dropout``) as :func:`~moekit.models.create_moe_vit` does. Only causal routers are
            accepted: ``"top_k"`` and ``"hierarchical"`` dropless or with ``capacity_scope="position"``,
            ``"hash"`` (routed by these token ids; its ``vocab_size`` is set), ``"dense"``. None builds the
            dense twin: every block a dense MLP of the same hidden size.
        moe_blocks: which blocks are MoE (see :func:`~moekit.models.placement.resolve_moe_blocks`:
            ``"all"``, ``"every_2"``, ``"last_<n>"``, indices, ...).
        num_experts: experts per MoE layer; None for layers sized through ``moe_kwargs``
            (``"hierarchical"``: ``num_groups`` x ``experts_per_group``).
        moe_kwargs: further MoE keywords (``top_k``, ``capacity_factor``, ``capacity_scope``, loss
            weights, ``expert_hidden_features``, ...).

    Initialisation (GPT-2): linear and embedding weights ``N(0, 0.02)``, zero biases; the projections
    into the residual stream (attention ``proj``, the MLPs' ``fc2``) ``N(0, 0.02 / sqrt(2 * depth))``.
    Experts are drawn the same way as the dense MLP they replace (``fc1`` ``N(0, s)``, ``fc2``
    ``N(0, s / sqrt(2 * depth))``, ``s`` = ``moe_kwargs["expert_init_std"]``, default 0.02;
    ``expert_init_std=None`` keeps :class:`~moekit.moe.ExpertBank`'s ``nn.Linear``-style default).
    Routers keep their layer's own initialisation.

    Attributes:
        vocab_size, max_seq_len: as given.
        moe_block_indices: sorted indices of the MoE blocks (``()`` for the dense model).
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        max_seq_len: int = 256,
        dim: int = 256,
        depth: int = 4,
        num_heads: int = 4,
        mlp_ratio: float = 4.0,
        gated: bool = False,
        act_layer: str | None = None,
        bias: bool = False,
        dropout: float = 0.0,
        tie_embeddings: bool = True,
        norm: NormName = "layernorm",
        pos_embedding: PosEmbedding = "rope",
        moe_layer: str | None = "top_k",
        moe_blocks: MoEBlocks = "every_2",
        num_experts: int | None = 8,
        moe_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        name = "TransformerLM"
        for key, value in (
            ("vocab_size", vocab_size),
            ("max_seq_len", max_seq_len),
            ("dim", dim),
            ("depth", depth),
            ("num_heads", num_heads),
        ):
            _check_positive_int(value, key, name)
        if dim % num_heads:
            raise ValueError(f"{name}: dim={dim} is not divisible by num_heads={num_heads}; pick a divisor of dim")
        if pos_embedding not in ("rope", "learned"):
            raise ValueError(f"{name}: pos_embedding={pos_embedding!r}; allowed: 'rope', 'learned'")
        if pos_embedding == "rope" and (dim // num_heads) % 2:
            raise ValueError(
                f"{name}: rotary positions need an even head size; dim / num_heads = {dim // num_heads}. "
                "Change num_heads or use pos_embedding='learned'"
            )
        if norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"{name}: norm={norm!r}; allowed: 'layernorm', 'rmsnorm'")
        if not isinstance(mlp_ratio, (int, float)) or int(dim * mlp_ratio) < 1:
            raise ValueError(f"{name}: mlp_ratio={mlp_ratio!r} must give a positive hidden size int(dim * mlp_ratio)")
        _check_dropout(dropout, name)
        if moe_layer is None and moe_kwargs:
            raise ValueError(
                f"{name}: moe_kwargs={dict(moe_kwargs)} but moe_layer=None builds a dense model; "
                "drop moe_kwargs or name an MoE layer"
            )

        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.dim = dim
        self.depth = depth
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        act_name = act_layer or ("silu" if gated else "gelu")
        act = get_act_layer(act_name)
        if act is None:
            raise ValueError(f"{name}: act_layer={act_layer!r} is not a timm activation name (e.g. 'gelu', 'silu')")
        hidden = int(dim * mlp_ratio)
        mlp_kwargs = dict(in_features=dim, hidden_features=hidden, act_layer=act, bias=bias, drop=dropout)

        self.moe_block_indices: tuple[int, ...] = ()
        moe_factory = None
        if moe_layer is not None:
            self.moe_block_indices = resolve_moe_blocks(moe_blocks, depth, model_name=name)
            moe_factory = _moe_layer_factory(
                moe_layer,
                num_experts,
                moe_kwargs,
                gated=gated,
                vocab_size=vocab_size,
                model_name=name,
                derived_from="dim, mlp_ratio, gated, act_layer, bias, dropout, vocab_size",
            )

        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.position_embedding = nn.Embedding(max_seq_len, dim) if pos_embedding == "learned" else None
        rope = RotaryEmbedding(self.head_dim, max_seq_len) if pos_embedding == "rope" else None
        self.embed_drop = nn.Dropout(dropout)
        blocks = []
        for i in range(depth):
            if moe_factory is not None and i in self.moe_block_indices:
                layer_cls, layer_kwargs = moe_factory
                mlp = layer_cls(**mlp_kwargs, **layer_kwargs)
            else:
                mlp = SwiGLU(**mlp_kwargs) if gated else Mlp(**mlp_kwargs)
            attn = CausalSelfAttention(dim, num_heads, bias=bias, dropout=dropout, rope=rope)
            blocks.append(TransformerBlock(attn, mlp, dim=dim, norm=norm, bias=bias))
        self.blocks = nn.ModuleList(blocks)
        self.norm = _make_norm(norm, dim, bias)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.token_embedding.weight
        expert_std = moe_factory[1].get("expert_init_std", INIT_STD) if moe_factory is not None else INIT_STD
        self._init_weights(expert_std)
        require_causal(self)
        self.grad_checkpointing = False

    @torch.no_grad()
    def _init_weights(self, expert_std: float | None) -> None:
        residual_scale = 1.0 / math.sqrt(2 * self.depth)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, INIT_STD)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, INIT_STD)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, 0.0, INIT_STD * residual_scale)
            if isinstance(block.mlp, MoELayer):
                if expert_std is not None:
                    for bank in block.mlp.modules():
                        if isinstance(bank, ExpertBank):
                            _normal_init_experts(bank, expert_std, expert_std * residual_scale)
            else:
                nn.init.normal_(block.mlp.fc2.weight, 0.0, INIT_STD * residual_scale)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Activation checkpointing of every block in training (timm's method name)."""
        self.grad_checkpointing = enable

    def init_cache(self, batch_size: int) -> LMCache:
        """An empty :class:`LMCache` for ``batch_size`` sequences, on the model's device and in its dtype."""
        _check_positive_int(batch_size, "batch_size", "TransformerLM.init_cache")
        weight = self.token_embedding.weight
        shape = (batch_size, self.num_heads, self.max_seq_len, self.head_dim)
        keys = [weight.new_zeros(shape) for _ in self.blocks]
        values = [weight.new_zeros(shape) for _ in self.blocks]
        return LMCache(keys=keys, values=values, position=0)

    def forward(self, input_ids: Tensor, cache: LMCache | None = None) -> Tensor:
        """``input_ids: [batch, tokens]`` long -> logits ``[batch, tokens, vocab_size]``.

        With ``cache``, the tokens sit at positions ``cache.position ..``: their keys and values are
        stored, they attend to the cached ones, and ``cache.position`` advances by ``tokens``.
        """
        _check_input_ids(input_ids, "TransformerLM")
        batch, tokens = input_ids.shape
        start = 0
        if cache is not None:
            _check_cache_batch(cache, batch, "TransformerLM")
            start = cache.position
        check_seq_len(start + tokens, self.max_seq_len)
        x = self.token_embedding(input_ids)
        if self.position_embedding is not None:
            positions = torch.arange(start, start + tokens, device=input_ids.device)
            x = x + self.position_embedding(positions)
        x = self.embed_drop(x)
        recompute = self.grad_checkpointing and self.training and cache is None and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            if recompute:  # activation checkpointing: keep only block inputs, recompute in backward
                x = torch.utils.checkpoint.checkpoint(block, x, input_ids, use_reentrant=False)
                continue
            kv_cache = None if cache is None else (cache.keys[i], cache.values[i])
            x = block(x, input_ids, start, kv_cache)
        if cache is not None:
            cache.position = start + tokens
        return self.head(self.norm(x))


# ---------------------------------------------------------------------------------------------
# Shazeer et al. 2017: LSTM - MoE - LSTM
# ---------------------------------------------------------------------------------------------
_SHAZEER_GATING = dict(noisy_gating=True, normalize_gates=True, importance_loss_weight=0.1, load_loss_weight=0.1)


def _balanced_divisor(n: int) -> int:
    """The largest divisor ``d`` of ``n`` with ``d * d <= n`` (16 -> 4, 8 -> 2, 256 -> 16)."""
    return max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)


def _hierarchical_sizes(num_experts: int, top_k: int, moe_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Map ``num_experts`` (total) and ``top_k`` (experts per token) onto HierarchicalMoE's groups."""
    kwargs = dict(moe_kwargs)
    for key in ("experts_per_group",):
        if key in kwargs:
            raise ValueError(
                f"LSTMMoELM: moe_kwargs sets {key}; with moe_layer='hierarchical' it is num_experts / num_groups, "
                "set num_experts (total) and moe_kwargs num_groups instead"
            )
    groups = kwargs.setdefault("num_groups", _balanced_divisor(num_experts))
    if not isinstance(groups, int) or groups < 1 or num_experts % groups:
        raise ValueError(
            f"LSTMMoELM: num_groups={groups!r} must divide num_experts={num_experts} (hierarchical experts come in "
            "equal groups)"
        )
    kwargs["experts_per_group"] = num_experts // groups
    top_k_groups = kwargs.setdefault("top_k_groups", _balanced_divisor(top_k))
    if not isinstance(top_k_groups, int) or top_k_groups < 1 or top_k % top_k_groups:
        raise ValueError(
            f"LSTMMoELM: top_k_groups={top_k_groups!r} must divide top_k={top_k} (experts per token = top_k_groups x "
            "experts per chosen group)"
        )
    kwargs["top_k"] = top_k // top_k_groups
    return kwargs


class LSTMMoELM(nn.Module):
    """The MoE language model of Shazeer et al. 2017 (1-Billion-Word experiments, appendix C).

    Layers: word embedding -> LSTM (``num_lstm_layers_before``) -> MoE applied to every position
    -> LSTM (``num_lstm_layers_after``) -> softmax (the output projection). As in the paper, every
    layer but the softmax has dropout on its output, and after dropout the previous layer's output is
    added (a residual connection; the embedding has none, having no previous layer)::

        x = dropout(embedding(ids))
        x = x + dropout(lstm(x))                  # each LSTM layer before the MoE
        x = x + dropout(sigmoid(moe(x)))          # the paper passes the MoE output through a sigmoid
        x = x + dropout(lstm(x))                  # each LSTM layer after the MoE
        logits = head(x)

    The experts are feed-forward networks with one ReLU hidden layer (``expert_hidden``; the paper:
    512 -> 1024 -> 512). Gating is noisy top-k (``k = 4`` in the paper) with the importance and load
    losses, ``w_importance = w_load = 0.1`` as in the paper's language-model experiments: the
    defaults of ``moe_kwargs`` are ``noisy_gating=True, normalize_gates=True,
    importance_loss_weight=0.1, load_loss_weight=0.1`` (``normalize_gates`` renormalises the top-k
    softmax, i.e. ``softmax(KeepTopK(H, k))``; ``noisy_gating=False`` also drops the load loss's
    default, the load estimator being defined through the noise). As in the paper's appendix A, the gating weights
    ``W_g`` and ``W_noise`` start at zero (equal load: no signal, only noise) when the gating is noisy.
    The losses are batch-level: over all ``batch * tokens`` positions of the forward.

    ``moe_layer="hierarchical"`` is the paper's two-level MoE: ``num_experts`` in ``num_groups``
    groups (``moe_kwargs``; default the largest divisor <= sqrt(num_experts), 16 for 256 experts as
    the paper's first-level branching) and ``top_k`` experts per token split as ``top_k_groups`` groups
    x ``top_k / top_k_groups`` experts in each (default 2 x 2 for ``top_k=4``: the paper's ``k = 2`` at
    each level). Other causal layers (``"dense"``, ``"hash"``) work too.

    Args:
        vocab_size: token vocabulary.
        dim: embedding size = LSTM units = MoE input/output size (the paper: 512).
        expert_hidden: hidden units of each expert.
        num_experts, top_k: routed experts and experts per token.
        moe_layer: ``"top_k"`` (default) or ``"hierarchical"`` (or another causal layer).
        moe_kwargs: further MoE keywords, over the defaults above.
        act_layer: the experts' activation (timm name).
        dropout: the paper's DropProb.
        tie_embeddings: the softmax reuses the embedding matrix (it keeps its own bias).
        num_lstm_layers_before, num_lstm_layers_after: LSTM layers on each side of the MoE (the paper: 1, 1).
        moe_output_sigmoid: apply the paper's sigmoid to the MoE output.

    Initialisation: embedding ``U(-0.1, 0.1)``, LSTMs PyTorch's default, experts ``nn.Linear``'s
    default, zero softmax bias.

    Attributes:
        vocab_size; max_seq_len (None: any length).
    """

    max_seq_len = None

    def __init__(
        self,
        *,
        vocab_size: int,
        dim: int = 512,
        expert_hidden: int = 1024,
        num_experts: int = 16,
        top_k: int = 4,
        moe_layer: str = "top_k",
        moe_kwargs: Mapping[str, Any] | None = None,
        act_layer: str = "relu",
        dropout: float = 0.1,
        tie_embeddings: bool = True,
        num_lstm_layers_before: int = 1,
        num_lstm_layers_after: int = 1,
        moe_output_sigmoid: bool = True,
    ) -> None:
        super().__init__()
        name = "LSTMMoELM"
        for key, value in (
            ("vocab_size", vocab_size),
            ("dim", dim),
            ("expert_hidden", expert_hidden),
            ("num_experts", num_experts),
            ("top_k", top_k),
            ("num_lstm_layers_before", num_lstm_layers_before),
            ("num_lstm_layers_after", num_lstm_layers_after),
        ):
            _check_positive_int(value, key, name)
        _check_dropout(dropout, name)
        act = get_act_layer(act_layer)
        if act is None:
            raise ValueError(f"{name}: act_layer={act_layer!r} is not a timm activation name (e.g. 'relu', 'gelu')")
        kwargs = dict(moe_kwargs or {})
        if "top_k" in kwargs:
            raise ValueError(f"{name}: moe_kwargs sets top_k; pass it as the top_k argument instead")
        layer_cls = get_moe_layer(moe_layer)
        accepted = inspect.signature(layer_cls).parameters
        layer_num_experts: int | None = num_experts
        if "num_experts" not in accepted and "experts_per_group" in accepted:
            kwargs = _hierarchical_sizes(num_experts, top_k, kwargs)
            layer_num_experts = None
        elif "top_k" in accepted:
            kwargs["top_k"] = top_k
        defaults = dict(_SHAZEER_GATING)
        if not kwargs.get("noisy_gating", True):  # the load loss is defined through the noise
            defaults.pop("load_loss_weight")
        layer_cls, layer_kwargs = _moe_layer_factory(
            moe_layer,
            layer_num_experts,
            kwargs,
            gated=False,
            vocab_size=vocab_size,
            model_name=name,
            derived_from="dim, expert_hidden, act_layer, vocab_size",
            defaults=defaults,
            expert_init_std=None,
        )

        self.vocab_size = vocab_size
        self.dim = dim
        self.moe_output_sigmoid = moe_output_sigmoid
        self.embedding = nn.Embedding(vocab_size, dim)
        self.lstm_before = nn.ModuleList(nn.LSTM(dim, dim, batch_first=True) for _ in range(num_lstm_layers_before))
        self.moe = layer_cls(in_features=dim, hidden_features=expert_hidden, act_layer=act, bias=True, **layer_kwargs)
        self.moe_takes_token_ids = _takes_token_ids(self.moe)
        self.lstm_after = nn.ModuleList(nn.LSTM(dim, dim, batch_first=True) for _ in range(num_lstm_layers_after))
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(dim, vocab_size)
        with torch.no_grad():
            nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
            nn.init.zeros_(self.head.bias)
            router = getattr(self.moe, "router", None)
            if router is not None and getattr(router, "noisy_gating", False):
                for param in router.parameters():
                    param.zero_()
        if tie_embeddings:
            self.head.weight = self.embedding.weight
        require_causal(self)

    @property
    def num_lstm_layers(self) -> int:
        return len(self.lstm_before) + len(self.lstm_after)

    def init_cache(self, batch_size: int) -> LSTMCache:
        """Zero LSTM states for ``batch_size`` sequences, on the model's device and in its dtype."""
        _check_positive_int(batch_size, "batch_size", "LSTMMoELM.init_cache")
        weight = self.embedding.weight
        shape = (self.num_lstm_layers, batch_size, self.dim)
        return LSTMCache(hidden=weight.new_zeros(shape), cell=weight.new_zeros(shape), position=0)

    def forward(self, input_ids: Tensor, cache: LSTMCache | None = None) -> Tensor:
        """``input_ids: [batch, tokens]`` long -> logits ``[batch, tokens, vocab_size]``.

        With ``cache``, the LSTMs start from its states, which are replaced by the states after these
        tokens (``cache.position`` advances by ``tokens``); without, they start from zeros.
        """
        _check_input_ids(input_ids, "LSTMMoELM")
        batch, tokens = input_ids.shape
        if cache is not None:
            _check_cache_batch(cache, batch, "LSTMMoELM")
        hidden, cell = [], []

        def run_lstm(layer: nn.LSTM, x: Tensor, index: int) -> Tensor:
            state = None if cache is None else (cache.hidden[index : index + 1], cache.cell[index : index + 1])
            out, (h, c) = layer(x, state)
            hidden.append(h)
            cell.append(c)
            return x + self.drop(out)

        x = self.drop(self.embedding(input_ids))
        for i, lstm in enumerate(self.lstm_before):
            x = run_lstm(lstm, x, i)
        moe_out = self.moe(x, token_ids=input_ids) if self.moe_takes_token_ids else self.moe(x)
        if self.moe_output_sigmoid:
            moe_out = torch.sigmoid(moe_out)
        x = x + self.drop(moe_out)
        for i, lstm in enumerate(self.lstm_after, start=len(self.lstm_before)):
            x = run_lstm(lstm, x, i)
        if cache is not None:
            cache.hidden = torch.cat(hidden, dim=0)
            cache.cell = torch.cat(cell, dim=0)
            cache.position += tokens
        return self.head(x)
