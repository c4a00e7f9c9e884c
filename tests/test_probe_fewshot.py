"""The few-shot ridge probe's maths (moekit.tasks.fewshot) against hand computations."""

import math
import re

import pytest
import torch
from omegaconf import OmegaConf

from moekit.tasks.fewshot import L2_GRID, FewShotResult, _design, fewshot_linear_probe, fit_ridge_probe


def test_one_shot_probe_does_not_claim_a_leave_one_out_accuracy():
    """Leaving out a class's only example leaves the class without any: the closed form then reports ~1.0 on
    random features (the held-out point is in the features' mean) and picks the smallest l2 for it."""
    torch.manual_seed(0)
    features, labels = torch.randn(10, 64), torch.arange(10)
    _, _, _, l2, loo = fit_ridge_probe(features, labels, 10)
    assert math.isnan(loo), f"1-shot leave-one-out accuracy {loo} on random features"
    assert l2 == 1.0 and l2 in L2_GRID
    text = str(FewShotResult(accuracy=0.5, shots=1, l2_reg=l2, loo_accuracy=loo))
    assert "nan" not in text and "fixed" in text


def test_probe_equals_a_hand_ridge_fit():
    """W = (X^T X + l2 I)^-1 X^T Y on standardised features with a bias column, Y in {-1, +1}."""
    torch.manual_seed(1)
    features, labels = torch.randn(15, 6), torch.arange(15) % 3
    weights, mean, std, l2, loo = fit_ridge_probe(features, labels, 3, l2_grid=(0.25,))
    x = torch.cat([(features.double() - features.double().mean(0)) / features.double().std(0), torch.ones(15, 1)], 1)
    y = 2.0 * torch.nn.functional.one_hot(labels, 3).double() - 1
    expected = torch.linalg.solve(x.t() @ x + 0.25 * torch.eye(7, dtype=torch.float64), x.t() @ y)
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(_design(features, mean, std), x)
    assert l2 == 0.25 and 0.0 <= loo <= 1.0


@pytest.mark.parametrize("shots", ["ten", None, 0, True, 2.5])
def test_the_probe_refuses_a_bad_shots_before_loading_the_checkpoint(shots, monkeypatch):
    import moekit.commands.probe as probe

    def load_task(path):
        raise AssertionError("loaded the checkpoint before checking shots")

    monkeypatch.setattr(probe, "load_task", load_task)
    with pytest.raises(ValueError, match=re.escape(f"shots={shots!r}: give the examples per class as a whole")):
        probe.linear_probe(OmegaConf.create({"ckpt_path": "x.ckpt", "shots": shots, "seed": 0}))


def test_a_leave_one_out_tie_goes_to_the_larger_l2():
    """Separable classes: every l2 of the grid has leave-one-out accuracy 1; the least regularised fit
    (2^-10, the old choice) interpolates noise, so the tie goes to the most regularised one."""
    torch.manual_seed(0)
    centers = 10 * torch.randn(4, 16)
    labels = torch.arange(4).repeat_interleave(3)
    features = centers[labels] + 0.01 * torch.randn(12, 16)
    _, _, _, l2, loo = fit_ridge_probe(features, labels, 4)
    assert loo == 1.0 and l2 == max(L2_GRID)


class _ToyNet(torch.nn.Module):
    """Pre-logit features = the flattened image through a fixed linear map (timm's two-step forward)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(12, 8)

    def forward_features(self, x):
        return self.proj(x.flatten(1))

    def forward_head(self, x, pre_logits=False):
        return x


class _ToyData:
    """What the probe reads of ImageClassificationDataModule; stacking the whole test split is refused."""

    num_classes = 3

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        centers = torch.randn(3, 3, 2, 2, generator=g)
        self.train_y, self.test_y = torch.arange(3).repeat_interleave(4), torch.arange(60) % 3
        self.train_x = centers[self.train_y] + 0.8 * torch.randn(12, 3, 2, 2, generator=g)
        self.test_x = centers[self.test_y] + 0.8 * torch.randn(60, 3, 2, 2, generator=g)

    def setup(self, stage=None):
        pass

    def fewshot_arrays(self, shots, seed):
        return self.train_x, self.train_y

    def test_dataloader(self):
        return [(self.test_x[i : i + 16], self.test_y[i : i + 16]) for i in range(0, 60, 16)]

    def test_arrays(self):
        raise MemoryError("the whole test split stacked: 30 GB for ImageNet at 224 px")


def test_probe_streams_the_test_split_and_equals_a_hand_computation():
    torch.manual_seed(0)
    net, data = _ToyNet(), _ToyData()
    result = fewshot_linear_probe(net, data, shots=4, seed=0)
    with torch.no_grad():
        train, test = net.proj(data.train_x.flatten(1)).double(), net.proj(data.test_x.flatten(1)).double()
    mean, std = train.mean(0), train.std(0)
    x = torch.cat([(train - mean) / std, torch.ones(12, 1, dtype=torch.float64)], 1)
    y = 2.0 * torch.nn.functional.one_hot(data.train_y, 3).double() - 1
    w = torch.linalg.solve(x.t() @ x + result.l2_reg * torch.eye(9, dtype=torch.float64), x.t() @ y)
    scores = torch.cat([(test - mean) / std, torch.ones(60, 1, dtype=torch.float64)], 1) @ w
    assert result.accuracy == pytest.approx((scores.argmax(1) == data.test_y).double().mean().item())
    assert result.l2_reg in L2_GRID and result.shots == 4


def test_more_shots_than_a_class_has_names_the_fix(fake_fashion):
    from moekit.data import ImageClassificationDataModule

    data = ImageClassificationDataModule(dataset="fashion_mnist", root=str(fake_fashion), val_size=0)
    with pytest.raises(ValueError, match=r"fewer than shots=1000; give a smaller shots=, or data with more"):
        fewshot_linear_probe(_ToyNet(), data, shots=1000)


def test_a_probe_takes_data_of_another_class_count_and_testing_does_not():
    """Transfer: a probe (or calibration, or slot pictures) fits its own classifier, so a CIFAR-10 model probes
    CIFAR-100; testing the checkpoint's own classifier needs its 10 classes."""
    from moekit.commands.common import datamodule_for
    from moekit.tasks import ImageClassifier

    net = {"_target_": "moekit.models.create_model", "model_name": "vit_tiny_patch4_32", "embed_dim": 32, "depth": 2,
           "num_heads": 2, "num_classes": 10}  # fmt: skip
    module = ImageClassifier(net=net, num_classes=10)
    cfg = OmegaConf.create(
        {
            "ckpt_path": "run.ckpt",
            "data": {"_target_": "moekit.data.ImageClassificationDataModule", "dataset": "cifar100"},
        }
    )
    assert datamodule_for(cfg, module, same_labels=False).num_classes == 100
    with pytest.raises(ValueError, match=r"has num_classes=100 but the checkpoint 'run.ckpt' was trained with num_cl"):
        datamodule_for(cfg, module)
