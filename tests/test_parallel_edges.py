"""Edge cases of expert parallelism through the Lightning strategies on gloo CPU processes: a model whose experts an
earlier fit split trains like the full model under a new Trainer (or is refused with the size that fits); manual
optimization clips and steps the experts' data-parallel mean gradients, also with two optimizers."""

import os

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from distributed import Regression, spawn
from moekit.parallel import MoEDDPStrategy, MoEFSDPStrategy, sharded_expert_banks

pytestmark = pytest.mark.e2e  # starts processes (make test-fast leaves it out)

DIM = 8  # the width of distributed.Regression


class _Regression(Regression):
    """A linear layer, an MoE layer and a linear layer, trained by SGD without momentum."""


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 5, DIM, generator=generator), torch.randn(8, 5, DIM, generator=generator)


def _reference(steps: int) -> nn.Module:
    """The full model after ``steps`` SGD steps on the mean loss of the whole batch."""
    x, y = _data()
    module = _Regression()
    optimizer = module.configure_optimizers()
    for _ in range(steps):
        optimizer.zero_grad()
        module.training_step((x, y), 0).backward()
        optimizer.step()
    return module.net


def _trainer(rank: int, world: int, strategy: str, expert_parallel_size: int, **options) -> L.Trainer:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    kind = {"ddp": MoEDDPStrategy, "fsdp": MoEFSDPStrategy}[strategy]
    return L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=kind(expert_parallel_size=expert_parallel_size, process_group_backend="gloo"),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def _assert_matches(module: nn.Module, reference: nn.Module, what: str) -> None:
    bank = sharded_expert_banks(module)["1.experts"]
    local = slice(bank.expert_offset, bank.expert_offset + bank.num_local_experts)
    expected = dict(reference.named_parameters())
    for name, param in module.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        target = expected[name][local] if name.startswith("1.experts.") else expected[name]
        torch.testing.assert_close(value.detach(), target.detach(), rtol=1e-5, atol=1e-7, msg=f"{name} {what}")


def _fit_twice(rank: int, world: int, strategy: str) -> None:
    """Two fits of one step, each with its own Trainer, move every weight as two steps of the full model."""
    loader = DataLoader(TensorDataset(*_data()), batch_size=8 // world)
    module = _Regression()
    _trainer(rank, world, strategy, 2).fit(module, loader)
    _trainer(rank, world, strategy, 2).fit(module, loader)
    _assert_matches(module.net, _reference(2), "after a fit by a second Trainer")
    with pytest.raises(ValueError, match=r"expert_parallel_size=1, but .*already split over groups of 2 ranks.*=2"):
        _trainer(rank, world, strategy, 1).fit(module, loader)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_second_trainer_syncs_the_experts_an_earlier_fit_split(strategy):
    spawn(_fit_twice, 2, strategy)


class _TwoOptimizers(_Regression):
    """Manual optimization: one SGD for the experts, whose gradients are clipped before its step, one for the rest."""

    clip_val = 1e-3

    def __init__(self, algorithm: str) -> None:
        super().__init__()
        self.algorithm = algorithm
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        experts, rest = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        self.clip_gradients(experts, gradient_clip_val=self.clip_val, gradient_clip_algorithm=self.algorithm)
        rest.step()
        experts.step()
        rest.zero_grad()
        experts.zero_grad()

    def configure_optimizers(self):
        experts = [p for name, p in self.net.named_parameters() if name.startswith("1.experts.")]
        rest = [p for name, p in self.net.named_parameters() if not name.startswith("1.experts.")]
        return torch.optim.SGD(experts, lr=0.5), torch.optim.SGD(rest, lr=0.5)


def _manual_step(rank: int, world: int, algorithm: str) -> None:
    """Clipping before the step and two optimizers stepping: the experts' gradients are the data-parallel mean when
    clipped and when each optimizer steps, as the full model's."""
    x, y = _data()
    reference = _Regression().net
    (reference(x) - y).square().mean().backward()
    experts = [p for name, p in reference.named_parameters() if name.startswith("1.experts.")]
    clip_val = _TwoOptimizers.clip_val
    assert max(p.grad.abs().max() for p in experts) > 5 * clip_val, "the clipping binds"
    if algorithm == "norm":
        torch.nn.utils.clip_grad_norm_(experts, clip_val)
    else:
        torch.nn.utils.clip_grad_value_(experts, clip_val)
    with torch.no_grad():
        for param in reference.parameters():
            param -= 0.5 * param.grad

    module = _TwoOptimizers(algorithm)
    _trainer(rank, world, "ddp", 2).fit(module, DataLoader(TensorDataset(x, y), batch_size=8 // world))
    _assert_matches(module.net, reference, f"after a manual step clipped by {algorithm}")


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_manual_optimization_clips_and_steps_the_mean_expert_gradients(algorithm):
    spawn(_manual_step, 2, algorithm)
