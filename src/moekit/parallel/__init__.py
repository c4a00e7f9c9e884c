"""Scaling out: expert parallelism (:mod:`moekit.parallel.expert_parallel`) and the Lightning
strategies that combine it with data parallelism and FSDP (:mod:`moekit.parallel.strategies`)."""

from .expert_parallel import (
    ExpertParallelGroups,
    check_shardable,
    clip_grad_norm_,
    gather_expert_optimizer_state,
    gather_expert_state,
    new_expert_parallel_groups,
    shard_expert_optimizer_state,
    shard_expert_state,
    shard_experts,
    sharded_expert_banks,
    share_non_finite_gradients,
    sync_expert_gradients,
)
from .strategies import MoEDDPStrategy, MoEFSDPStrategy, sharding_units

__all__ = [
    "MoEDDPStrategy",
    "MoEFSDPStrategy",
    "sharding_units",
    "ExpertParallelGroups",
    "check_shardable",
    "clip_grad_norm_",
    "gather_expert_optimizer_state",
    "gather_expert_state",
    "new_expert_parallel_groups",
    "shard_expert_optimizer_state",
    "shard_expert_state",
    "shard_experts",
    "sharded_expert_banks",
    "share_non_finite_gradients",
    "sync_expert_gradients",
]
