"""ExpertLoadMonitor: interval figures against hand-computed values on crafted routings, the interval
mean against the per-step records, the DDP reduction against one process, the heatmap's colours,
and a training run that writes the scalars, histograms and heatmaps."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning import LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from conftest import compose_config
from distributed import spawn
from moekit.callbacks import ExpertLoadMonitor
from moekit.callbacks.moe_stats import RoutingStatsSums, layer_label, load_heatmap
from moekit.commands.train import train
from moekit.data.fashion_mnist import write_fake_fashion_mnist
from moekit.moe import SoftMoE, TopKMoE


def _routed_to(experts: list[int], shape: tuple[int, int], num_experts: int = 4) -> torch.Tensor:
    """Tokens ``[batch, tokens, E]`` that a router with weight ``10 * I`` sends to ``experts`` (in order)."""
    return torch.eye(num_experts)[experts].reshape(*shape, num_experts)


def _crafted_top1() -> TopKMoE:
    layer = TopKMoE(4, 8, num_experts=4, top_k=1, capacity_factor=1.0, switch_loss_weight=0.01)
    with torch.no_grad():
        layer.router.weight.copy_(10 * torch.eye(4))  # token e_i -> expert i, with probability p below
    return layer


def test_interval_figures_equal_hand_computed_values_on_a_crafted_routing():
    layer = _crafted_top1()
    monitor = ExpertLoadMonitor()
    assert set(monitor.watch(nn.Sequential(layer))) == {"0"}
    sums = RoutingStatsSums()
    switch_losses = []
    # step 1: 8 tokens, capacity ceil(8 / 4) = 2: experts 0 and 2 drop one token each -> kept [2, 2, 2, 0]
    layer(_routed_to([0, 0, 0, 1, 1, 2, 2, 2], (1, 8)))
    switch_losses.append(layer.aux_losses["switch"].item())
    monitor.accumulate(sums)
    # step 2: 2 x 2 tokens, capacity 1, all to expert 3 -> kept [0, 0, 0, 1]
    layer(_routed_to([3, 3, 3, 3], (2, 2)))
    switch_losses.append(layer.aux_losses["switch"].item())
    monitor.accumulate(sums)
    monitor.accumulate(sums)  # no forward since: the old record must not count again

    figures = sums.compute()
    assert set(figures) == {"0"}
    f = figures["0"]
    assert f.forwards == 2 and f.tokens == 12
    # the load is pooled: the interval's kept assignments [2, 2, 2, 0] + [0, 0, 0, 1] (not the token-weighted
    # mean of the steps' fractions, [2, 2, 2, 3] / 9, which made expert 3, with 1 of 7 assignments, the busiest)
    torch.testing.assert_close(f.expert_load, torch.tensor([2 / 7, 2 / 7, 2 / 7, 1 / 7]))
    # token-weighted (8 : 4) means of the two steps
    cv1, cv2 = 1 / math.sqrt(3), math.sqrt(3)  # std / mean of [2, 2, 2, 0] and of [0, 0, 0, 1]
    assert f.scalars["load_cv"] == pytest.approx((8 * cv1 + 4 * cv2) / 12)
    assert f.scalars["unused_experts"] == pytest.approx((8 * 0.25 + 4 * 0.75) / 12)
    assert f.scalars["dropped_fraction"] == pytest.approx((8 * 0.25 + 4 * 0.75) / 12)
    assert f.scalars["tokens_fully_dropped"] == pytest.approx(5 / 12)
    p = math.exp(10) / (math.exp(10) + 3)  # every token's top probability; the others (1 - p) / 3
    q = (1 - p) / 3
    assert f.scalars["router_entropy"] == pytest.approx(-(p * math.log(p) + 3 * q * math.log(q)), rel=1e-4)
    assert f.scalars["mean_top_gate"] == pytest.approx(p)
    assert f.scalars["aux/switch"] == pytest.approx((8 * switch_losses[0] + 4 * switch_losses[1]) / 12)
    # the interval's own load [2, 2, 2, 1] / 7: every expert got tokens
    assert f.scalars["interval_load_cv"] == pytest.approx(math.sqrt(3) / 7)
    assert f.scalars["interval_unused_experts"] == 0.0

    sums.reset()
    assert not sums and sums.compute() == {}


def test_layers_are_named_without_wrapper_segments_and_a_bare_layer_by_its_class():
    layer = _crafted_top1()
    assert set(ExpertLoadMonitor().watch(layer)) == {"TopKMoE"}  # not "": its keys would read moe//load_cv
    assert layer_label("_orig_mod.blocks.3._checkpoint_wrapped_module.mlp", layer) == "blocks.3.mlp"
    assert layer_label("blocks.3.mlp", layer) == "blocks.3.mlp"


def test_soft_moe_uniform_dispatch_mixes_every_token_into_each_slot():
    layer = SoftMoE(8, 16, num_experts=2, slots_per_expert=2)
    with torch.no_grad():
        layer.phi.zero_()  # all logits 0: dispatch and combine uniform
    monitor, sums = ExpertLoadMonitor(), RoutingStatsSums()
    monitor.watch(nn.Sequential(layer))
    layer(torch.randn(3, 5, 8))
    monitor.accumulate(sums)
    f = sums.compute()["0"]
    assert f.scalars["tokens_per_slot"] == pytest.approx(5.0)
    assert f.scalars["dispatch_entropy"] == pytest.approx(math.log(5))
    assert f.scalars["max_dispatch_weight"] == pytest.approx(1 / 5)
    assert f.scalars["combine_entropy"] == pytest.approx(math.log(4))
    torch.testing.assert_close(f.expert_load, torch.tensor([0.5, 0.5]))
    assert f.scalars["interval_load_cv"] == pytest.approx(0.0, abs=1e-7)
    # a second forward with 7 tokens per sequence: tokens_per_slot 7, weighted by 1 x 7 tokens against 3 x 5
    layer(torch.randn(1, 7, 8))
    monitor.accumulate(sums)
    assert sums.compute()["0"].scalars["tokens_per_slot"] == pytest.approx((15 * 5 + 7 * 7) / 22)


def test_interval_mean_is_the_token_weighted_mean_of_the_steps():
    layer = TopKMoE(8, 16, num_experts=4, top_k=2, capacity_factor=1.0, z_loss_weight=0.001)
    monitor, sums = ExpertLoadMonitor(), RoutingStatsSums()
    monitor.watch(nn.Sequential(layer))
    records, weights = [], []
    for batch in (3, 5):  # two different batches of 6 tokens per sequence
        layer(torch.randn(batch, 6, 8))
        stats = {k: v for k, v in layer.stats.items() if k != "real_tokens"}  # the weight, not a figure
        records.append({**stats, **{f"aux/{k}": v.detach() for k, v in layer.aux_losses.items()}})
        weights.append(batch * 6)
        monitor.accumulate(sums)
    f = sums.compute()["0"]
    assert records[0]["expert_load"].ne(records[1]["expert_load"]).any(), "the two steps must differ"
    mean = {k: (weights[0] * records[0][k] + weights[1] * records[1][k]) / sum(weights) for k in records[0]}
    kept = [r["expert_load"] * (1 - r["dropped_fraction"]) * w for r, w in zip(records, weights)]  # pooled
    torch.testing.assert_close(f.expert_load, (kept[0] + kept[1]) / (kept[0] + kept[1]).sum())
    assert set(f.scalars) == set(mean) - {"expert_load"} | {"interval_load_cv", "interval_unused_experts"}
    for key, value in mean.items():
        if key != "expert_load":
            assert f.scalars[key] == pytest.approx(value.item(), rel=1e-5, abs=1e-7), key


def test_dropless_interval_load_equals_one_forward_over_all_tokens():
    """Without capacity the token weighting is exact: the interval's load and per-token means are
    those of one forward over the concatenated steps."""
    layer = TopKMoE(8, 16, num_experts=4, top_k=2, capacity_factor=None)
    monitor, sums = ExpertLoadMonitor(), RoutingStatsSums()
    monitor.watch(nn.Sequential(layer))
    steps = [torch.randn(2, 6, 8), torch.randn(5, 6, 8)]
    for x in steps:
        layer(x)
        monitor.accumulate(sums)
    f = sums.compute()["0"]
    layer(torch.cat(steps))
    whole = layer.stats
    torch.testing.assert_close(f.expert_load, whole["expert_load"])
    for key in ("router_entropy", "mean_top_gate"):
        assert f.scalars[key] == pytest.approx(whole[key].item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------
_MICRO_BATCHES = [4, 2, 3, 5]  # sequences of 6 tokens in each micro-batch: rank r gets micro-batches r, r + 2


def _figures(indices, sum_over_ranks=None) -> dict:
    torch.manual_seed(0)
    layer = TopKMoE(8, 16, num_experts=4, top_k=2, capacity_factor=1.0, switch_loss_weight=0.01)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(n, 6, 8, generator=generator) for n in _MICRO_BATCHES]
    sums = RoutingStatsSums()
    for i in indices:
        layer(batches[i])
        sums.add("moe", layer.stats, layer.aux_losses, layer.forward_tokens)
    f = sums.compute(sum_over_ranks)["moe"]
    return {"load": f.expert_load.tolist(), "scalars": f.scalars, "forwards": f.forwards, "tokens": f.tokens}


def _ddp_figures(rank: int, world: int, out: Path) -> None:
    def sum_over_ranks(tensor):
        dist.all_reduce(tensor)
        return tensor

    result = _figures(range(rank, len(_MICRO_BATCHES), world), sum_over_ranks)
    if rank == 0:
        out.write_text(json.dumps(result))


@pytest.mark.e2e
def test_ddp_reduction_equals_one_process_fed_all_the_data(tmp_path):
    out = tmp_path / "figures.json"
    spawn(_ddp_figures, 2, out)
    ddp, single = json.loads(out.read_text()), _figures(range(len(_MICRO_BATCHES)))
    assert ddp["forwards"] == single["forwards"] == 4 and ddp["tokens"] == single["tokens"] == 14 * 6
    assert ddp["load"] == pytest.approx(single["load"], rel=1e-5)
    assert set(ddp["scalars"]) == set(single["scalars"]) and "aux/switch" in ddp["scalars"]
    for key, value in single["scalars"].items():
        assert ddp["scalars"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


# ---------------------------------------------------------------------------------------------
def test_heatmap_colours_the_load_relative_to_uniform():
    image = load_heatmap([torch.tensor([0.0, 0.25, 0.5, 0.25]), torch.tensor([0.5, 0.5])], max_width=64)
    assert image.shape == (3, 2 * 16, 4 * 16)  # cells 64 // 4 = 16 px wide, at least 16 high
    assert image.min() >= 0 and image.max() <= 1

    def cell(row: int, col: int) -> torch.Tensor:
        return image[:, row * 16 + 8, col * 16 + 8]

    blue, grey, red = cell(0, 0), cell(0, 1), cell(0, 2)
    assert blue[2] > blue[0] and red[0] > red[2], "no token: blue; twice uniform: red"
    assert grey.max() - grey.min() < 1e-6 and grey.min() > 0.8, "uniform load: light grey"
    torch.testing.assert_close(cell(1, 0), grey)  # 0.5 of 2 experts is uniform too
    assert cell(1, 2).abs().sum() == 0 and cell(1, 3).abs().sum() == 0, "missing experts: black"
    half_way = load_heatmap([torch.tensor([0.25, 0.75])])[:, 0, 0]  # load x 2 experts: ratios 0.5 and 1.5
    torch.testing.assert_close(half_way, (blue + grey) / 2)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="log_every_n_steps=0 must be a positive int"):
        ExpertLoadMonitor(log_every_n_steps=0)
    with pytest.raises(ValueError, match="log_every_n_steps=True must be a positive int"):
        ExpertLoadMonitor(log_every_n_steps=True)  # a YAML `true` is no step count
    with pytest.raises(ValueError, match="tokens=0 for layer 'x'"):
        RoutingStatsSums().add("x", {"load_cv": torch.tensor(0.0)}, {}, tokens=0)
    with pytest.raises(ValueError, match="loads is empty"):
        load_heatmap([])


# ---------------------------------------------------------------------------------------------
TOKEN_CHOICE_SCALARS = (
    "load_cv",
    "unused_experts",
    "dropped_fraction",
    "router_entropy",
    "mean_top_gate",
    "aux/switch",
    "interval_load_cv",
    "interval_unused_experts",
)


@pytest.mark.e2e
def test_training_run_writes_scalars_histograms_and_heatmaps(tmp_path):
    data = write_fake_fashion_mnist(tmp_path / "fashion-mnist", n_train=320, n_test=32)
    cfg = compose_config(
        "train",
        [
            "experiment=tokens_choice_vit",
            f"data.root={data}",
            "data.val_size=64",
            "debug=tiny",  # batches of 32: 256 training images, 8 steps
            "model.depth=4",
            "model.moe_blocks=second_half",  # MoE in blocks 2 and 3
            "logger=many",
            "trainer.precision=32-true",
            "callbacks.expert_load.log_every_n_steps=4",  # means over steps 1-4 and 5-8
            "test=false",
        ],
        tmp_path / "run",
    )
    train(cfg)
    (events,) = (tmp_path / "run" / "tensorboard").rglob("events.out.tfevents.*")
    board = EventAccumulator(str(events), size_guidance={"scalars": 0, "histograms": 0, "images": 0})
    board.Reload()
    tags = board.Tags()
    layers = ("blocks.2.mlp", "blocks.3.mlp")
    for prefix in ("moe", "val_moe"):
        for layer in layers:
            for stat in TOKEN_CHOICE_SCALARS:
                assert f"{prefix}/{layer}/{stat}" in tags["scalars"], (prefix, layer, stat)
            assert f"{prefix}/{layer}/expert_load" in tags["histograms"]
        assert f"{prefix}/expert_load_heatmap" in tags["images"]

    train_steps = [e.step for e in board.Scalars("moe/blocks.2.mlp/load_cv")]
    loss_steps = [e.step for e in board.Scalars("train/loss_step")]
    assert train_steps == [3, 7] and {3, 7} <= set(loss_steps), "every 4 steps, on Lightning's step axis"
    assert len(board.Scalars("val_moe/blocks.2.mlp/load_cv")) == 1, "the sanity-check validation is not logged"
    (histogram,) = board.Histograms("val_moe/blocks.3.mlp/expert_load")
    buckets = histogram.histogram_value.bucket
    assert len(buckets) == 8 and sum(buckets) == pytest.approx(1.0, rel=1e-5), "8 experts' fractions of the tokens"
    heatmap = board.Images("moe/expert_load_heatmap")[-1]
    assert (heatmap.width, heatmap.height) == (8 * 32, 2 * 32), "8 experts x 2 layers, 32 px cells"

    with open(tmp_path / "run" / "csv" / "metrics.csv") as f:
        header = next(csv.reader(f))
    assert "moe/blocks.3.mlp/dropped_fraction" in header and "val_moe/blocks.3.mlp/aux/switch" in header


# ---------------------------------------------------------------------------------------------
class _TinyTask(LightningModule):
    """A module whose ``net`` is one top-1 MoE layer, trained on 16 batches of 2 x 3 tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(TopKMoE(4, 8, num_experts=4, top_k=1))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(32, 3, 4, generator=torch.Generator().manual_seed(0)))
        return torch.utils.data.DataLoader(data, batch_size=2)


class _RowSteps(Logger):
    """A logger that keeps the step of each row holding ``moe/`` figures."""

    name, version, experiment = "rows", 0, None

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[int] = []

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        if any(key.startswith("moe/") for key in metrics):
            self.steps.append(step)


def _fit_tiny(max_steps: int, tmp_path, ckpt_path=None, save=None) -> list[int]:
    logger = _RowSteps()
    trainer = Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=2,
        log_every_n_steps=2,
        logger=logger,
        callbacks=[ExpertLoadMonitor()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(_TinyTask(), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    return logger.steps


def test_gradient_accumulation_logs_each_interval_once_also_after_a_resume(tmp_path):
    """2 micro-batches a step, figures every 2 steps: rows at Lightning's steps 1, 3, 5. A run resumed from the
    checkpoint of step 2 must not log a row of its own at step 2 (from its first micro-batch, still at
    global_step 2): the first run's rows and the resumed run's together equal the uninterrupted run's."""
    assert _fit_tiny(6, tmp_path / "whole") == [1, 3, 5]
    ckpt = tmp_path / "step2.ckpt"
    assert _fit_tiny(2, tmp_path / "first", save=ckpt) == [1]
    assert _fit_tiny(6, tmp_path / "resumed", ckpt_path=ckpt) == [3, 5]


def test_routing_report_figures_equal_a_hand_count_of_the_test_splits_assignments(tmp_path):
    """Two test batches through the crafted top-1 layer (capacity 1 in evaluation too): kept [2, 2, 2, 0] of 8
    tokens, then [0, 0, 0, 1] of 4. Over the split the experts took 2, 2, 2 and 1 of the 7 kept assignments:
    the report's shares, load CV, max / mean and effective experts follow from those counts (the mean of the two
    batches' fractions, [2, 2, 2, 3] / 9, made expert 3 the busiest), and the dropped fraction is 5 of the 12
    assignments."""
    from types import SimpleNamespace

    from moekit.callbacks import RoutingReport

    layer = _crafted_top1().eval()
    module = SimpleNamespace(net=nn.Sequential(layer))
    trainer = SimpleNamespace(world_size=1, is_global_zero=True, datamodule=None)
    report = RoutingReport(str(tmp_path))
    report.on_test_epoch_start(trainer, module)
    for index, x in enumerate([_routed_to([0, 0, 0, 1, 1, 2, 2, 2], (1, 8)), _routed_to([3, 3, 3, 3], (2, 2))]):
        with torch.no_grad():
            layer(x)
        report.on_test_batch_end(trainer, module, None, (x,), index)
    report.on_test_epoch_end(trainer, module)

    r = report.layers["0"]
    shares = torch.tensor([2, 2, 2, 1], dtype=torch.float64) / 7
    assert r.expert_load == pytest.approx(shares.tolist())
    assert r.tokens == 12 and r.unused_experts == 0 and r.dropped_fraction == pytest.approx(5 / 12)
    assert r.max_over_mean == pytest.approx(4 * 2 / 7)
    assert r.load_cv == pytest.approx(math.sqrt(3) / 7)
    assert r.effective_experts == pytest.approx(math.exp(-(shares * shares.log()).sum().item()))
    assert "| `0` | 4 | 12 | 0 | 0.247 | 1.14 | 3.86 | 0.417 |" in (tmp_path / "routing_report.md").read_text()


def test_depth_routers_mean_gate_is_the_mean_over_every_processed_token_of_the_interval():
    """A causal Mixture-of-Depths router in evaluation decides per token: 1 of 8 tokens processed in one forward
    (gate 4), 6 of 8 in the next (gate 1 each). ``mean_gate`` is a mean over processed tokens: (4 + 6) / 7, not the
    forwards' means (4 and 1) weighted by their 8 tokens each (2.5)."""
    from moekit.moe.depth import DepthRouter
    from moekit.recipes.depth import DepthSpec

    router = DepthRouter(2, DepthSpec(capacity=0.5), causal=True).eval()
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0, 0.0]]))  # logit = the first feature; processed when > 0
    monitor, sums = ExpertLoadMonitor(), RoutingStatsSums()
    monitor.watch(nn.Sequential(router))
    for first in ([4.0] + [-1.0] * 7, [1.0] * 6 + [-1.0] * 2):
        router.decide(torch.tensor(first).view(1, 8, 1).expand(1, 8, 2).contiguous())
        monitor.accumulate(sums)
    f = sums.compute()["0"]
    assert f.scalars["processed_fraction"] == pytest.approx(7 / 16)
    assert f.scalars["mean_gate"] == pytest.approx(10 / 7)
    assert f.tokens == 16


class _MoEFigures(Logger):
    """A logger that keeps the ``moe/`` figures of each row by step."""

    name, version, experiment = "figures", 0, None

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, dict[str, float]] = {}

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        figures = {key: value for key, value in metrics.items() if key.startswith("moe/")}
        if figures:
            self.rows[step] = figures


class _SixBatchTask(_TinyTask):
    """A capacity-limited top-1 layer trained on 6 batches an epoch, with a learning rate that moves its routing."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(TopKMoE(4, 8, num_experts=4, top_k=1, capacity_factor=1.0))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(12, 3, 4, generator=torch.Generator().manual_seed(0)))
        return torch.utils.data.DataLoader(data, batch_size=2)


def test_a_run_resumed_inside_an_interval_logs_the_uninterrupted_runs_figures(tmp_path):
    """Figures every 4 steps, a checkpoint at step 6: the interval of steps 5-8 spans the resume. The resumed run's
    row at Lightning's step 7 must hold the means over steps 5-8, as the uninterrupted run's does (the sums of steps
    5 and 6 travel in the checkpoint), not over steps 7 and 8 alone."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(root, ckpt_path=None) -> dict[int, dict[str, float]]:
        logger = _MoEFigures()
        saver = ModelCheckpoint(dirpath=root, filename="step6", every_n_train_steps=6, save_top_k=-1)
        trainer = Trainer(
            max_steps=8,
            log_every_n_steps=4,
            logger=logger,
            callbacks=[ExpertLoadMonitor(), saver],
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        trainer.fit(_SixBatchTask(), ckpt_path=ckpt_path)
        return logger.rows

    whole = fit(tmp_path / "whole")
    resumed = fit(tmp_path / "resumed", ckpt_path=tmp_path / "whole" / "step6.ckpt")
    assert sorted(whole) == [3, 7] and sorted(resumed) == [7]
    assert resumed[7].keys() == whole[7].keys()
    for key, value in whole[7].items():
        assert resumed[7][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_checkpointed_sums_of_all_ranks_count_once_after_a_resume():
    """Under data parallelism the checkpoint holds the sums of all ranks; on resume the first rank takes them and the
    others start from zero, so the interval's figures equal those of one process fed every rank's forwards."""
    layer = TopKMoE(8, 16, num_experts=4, top_k=2, capacity_factor=1.0, switch_loss_weight=0.01)
    generator = torch.Generator().manual_seed(3)
    before, after = (
        [torch.randn(n, 6, 8, generator=generator) for n in (2, 4)],
        torch.randn(3, 6, 8, generator=generator),
    )

    def feed(sums: RoutingStatsSums, batches) -> RoutingStatsSums:
        for x in batches:
            layer(x)
            sums.add("moe", layer.stats, layer.aux_losses, layer.forward_tokens)
        return sums

    # two ranks that saw the same forwards before the checkpoint: the sum over ranks doubles every entry
    state = feed(RoutingStatsSums(), before).state_dict(lambda flat: 2 * flat)
    first, other = RoutingStatsSums(), RoutingStatsSums()
    first.load_state_dict(state, keep=True)
    other.load_state_dict(state, keep=False)
    feed(first, [after])
    feed(other, [after])
    other_flat: list[torch.Tensor] = []
    other.compute(lambda flat: other_flat.append(flat.clone()) or flat)
    resumed = first.compute(lambda flat: flat + other_flat[0].to(flat.device))["moe"]
    single = feed(RoutingStatsSums(), [*before, *before, after, after]).compute()["moe"]
    assert (resumed.forwards, resumed.tokens) == (single.forwards, single.tokens) == (6, 2 * 36 + 2 * 18)
    torch.testing.assert_close(resumed.expert_load, single.expert_load)
    assert resumed.scalars == pytest.approx(single.scalars, rel=1e-5)
