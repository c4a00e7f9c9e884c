"""The global-batch Switch loss: the same loss and gradient whatever the split of a batch into processes and
micro-batches (1 x 4, 2 x 2, 4 x 1), where the per-micro-batch loss changes with the split."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import spawn
from moekit.moe import TopKMoE, update_balancing_biases
from moekit.moe.losses import switch_loss_from_fractions

pytestmark = pytest.mark.e2e  # starts processes (make test-fast leaves it out)

BATCH, TOKENS, DIM, EXPERTS = 8, 6, 8, 4


def build(scope: str) -> nn.Module:
    torch.manual_seed(0)
    layer = TopKMoE(DIM, 16, num_experts=EXPERTS, top_k=2, switch_loss_weight=1.0, switch_loss_scope=scope)
    with torch.no_grad():
        layer.router.weight.mul_(4.0)  # a decisive, unbalanced router
    return nn.Sequential(nn.Linear(DIM, DIM), layer).train()


def data(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, TOKENS, DIM, generator=generator) + 1.0


def run(rank: int, world: int, micro: int, scope: str) -> dict[str, torch.Tensor]:
    """Two optimizer steps of the balancing loss alone on this rank's share of each batch, split into ``micro``
    micro-batches, gradients averaged over micro-batches (gradient accumulation) and ranks (DDP). Returns the
    second step's loss and gradients."""
    model = build(scope)
    per_rank = BATCH // world
    for step in range(2):
        model.zero_grad()
        shard = data(step)[rank * per_rank : (rank + 1) * per_rank]
        total = torch.zeros(())
        for chunk in shard.chunk(micro):
            model(chunk)
            loss = model[1].aux_losses["switch"] / micro
            loss.backward()
            total += loss.detach()
        if dist.is_initialized():
            for tensor in (total, *(p.grad for p in model.parameters() if p.grad is not None)):
                dist.all_reduce(tensor)
                tensor /= world
        update_balancing_biases(model)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == {"0.weight", "0.bias", "1.router.weight"}, "the loss reaches the router and its input"
    return {"loss": total, **grads}


def _rank(rank: int, world: int, micro: int, scope: str, out: str) -> None:
    result = run(rank, world, micro, scope)
    if rank == 0:
        torch.save(result, out)


def layout(world: int, micro: int, scope: str, tmp_path) -> dict[str, torch.Tensor]:
    if world == 1:
        return run(0, 1, micro, scope)
    out = str(tmp_path / f"{scope}_{world}x{micro}.pt")
    spawn(_rank, world, micro, scope, out)
    return torch.load(out)


def test_the_global_batch_switch_loss_is_the_same_for_every_layout(tmp_path):
    reference = layout(1, 4, "global_batch", tmp_path)
    # by hand: f of step 0's whole batch, P of step 1's whole batch
    model = build("global_batch")
    with torch.no_grad():
        routing = model[1].router(model[0](data(0)).reshape(-1, DIM))
        counts = torch.bincount(routing.expert_ids.reshape(-1), minlength=EXPERTS)
        hidden = model[0](data(1)).reshape(-1, DIM)
        probs = torch.softmax(hidden @ model[1].router.weight.t(), -1)
    expected = switch_loss_from_fractions(probs, counts / counts.sum())
    torch.testing.assert_close(reference["loss"], expected)
    assert expected > 1.05, "the router is unbalanced, so the loss pulls"
    for world, micro in ((2, 2), (4, 1)):
        other = layout(world, micro, "global_batch", tmp_path)
        assert other.keys() == reference.keys()
        for name in reference:
            torch.testing.assert_close(other[name], reference[name], msg=f"{world} x {micro}: {name}")


def test_the_micro_batch_switch_loss_changes_with_the_layout(tmp_path):
    one, four = layout(1, 4, "micro_batch", tmp_path), layout(1, 1, "micro_batch", tmp_path)
    assert not torch.allclose(one["1.router.weight"], four["1.router.weight"])


def test_a_global_scope_without_the_switch_loss_is_refused():
    with pytest.raises(ValueError, match="switch_loss_scope='global_batch' changes the Switch loss, which is off"):
        TopKMoE(DIM, 16, switch_loss_scope="global_batch")
