"""Load-balancing and stability losses of the sparse MoE literature, as pure functions of router outputs.

All inputs are router tensors (float32, or float64 in tests) over ``N`` tokens and ``E`` experts. Each layer multiplies
these by its own weight (zero turns a loss off).

Every loss takes an optional ``mask: [N]`` bool of the tokens that count (False for padding): the others are left
out of every sum and mean, so a loss over real tokens does not change with the amount of padding around them. The
mask enters as weights, never by indexing, so the shapes stay static and nothing synchronises with the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .routing import count_ids

__all__ = [
    "switch_load_balancing_loss",
    "switch_loss_from_fractions",
    "cv_squared",
    "importance_loss",
    "load_loss",
    "load_probabilities",
    "smooth_load",
    "vmoe_load_probabilities",
    "vmoe_load_loss",
    "router_z_loss",
    "bengio_batchwise_loss",
    "bengio_examplewise_loss",
    "bengio_variance_loss",
    "batchwise_threshold_loss",
    "masked_mean",
]


def masked_mean(values: Tensor, mask: Tensor | None = None) -> Tensor:
    """The mean of ``values [N, ...]`` over its first dimension, over the tokens of ``mask [N]`` only (0 when none)."""
    if mask is None:
        return values.mean(dim=0)
    weights = mask.to(values.dtype).view(-1, *([1] * (values.dim() - 1)))
    return (values * weights).sum(dim=0) / weights.sum().clamp_min(1.0)


def _masked(values: Tensor, mask: Tensor | None) -> Tensor:
    """``values [N, ...]`` with the rows outside ``mask`` zeroed (for sums over tokens)."""
    return values if mask is None else values * mask.to(values.dtype).view(-1, *([1] * (values.dim() - 1)))


def switch_load_balancing_loss(
    router_probs: Tensor, expert_ids: Tensor, num_experts: int, mask: Tensor | None = None
) -> Tensor:
    """Switch Transformer (Fedus et al. 2021) balancing loss ``E * sum_i f_i * P_i``.

    Args:
        router_probs: ``[N, E]`` softmax router probabilities.
        expert_ids: ``[N]`` or ``[N, k]`` chosen experts (before capacity).
        num_experts: ``E``.

    ``f_i`` is the fraction of routing assignments that chose expert ``i`` (over all ``k`` choices, so a
    perfectly balanced router gives ``f_i = 1/E`` for any ``k``) and ``P_i`` the mean router probability
    of expert ``i``. The loss is 1 at perfect balance and ``E`` when all tokens collapse onto one expert.
    """
    if mask is None:
        counts = count_ids(expert_ids, num_experts).to(router_probs.dtype)
        return switch_loss_from_fractions(router_probs, counts / expert_ids.numel())
    ids = expert_ids.reshape(mask.shape[0], -1)  # [N, k]
    weights = mask.to(router_probs.dtype).unsqueeze(1).expand_as(ids).reshape(-1)
    counts = router_probs.new_zeros(num_experts).index_add_(0, ids.reshape(-1), weights)
    return switch_loss_from_fractions(router_probs, counts / counts.sum().clamp_min(1.0), mask)


def switch_loss_from_fractions(router_probs: Tensor, fraction: Tensor, mask: Tensor | None = None) -> Tensor:
    """``E * sum_i f_i * P_i`` with given assignment fractions ``f [E]`` (no gradient flows through them) and
    ``P_i`` the mean of ``router_probs [N, E]`` over the tokens: the Switch loss with ``f`` counted elsewhere, e.g.
    over a whole global batch."""
    return router_probs.shape[-1] * torch.sum(fraction.to(router_probs.dtype) * masked_mean(router_probs, mask))


def cv_squared(values: Tensor, eps: float = 1e-10) -> Tensor:
    """Squared coefficient of variation ``Var(v) / Mean(v)^2`` (population variance), 0 for one value."""
    if values.numel() <= 1:
        return values.new_zeros(())
    return values.var(unbiased=False) / (values.mean() ** 2 + eps)


def importance_loss(gates: Tensor, mask: Tensor | None = None) -> Tensor:
    """Shazeer et al. 2017 importance loss ``CV(Importance)^2`` with ``Importance_i = sum_x G(x)_i``.

    Args:
        gates: ``[N, E]`` sparse gate values (zero for unselected experts).
    """
    return cv_squared(_masked(gates, mask).sum(dim=0))


def load_probabilities(clean_logits: Tensor, noisy_logits: Tensor, noise_std: Tensor, k: int) -> Tensor:
    """Shazeer et al. 2017 ``P(x, i)``: the probability that expert ``i`` stays in the top ``k`` of the
    noisy logits ``H`` if its own noise were drawn again,
    ``P(x, i) = Phi((clean_i - kth_excluding(H, k, i)) / noise_std_i)``.

    The threshold is the ``k``-th largest noisy logit among the other experts: the ``(k+1)``-th largest
    of ``H`` when ``i`` is in the top ``k``, the ``k``-th largest otherwise.

    Args:
        clean_logits, noisy_logits, noise_std: ``[N, E]``.
        k: experts per token.

    Returns:
        ``[N, E]``.
    """
    num_experts = noisy_logits.shape[-1]
    if k >= num_experts:  # every expert is always selected
        return torch.ones_like(noisy_logits)
    top_values = noisy_logits.topk(k + 1, dim=-1).values  # [N, k+1]
    threshold_if_in = top_values[:, k : k + 1]
    threshold_if_out = top_values[:, k - 1 : k]
    is_in = noisy_logits >= threshold_if_out
    threshold = torch.where(is_in, threshold_if_in, threshold_if_out)
    return torch.special.ndtr((clean_logits - threshold) / noise_std)


def smooth_load(
    clean_logits: Tensor, noisy_logits: Tensor, noise_std: Tensor, k: int, mask: Tensor | None = None
) -> Tensor:
    """Shazeer et al. 2017 smooth load estimator ``Load_i = sum_x P(x, i)`` (see
    :func:`load_probabilities`); ``[E]``."""
    return _masked(load_probabilities(clean_logits, noisy_logits, noise_std, k), mask).sum(dim=0)


def load_loss(
    clean_logits: Tensor, noisy_logits: Tensor, noise_std: Tensor, k: int, mask: Tensor | None = None
) -> Tensor:
    """Shazeer et al. 2017 load loss ``CV(Load)^2`` from :func:`smooth_load`."""
    return cv_squared(smooth_load(clean_logits, noisy_logits, noise_std, k, mask))


def vmoe_load_probabilities(clean_logits: Tensor, noisy_logits: Tensor, noise_std: Tensor, k: int) -> Tensor:
    """V-MoE (Riquelme et al. 2021, appendix A.2) ``P(x, i) = 1 - Phi((threshold_k(x) - clean_i) / noise_std)``:
    the probability that expert ``i``'s logit, with its noise drawn again, clears ``threshold_k(x)``, the
    ``k``-th largest noisy logit of ``x`` over all experts (Shazeer's :func:`load_probabilities` leaves expert
    ``i`` out of the threshold instead).

    Args:
        clean_logits, noisy_logits, noise_std: ``[N, E]``.
        k: experts per token.

    Returns:
        ``[N, E]``.
    """
    threshold = noisy_logits.topk(k, dim=-1).values[:, k - 1 : k]
    return torch.special.ndtr((clean_logits - threshold) / noise_std)


def vmoe_load_loss(
    clean_logits: Tensor, noisy_logits: Tensor, noise_std: Tensor, k: int, mask: Tensor | None = None
) -> Tensor:
    """V-MoE load loss ``CV(Load)^2`` with ``Load_i = sum_x P(x, i)`` of :func:`vmoe_load_probabilities`."""
    return cv_squared(_masked(vmoe_load_probabilities(clean_logits, noisy_logits, noise_std, k), mask).sum(dim=0))


def router_z_loss(logits: Tensor, mask: Tensor | None = None) -> Tensor:
    """ST-MoE (Zoph et al. 2022) router z-loss ``mean_x (logsumexp_i logits_x,i)^2``."""
    return masked_mean(torch.logsumexp(logits, dim=-1).pow(2), mask)


# Bengio, Bacon, Pineau and Precup 2015, "Conditional computation in neural networks for faster models": three
# regularisers of the probabilities ``sigma [N, E]`` that each of ``E`` units (here: experts) is on for each of ``N``
# examples (here: tokens), towards a target rate ``tau`` of units on.


def bengio_batchwise_loss(probs: Tensor, target: float, mask: Tensor | None = None) -> Tensor:
    """``L_b = sum_e | mean_n sigma_ne - tau |``: every expert on for a fraction ``tau`` of the batch (balance).

    Args:
        probs: ``[N, E]`` probabilities that expert ``e`` is used for token ``n``.
        target: ``tau``.
    """
    return (masked_mean(probs, mask) - target).abs().sum()


def bengio_examplewise_loss(probs: Tensor, target: float, mask: Tensor | None = None) -> Tensor:
    """``L_e = mean_n | mean_e sigma_ne - tau |``: every token uses a fraction ``tau`` of the experts (sparsity
    per example). Constant for probabilities that sum to 1 over experts (a softmax router)."""
    return masked_mean((probs.mean(dim=1) - target).abs(), mask)


def bengio_variance_loss(probs: Tensor, mask: Tensor | None = None) -> Tensor:
    """``L_v = -sum_e Var_n(sigma_ne)`` (population variance): minimised by experts that are on for some tokens and
    off for others, so that routing depends on the token rather than being the same for all."""
    return -masked_mean((probs - masked_mean(probs, mask)).pow(2), mask).sum()


def batchwise_threshold_loss(
    scores: Tensor, thresholds: Tensor, batchwise_mask: Tensor, mask: Tensor | None = None
) -> Tensor:
    """Shazeer et al. 2017, appendix F: ``L_batchwise = sum_n sum_e (M_threshold - M_batchwise)_ne (X_ne - T_e)``,
    here averaged over the ``N`` tokens so that its weight does not depend on the batch size.

    Args:
        scores: ``X [N, E]``, the gate scores the masks are taken of.
        thresholds: ``T [E]``; ``M_threshold = X > T``.
        batchwise_mask: ``M_batchwise [N, E]`` bool, each expert's top ``m`` tokens of the batch.

    Every term is ``>= 0`` (a token the threshold lets in but the batch does not has ``X > T``, one the batch
    takes but the threshold does not has ``X <= T``), so the loss is zero exactly when the masks agree; its
    gradient moves each ``T_e`` by the number of disagreements in each direction.
    """
    threshold_mask = (scores > thresholds).to(scores.dtype)
    return masked_mean(((threshold_mask - batchwise_mask.to(scores.dtype)) * (scores - thresholds)).sum(dim=1), mask)
