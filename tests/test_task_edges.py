"""Edge cases of the tasks and commands, checked against hand computations: a language-model batch whose targets are
all left out, mixup settings that mix nothing, the dataset override a command's error names, predict's settings."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moekit.commands.predict as predict_command
from conftest import TINY_NET, compose_config
from moekit.commands.common import datamodule_for
from moekit.moe import collect_moe_outputs
from moekit.tasks import ImageClassifier, LanguageModel
from moekit.tasks.precision import no_trainer_warnings

TINY_LM = {
    "_target_": "moekit.models.TransformerLM",
    "vocab_size": 32,
    "max_seq_len": 8,
    "dim": 16,
    "depth": 1,
    "num_heads": 2,
    "dropout": 0.0,
    "moe": {"recipe": "mixtral", "num_experts": 4},
}


def test_a_batch_whose_targets_are_all_left_out_adds_nothing_to_the_means():
    """A batch of prompts only (every target left out) has no cross-entropy: its loss is the aux losses alone, not
    NaN, and the training epoch's and the split's token-weighted means are those of the other batches' tokens."""
    torch.manual_seed(0)
    task = LanguageModel(net=TINY_LM, vocab_size=32).eval()
    inputs = torch.randint(1, 32, (4, 8))
    targets = torch.randint(0, 32, (4, 8))
    targets[0, 5:] = -100
    targets[2:] = -100  # the second batch: no real target
    mask = torch.ones(4, 8, dtype=torch.bool)
    with torch.no_grad():
        logits = task(inputs[:2], mask[:2])
    expected = F.cross_entropy(logits.flatten(0, 1), targets[:2].flatten(), ignore_index=-100)
    with torch.no_grad(), no_trainer_warnings():
        for split in ("train", "val"):
            batches = [(inputs[i : i + 2], targets[i : i + 2], mask[i : i + 2]) for i in (0, 2)]
            losses = [task._shared_step(batch, split) for batch in batches]
            assert torch.isfinite(losses[1]), split
    means = task.epoch_means.compute()
    torch.testing.assert_close(means["train/ce_epoch"], expected)
    torch.testing.assert_close(task.eval_ce["val"].compute(), expected)


@pytest.mark.parametrize("command", ["eval", "sample"])
def test_a_checkpoint_that_records_no_dataset_names_the_override_that_composes(command, tmp_path):
    """The error says ``data=<dataset>``; sample.py had no ``data`` group, where Hydra refused ``data=`` (asking for
    ``+data=``)."""
    module = LanguageModel(net=TINY_LM, vocab_size=32)
    cfg = compose_config(command, ["ckpt_path=x.ckpt"], tmp_path)
    with pytest.raises(ValueError, match=r"does not record its dataset; pass data=<dataset>"):
        datamodule_for(cfg, module)
    assert compose_config(command, ["ckpt_path=x.ckpt", "data=pydoc_text"], tmp_path).data.vocab_size


def test_mixup_with_both_alphas_zero_trains_on_the_smoothed_labels():
    """``mixup_alpha=0`` and ``cutmix_alpha=0`` (a sweep's "off") mix nothing: training takes the labels, smoothed,
    where timm's Mixup fails at the first step; a negative alpha is refused naming it."""
    task = ImageClassifier(
        net=TINY_NET, num_classes=10, label_smoothing=0.2, mixup={"mixup_alpha": 0.0, "cutmix_alpha": 0.0}
    ).eval()
    images, labels = torch.randn(6, 1, 28, 28), torch.tensor([0, 3, 7, 9, 1, 1])
    with torch.no_grad(), no_trainer_warnings():
        loss = task._shared_step((images, labels), "train")
        log_p = F.log_softmax(task(images).float(), dim=-1)
    nll = -log_p[torch.arange(6), labels].mean()
    expected = 0.8 * nll - 0.2 * log_p.mean(dim=-1).mean() + collect_moe_outputs(task.net).aux_loss
    torch.testing.assert_close(loss, expected)
    with pytest.raises(ValueError, match=r"task.mixup: .*'mixup_alpha': -0.5.* must be >= 0"):
        ImageClassifier(net=TINY_NET, num_classes=10, mixup={"mixup_alpha": -0.5})


@pytest.mark.parametrize("setting", ["top_k=true", "batch_size=true"])
def test_predict_refuses_a_boolean_count(setting, monkeypatch, tmp_path):
    """``top_k=true`` is Hydra's bool, which Python counts as 1: refused naming the value, not read as top-1."""
    monkeypatch.setattr(predict_command, "load_task", lambda path: ImageClassifier(net=TINY_NET, num_classes=10))
    cfg = compose_config("predict", ["ckpt_path=x.ckpt", f"inputs={tmp_path}", setting], tmp_path / "out")
    with pytest.raises(ValueError, match=rf"{setting.split('=')[0]}=True; give a whole number"):
        predict_command.predict(cfg)


@pytest.mark.parametrize(("key", "where"), [("label_smoothing", "task.label_smoothing"), ("num_classes", "the data")])
def test_mixup_settings_the_task_gives_are_refused_naming_where_they_come_from(key, where):
    """timm's Mixup got them twice: a TypeError ("multiple values for keyword argument") that named no fix."""
    with pytest.raises(ValueError, match=rf"task.mixup.{key}=0.1: the mixed targets take it from {where}"):
        ImageClassifier(net=TINY_NET, num_classes=10, mixup={"mixup_alpha": 0.8, key: 0.1})
