"""The language model of Shazeer et al. 2017 ("Outrageously Large Neural Networks"): embedding -> LSTM ->
MoE applied at every position -> LSTM -> softmax, whose state can be carried across calls.

It maps ``input_ids: [batch, tokens]`` (long) to logits ``[batch, tokens, vocab_size]`` and takes an optional
cache (:meth:`LSTMMoELM.init_cache`, the LSTM states) that the forward updates, so
``model(ids[:, :t], cache); model(ids[:, t:], cache)`` computes the logits of ``model(ids)`` in two pieces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from moekit.moe import build_moe_layer, require_causal
from moekit.moe.cpu_matmul import adopt_linears
from moekit.moe.dropout import Dropout
from moekit.recipes import check_fits, resolve_recipe

from .lm_common import (
    activation_layer,
    check_cache_batch,
    check_dropout,
    check_input_ids,
    check_padding_mask,
    check_positive_int,
    takes_token_ids,
)

__all__ = ["LSTMCache", "LSTMMoELM"]


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

    The experts are feed-forward networks with one ReLU hidden layer (``expert_hidden``, divided by the
    recipe's ``granularity``; the paper: 512 -> 1024 -> 512). The MoE is a recipe of :mod:`moekit.recipes`,
    by default ``noisy_top_k``, the paper's: noisy top-4 gating with the importance and load losses,
    ``w_importance = w_load = 0.1`` as in its language-model experiments, and the gating weights ``W_g`` and
    ``W_noise`` starting at zero as in its appendix A (the recipes' ``router_init: zeros``: equal load, no signal,
    only noise). The losses are batch-level: over all ``batch * tokens`` positions of the forward.
    ``moe="hierarchical"`` is the paper's two-level MoE. Only recipes that route each token on its own are
    accepted (:func:`moekit.recipes.check_fits`); hash routing reads these token ids.

    Args:
        vocab_size: token vocabulary.
        dim: embedding size = LSTM units = MoE input/output size (the paper: 512).
        expert_hidden: hidden units of each expert (before the recipe's granularity).
        moe: the MoE recipe (a name or a recipe mapping).
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
        moe: str | Mapping[str, Any] = "noisy_top_k",
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
            ("num_lstm_layers_before", num_lstm_layers_before),
            ("num_lstm_layers_after", num_lstm_layers_after),
        ):
            check_positive_int(value, key, name)
        check_dropout(dropout, name)
        act = activation_layer(act_layer, name, "'relu', 'gelu'")
        spec = resolve_recipe(moe)
        if spec is None:
            raise ValueError(f"{name}: moe=None; the LSTM MoE LM needs an MoE recipe (e.g. moe='noisy_top_k')")
        check_fits(spec, model="the LSTM MoE LM", causal=True, token_ids=True)

        self.vocab_size = vocab_size
        self.dim = dim
        self.moe_output_sigmoid = moe_output_sigmoid
        self.embedding = nn.Embedding(vocab_size, dim)
        self.lstm_before = nn.ModuleList(nn.LSTM(dim, dim, batch_first=True) for _ in range(num_lstm_layers_before))
        self.moe = build_moe_layer(
            spec,
            in_features=dim,
            hidden_features=expert_hidden,
            act_layer=act,
            model_settings={"vocab_size": vocab_size},
        )
        self.moe_takes_token_ids = takes_token_ids(self.moe)
        self.lstm_after = nn.ModuleList(nn.LSTM(dim, dim, batch_first=True) for _ in range(num_lstm_layers_after))
        self.drop = Dropout(dropout)
        self.head = nn.Linear(dim, vocab_size)
        with torch.no_grad():
            nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
            nn.init.zeros_(self.head.bias)
        if tie_embeddings:
            self.head.weight = self.embedding.weight
        adopt_linears(self)  # float32 CPU products on the faster library (moekit.moe.cpu_matmul)
        require_causal(self)

    @property
    def num_lstm_layers(self) -> int:
        return len(self.lstm_before) + len(self.lstm_after)

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (transformers' method name)."""
        return self.embedding

    def init_cache(self, batch_size: int) -> LSTMCache:
        """Zero LSTM states for ``batch_size`` sequences, on the model's device and in its dtype."""
        check_positive_int(batch_size, "batch_size", "LSTMMoELM.init_cache")
        weight = self.embedding.weight
        shape = (self.num_lstm_layers, batch_size, self.dim)
        return LSTMCache(hidden=weight.new_zeros(shape), cell=weight.new_zeros(shape), position=0)

    def forward(self, input_ids: Tensor, cache: LSTMCache | None = None, padding_mask: Tensor | None = None) -> Tensor:
        """``input_ids: [batch, tokens]`` long -> logits ``[batch, tokens, vocab_size]``.

        With ``cache``, the LSTMs start from its states, which are replaced by the states after these
        tokens (``cache.position`` advances by ``tokens``); without, they start from zeros.

        ``padding_mask: [batch, tokens]`` bool, True for real tokens (not with a cache): padding gets no expert, takes
        no capacity and counts in no auxiliary loss or routing statistic. The LSTMs read the tokens in order, so
        padding must follow the real tokens (right padding) for their logits not to depend on it.
        """
        check_input_ids(input_ids, "LSTMMoELM")
        batch, tokens = input_ids.shape
        if cache is not None:
            check_cache_batch(cache, batch, "LSTMMoELM")
        check_padding_mask(padding_mask, input_ids, cache, "LSTMMoELM")
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
        moe_kwargs: dict = {} if padding_mask is None else {"padding_mask": padding_mask}
        if self.moe_takes_token_ids:
            moe_kwargs["token_ids"] = input_ids
        moe_out = self.moe(x, **moe_kwargs)
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
