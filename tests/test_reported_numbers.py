"""The routing and throughput numbers moekit reports, against hand-computed values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moekit.callbacks import ExpertLoadMonitor
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
