"""The training task's numerics against hand-computed values: which parameters weight decay reaches, mixup's soft
targets on an odd batch, and a frozen backbone that stays frozen (batch-norm statistics included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import TINY_NET
from moekit.moe import SoftMoE
from moekit.tasks import ImageClassifier
from moekit.tasks.optim import param_groups


def _no_decay_ids(groups: list[dict]) -> set[int]:
    return {id(p) for group in groups if group["weight_decay"] == 0.0 for p in group["params"]}


def test_no_weight_decay_on_any_bias_the_experts_included():
    """An expert bank's biases are ``[experts, hidden]`` (2-d) but biases all the same: a dense MLP's ``fc1.bias``
    is not decayed, so neither are the experts' copies of it. Every trainable parameter is in exactly one group."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), SoftMoE(4, 8, num_experts=2), nn.Linear(4, 3))
    model[3].weight.requires_grad = False
    experts = model[2].experts
    assert experts.fc1_bias.ndim == 2 and experts.fc2_bias.ndim == 2
    groups = param_groups(model, weight_decay=0.1)
    no_decay = _no_decay_ids(groups)
    assert {id(experts.fc1_bias), id(experts.fc2_bias), id(model[0].bias)} <= no_decay
    assert id(experts.fc1_weight) not in no_decay and id(model[2].phi) not in no_decay
    grouped = [id(p) for group in groups for p in group["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters() if p.requires_grad)
    (everything,) = param_groups(model, weight_decay=0.1, decay_1d=True)  # decay_1d: biases decayed too
    assert id(experts.fc1_bias) in {id(p) for p in everything["params"]}


def test_an_moe_vit_decays_no_bias():
    net = ImageClassifier(net=TINY_NET, num_classes=10).net
    no_decay = _no_decay_ids(param_groups(net, weight_decay=0.05))
    biases = [name for name, _ in net.named_parameters() if name.endswith("bias")]
    assert any("experts.fc1_bias" in name for name in biases)
    assert [name for name, p in net.named_parameters() if name.endswith("bias") and id(p) not in no_decay] == []


def test_mixup_of_an_odd_batch_mixes_all_but_the_last_image():
    """timm's Mixup refuses an odd batch (the last, partial batch of an epoch): the task mixes the first ``n - 1``
    images and gives the last its own label, smoothed as the others are."""
    task = ImageClassifier(
        net=TINY_NET, num_classes=10, label_smoothing=0.1, mixup={"mixup_alpha": 0.8, "cutmix_alpha": 0.0}
    )
    images, labels = torch.randn(7, 1, 28, 28), torch.tensor([0, 1, 2, 3, 4, 5, 6])
    assert torch.isfinite(task._shared_step((images.clone(), labels), "train"))  # timm alone: "should be even"
    np.random.seed(0)
    mixed, targets = task._mix(images.clone(), labels)
    smooth = F.one_hot(labels, 10).float() * 0.9 + 0.01  # on 0.91, off 0.01
    lam = (targets[0, 0].item() - 0.01) / 0.9  # image 0 pairs with image 5 (the first six flipped)
    assert 0.0 < lam < 1.0
    torch.testing.assert_close(targets[:6], lam * smooth[:6] + (1 - lam) * smooth[:6].flip(0))
    torch.testing.assert_close(targets[6], smooth[6])
    torch.testing.assert_close(mixed[:6], lam * images[:6] + (1 - lam) * images[:6].flip(0))
    torch.testing.assert_close(mixed[6], images[6])
    torch.testing.assert_close(targets.sum(-1), torch.ones(7))
    _, single = task._mix(images[:1].clone(), labels[:1])  # a batch of one: nothing to mix with
    torch.testing.assert_close(single, smooth[:1])


def test_label_smoothing_trains_and_evaluation_reports_the_plain_cross_entropy():
    """Smoothing is a training target: val/test losses are the cross-entropy of the labels (as timm validates), so
    they compare with other runs' and tools' whatever the smoothing."""
    task = ImageClassifier(net=TINY_NET, num_classes=10, label_smoothing=0.3).eval()
    images, labels = torch.randn(4, 1, 28, 28), torch.tensor([0, 3, 7, 9])
    with torch.no_grad():
        log_p = F.log_softmax(task(images).float(), dim=-1)
        plain = -log_p[torch.arange(4), labels].mean()
        smoothed = 0.7 * plain - 0.3 * log_p.mean(dim=-1).mean()
        for split, expected in (("val", plain), ("test", plain), ("train", smoothed)):
            torch.testing.assert_close(task._shared_step((images, labels), split), expected)


def test_a_frozen_backbone_stays_in_eval_mode_while_the_head_trains():
    """Linear probing: no batch-norm statistics of the conv stem (nor any other buffer) move in training, only the
    head is in training mode, also after an evaluation switched the task to eval and back."""
    net = dict(TINY_NET, stem="conv", stem_channels=[8, 16])
    task = ImageClassifier(net=net, num_classes=10, freeze_backbone=True)
    assert any(isinstance(m, nn.BatchNorm2d) for m in task.net.modules())
    before = {k: v.clone() for k, v in task.net.state_dict().items()}
    task.eval()
    task.train()
    assert task.training and task.net.head.training and not task.net.training
    assert not any(m.training for name, m in task.net.named_modules() if name and not name.startswith("head"))
    task._shared_step((torch.randn(4, 1, 28, 28), torch.arange(4)), "train")
    changed = [k for k, v in task.net.state_dict().items() if not torch.equal(v, before[k])]
    assert changed == []
    unfrozen = ImageClassifier(net=net, num_classes=10)  # the same backbone trained: every module trains
    assert all(m.training for m in unfrozen.modules())


@pytest.mark.parametrize("masked", ["padding", "targets"])
def test_training_epoch_cross_entropy_of_padded_documents_is_the_mean_over_real_tokens(masked):
    """``data.pack=false`` batches hold different amounts of padding: the training epoch's ``train/ce_epoch`` is the
    mean negative log-likelihood over the epoch's real target tokens (as ``val/ce`` is over the split's), not a mean
    of batch means weighed by positions, padding included. Learning rate 0: the weights of every batch are the
    start's; the checkpoint holds the count of real tokens, for a resumed epoch to go on from. ``targets``: every
    input real, some targets left out of the loss (a prompt's): ``val/ce`` weighed batches by their real inputs."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from moekit.tasks import LanguageModel

    net = {"_target_": "moekit.models.TransformerLM", "vocab_size": 32, "max_seq_len": 8, "dim": 16, "depth": 1}
    net |= {"num_heads": 2, "dropout": 0.0, "moe": {"recipe": "mixtral", "num_experts": 4}}
    task = LanguageModel(net=net, vocab_size=32, optimizer={"lr": 0.0, "weight_decay": 0.0})
    lengths = torch.tensor([8, 1, 2, 8, 3, 8])  # batches of two: 9, 10 and 11 real targets of 16 positions
    real = torch.arange(8) < lengths[:, None]
    mask = real if masked == "padding" else torch.ones(6, 8, dtype=torch.bool)
    inputs = torch.where(mask, torch.randint(1, 32, (6, 8)), 0)
    targets = torch.where(real, torch.randint(0, 32, (6, 8)), -100)
    data = DataLoader(TensorDataset(inputs, targets, mask), batch_size=2)
    trainer = L.Trainer(
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(task, data, data)
    with torch.no_grad():
        logits = task.eval()(inputs, mask)
    nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum") / real.sum()
    metrics = trainer.callback_metrics
    torch.testing.assert_close(metrics["val/ce"], nll)
    torch.testing.assert_close(metrics["train/ce_epoch"], nll)
    checkpoint = {}
    task.on_save_checkpoint(checkpoint)
    counts = [count for _, count in checkpoint["moekit_epoch_means"]["sums"].values()]
    assert counts and all(int(count) == real.sum() for count in counts)
