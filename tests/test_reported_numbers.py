"""The routing and throughput numbers moekit reports, against hand-computed values."""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from moekit.callbacks import ExpertLoadMonitor, ThroughputMonitor
from moekit.callbacks.moe_stats import RoutingStatsSums
from moekit.moe import TopKMoE


def test_interval_figures_weight_each_forward_by_its_real_tokens_not_its_padding():
    """Padding counts in no routing statistic, so not in the weights either: two padded forwards of a dropless
    layer give the figures of one forward over both (real tokens 3 + 10 = 13, not 2 x 6 + 2 x 6 = 24 positions)."""
    torch.manual_seed(0)
    layer = TopKMoE(8, 16, num_experts=4, top_k=2, capacity_factor=None)
    monitor, sums = ExpertLoadMonitor(), RoutingStatsSums()
    monitor.watch(nn.Sequential(layer))
    xs = [torch.randn(2, 6, 8), torch.randn(2, 6, 8)]
    masks = [torch.arange(6) < torch.tensor([[2], [1]]), torch.arange(6) < torch.tensor([[6], [4]])]
    for x, mask in zip(xs, masks):
        layer(x, padding_mask=mask)
        monitor.accumulate(sums)
    f = sums.compute()["0"]
    assert f.tokens == 13
    layer(torch.cat(xs), padding_mask=torch.cat(masks))
    whole = layer.stats
    torch.testing.assert_close(f.expert_load, whole["expert_load"])
    for key in ("router_entropy", "mean_top_gate"):
        assert f.scalars[key] == pytest.approx(whole[key].item(), rel=1e-5), key


class _Tiny(L.LightningModule):
    """A linear model on ``(x, y)`` batches of 4 rows; validation sleeps ``val_sleep`` seconds per batch."""

    def __init__(self, val_sleep: float = 0.0) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.val_sleep = val_sleep

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).square().mean()

    def validation_step(self, batch, batch_idx):
        time.sleep(self.val_sleep)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(16, 3), torch.zeros(16)), batch_size=4)


def _trainer(tmp_path, monitor: ThroughputMonitor, **kwargs) -> L.Trainer:
    settings = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    return L.Trainer(default_root_dir=tmp_path, accelerator="cpu", callbacks=[monitor], **{**settings, **kwargs})


def test_throughput_totals_of_a_resumed_fit_count_the_batches_before_its_checkpoint(tmp_path):
    """``results.json``'s examples (and the training FLOPs made from them), batches and fit time are the run's, not
    those after the last resume: 2 epochs of 4 batches of 4 rows, then 1 more epoch from the checkpoint."""
    first = ThroughputMonitor(log=False)
    _trainer(tmp_path, first, max_epochs=2, limit_val_batches=0).fit(_Tiny(), _loader())
    checkpoint = next((tmp_path / "checkpoints").glob("*.ckpt"))
    resumed = ThroughputMonitor(log=False)
    _trainer(tmp_path / "resumed", resumed, max_epochs=3, limit_val_batches=0).fit(
        _Tiny(), _loader(), ckpt_path=checkpoint
    )
    assert (resumed.examples, resumed.batches) == (3 * 16, 3 * 4)
    assert (resumed.timed_examples, resumed.timed_batches) == (3 * 12, 3 * 3), "each epoch's first batch starts it"
    assert resumed.fit_seconds > first.fit_seconds * 0.99
    # testing a checkpoint (the best one, after a fit) leaves the fit's totals alone
    other = ThroughputMonitor(log=False)
    trainer = _trainer(tmp_path / "other", other, max_epochs=1, limit_val_batches=0)
    trainer.fit(_Tiny(), _loader())  # one epoch: 16 rows
    trainer.validate(_Tiny(), _loader(), ckpt_path=checkpoint, verbose=False)  # the 2-epoch checkpoint: 32 rows
    assert (other.examples, other.batches) == (16, 4)


def test_a_validation_within_the_epoch_is_not_training_time(tmp_path):
    """With ``val_check_interval=2`` a 1.5 s validation runs between the 2nd and 3rd of 4 batches: the batch clock
    stops for it (a tiny linear model's batches take milliseconds)."""
    monitor = ThroughputMonitor(log=False)
    trainer = _trainer(tmp_path, monitor, max_epochs=1, val_check_interval=2, limit_val_batches=1)
    trainer.fit(_Tiny(val_sleep=1.5), _loader(), _loader())
    assert monitor.timed_batches == 3 and monitor.fit_seconds > 3.0, "two validations ran"
    assert monitor.timed_seconds < 0.75


class _PaddedLM(_Tiny):
    def training_step(self, batch, batch_idx):
        inputs, _, padding_mask = batch
        return (self.layer(inputs.unsqueeze(-1).float().expand(-1, -1, 3)) * padding_mask.unsqueeze(-1)).mean()


def test_tokens_per_second_count_the_real_tokens_of_padded_batches(tmp_path):
    """``data.pack=false`` batches are ``(inputs, targets, padding_mask)``: tokens/s and the record's tokens (and
    the training FLOPs made from them) count the real tokens, 3 + 8 + 5 + 1 of 4 windows of 8, not 32."""
    lengths = torch.tensor([3, 8, 5, 1])
    mask = torch.arange(8) < lengths.unsqueeze(1)
    ids = torch.randint(10, (4, 8))
    loader = DataLoader(TensorDataset(ids, ids, mask), batch_size=2)  # batches of 3 + 8 and 5 + 1 real tokens
    monitor = ThroughputMonitor(unit="tokens", count="elements", log=False)
    _trainer(tmp_path, monitor, max_epochs=1).fit(_PaddedLM(), loader)
    assert monitor.examples == 17 and monitor.timed_examples == 6
    assert monitor.batch_examples((ids, ids)) == 32, "packed batches: every position is a real token"


def test_under_gradient_accumulation_the_throughput_is_logged_once_per_optimizer_step(tmp_path):
    """2 micro-batches per optimizer step, a log every step: one value per step, each over its whole step (the
    epoch's first batch only starts the clock), not a second one over a lone micro-batch."""
    logged = []

    class Logged(_Tiny):
        def log(self, name, value, **kwargs):
            if name == "train/images_per_sec":
                logged.append(self.trainer.global_step)

    monitor = ThroughputMonitor()
    loader = DataLoader(TensorDataset(torch.randn(32, 3), torch.zeros(32)), batch_size=4)  # 8 batches, 4 steps
    _trainer(tmp_path, monitor, max_epochs=1, accumulate_grad_batches=2, log_every_n_steps=1).fit(Logged(), loader)
    assert logged == [1, 2, 3, 4]
