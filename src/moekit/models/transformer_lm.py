"""A decoder-only, pre-norm Transformer language model (GPT-2 layout) whose feed-forwards are MoE layers of
:mod:`moekit.moe` in the chosen blocks, with rotary or learned positions and a key/value cache for incremental
decoding. ``moe=None`` is its dense twin.

It maps ``input_ids: [batch, tokens]`` (long) to logits ``[batch, tokens, vocab_size]`` and takes an optional
cache (:meth:`TransformerLM.init_cache`) that the forward extends in place, so
``model(ids[:, :t], cache); model(ids[:, t:], cache)`` computes the logits of ``model(ids)`` in two pieces.
It refuses, at construction, MoE recipes whose routing of a token looks at other tokens
(:func:`moekit.recipes.check_fits`, :func:`moekit.moe.require_causal`): Soft MoE, experts-choice, BASE, tokens-choice
capacity and strictly balanced gating over the whole batch. Tokens-choice layers with a capacity are causal with
``capacity_scope="position"`` (each position's tokens compete among themselves only) or ``"group"`` (a sequence's
tokens served in order; the cache carries the counts), and cached decoding drops exactly what the full forward drops.
Lory (``moe=lory``), the causal soft MoE, routes each segment by the previous one; the cache carries the
segment too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.utils.checkpoint
from timm.layers import Mlp, SwiGLU
from torch import Tensor, nn

from moekit.moe import DepthRouter, ExpertBank, MoELayer, RoutingModule, build_moe_layer, require_causal
from moekit.moe.cpu_matmul import adopt_linears
from moekit.moe.dropout import Dropout, use_fast_dropout
from moekit.recipes import check_fits, resolve_recipe, routes_by_position
from moekit.recipes.depth import DepthSpec, resolve_depth

from .attention import CausalSelfAttention, check_heads
from .lm_common import (
    INIT_STD,
    activation_layer,
    check_cache_batch,
    check_dropout,
    check_input_ids,
    check_padding_mask,
    check_positive_int,
    check_seq_len,
    takes_positions,
    takes_token_ids,
)
from .placement import MoEBlocks, resolve_moe_blocks
from .rotary import RotaryEmbedding

__all__ = ["LMCache", "TransformerLM"]

PosEmbedding = Literal["rope", "learned"]
NormName = Literal["layernorm", "rmsnorm"]


@dataclass
class LMCache:
    """Keys and values of a :class:`TransformerLM` for incremental decoding (one batch, one position).

    Attributes:
        keys, values: one pre-allocated ``[batch, kv_heads, max_seq_len, head_dim]`` buffer per block;
            positions ``0 .. position - 1`` hold the (rotated, for RoPE) keys and the values of the
            tokens seen so far.
        position: tokens stored so far = the position of the next token.
        processed: per block, ``[batch, max_seq_len]`` bool for a Mixture-of-Depths block (which of the
            stored tokens the block processed: the only keys its queries see), None for the others.
        layer_states: per block, the decoding state of an MoE layer that routes by position (Lory's
            :class:`~moekit.moe.SegmentState`), None for the others.

    Pre-allocated rather than grown by ``torch.cat`` each step: a concatenation copies the whole cache at
    every decoded token.
    """

    keys: list[Tensor]
    values: list[Tensor]
    position: int = 0
    processed: list[Tensor | None] = field(default_factory=list)
    layer_states: list[Any] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]


def _make_norm(norm: str, dim: int, bias: bool, eps: float | None) -> nn.Module:
    if norm == "layernorm":
        return nn.LayerNorm(dim, eps=1e-5 if eps is None else eps, bias=bias)
    return nn.RMSNorm(dim, eps=eps)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``x + dropout(mlp(norm2(x)))``; ``mlp`` is a dense MLP or
    an MoE layer (hash layers also get the token ids). ``[batch, tokens, dim] -> [batch, tokens, dim]``.

    ``dropout`` drops the feed-forward's output, one mask per token (GPT-2's residual dropout; after an MoE layer's
    combine, as Switch Transformer and fairseq do), the feed-forward built with ``drop=(p, 0)``: a dense MLP's own
    ``drop2`` moved out, where an MoE layer's would draw a mask for each of a token's ``k`` expert copies.

    With a ``depth_router`` it is a Mixture-of-Depths block (:mod:`moekit.moe.depth`): in training the top-C
    tokens of each sequence go through it, gathered in sequence order with their positions, and the others
    pass unchanged; in eval each token is processed when the router decides so on its own (causal), the
    queries then attending to the processed keys only (``processed`` holds a cache's flags for them).
    """

    def __init__(
        self,
        attn: CausalSelfAttention,
        mlp: nn.Module,
        *,
        dim: int,
        norm: str,
        bias: bool,
        norm_eps: float | None = None,
        depth_router: DepthRouter | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.norm1 = _make_norm(norm, dim, bias, norm_eps)
        self.attn = attn
        self.norm2 = _make_norm(norm, dim, bias, norm_eps)
        self.mlp = mlp
        self.mlp_drop = Dropout(dropout)
        self.mlp_takes_token_ids = takes_token_ids(mlp)
        self.mlp_takes_positions = takes_positions(mlp)
        self.depth_router = depth_router

    def _mlp(
        self, h: Tensor, token_ids: Tensor, start: int = 0, state: Any = None, padding_mask: Tensor | None = None
    ) -> Tensor:
        kwargs: dict[str, Any] = {} if padding_mask is None else {"padding_mask": padding_mask}
        if self.mlp_takes_token_ids:
            kwargs["token_ids"] = token_ids
        if self.mlp_takes_positions:
            kwargs.update(start=start, state=state)
        return self.mlp_drop(self.mlp(h, **kwargs))

    def forward(
        self,
        x: Tensor,
        token_ids: Tensor,
        start: int = 0,
        kv_cache: tuple[Tensor, Tensor] | None = None,
        processed: Tensor | None = None,
        mlp_state: Any = None,
        padding_mask: Tensor | None = None,
    ) -> Tensor:
        if self.depth_router is None:
            x = x + self.attn(self.norm1(x), start, kv_cache, key_mask=padding_mask)
            return x + self._mlp(self.norm2(x), token_ids, start, mlp_state, self._routed_mask(padding_mask))
        if self.depth_router.routes_top_c and kv_cache is None:
            return self._forward_top_c(x, token_ids, padding_mask)
        return self._forward_per_token(x, token_ids, start, kv_cache, processed, padding_mask)

    def _routed_mask(self, padding_mask: Tensor | None) -> Tensor | None:
        """The padding mask the feed-forward takes: an MoE layer's (a dense MLP has no use for one)."""
        return padding_mask if isinstance(self.mlp, RoutingModule) else None

    def _update(self, x: Tensor, token_ids: Tensor, **attn_kwargs) -> Tensor:
        """``f(x)``, what the block adds to the residual stream; the attention's ``key_mask`` is also the tokens
        the feed-forward routes."""
        attended = self.attn(self.norm1(x), **attn_kwargs)
        routed = self._routed_mask(attn_kwargs.get("key_mask"))
        if routed is not None and routed.shape[1] != x.shape[1]:  # a cache's flags: this call's tokens
            routed = routed[:, -x.shape[1] :]
        return attended + self._mlp(self.norm2(x + attended), token_ids, padding_mask=routed)

    def _forward_top_c(self, x_BSD: Tensor, token_ids_BS: Tensor, padding_mask: Tensor | None) -> Tensor:
        top_BC, gates_BC, taken_BC = self.depth_router.route(x_BSD, padding_mask)
        index_BCD = top_BC.unsqueeze(-1).expand(-1, -1, x_BSD.shape[-1])
        chosen_BCD = x_BSD.gather(1, index_BCD)
        update_BCD = self._update(chosen_BCD, token_ids_BS.gather(1, top_BC), positions=top_BC, key_mask=taken_BC)
        return x_BSD.scatter_add(1, index_BCD, (gates_BC.unsqueeze(-1) * update_BCD).to(x_BSD.dtype))

    def _forward_per_token(
        self,
        x_BSD: Tensor,
        token_ids_BS: Tensor,
        start: int,
        kv_cache,
        processed: Tensor | None,
        padding_mask: Tensor | None,
    ) -> Tensor:
        processed_BS, gates_BS = self.depth_router.decide(
            x_BSD, whole_sequences=kv_cache is None, padding_mask=padding_mask
        )
        key_mask = processed_BS
        if processed is not None:  # the cache's flags of every stored token
            processed[:, start : start + x_BSD.shape[1]] = processed_BS
            key_mask = processed[:, : start + x_BSD.shape[1]]
        update_BSD = self._update(x_BSD, token_ids_BS, start=start, kv_cache=kv_cache, key_mask=key_mask)
        return torch.where(
            processed_BS.unsqueeze(-1), x_BSD + (gates_BS.unsqueeze(-1) * update_BSD).to(x_BSD.dtype), x_BSD
        )


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
        num_kv_heads: key/value heads (grouped-query attention, a divisor of ``num_heads``); None = ``num_heads``.
        mlp_ratio: feed-forward hidden size ``int(dim * mlp_ratio)``, of the dense MLPs; each expert's is
            that divided by the recipe's ``granularity``.
        gated: GLU feed-forwards and experts, ``act(x W_gate) * (x W_up)``: SwiGLU with the default
            activation (Mixtral's experts).
        act_layer: the activation (a timm name); None = ``"gelu"``, or ``"silu"`` when ``gated``.
        bias: biases of the linear layers and LayerNorms.
        qkv_bias: biases of the query/key/value projection alone (Qwen's attention); None = ``bias``.
        dropout: after the embeddings, on the attention probabilities, after the attention projection, after
            the feed-forwards' activation (each expert's, in an MoE layer) and on their output (one mask per
            token, after an MoE layer's combine: :class:`TransformerBlock`).
        tie_embeddings: the head reuses the token-embedding matrix.
        norm: ``"layernorm"`` or ``"rmsnorm"``.
        norm_eps: the norms' epsilon; None = torch's default (LayerNorm 1e-5, RMSNorm the dtype's machine epsilon).
        pos_embedding: ``"rope"`` (rotary, applied to queries and keys) or ``"learned"`` (absolute,
            added to the token embeddings).
        rope_base: the rotary frequencies' base (``theta``; 10000 in RoFormer, 1e6 in Mixtral).
        moe: the MoE recipe of the MoE blocks (:mod:`moekit.recipes`: a name, a recipe mapping, or None for
            the dense twin, every block a dense MLP of the same hidden size). Its experts have the form of the
            dense MLPs (``gated``, ``act_layer``, ``bias``, ``dropout``); hash routing reads these token ids.
            Only recipes that route each token on its own or from earlier tokens are accepted
            (:func:`moekit.recipes.check_fits`): ``mixtral``, ``deepseek``, ``noisy_top_k``, ``hash``,
            ``hierarchical``, ``dense_moe``, ``lory``, and capacity limits with ``capacity_scope`` ``"position"`` or
            ``"group"`` (whose ``group_size`` defaults to ``max_seq_len``: one sequence).
        moe_blocks: which blocks are MoE (see :func:`~moekit.models.placement.resolve_moe_blocks`:
            ``"all"``, ``"every_2"``, ``"last_<n>"``, indices, ...).
        mod: Mixture-of-Depths (:mod:`moekit.moe.depth`): None, or the settings of
            :class:`~moekit.recipes.depth.DepthSpec` (``{"capacity": 0.125, "blocks": "every_2"}``): a router
            in front of each block of ``mod["blocks"]`` sends the top-C tokens of each sequence through it in
            training; sampling decides per token with the causal router it trains alongside. Combines with
            ``moe`` (MoDE: routed blocks whose feed-forwards are MoE layers).

    Initialisation (GPT-2): linear and embedding weights ``N(0, 0.02)``, zero biases; the projections
    into the residual stream (attention ``proj``, the MLPs' ``fc2``) ``N(0, 0.02 / sqrt(2 * depth))``.
    Experts are drawn the same way as the dense MLP they replace (``fc1`` ``N(0, 0.02)``, ``fc2``
    ``N(0, 0.02 / sqrt(2 * depth))``). The MoE and depth routers' weights keep their layer's own initialisation;
    the Mixture-of-Depths predictor and the shared-expert gate are linear layers, drawn as above.

    Attributes:
        vocab_size, max_seq_len: as given.
        moe_block_indices: sorted indices of the MoE blocks (``()`` for the dense model).
        mod_block_indices: sorted indices of the Mixture-of-Depths blocks (``()`` without ``mod``).
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        max_seq_len: int = 256,
        dim: int = 256,
        depth: int = 4,
        num_heads: int = 4,
        num_kv_heads: int | None = None,
        mlp_ratio: float = 4.0,
        gated: bool = False,
        act_layer: str | None = None,
        bias: bool = False,
        qkv_bias: bool | None = None,
        dropout: float = 0.0,
        tie_embeddings: bool = True,
        norm: NormName = "layernorm",
        norm_eps: float | None = None,
        pos_embedding: PosEmbedding = "rope",
        rope_base: float = 10000.0,
        moe: str | Mapping[str, Any] | None = "mixtral",
        moe_blocks: MoEBlocks = "all",
        mod: DepthSpec | Mapping[str, Any] | None = None,
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
            check_positive_int(value, key, name)
        check_heads(dim, num_heads, num_kv_heads, name)
        for key, value in (("norm_eps", norm_eps), ("rope_base", rope_base)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf
            ):
                raise ValueError(f"{name}: {key}={value!r} must be a positive number (and finite)")
        if pos_embedding not in ("rope", "learned"):
            raise ValueError(f"{name}: pos_embedding={pos_embedding!r}; allowed: 'rope', 'learned'")
        if pos_embedding == "rope" and (dim // num_heads) % 2:
            raise ValueError(
                f"{name}: rotary positions need an even head size; dim / num_heads = {dim // num_heads}. "
                "Change num_heads or use pos_embedding='learned'"
            )
        if norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"{name}: norm={norm!r}; allowed: 'layernorm', 'rmsnorm'")
        if not isinstance(mlp_ratio, (int, float)) or not 0 < mlp_ratio < math.inf or int(dim * mlp_ratio) < 1:
            raise ValueError(f"{name}: mlp_ratio={mlp_ratio!r} must give a positive hidden size int(dim * mlp_ratio)")
        check_dropout(dropout, name)
        spec = resolve_recipe(moe)
        depth_spec = resolve_depth(mod)

        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.dim = dim
        self.depth = depth
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = dim // num_heads
        act_name = act_layer or ("silu" if gated else "gelu")
        act = activation_layer(act_name, name, "'gelu', 'silu'")
        hidden = int(dim * mlp_ratio)
        mlp_kwargs = dict(in_features=dim, hidden_features=hidden, act_layer=act, bias=bias, drop=(dropout, 0.0))

        self.moe_block_indices: tuple[int, ...] = ()
        if spec is not None:
            check_fits(spec, model="the Transformer LM", causal=True, token_ids=True, positions=True)
            self.moe_block_indices = resolve_moe_blocks(moe_blocks, depth, model_name=name)
        self.mod_block_indices: tuple[int, ...] = ()
        if depth_spec is not None:
            depth_spec.check_causal(name)
            if spec is not None and routes_by_position(spec):
                raise ValueError(
                    f"{name}: moe={spec.get('name') or spec['layer']} routes by the tokens' positions (Lory's "
                    "segments, capacity_scope=group), and Mixture-of-Depths blocks process a subset of them; use "
                    "mod=none with it, or capacity_scope=position"
                )
            self.mod_block_indices = resolve_moe_blocks(
                depth_spec.blocks, depth, model_name=name, setting="mod.blocks", kind="routed"
            )

        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.position_embedding = nn.Embedding(max_seq_len, dim) if pos_embedding == "learned" else None
        rope = RotaryEmbedding(self.head_dim, max_seq_len, base=rope_base) if pos_embedding == "rope" else None
        self.embed_drop = Dropout(dropout)
        blocks, block_settings = [], dict(dim=dim, norm=norm, bias=bias, norm_eps=norm_eps, dropout=dropout)
        for i in range(depth):
            if i in self.moe_block_indices:
                model_settings = {"vocab_size": vocab_size, "gated": gated}
                if spec.get("capacity_scope") == "group":  # a group is a sequence unless the recipe sizes it
                    model_settings["group_size"] = max_seq_len
                mlp = build_moe_layer(spec, **mlp_kwargs, model_settings=model_settings)
            else:
                mlp = SwiGLU(**mlp_kwargs) if gated else Mlp(**mlp_kwargs)
            attn = CausalSelfAttention(
                dim, num_heads, num_kv_heads=num_kv_heads, bias=bias, qkv_bias=qkv_bias, dropout=dropout, rope=rope
            )
            router = DepthRouter(dim, depth_spec, causal=True) if i in self.mod_block_indices else None
            blocks.append(TransformerBlock(attn, mlp, depth_router=router, **block_settings))
        self.blocks = nn.ModuleList(blocks)
        self.norm = _make_norm(norm, dim, bias, norm_eps)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.token_embedding.weight
        self._init_weights()
        use_fast_dropout(self)  # timm's MLPs build torch's Dropout
        adopt_linears(self)  # float32 CPU products on the faster library (moekit.moe.cpu_matmul)
        require_causal(self)
        self.grad_checkpointing = False

    @torch.no_grad()
    def _init_weights(self) -> None:
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
                for bank in block.mlp.modules():
                    if isinstance(bank, ExpertBank):
                        bank.init_normal_(INIT_STD, INIT_STD * residual_scale)
            else:
                nn.init.normal_(block.mlp.fc2.weight, 0.0, INIT_STD * residual_scale)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Activation checkpointing of every block in training (timm's method name)."""
        self.grad_checkpointing = enable

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (transformers' method name)."""
        return self.token_embedding

    def init_cache(self, batch_size: int) -> LMCache:
        """An empty :class:`LMCache` for ``batch_size`` sequences, on the model's device and in its dtype."""
        check_positive_int(batch_size, "batch_size", "TransformerLM.init_cache")
        weight = self.token_embedding.weight
        shape = (batch_size, self.num_kv_heads, self.max_seq_len, self.head_dim)
        keys = [weight.new_zeros(shape) for _ in self.blocks]
        values = [weight.new_zeros(shape) for _ in self.blocks]
        flags = (batch_size, self.max_seq_len)
        processed = [
            weight.new_zeros(flags, dtype=torch.bool) if i in self.mod_block_indices else None
            for i in range(self.depth)
        ]
        states = [
            block.mlp.init_state(batch_size, weight) if block.mlp_takes_positions else None for block in self.blocks
        ]
        return LMCache(keys=keys, values=values, position=0, processed=processed, layer_states=states)

    def forward(self, input_ids: Tensor, cache: LMCache | None = None, padding_mask: Tensor | None = None) -> Tensor:
        """``input_ids: [batch, tokens]`` long -> logits ``[batch, tokens, vocab_size]``.

        With ``cache``, the tokens sit at positions ``cache.position ..``: their keys and values are
        stored, they attend to the cached ones, and ``cache.position`` advances by ``tokens``.

        ``padding_mask: [batch, tokens]`` bool, True for real tokens (not with a cache): no token attends to padding,
        and padding gets no expert, takes no capacity and counts in no auxiliary loss or routing statistic, so the
        logits of the real tokens do not depend on the padding that follows them (its own logits are meaningless);
        padding before them shifts their positions, which learned position embeddings see (rotary ones do not), and so
        do layers that group tokens by position (Lory's segments): pad those models' inputs on the right.
        """
        check_input_ids(input_ids, "TransformerLM")
        batch, tokens = input_ids.shape
        start = 0
        if cache is not None:
            check_cache_batch(cache, batch, "TransformerLM")
            start = cache.position
        check_padding_mask(padding_mask, input_ids, cache, "TransformerLM")
        check_seq_len(start + tokens, self.max_seq_len)
        x = self.token_embedding(input_ids)
        if self.position_embedding is not None:
            positions = torch.arange(start, start + tokens, device=input_ids.device)
            x = x + self.position_embedding(positions)
        x = self.embed_drop(x)
        recompute = self.grad_checkpointing and self.training and cache is None and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            if recompute:  # activation checkpointing: keep only block inputs, recompute in backward
                x = torch.utils.checkpoint.checkpoint(
                    block, x, input_ids, padding_mask=padding_mask, use_reentrant=False
                )
                continue
            kv_cache = None if cache is None else (cache.keys[i], cache.values[i])
            processed = cache.processed[i] if cache is not None and cache.processed else None
            mlp_state = cache.layer_states[i] if cache is not None and cache.layer_states else None
            x = block(x, input_ids, start, kv_cache, processed, mlp_state, padding_mask)
        if cache is not None:
            cache.position = start + tokens
        return self.head(self.norm(x))
