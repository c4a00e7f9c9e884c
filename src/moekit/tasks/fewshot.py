"""Few-shot linear probing (the Soft MoE / big_vision protocol): freeze the network, take its
pre-logit features of ``shots`` training images per class, fit an L2-regularised least-squares
classifier to ``{-1, +1}`` one-vs-all targets, and report its accuracy on the test set.

The regulariser is chosen among ``2^-10 .. 2^10`` by leave-one-out accuracy on the few-shot set
itself (closed form for ridge regression), so the test set is never used to tune it; a tie (frequent with a
few examples) goes to the larger l2. With 1 shot, leaving an example out leaves its class without any, so
leave-one-out cannot choose: the probe uses ``l2 = 1`` (the middle of the grid) and reports no leave-one-out
accuracy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["FewShotResult", "check_shots", "extract_features", "fit_ridge_probe", "fewshot_linear_probe"]

L2_GRID = tuple(2.0**k for k in range(-10, 11))
ONE_SHOT_L2 = 1.0  # the middle of L2_GRID, where leave-one-out cannot choose


@dataclass
class FewShotResult:
    accuracy: float
    shots: int
    l2_reg: float
    loo_accuracy: float

    def __str__(self) -> str:
        if math.isnan(self.loo_accuracy):
            return (
                f"{self.shots}-shot linear probe: test accuracy {self.accuracy:.4f} (l2 {self.l2_reg:g} fixed: "
                "leave-one-out needs 2 examples a class to choose it)"
            )
        return (
            f"{self.shots}-shot linear probe: test accuracy {self.accuracy:.4f} "
            f"(l2 {self.l2_reg:g}, leave-one-out accuracy {self.loo_accuracy:.4f})"
        )


def check_shots(shots: object) -> None:
    """Refuse a ``shots`` that is not a whole number >= 1, naming the fix (``shots=ten`` from the command line)."""
    if isinstance(shots, bool) or not isinstance(shots, int) or shots < 1:
        raise ValueError(f"shots={shots!r}: give the examples per class as a whole number >= 1, e.g. shots=10")


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
    ``Y - (Y - X W) / (1 - h)`` with ``h`` the diagonal of ``X (X^T X + l2 I)^-1 X^T``. When a class has a
    single example, leaving it out leaves the class without any (and the features' mean, which holds it, then
    makes that class win: a leave-one-out accuracy of ~1 at the smallest l2 even on random features), so the
    fit uses :data:`ONE_SHOT_L2` and returns ``loo_accuracy = nan``.
    """
    mean = features.double().mean(0)
    std = features.double().std(0).clamp_min(1e-6)
    x = _design(features, mean, std)
    targets = -torch.ones(x.shape[0], num_classes, dtype=torch.float64)
    targets[torch.arange(x.shape[0]), labels] = 1.0
    gram = x.t() @ x
    counts = torch.bincount(labels, minlength=num_classes)
    one_shot = int(counts[counts > 0].min()) < 2
    if one_shot:
        l2_grid = (ONE_SHOT_L2,)
    best = None
    for l2 in sorted(l2_grid):
        inverse = torch.linalg.inv(gram + l2 * torch.eye(gram.shape[0], dtype=gram.dtype))
        weights = inverse @ x.t() @ targets
        leverage = ((x @ inverse) * x).sum(1, keepdim=True)
        loo_pred = targets - (targets - x @ weights) / (1 - leverage).clamp_min(1e-9)
        loo_acc = (loo_pred.argmax(1) == labels).double().mean().item()
        if best is None or loo_acc >= best[4]:  # a tie goes to the larger l2, the safer fit on few examples
            best = (weights, mean, std, l2, loo_acc)
    if one_shot:
        best = (*best[:4], math.nan)
    return best


def fewshot_linear_probe(net: nn.Module, datamodule, shots: int = 10, seed: int = 0) -> FewShotResult:
    """``shots``-per-class linear probe of ``net`` on ``datamodule`` (needs ``fewshot_arrays`` and
    ``test_dataloader``, as :class:`moekit.data.ImageClassificationDataModule` has). The test images are read one
    loader batch at a time (ImageNet's 50,000 at 224 px would take 30 GB stacked); only the right answers are
    counted."""
    check_shots(shots)
    datamodule.setup("fit")
    try:
        x_train, y_train = datamodule.fewshot_arrays(shots, seed)
    except ValueError as err:  # a class with fewer training images than shots
        raise ValueError(f"{err}; give a smaller shots=, or data with more training images a class") from None
    train_features = extract_features(net, x_train)
    weights, mean, std, l2, loo_acc = fit_ridge_probe(train_features, y_train, datamodule.num_classes)
    hits = total = 0
    for x_test, y_test in datamodule.test_dataloader():
        scores = _design(extract_features(net, x_test), mean, std) @ weights
        hits += int((scores.argmax(1) == y_test).sum())
        total += len(y_test)
    if total == 0:
        raise ValueError("the test split is empty: the probe has nothing to score; give data with test images")
    accuracy = hits / total
    return FewShotResult(accuracy=accuracy, shots=shots, l2_reg=l2, loo_accuracy=loo_acc)
