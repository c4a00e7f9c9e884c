"""What the language models share: their input checks, the sequence-length limit, and how an MoE layer
that routes by token id (hash routing) is recognised, fed and fitted."""

from __future__ import annotations

import torch
from timm.layers import get_act_layer
from torch import Tensor, nn

__all__ = [
    "check_seq_len",
    "check_input_ids",
    "check_positive_int",
    "check_dropout",
    "check_cache_batch",
    "activation_layer",
    "takes_token_ids",
    "takes_positions",
    "fit_hash_routing",
    "INIT_STD",
]

INIT_STD = 0.02
"""GPT-2's std for the weights of every linear and embedding layer."""


def check_seq_len(length: int, max_seq_len: int | None) -> None:
    """Raise ``ValueError`` when a sequence of ``length`` tokens does not fit ``max_seq_len``."""
    if max_seq_len is not None and length > max_seq_len:
        raise ValueError(
            f"sequence length {length} exceeds max_seq_len={max_seq_len}; use shorter inputs or a model with "
            f"max_seq_len >= {length}"
        )


def check_input_ids(input_ids: Tensor, name: str) -> None:
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"{name}: input_ids of shape {shape}; expected [batch, tokens] token ids")
    if input_ids.dtype not in (torch.long, torch.int32):
        raise ValueError(f"{name}: input_ids have dtype {input_ids.dtype}; expected torch.long token ids")
    if input_ids.shape[1] == 0:
        raise ValueError(f"{name}: input_ids hold no tokens (shape {tuple(input_ids.shape)}); pass at least one")


def check_padding_mask(padding_mask: Tensor | None, input_ids: Tensor, cache, name: str) -> None:
    """A padding mask is a bool ``[batch, tokens]`` like ``input_ids``, and whole sequences only (no cache)."""
    if padding_mask is None:
        return
    ok = isinstance(padding_mask, Tensor) and padding_mask.shape == input_ids.shape
    if not ok or padding_mask.dtype != torch.bool:
        shape = tuple(padding_mask.shape) if isinstance(padding_mask, Tensor) else type(padding_mask).__name__
        raise ValueError(
            f"{name}: padding_mask {shape} - expected a bool tensor of input_ids' shape {tuple(input_ids.shape)}, "
            "True for real tokens"
        )
    if cache is not None:
        raise ValueError(f"{name}: padding_mask with a cache; decode the real tokens only (pass padding_mask=None)")


def check_positive_int(value, name: str, owner: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}: {name}={value!r} must be a positive int")


def check_dropout(value, owner: str) -> None:
    if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{owner}: dropout={value!r} must lie in [0, 1)")


def activation_layer(act_layer: str, owner: str, examples: str) -> type[nn.Module]:
    """The timm activation named ``act_layer``; a ``ValueError`` naming it where timm has none (timm: ``KeyError``)."""
    try:
        act = get_act_layer(act_layer)
    except KeyError:
        act = None
    if act is None:
        raise ValueError(f"{owner}: act_layer={act_layer!r} is not a timm activation name (e.g. {examples})")
    return act


def check_cache_batch(cache, batch: int, name: str) -> None:
    if cache.batch_size != batch:
        raise ValueError(
            f"{name}: the cache holds {cache.batch_size} sequences but input_ids has batch {batch}; "
            f"make the cache with init_cache(batch_size={batch})"
        )


def takes_token_ids(layer: nn.Module) -> bool:
    """Whether ``layer`` routes by token id (its router reads ids: hash routing) and must get them."""
    return getattr(getattr(layer, "router", None), "needs_token_ids", False)


def takes_positions(layer: nn.Module) -> bool:
    """Whether ``layer`` routes by position (Lory's segments) and must get ``start`` and its decoding state."""
    return getattr(layer, "needs_positions", False)


@torch.no_grad()
def fit_hash_routing(model: nn.Module, token_ids: Tensor | None = None, *, refit: bool = False) -> list[str]:
    """Fit the tables of the hash routers of ``model`` that are fitted from data
    (:class:`~moekit.moe.hash_routing.HashRouter`): ``hash_method="frequency"`` from the counts of ``token_ids`` (the
    training corpus, any shape), ``"clustered"`` from the model's token embeddings
    (``model.get_input_embeddings()``). Routers already fitted are left alone unless ``refit``. Returns the names of
    the layers fitted."""
    fitted = []
    for name, module in model.named_modules():
        router = getattr(module, "router", None)
        method = getattr(router, "hash_method", None)
        if method not in ("frequency", "clustered") or not (refit or router.needs_fit):
            continue
        if method == "frequency":
            if token_ids is None:
                raise ValueError(
                    f"{name}: hash_method='frequency' is fitted from token counts; pass the training token ids"
                )
            router.fit_frequency(torch.bincount(token_ids.reshape(-1).cpu(), minlength=router.vocab_size))
        else:
            router.fit_clusters(model.get_input_embeddings().weight)
        fitted.append(name)
    return fitted
