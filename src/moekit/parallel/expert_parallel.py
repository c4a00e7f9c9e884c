"""Expert parallelism in training: process groups, sharding a model's experts, the gradients and
gradient norm of sharded experts, and checkpoints that do not depend on the world size.

Layout. ``W`` ranks train data parallel; the experts of every MoE layer are split over expert-parallel
groups of ``P`` consecutive ranks (``P`` divides ``W`` and each layer's expert count). Rank ``r`` holds
the experts of block ``r mod P``; the ``W / P`` ranks holding the same block form its replica group.
Everything else (attention, routers, embeddings) stays replicated or is sharded by FSDP.

Gradients. Data parallel training averages gradients over the ``W`` ranks. An expert's gradient on
its holder already sums the contributions of the ``P`` ranks of its group (the token exchange carries
them back), so :func:`sync_expert_gradients` divides by ``W`` and sums over the replica group.
Gradient clipping needs the norm over all experts of the group: :func:`clip_grad_norm_`; a loss scaler's
overflow check, an overflow on any rank: :func:`share_non_finite_gradients`.

Checkpoints. :func:`gather_expert_state` / :func:`gather_expert_optimizer_state` turn local expert
tensors into the full ones (what an unsharded model holds), :func:`shard_expert_state` /
:func:`shard_expert_optimizer_state` take this rank's block of full tensors: a checkpoint saved at any
world size loads at any other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moekit.moe import ExpertBank, moe_layers

__all__ = [
    "ExpertParallelGroups",
    "new_expert_parallel_groups",
    "check_expert_parallel_size",
    "check_shardable",
    "shard_experts",
    "sharded_expert_banks",
    "sync_expert_gradients",
    "share_non_finite_gradients",
    "clip_grad_norm_",
    "gather_expert_state",
    "gather_expert_optimizer_entries",
    "shard_expert_entries",
    "shard_expert_state",
    "gather_expert_optimizer_state",
    "shard_expert_optimizer_state",
]


@dataclass
class ExpertParallelGroups:
    """The process groups of expert parallelism with ``size`` ranks per group over ``world_size``.

    Attributes:
        expert_group: the ranks that share one copy of the experts, each holding ``1 / size`` of them.
        replica_group: the ranks holding the same block of experts (None when ``size == world_size``).
        size: ``P``, ranks per expert group.
        world_size: ``W``, data-parallel ranks.
    """

    expert_group: Any
    replica_group: Any
    size: int
    world_size: int


def new_expert_parallel_groups(size: int) -> ExpertParallelGroups:
    """Create the groups on the default process group; every rank must call this, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(size, int) or size < 1 or world % size:
        raise ValueError(
            f"expert_parallel_size={size!r} must be a positive int dividing the world size {world} "
            f"(the ranks of one expert group hold one copy of every expert between them)"
        )
    expert_group = replica_group = None
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks)
        if rank in ranks:
            expert_group = group
    if world > size:
        for offset in range(size):
            ranks = list(range(offset, world, size))
            group = dist.new_group(ranks)
            if rank in ranks:
                replica_group = group
    return ExpertParallelGroups(expert_group, replica_group, size, world)


def _routed_banks(model: nn.Module) -> dict[str, ExpertBank]:
    """``{qualified name: bank}``: every MoE layer's routed experts (shared experts, applied to every token, stay
    replicated)."""
    banks = {}
    for name, layer in moe_layers(model):
        bank = getattr(layer, "experts", None)
        if isinstance(bank, ExpertBank):
            banks[f"{name}.experts" if name else "experts"] = bank
    return banks


def check_expert_parallel_size(size: int) -> int:
    """``size``, or a ``ValueError`` naming it unless it is a positive int."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"expert_parallel_size={size!r} must be a positive int (1: experts replicated)")
    return size


def check_shardable(model: nn.Module, size: int, world_size: int | None = None) -> None:
    """Raise ``ValueError`` (naming the value and the fix) unless :func:`shard_experts` can split the routed
    experts of ``model`` over groups of ``size`` ranks (of ``world_size``, where given): no layer merges its
    experts, ``size`` divides the world size and every routed bank's expert count, no bank is still on the
    meta device. Needs no process group: the strategies call it before any data or model work."""
    check_expert_parallel_size(size)
    if world_size is not None and world_size % size:
        raise ValueError(
            f"expert_parallel_size={size} must be a positive int dividing the world size {world_size} "
            f"(the ranks of one expert group hold one copy of every expert between them)"
        )
    merging = [f"{name} ({type(layer).__name__})" for name, layer in moe_layers(model) if layer.merges_experts]
    if merging:
        raise ValueError(
            f"expert parallelism cannot split {', '.join(merging)}: a layer that merges all of its experts into one "
            "for every token needs every expert on every rank; use expert_parallel_size=1 (data parallel) with it"
        )
    banks = _routed_banks(model)
    odd = [f"{name}: num_experts={bank.num_experts}" for name, bank in banks.items() if bank.num_experts % size]
    if odd:
        raise ValueError(
            f"{', '.join(odd)} cannot be split over expert-parallel groups of {size} ranks "
            f"(expert_parallel_size={size}); choose an expert_parallel_size dividing every layer's num_experts"
        )
    meta = [name for name, bank in banks.items() if bank.fc1_weight.is_meta]
    if meta and size > 1:
        raise ValueError(
            f"expert_parallel_size={size}: the experts of {', '.join(meta)} are on the meta device (e.g. built under "
            "trainer.init_module(empty_init=True)); each rank would then initialise only its own block, with the same "
            "draws as every other rank. Build the model with real weights (empty_init=False): every rank draws the "
            "full bank and keeps its block"
        )


def shard_experts(model: nn.Module, groups: ExpertParallelGroups) -> int:
    """Shard the routed experts of every MoE layer of ``model`` over ``groups.expert_group``; returns
    the number of banks sharded. Build the optimizer afterwards. A model that cannot be split
    (:func:`check_shardable`) is refused before any bank is sharded."""
    check_shardable(model, groups.size)
    banks = _routed_banks(model).values()
    for bank in banks:
        bank.shard_(groups.expert_group)
    return len(banks)


def sharded_expert_banks(model: nn.Module) -> dict[str, ExpertBank]:
    """``{qualified name: bank}`` of the expert banks of ``model`` that :func:`shard_experts` sharded."""
    return {name: m for name, m in model.named_modules() if isinstance(m, ExpertBank) and m.ep_group is not None}


def _expert_params(model: nn.Module) -> dict[str, tuple[nn.Parameter, ExpertBank]]:
    """``{qualified parameter name: (parameter, its bank)}`` of the sharded experts."""
    return {
        f"{name}.{pname}": (param, bank)
        for name, bank in sharded_expert_banks(model).items()
        for pname, param in bank.named_parameters(recurse=False)
    }


def sync_expert_gradients(parameters: Iterable[Tensor], groups: ExpertParallelGroups) -> None:
    """Turn the local gradients of sharded expert ``parameters`` into the data-parallel mean: divide
    by the world size, then sum over the replica group (one flat all-reduce)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    torch._foreach_div_(grads, float(groups.world_size))
    if groups.replica_group is not None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=groups.replica_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def share_non_finite_gradients(parameters: Iterable[Tensor]) -> None:
    """Make the gradients of sharded expert ``parameters`` non-finite on every rank where one is non-finite on any
    rank (one scalar all-reduce over all ranks). A float16 GradScaler looks for overflows in its own rank's
    gradients only: expert gradients are not all-reduced, so without this the ranks whose experts overflowed would
    skip the step and lower their loss scale while the others took it, and the replicated weights drift apart."""
    params = list(parameters)
    if not params:
        return
    grads = [p.grad for p in params if p.grad is not None]
    bad = torch.zeros((), device=params[0].device)
    if grads:
        bad = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any().float()
    dist.all_reduce(bad)
    if grads:
        first = grads[0].view(-1)[:1]
        first.copy_(torch.where(bad > 0, torch.full_like(first, float("inf")), first))


def _squared_norm(grads: list[Tensor]) -> Tensor:
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if hasattr(norm, "full_tensor"):  # FSDP-sharded gradients (DTensor): the norm over all shards
        norm = norm.full_tensor()
    return norm.float().square()


def clip_grad_norm_(
    parameters: Iterable[Tensor], expert_parameters: Iterable[Tensor], max_norm: float, groups: ExpertParallelGroups
) -> Tensor:
    """Clip the gradients of all ``parameters`` to a total L2 norm of ``max_norm``, where the norm
    counts every expert of the expert group once (the local norms of the sharded
    ``expert_parameters`` are summed over ``groups.expert_group``). Returns the total norm."""
    expert_ids = {id(p) for p in expert_parameters}
    params = [p for p in parameters if p.grad is not None]
    dense = [p.grad for p in params if id(p) not in expert_ids]
    experts = [p.grad for p in params if id(p) in expert_ids]
    device = params[0].grad.device if params else torch.device("cpu")
    dense_sq = _squared_norm(dense) if dense else torch.zeros((), device=device)
    expert_sq = _squared_norm(experts) if experts else torch.zeros((), device=device)
    dist.all_reduce(expert_sq, group=groups.expert_group)
    total = (dense_sq.to(expert_sq.device) + expert_sq).sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    # Scale the local tensors: FSDP-sharded gradients (DTensor) and plain expert gradients do not mix.
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
    if grads:
        torch._foreach_mul_(grads, scale.to(grads[0].device))
    return total


def _gather_dim0(tensor: Tensor, group) -> Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts)


def gather_expert_state(model: nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Put the full expert tensors (gathered from the model's shards) into ``state_dict`` under their
    ``model.state_dict()`` keys, where ``state_dict`` has those keys (a rank that saves nothing may
    pass ``{}``). Collective: every rank of every expert group calls it."""
    for name, (param, bank) in _expert_params(model).items():
        full = _gather_dim0(param.detach(), bank.ep_group)
        if name in state_dict:
            state_dict[name] = full.cpu()
    return state_dict


def gather_expert_optimizer_entries(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Tensor]]:
    """``{parameter name: {state name: full tensor}}`` of the sharded experts' optimizer states (e.g.
    AdamW moments), gathered from the live optimizer. Collective."""
    entries = {}
    for name, (param, bank) in _expert_params(model).items():
        state = optimizer.state.get(param, {})
        entries[name] = {
            key: _gather_dim0(value, bank.ep_group).cpu()
            for key, value in sorted(state.items())
            if isinstance(value, Tensor) and value.shape == param.shape
        }
    return entries


def shard_expert_entries(model: nn.Module, entries: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``entries`` (``{parameter name: tensor or {state name: tensor}}``, e.g. a state dict or
    the ``"state"`` of a name-keyed optimizer state dict) with the full expert tensors cut to this
    rank's block."""
    result = dict(entries)
    for name, (param, bank) in _expert_params(model).items():
        value = result.get(name)
        if isinstance(value, Tensor):
            result[name] = _local_block(value, param, bank, name)
        elif isinstance(value, Mapping):
            result[name] = {
                k: _local_block(v, param, bank, f"{name}.{k}") if isinstance(v, Tensor) and v.dim() > 0 else v
                for k, v in value.items()
            }
    return result


def shard_expert_state(model: nn.Module, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` (``model.state_dict()`` keys) whose full expert tensors are cut to
    this rank's block."""
    return shard_expert_entries(model, state_dict)


def _local_block(full: Tensor, param: Tensor, bank: ExpertBank, key: str) -> Tensor:
    if full.shape[0] == param.shape[0] and bank.num_local_experts == bank.num_experts:
        return full
    if full.shape[0] != bank.num_experts:
        raise ValueError(
            f"checkpoint entry '{key}' holds {full.shape[0]} experts, the model has {bank.num_experts}: "
            "the checkpoint belongs to a different model configuration"
        )
    return full[bank.expert_offset : bank.expert_offset + bank.num_local_experts]


def _optimizer_indices(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """``{expert parameter name: its index in optimizer.state_dict()}`` for the sharded experts."""
    index_of = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    return {name: index_of[id(param)] for name, (param, _) in _expert_params(model).items() if id(param) in index_of}


def gather_expert_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any]
) -> dict[str, Any]:
    """A copy of ``optimizer_state`` (``optimizer.state_dict()``, index-keyed) whose expert state
    tensors are the full ones (:func:`gather_expert_optimizer_entries`). Collective."""
    entries = gather_expert_optimizer_entries(model, optimizer)
    state = {**optimizer_state, "state": dict(optimizer_state["state"])}
    for name, index in _optimizer_indices(model, optimizer).items():
        state["state"][index] = {**state["state"].get(index, {}), **entries[name]}
    return state


def shard_expert_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, optimizer_state: Mapping[str, Any]
) -> dict[str, Any]:
    """A copy of a full, index-keyed ``optimizer_state`` whose expert state tensors are cut to this
    rank's block (:func:`shard_expert_entries`)."""
    indices = _optimizer_indices(model, optimizer)
    by_name = {name: optimizer_state["state"][i] for name, i in indices.items() if i in optimizer_state["state"]}
    local = shard_expert_entries(model, by_name)
    state = {**optimizer_state, "state": dict(optimizer_state["state"])}
    for name, entry in local.items():
        state["state"][indices[name]] = entry
    return state
