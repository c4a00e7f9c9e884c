"""Autoregressive sampling from the language models of :mod:`moekit.models` (Transformer and LSTM).

:func:`sample_next_token` turns next-token logits into tokens (greedy, temperature, top-k, nucleus);
:func:`generate` extends prompts token by token, with the model's cache (a KV cache for
:class:`~moekit.models.TransformerLM`, the carried LSTM state for :class:`~moekit.models.LSTMMoELM`)
or by re-running the whole sequence every step.

Sampling draws ``argmax(p / q)`` with ``q ~ Exp(1)`` per token, an exact sample of ``p`` (the
exponential race) that stays on the device: no host synchronisation per step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .lm_common import check_seq_len

__all__ = ["sample_next_token", "generate", "tokens_run", "check_generation"]


def check_generation(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    """:func:`generate`'s own arguments, checked before any work (``ValueError`` naming the bad one)."""
    _check_sampling(temperature, top_k, top_p)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0")


_FLOAT32_MAX = torch.finfo(torch.float32).max  # a larger temperature turns every logit into 0 (or NaN)


def _check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
    if not number or not 0 <= temperature <= _FLOAT32_MAX:
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0 = greedy argmax)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be an int >= 1 (keep the k most likely tokens), or None for all")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p={top_p!r} must lie in (0, 1] (the nucleus' probability mass), or None for all")


def _keep_top_k(logits: Tensor, top_k: int) -> Tensor:
    """``logits`` with all but the ``top_k`` largest of each row set to ``-inf``."""
    top = logits.topk(top_k, dim=-1)
    return torch.full_like(logits, float("-inf")).scatter(-1, top.indices, top.values)


def _keep_nucleus(logits: Tensor, top_p: float) -> Tensor:
    """``logits`` with ``-inf`` outside each row's nucleus: the most likely tokens whose probability
    first reaches ``top_p`` (the top token always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
    return torch.empty_like(logits).scatter(-1, order, sorted_logits)


def sample_next_token(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Sample one token per row of ``logits: [batch, vocab]`` -> ``[batch]`` long.

    Args:
        logits: next-token logits (any float dtype; sampled in float32).
        temperature: divides the logits; 0 = greedy (argmax; ``top_k`` / ``top_p`` then change nothing).
        top_k: keep the ``top_k`` most likely tokens (None or >= vocab: all).
        top_p: then keep the nucleus: the most likely tokens whose probability reaches ``top_p``
            (renormalised over the tokens ``top_k`` kept); None or 1: all.
        generator: the random generator (on the logits' device) for reproducible samples.
    """
    _check_sampling(temperature, top_k, top_p)
    if logits.dim() != 2:
        raise ValueError(f"logits of shape {tuple(logits.shape)}; expected [batch, vocab]")
    if temperature == 0:
        return logits.argmax(dim=-1)
    # The largest logit at 0 and a temperature float32 holds: a tiny temperature cannot overflow into inf - inf
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, torch.finfo(torch.float32).tiny)
    if top_k is not None and top_k < logits.shape[-1]:
        logits = _keep_top_k(logits, top_k)
    if top_p is not None and top_p < 1.0:
        logits = _keep_nucleus(logits, top_p)
    probs = logits.softmax(dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return (probs / race).argmax(dim=-1)


def tokens_run(prompt_len: int, max_new_tokens: int) -> int:
    """The longest sequence :func:`generate` runs through the model: the prompt and every new token but the last,
    after which nothing is sampled (what must fit ``max_seq_len`` without ``slide``)."""
    return prompt_len + max(0, max_new_tokens - 1)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    on_token: Callable[[Tensor], None] | None = None,
    slide: bool = False,
    vocab_limit: int | None = None,
) -> Tensor:
    """Extend ``prompt_ids: [batch, T0]`` by ``max_new_tokens`` sampled tokens -> ``[batch, T0 + max_new_tokens]``.

    Runs ``model`` in eval mode (its mode is restored afterwards) without gradients. With
    ``use_cache`` the prompt is run once into ``model.init_cache(batch)`` and then one token per step;
    without, every step re-runs the whole context. Sampling arguments as in :func:`sample_next_token`.
    ``on_token``, if given, receives each step's new tokens ``[batch]`` as soon as they are sampled (streaming).

    ``slide``: generate past the model's ``max_seq_len`` with a sliding window. The context is the last
    ``max_seq_len`` tokens at most (a longer prompt is cut to them); when it is full, it restarts from its last
    ``max_seq_len // 2`` tokens, re-encoded into a fresh cache at positions ``0 ..`` - the positions the model was
    trained on - so that each restart costs one forward of half a window, not one per token.

    ``vocab_limit``: sample ids below it only (a tokenizer smaller than the model's padded embedding: no id of the
    padding rows, which the tokenizer cannot decode).

    Raises:
        ValueError: bad sampling arguments or ``vocab_limit``, a prompt that is not ``[batch, T0 >= 1]`` token ids
            of the model's vocabulary, or, without ``slide``, ``T0 + max_new_tokens - 1`` tokens to run beyond the
            model's ``max_seq_len`` (:func:`tokens_run`, checked before any work).
    """
    check_generation(max_new_tokens, temperature, top_k, top_p)
    bad_limit = isinstance(vocab_limit, bool) or not isinstance(vocab_limit, int) or vocab_limit < 1
    if vocab_limit is not None and bad_limit:
        raise ValueError(f"vocab_limit={vocab_limit!r} must be an int >= 1 (the tokenizer's vocabulary size), or None")
    if not isinstance(prompt_ids, Tensor) or prompt_ids.dim() != 2 or prompt_ids.shape[1] == 0:
        shape = tuple(prompt_ids.shape) if isinstance(prompt_ids, Tensor) else type(prompt_ids).__name__
        raise ValueError(f"prompt_ids of shape {shape}; expected [batch, tokens] with at least one token per row")
    vocab_size = getattr(model, "vocab_size", None)
    outside = None if vocab_size is None else (prompt_ids < 0) | (prompt_ids >= vocab_size)
    if outside is not None and bool(outside.any()):  # an embedding lookup would fail deep in torch (on a GPU: assert)
        raise ValueError(
            f"prompt_ids hold token id {int(prompt_ids[outside][0])}, outside the model's vocabulary "
            f"0 .. {vocab_size - 1}; encode the prompt with the model's tokenizer"
        )
    if use_cache and not callable(getattr(model, "init_cache", None)):
        raise ValueError(f"use_cache=True needs {type(model).__name__}.init_cache(batch_size); pass use_cache=False")
    batch, prompt_len = prompt_ids.shape
    total = prompt_len + max_new_tokens
    limit = getattr(model, "max_seq_len", None)
    if not slide:
        try:
            check_seq_len(tokens_run(prompt_len, max_new_tokens), limit)
        except ValueError as err:
            raise ValueError(f"{err}, or pass slide=True (a sliding window over the last max_seq_len tokens)") from None

    tokens = prompt_ids.new_empty(batch, total)
    tokens[:, :prompt_len] = prompt_ids
    if max_new_tokens == 0:
        return tokens
    was_training = model.training
    model.eval()
    start = max(0, prompt_len - limit) if slide and limit is not None else 0  # the context: tokens[start:]

    def encode(end: int) -> Tensor:  # a fresh context tokens[start:end] -> the next-token logits
        context = tokens[:, start:end]
        return model(context, cache=cache)[:, -1] if use_cache else model(context)[:, -1]

    try:
        cache = model.init_cache(batch) if use_cache else None
        logits = encode(prompt_len)
        for t in range(prompt_len, total):
            if vocab_limit is not None and vocab_limit < logits.shape[-1]:
                logits = logits.clone()
                logits[:, vocab_limit:] = float("-inf")
            next_token = sample_next_token(logits, temperature, top_k, top_p, generator)
            tokens[:, t] = next_token
            if on_token is not None:
                on_token(next_token)
            if t + 1 == total:
                break
            if slide and limit is not None and t + 1 - start > limit:  # full: restart from the last half
                start = t + 1 - max(1, limit // 2)
                cache = model.init_cache(batch) if use_cache else None
                logits = encode(t + 1)
            elif use_cache:
                logits = model(next_token.unsqueeze(1), cache=cache)[:, -1]
            else:
                logits = encode(t + 1)
    finally:
        model.train(was_training)
    return tokens
