"""Lightning strategies for MoE models: data parallel (DDP) and fully sharded (FSDP2), each with
optional expert parallelism.

* :class:`MoEDDPStrategy` - Lightning's ``DDPStrategy``. With ``expert_parallel_size=P > 1`` the routed
  experts of every MoE layer are split over groups of ``P`` ranks (tokens travel by all-to-all, see
  :mod:`moekit.moe.all_to_all`); DDP all-reduces only the other parameters.
* :class:`MoEFSDPStrategy` - FSDP2 (``fully_shard``) through Lightning's ``ModelParallelStrategy``:
  transformer blocks / LSTM layers are the sharding units, every MoE layer's router is its own unit
  kept in float32, optional activation checkpointing and parameter mixed precision, full or sharded
  (distributed) checkpoints. Runs on CPU processes with gloo (tests) and on GPUs with NCCL.

Both shard the model in ``LightningModule.configure_model`` (:meth:`MoETask.configure_model` calls
``strategy.parallelize``), before the optimizer is built. Checkpoints hold full expert tensors, so a run
saved at one world size resumes at another.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from moekit.moe import ExpertBank, MoELayer, moe_layers

from .expert_parallel import (
    ExpertParallelGroups,
    check_expert_parallel_size,
    check_shardable,
    clip_grad_norm_,
    gather_expert_optimizer_entries,
    gather_expert_optimizer_state,
    gather_expert_state,
    new_expert_parallel_groups,
    shard_expert_entries,
    shard_expert_optimizer_state,
    shard_expert_state,
    shard_experts,
    sharded_expert_banks,
    share_non_finite_gradients,
    sync_expert_gradients,
)

__all__ = ["MoEDDPStrategy", "MoEFSDPStrategy", "sharding_units"]


def _unwrap(optimizer: Optimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class _ExpertParallel:
    """Expert parallelism shared by the strategies: sharding, gradient sync, clipping, checkpoints."""

    expert_parallel_size: int
    _expert_groups: ExpertParallelGroups | None = None
    _experts_synced = False  # the expert gradients are the data-parallel mean (since the last backward)

    def setup_environment(self) -> None:
        # Refused before any process group exists (a rank that raised after creating one could leave the others
        # waiting on it) and before the data and model setup.
        module = self.lightning_module
        if self.expert_parallel_size > 1 and module is not None:
            check_shardable(module, self.expert_parallel_size, self.num_nodes * self.num_processes)
        super().setup_environment()

    def _shard_experts(self, lightning_module: nn.Module) -> list[nn.Parameter]:
        """Shard the routed experts (once); returns the sharded expert parameters."""
        sharded = sharded_expert_banks(lightning_module)
        if sharded and self._expert_groups is None:  # split by an earlier fit's strategy: this one syncs them too
            self._adopt_sharded_experts(sharded)
        elif self.expert_parallel_size > 1 and not sharded:
            groups = new_expert_parallel_groups(self.expert_parallel_size)
            if shard_experts(lightning_module, groups) == 0:
                raise ValueError(
                    f"expert_parallel_size={self.expert_parallel_size}, but the model has no MoE layer with routed "
                    "experts; use expert_parallel_size=1"
                )
            self._expert_groups = groups
            self._sync_expert_replicas(lightning_module)
        if self._expert_groups is not None:
            self._route_norm_clipping()
        return self._expert_parameters(lightning_module)

    def _adopt_sharded_experts(self, banks: Mapping[str, ExpertBank]) -> None:
        """Take on experts that another strategy split (a second ``Trainer`` on the same module): their gradients
        need this strategy's sync and clipping as well, and their checkpoints the gather."""
        sizes = {name: dist.get_world_size(bank.ep_group) for name, bank in banks.items()}
        odd = {name: size for name, size in sizes.items() if size != self.expert_parallel_size}
        if odd:
            name, size = next(iter(odd.items()))
            raise ValueError(
                f"expert_parallel_size={self.expert_parallel_size}, but the experts of {name} are already split over "
                f"groups of {size} ranks (by an earlier fit); use expert_parallel_size={size} with this model"
            )
        self._expert_groups = new_expert_parallel_groups(self.expert_parallel_size)

    @torch.no_grad()
    def _sync_expert_replicas(self, lightning_module: nn.Module) -> None:
        """The ranks holding the same block of experts start from its first holder's weights (as DDP gives every
        rank rank 0's replicated weights): ranks seeded differently drew different banks, and replicas that start
        apart stay apart (they apply the same summed gradient)."""
        replicas = self._expert_groups.replica_group
        if replicas is None:
            return
        source = dist.get_global_rank(replicas, 0)
        for param in self._expert_parameters(lightning_module):
            buffer = param.detach().to(self.root_device)  # NCCL broadcasts device tensors only
            dist.broadcast(buffer, src=source, group=replicas)
            param.copy_(buffer)

    def _route_norm_clipping(self) -> None:
        """Send Lightning's own norm clipping (``LightningModule.clip_gradients``, what a module without moekit's
        ``configure_gradient_clipping`` calls) through :meth:`clip_gradient_norm`: a rank's local norm misses the
        experts of the other ranks, so each rank would clip by another factor (the replicated weights drift apart).
        Value clipping, too, reads the experts' mean gradients (manual optimization clips before the step)."""
        plugin = self.precision_plugin
        self.precision_plugin = plugin  # kept (without a Trainer's, each read gives a new default plugin)

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
            self.clip_gradient_norm(optimizer, float(clip_val))

        def clip_grad_by_value(optimizer: Optimizer, clip_val: float) -> None:
            self._sync_before_clipping()
            type(plugin).clip_grad_by_value(plugin, optimizer, clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm  # the plugin's clip_gradients calls it after unscaling
        plugin.clip_grad_by_value = clip_grad_by_value

    @staticmethod
    def _expert_parameters(module: nn.Module) -> list[nn.Parameter]:
        return [p for bank in sharded_expert_banks(module).values() for p in bank.parameters()]

    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        self._experts_synced = False  # new expert gradients: sync them before the next clipping or step
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _sync_expert_gradients(self) -> None:
        """Make the experts' local gradients the data-parallel mean, once after each backward: before the first
        clipping or optimizer step that reads them (manual optimization clips before the step, and each of several
        optimizers steps)."""
        if self._expert_groups is None or self._experts_synced:
            return
        expert_params = self._expert_parameters(self.lightning_module)
        sync_expert_gradients(expert_params, self._expert_groups)
        if getattr(self.precision_plugin, "scaler", None) is not None:  # before the scaler's local overflow check
            share_non_finite_gradients(expert_params)
        self._experts_synced = True

    def _sync_before_clipping(self) -> None:
        """Manual optimization clips before the step: sync the expert gradients first (automatic optimization clips
        after the closure, which synced them)."""
        if not getattr(self.lightning_module, "automatic_optimization", True):
            self._sync_expert_gradients()

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        if self._expert_groups is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_sync_experts():
            result = closure()  # forward + backward of the last micro-batch of the step (manual: nothing)
            self._sync_expert_gradients()
            return result

        return super().optimizer_step(optimizer, closure_then_sync_experts, model, **kwargs)

    def clip_gradient_norm(self, optimizer: Optimizer, max_norm: float) -> torch.Tensor | None:
        """Clip by the norm over all experts of the expert group (None: not expert parallel, the
        caller clips as usual)."""
        if self._expert_groups is None:
            return None
        self._sync_before_clipping()
        params = [p for group in _unwrap(optimizer).param_groups for p in group["params"]]
        experts = self._expert_parameters(self.lightning_module)
        return clip_grad_norm_(params, experts, max_norm, self._expert_groups)

    # Checkpoints hold full expert tensors (collectives: every rank takes part).
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        if self._expert_groups is not None:
            state = gather_expert_state(self.lightning_module, state)
        return state


class MoEDDPStrategy(_ExpertParallel, DDPStrategy):
    """Lightning DDP with optional expert parallelism.

    Args:
        expert_parallel_size: ranks that share one copy of the experts (1: every rank holds all
            experts, plain DDP). Must divide the world size and every MoE layer's expert count.
        **kwargs: ``DDPStrategy`` arguments (``find_unused_parameters``, ``process_group_backend``, ...).
    """

    strategy_name = "moe_ddp"

    def __init__(self, expert_parallel_size: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.expert_parallel_size = check_expert_parallel_size(expert_parallel_size)

    def parallelize(self, lightning_module: nn.Module) -> None:
        """Shard the experts; DDP then leaves them out of its gradient all-reduce and its broadcasts."""
        experts = {id(p) for p in self._shard_experts(lightning_module)}
        if experts:
            names = [name for name, p in lightning_module.named_parameters() if id(p) in experts]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(lightning_module, names)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        if self._expert_groups is not None:
            state = gather_expert_optimizer_state(self.lightning_module, _unwrap(optimizer), state)
        return state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._expert_groups is not None:
            checkpoint = {
                **checkpoint,
                "state_dict": shard_expert_state(self.lightning_module, checkpoint["state_dict"]),
            }
        super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._expert_groups is not None:
            states = [
                shard_expert_optimizer_state(self.lightning_module, _unwrap(optimizer), state)
                for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"])
            ]
            checkpoint = {**checkpoint, "optimizer_states": states}
        super().load_optimizer_state_dict(checkpoint)


def sharding_units(net: nn.Module) -> list[nn.Module]:
    """FSDP's sharding units of ``net``: transformer blocks (timm ViT ``Block``, moekit
    ``TransformerBlock``: the elements of ``net.blocks``) and LSTM layers."""
    blocks = getattr(net, "blocks", None)
    units = list(blocks) if isinstance(blocks, (nn.ModuleList, nn.Sequential)) else []
    return units + [m for m in net.modules() if isinstance(m, nn.LSTM)]


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, None: None}


class MoEFSDPStrategy(_ExpertParallel, ModelParallelStrategy):
    """FSDP2 (``fully_shard``) over all processes for MoE models.

    Args:
        activation_checkpointing: recompute each block in backward (the model's
            ``set_grad_checkpointing``, as timm models offer).
        param_dtype: dtype the sharded parameters are gathered in for compute (``"bfloat16"``; None:
            as stored). Routers stay float32 either way (their MoE layer is its own unit).
        reduce_dtype: dtype of the gradient reduce-scatter (None: ``param_dtype``).
        reshard_after_forward: free the gathered parameters after each unit's forward (ZeRO-3);
            False keeps them until backward (ZeRO-2-like, more memory, less communication).
        state_dict_type: ``"full"`` (one file on rank 0, loadable without FSDP and at any world size)
            or ``"sharded"`` (a folder with one file per rank, torch.distributed.checkpoint; resumes
            with this strategy at any world size).
        expert_parallel_size: ``P > 1`` splits the routed experts over groups of ``P`` ranks (as
            :class:`MoEDDPStrategy`); FSDP then shards everything else over all ranks and leaves the
            experts to expert parallelism. Checkpoints must be ``full`` then.
        **kwargs: ``ModelParallelStrategy`` arguments (``process_group_backend``, ``timeout``).
    """

    strategy_name = "moe_fsdp"

    def __init__(
        self,
        activation_checkpointing: bool = False,
        param_dtype: Literal["float32", "bfloat16", "float16"] | None = None,
        reduce_dtype: Literal["float32", "bfloat16", "float16"] | None = None,
        reshard_after_forward: bool = True,
        state_dict_type: Literal["full", "sharded"] = "full",
        expert_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        if state_dict_type not in ("full", "sharded"):
            raise ValueError(f"MoEFSDPStrategy: state_dict_type={state_dict_type!r}; allowed: 'full', 'sharded'")
        for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value not in _DTYPES:
                raise ValueError(f"MoEFSDPStrategy: {name}={value!r}; allowed: 'float32', 'bfloat16', 'float16', null")
        if expert_parallel_size != 1 and state_dict_type == "sharded":
            raise ValueError(
                f"MoEFSDPStrategy: state_dict_type='sharded' with expert_parallel_size={expert_parallel_size} is not "
                "supported; use state_dict_type=full (a checkpoint that also loads at other world sizes)"
            )
        super().__init__(save_distributed_checkpoint=state_dict_type == "sharded", **kwargs)
        self.expert_parallel_size = check_expert_parallel_size(expert_parallel_size)
        self.activation_checkpointing = activation_checkpointing
        self.param_dtype = _DTYPES[param_dtype]
        self.reduce_dtype = _DTYPES[reduce_dtype]
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        # One data-parallel mesh dimension over every process (no tensor parallelism).
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def parallelize(self, lightning_module: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        net = lightning_module.net
        if isinstance(net, FSDPModule):  # configure_model runs again for trainer.test after fit, or a new Trainer's
            self._shard_experts(lightning_module)
            return
        if self.activation_checkpointing:
            if not hasattr(net, "set_grad_checkpointing"):
                raise ValueError(
                    f"MoEFSDPStrategy: activation_checkpointing=True, but {type(net).__name__} has no "
                    "set_grad_checkpointing(); use activation_checkpointing=false"
                )
            net.set_grad_checkpointing(True)
        experts = set(self._shard_experts(lightning_module))  # expert parallelism owns these, FSDP the rest
        mesh = self.device_mesh["data_parallel"]
        compute = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)
        # Routers in float32: the MoE layer's own parameters are gathered in float32 and its input is
        # not cast (the experts inside are a unit of their own, in the compute dtype).
        router = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
        options = {"mesh": mesh, "reshard_after_forward": self.reshard_after_forward, "ignored_params": experts or None}
        for _, layer in moe_layers(net):
            for module in layer.children():
                if isinstance(module, ExpertBank) and module.ep_group is None:  # shared experts, or P = 1
                    fully_shard(module, mp_policy=compute, **options)
            fully_shard(layer, mp_policy=router, **options)
        for unit in sharding_units(net):
            if not isinstance(unit, MoELayer):
                fully_shard(unit, mp_policy=compute, **options)
        fully_shard(net, mp_policy=compute, **options)

    # Full checkpoints with expert parallelism: FSDP's state-dict functions see the experts as plain
    # per-rank tensors, so their full tensors are gathered on save and cut to each rank on load here.
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._expert_groups is None:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

        optimizer = _unwrap(optimizer)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(self.model, optimizer, options=options)  # name-keyed, rank 0 only
        experts = gather_expert_optimizer_entries(self.model, optimizer)
        if self.global_rank != 0:
            return state
        for name, entries in experts.items():
            state["state"].setdefault(name, {}).update(entries)
        return FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        if self._expert_groups is None:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        from lightning.fabric.strategies.model_parallel import _rekey_optimizer_state_if_needed
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        if not path.is_file():
            raise ValueError(
                f"ckpt_path={str(path)!r}: with expert_parallel_size={self.expert_parallel_size} FSDP resumes from "
                "full checkpoints (one file) only"
            )
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=False)
        strict = self.lightning_module.strict_loading
        # Every rank reads the file and keeps its own block of experts (no broadcast from rank 0).
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(self.model, shard_expert_state(self.model, checkpoint.pop("state_dict")), options=options)
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"]):
            saved = _rekey_optimizer_state_if_needed(saved, self.model)
            saved = {**saved, "state": shard_expert_entries(self.model, saved["state"])}
            set_optimizer_state_dict(
                self.model, _unwrap(optimizer), saved, options=StateDictOptions(full_state_dict=True)
            )
        return checkpoint
