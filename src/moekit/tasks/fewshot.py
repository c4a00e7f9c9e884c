"""Few-shot linear probing (the Soft MoE / big_vision protocol): freeze the network, take its
pre-logit features of ``shots`` training images per class, fit an L2-regularised least-squares
classifier to ``{-1, +1}`` one-vs-all targets, and report its accuracy on the test set.

The regulariser is chosen among ``2^-10 .. 2^10`` by leave-one-out accuracy on the few-shot set
itself (closed form for ridge regression), so the test set is never used to tune it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["FewShotResult", "extract_features", "fit_ridge_probe", "fewshot_linear_probe"]

L2_GRID = tuple(2.0**k for k in range(-10, 11))


@dataclass
class FewShotResult:
    accuracy: float
    shots: int
    l2_reg: float
    loo_accuracy: float

    def __str__(self) -> str:
        return (
            f"{self.shots}-shot linear probe: test accuracy {self.accuracy:.4f} "
            f"(l2 {self.l2_reg:g}, leave-one-out accuracy {self.loo_accuracy:.4f})"
        )


@torch.no_grad()
def extract_features(net: nn.Module, images: Tensor, batch_size: int = 256) -> Tensor:
    """Pre-logit features ``[N, D]`` (timm ``forward_head(..., pre_logits=True)``) of ``images [N, C, H, W]``."""
    was_training = net.training
    net.eval()
    device = next(net.parameters()).device
    chunks = []
    for start in range(0, images.shape[0], batch_size):
        batch = images[start : start + batch_size].to(device)
        chunks.append(net.forward_head(net.forward_features(batch), pre_logits=True).float().cpu())
    net.train(was_training)
    return torch.cat(chunks)


def _design(features: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    x = (features.double() - mean) / std
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)  # bias column


def fit_ridge_probe(features: Tensor, labels: Tensor, num_classes: int, l2_grid=L2_GRID):
    """Fit the probe; returns ``(weights [D+1, K], mean, std, l2, loo_accuracy)``.

    For each ``l2``: ``W = (X^T X + l2 I)^-1 X^T Y``; leave-one-out predictions are
    ``Y - (Y - X W) / (1 - h)`` with ``h`` the diagonal of ``X (X^T X + l2 I)^-1 X^T``.
    """
    mean = features.double().mean(0)
    std = features.double().std(0).clamp_min(1e-6)
    x = _design(features, mean, std)
    targets = -torch.ones(x.shape[0], num_classes, dtype=torch.float64)
    targets[torch.arange(x.shape[0]), labels] = 1.0
    gram = x.t() @ x
    best = None
    for l2 in l2_grid:
        inverse = torch.linalg.inv(gram + l2 * torch.eye(gram.shape[0], dtype=gram.dtype))
        weights = inverse @ x.t() @ targets
        leverage = ((x @ inverse) * x).sum(1, keepdim=True)
        loo_pred = targets - (targets - x @ weights) / (1 - leverage).clamp_min(1e-9)
        loo_acc = (loo_pred.argmax(1) == labels).double().mean().item()
        if best is None or loo_acc > best[4]:
            best = (weights, mean, std, l2, loo_acc)
    return best


def fewshot_linear_probe(net: nn.Module, datamodule, shots: int = 10, seed: int = 0) -> FewShotResult:
    """``shots``-per-class linear probe of ``net`` on ``datamodule`` (needs ``fewshot_arrays`` and
    ``test_arrays``, as :class:`moekit.data.ImageClassificationDataModule` has)."""
    if shots < 1:
        raise ValueError(f"shots={shots!r} must be >= 1")
    datamodule.setup("fit")
    x_train, y_train = datamodule.fewshot_arrays(shots, seed)
    x_test, y_test = datamodule.test_arrays()
    train_features = extract_features(net, x_train)
    weights, mean, std, l2, loo_acc = fit_ridge_probe(train_features, y_train, datamodule.num_classes)
    scores = _design(extract_features(net, x_test), mean, std) @ weights
    accuracy = (scores.argmax(1) == y_test).double().mean().item()
    return FewShotResult(accuracy=accuracy, shots=shots, l2_reg=l2, loo_accuracy=loo_acc)
