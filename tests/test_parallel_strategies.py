"""Expert parallelism through the strategies and the sharding entry point on gloo CPU processes: a model that
cannot be split is refused before anything is sharded and, by the strategies, before the data is set up;
Lightning's own norm clipping (a LightningModule without moekit's ``configure_gradient_clipping``) clips by the
norm of the whole model, the same factor on every rank."""

import copy
import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from distributed import Regression, spawn
from moekit.moe import TopKMoE
from moekit.parallel import (
    MoEDDPStrategy,
    MoEFSDPStrategy,
    new_expert_parallel_groups,
    shard_experts,
    sharded_expert_banks,
    sync_expert_gradients,
)

pytestmark = pytest.mark.e2e  # starts processes (make test-fast leaves it out)

DIM, HIDDEN = 8, 16


def _refusals(rank: int, world: int) -> None:
    groups = new_expert_parallel_groups(world)
    uneven = nn.Sequential(TopKMoE(DIM, HIDDEN, num_experts=4), TopKMoE(DIM, HIDDEN, num_experts=3))
    with pytest.raises(ValueError, match=r"1\.experts: num_experts=3 cannot be split over .* groups of 2 ranks"):
        shard_experts(uneven, groups)
    assert not sharded_expert_banks(uneven), "layer 0 was sharded before layer 1 was refused"
    assert uneven[0].experts.num_local_experts == 4

    with torch.device("meta"):  # trainer.init_module(empty_init=True) under FSDP
        on_meta = TopKMoE(DIM, HIDDEN, num_experts=4)
    with pytest.raises(ValueError, match=r"expert_parallel_size=2: the experts of experts are on the meta device"):
        shard_experts(on_meta, groups)
    assert not sharded_expert_banks(on_meta)


def test_a_model_that_cannot_be_split_is_refused_before_any_bank_is_sharded():
    spawn(_refusals, 2)


def test_strategies_refuse_a_bool_expert_parallel_size():
    for strategy in (MoEDDPStrategy, MoEFSDPStrategy):
        with pytest.raises(ValueError, match="expert_parallel_size=True must be a positive int"):
            strategy(expert_parallel_size=True)


def _clip_by_lightning(rank: int, world: int) -> None:
    """DDP over 2 ranks with the experts split over both; after DDP's mean and the expert sync, the
    precision plugin's norm clipping (Lightning's default) matches the full model's clipping of its
    mean-loss gradient."""
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(DIM, DIM), TopKMoE(DIM, HIDDEN, num_experts=4, top_k=2))
    module = copy.deepcopy(full)
    strategy = MoEDDPStrategy(expert_parallel_size=world)
    strategy._lightning_module = module  # what Trainer.fit's strategy.connect does
    strategy.parallelize(module)
    experts = list(sharded_expert_banks(module)["1.experts"].parameters())

    inputs = [torch.randn(2 + r, 5, DIM, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    (sum(full(x).square().mean() for x in inputs) / world).backward()
    module(inputs[rank]).square().mean().backward()
    expert_ids = {id(p) for p in experts}
    for param in module.parameters():  # DDP's mean of the replicated gradients
        if id(param) not in expert_ids:
            dist.all_reduce(param.grad)
            param.grad /= world
    sync_expert_gradients(experts, strategy._expert_groups)

    max_norm = 1e-3
    assert torch.nn.utils.clip_grad_norm_(full.parameters(), max_norm) > 5 * max_norm, "the clipping binds"
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    strategy.precision_plugin.clip_gradients(optimizer, max_norm, GradClipAlgorithmType.NORM)
    bank = sharded_expert_banks(module)["1.experts"]
    local = slice(bank.expert_offset, bank.expert_offset + bank.num_local_experts)
    full_params = dict(full.named_parameters())
    for name, param in module.named_parameters():
        reference = full_params[name].grad
        reference = reference[local] if id(param) in expert_ids else reference
        torch.testing.assert_close(param.grad, reference, rtol=1e-5, atol=1e-9, msg=f"clipped grad of {name}")


def test_lightning_norm_clipping_counts_every_expert_once():
    spawn(_clip_by_lightning, 2)


class _Task(L.LightningModule):
    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, DIM), TopKMoE(DIM, HIDDEN, num_experts=num_experts))

    def configure_model(self) -> None:
        self.trainer.strategy.parallelize(self)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Data(L.LightningDataModule):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def prepare_data(self) -> None:
        self.log.append("prepare_data")

    def setup(self, stage: str) -> None:
        self.log.append("setup")

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 5, DIM)), batch_size=2)


def _trainer(rank: int, world: int, strategy_name: str, **options) -> L.Trainer:
    """One step of a Lightning trainer with experts split over 2 of the ``world`` CPU processes started outside."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    strategy = {"ddp": MoEDDPStrategy, "fsdp": MoEFSDPStrategy}[strategy_name]
    return L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy(expert_parallel_size=2, process_group_backend="gloo"),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def _fit_refused(rank: int, world: int, strategy_name: str) -> None:
    trainer = _trainer(rank, world, strategy_name)
    log: list[str] = []
    with pytest.raises(ValueError, match=r"net\.1\.experts: num_experts=3 cannot be split .*expert_parallel_size=2"):
        trainer.fit(_Task(num_experts=3), datamodule=_Data(log))
    assert log == [], f"the data was set up ({log}) before the layout was refused"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_strategies_refuse_experts_that_do_not_split_before_the_data_is_set_up(strategy):
    spawn(_fit_refused, 2, strategy)


class _Regression(Regression):
    """One MoE layer between two linear layers, trained by SGD with Lightning's default norm clipping."""

    lr, num_shared_experts = 1.0, 1


def _sgd_step(rank: int, world: int, strategy_name: str, accumulate: int) -> None:
    """One optimizer step of SGD with clipping through Lightning: every weight moves as the full model's
    weight does under the clipped gradient of the mean loss over all ranks' batches."""
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 5, DIM, generator=generator), torch.randn(8, 5, DIM, generator=generator)
    max_norm = 0.01
    reference = _Regression().net
    (reference(x) - y).square().mean().backward()
    assert torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm) > 5 * max_norm, "the clipping binds"
    with torch.no_grad():
        for param in reference.parameters():
            param -= param.grad

    trainer = _trainer(rank, world, strategy_name, gradient_clip_val=max_norm, accumulate_grad_batches=accumulate)
    module = _Regression()
    loader = DataLoader(TensorDataset(x, y), batch_size=8 // world // accumulate)  # rank r: samples r, r + 2, ...
    trainer.fit(module, loader)
    bank = sharded_expert_banks(module.net)["1.experts"]
    local = slice(bank.expert_offset, bank.expert_offset + bank.num_local_experts)
    expected = dict(reference.named_parameters())
    for name, param in module.net.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param  # FSDP's shards
        target = expected[name][local] if name.startswith("1.experts.") else expected[name]
        torch.testing.assert_close(value.detach(), target.detach(), rtol=1e-5, atol=1e-7, msg=f"{name} after the step")


@pytest.mark.parametrize("strategy,accumulate", [("ddp", 1), ("ddp", 2), ("fsdp", 1)])
def test_a_clipped_sgd_step_through_lightning_equals_the_full_model(strategy, accumulate):
    spawn(_sgd_step, 2, strategy, accumulate)


class _OverflowOnRank0(_Regression):
    """A float16 loss-scale overflow in the experts of rank 0 only (their gradients are not all-reduced)."""

    def on_after_backward(self) -> None:
        if self.global_rank == 0:
            sharded_expert_banks(self.net)["1.experts"].fc2_weight.grad.view(-1)[0] = float("inf")


def _overflow_step(rank: int, world: int) -> None:
    """Under a GradScaler every rank skips a step whose gradients overflowed on any rank, and lowers its scale
    alike: the replicated weights and the scales stay the same on all ranks."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=MoEDDPStrategy(expert_parallel_size=2, process_group_backend="gloo"),
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = _OverflowOnRank0()
    before = {name: p.detach().clone() for name, p in module.net.named_parameters()}
    data = TensorDataset(torch.randn(8, 5, DIM), torch.randn(8, 5, DIM))
    trainer.fit(module, DataLoader(data, batch_size=4))
    assert scaler.get_scale() == 128.0, f"rank {rank}: scale {scaler.get_scale()}, the overflow halves it on every rank"
    bank = sharded_expert_banks(module.net)["1.experts"]
    local = slice(bank.expert_offset, bank.expert_offset + bank.num_local_experts)
    for name, param in module.net.named_parameters():
        start = before[name][local] if name.startswith("1.experts.") else before[name]
        assert torch.equal(param.detach(), start), f"rank {rank} took the step that overflowed: {name} moved"


def test_a_loss_scale_overflow_in_one_ranks_experts_is_skipped_on_every_rank():
    spawn(_overflow_step, 2)


def _replicas_start_alike(rank: int, world: int) -> None:
    """4 ranks, experts split over groups of 2, each rank seeded differently (no seed_everything): the two
    ranks holding each block of experts start training from the same weights."""
    trainer = _trainer(rank, world, "ddp")
    torch.manual_seed(rank)
    module = _Task(num_experts=4)
    trainer.fit(module, datamodule=_Data([]))
    for name, param in sharded_expert_banks(module.net)["1.experts"].named_parameters():
        copies = [torch.empty_like(param) for _ in range(world)]
        dist.all_gather(copies, param.detach().contiguous())
        assert torch.equal(copies[rank % 2], copies[rank % 2 + 2]), f"{name}: the replicas of a block differ"


def test_expert_replicas_start_from_the_same_weights_without_a_common_seed():
    spawn(_replicas_start_alike, 4)
