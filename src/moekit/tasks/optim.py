"""Optimizer parameter groups and learning-rate schedules shared by every task.

Schedules are functions of the optimizer step, used through ``torch.optim.lr_scheduler.LambdaLR``
with ``interval="step"``: linear warmup, then cosine decay to ``min_lr_ratio``, reciprocal square
root decay (with an optional linear cooldown, as in ViT/Soft MoE training), or constant.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from moekit.config_checks import OPTIMIZERS

__all__ = ["ScheduleConfig", "param_groups", "lr_lambda", "build_optimizer", "optimizer_for", "clip_grad_norm"]


def param_groups(model: nn.Module, weight_decay: float, decay_1d: bool = False) -> list[dict]:
    """Split parameters into a decayed and a non-decayed group.

    Without decay: every parameter with fewer than 2 dimensions (biases, norm weights, the Soft MoE
    ``scale``, loss-free balancing biases are buffers anyway) and every bias, also an expert bank's
    ``fc1_bias [experts, hidden]``, unless ``decay_1d``; and the names the model lists in ``no_weight_decay()``
    (timm: ``pos_embed``, ``cls_token``, ...).
    """
    skip = set()
    if hasattr(model, "no_weight_decay"):
        skip = {name for name in model.no_weight_decay()}
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        short = name.split(".", 1)[-1] if name.startswith(("net.", "_orig_mod.")) else name
        bias_like = param.ndim < 2 or name.endswith("bias")  # nn.Linear's bias, an expert bank's fc1_bias
        if (bias_like and not decay_1d) or name in skip or short in skip:
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


@dataclass
class ScheduleConfig:
    """Learning-rate schedule.

    Attributes:
        name: ``"cosine" | "rsqrt" | "constant"``.
        warmup_steps: linear warmup from 0; a float in (0, 1) is a fraction of the total steps.
        min_lr_ratio: cosine floor, as a fraction of the peak learning rate.
        cooldown_steps: rsqrt only: linear decay to 0 over the last steps (int or fraction).
        timescale: rsqrt only: ``lr = peak * sqrt(timescale / max(step, timescale))`` after warmup;
            default the warmup length.
    """

    name: Literal["cosine", "rsqrt", "constant"] = "cosine"
    warmup_steps: float = 0.05
    min_lr_ratio: float = 0.0
    cooldown_steps: float = 0.0
    timescale: float | None = None


def _steps(value: float, total: int) -> int:
    return int(round(value * total)) if 0 < value < 1 else int(value)


def _needs_total(config: ScheduleConfig) -> str | None:
    """What of ``config`` depends on the run's total number of steps, or None."""
    if config.name == "cosine":
        return "name='cosine' (it decays over the run's steps)"
    if 0 < config.warmup_steps < 1:
        return f"warmup_steps={config.warmup_steps} (a fraction of the run's steps)"
    if config.name == "rsqrt" and config.cooldown_steps:
        return f"cooldown_steps={config.cooldown_steps} (the run's last steps)"
    return None


def lr_lambda(config: ScheduleConfig, total_steps: float) -> Callable[[int], float]:
    """Multiplier of the peak learning rate at each optimizer step. ``total_steps`` may be ``inf`` (a run with no
    step or epoch limit, stopped by ``max_time``) for a schedule that does not depend on it."""
    if config.name not in ("cosine", "rsqrt", "constant"):
        raise ValueError(f"scheduler name={config.name!r}; allowed: 'cosine', 'rsqrt', 'constant'")
    if not math.isfinite(total_steps) and (needs := _needs_total(config)):
        raise ValueError(
            f"scheduler {needs} needs the run's number of optimizer steps, but nothing limits it "
            "(trainer.max_steps=-1, with trainer.max_epochs=-1 or training data of no length); set trainer.max_steps, "
            "or use scheduler.name=constant or rsqrt with a whole number of warmup_steps and no cooldown_steps"
        )
    total_steps = max(1, total_steps)
    warmup = min(_steps(config.warmup_steps, total_steps), total_steps)
    cooldown = _steps(config.cooldown_steps, total_steps)
    timescale = config.timescale or max(warmup, 1)

    def multiplier(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if config.name == "constant":
            return 1.0
        if config.name == "cosine":
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        value = math.sqrt(timescale / max(step, timescale))
        if cooldown and step >= total_steps - cooldown:
            value *= max(0.0, (total_steps - step) / cooldown)
        return value

    return multiplier


def _one_tensor_kind(groups: list[dict]) -> bool:
    """Every parameter a DTensor, or none (the fused kernels refuse a mix)."""
    from torch.distributed.tensor import DTensor

    return len({isinstance(p, DTensor) for group in groups for p in group["params"]}) <= 1


def build_optimizer(
    params: Iterable[dict],
    name: str = "adamw",
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    momentum: float | None = None,
    fused: bool = True,
    ns_steps: int = 5,
    ns_dtype: str = "auto",
    run_precision: str | None = None,
) -> torch.optim.Optimizer:
    """``adamw``, ``sgd`` (momentum default 0.9) or ``muon`` (:class:`~moekit.tasks.muon.MuonAdamW`, over the groups
    of :func:`~moekit.tasks.muon.muon_param_groups`; momentum default 0.95, ``ns_steps`` and ``ns_dtype`` its
    Newton-Schulz settings, ``run_precision`` the run's ``trainer.precision`` that ``ns_dtype="auto"`` reads) over
    pre-built parameter groups.

    ``fused``: AdamW's fused kernel, one pass over all tensors per step instead of several. An MoE model's update
    grows with its total parameters, not its active ones: on a 2-core AMD EPYC the fused step of 200M expert
    weights took 0.33x the time of the default, and on an H100 the fused update of Soft MoE S/16 (923M
    parameters) 15 ms instead of 33. It leaves unscaling to a float16 ``GradScaler``; a float16 run turns it off
    (:meth:`moekit.tasks.MoETask.configure_optimizers`), and norm clipping runs inside the step
    (:func:`clip_grad_norm`). The fused kernel takes all-DTensor or all-plain
    parameters; FSDP with expert parallelism (sharded DTensors beside plain local experts) runs the default.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer name={name!r}; allowed: {', '.join(map(repr, OPTIMIZERS))}")
    params = list(params)
    if name == "adamw":
        fused = fused and _one_tensor_kind(params)
        return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, fused=fused)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9 if momentum is None else momentum)
    from .muon import MuonAdamW

    if not all(isinstance(group, dict) and "algorithm" in group for group in params):
        raise ValueError(
            "optimizer name='muon' takes param groups that say which algorithm trains them ('algorithm': 'muon' "
            "or 'adamw'): build them with moekit.tasks.muon.muon_param_groups(model, weight_decay)"
        )
    momentum = 0.95 if momentum is None else momentum
    return MuonAdamW(params, lr=lr, momentum=momentum, betas=betas, eps=eps, ns_steps=ns_steps, ns_dtype=ns_dtype,
                     fused=fused, run_precision=run_precision)  # fmt: skip


def optimizer_for(
    model: nn.Module, config: Mapping[str, Any], fused: bool = True, run_precision: str | None = None
) -> torch.optim.Optimizer:
    """The optimizer that a task's ``optimizer`` config (``name``, ``weight_decay``, ``decay_1d``, and the
    keywords of :func:`build_optimizer`) builds for ``model`` in a run of ``run_precision``, over
    :func:`param_groups`, or for ``muon`` over :func:`~moekit.tasks.muon.muon_param_groups`."""
    config = dict(config)
    weight_decay = config.pop("weight_decay", 0.0)
    decay_1d = config.pop("decay_1d", False)
    if config.get("name") == "muon":
        from .muon import muon_param_groups

        groups = muon_param_groups(model, weight_decay, decay_1d)
    else:
        groups = param_groups(model, weight_decay, decay_1d)
    return build_optimizer(groups, **config, fused=fused, run_precision=run_precision)


def clip_grad_norm(optimizer: torch.optim.Optimizer, max_norm: float) -> Tensor:
    """Clip the gradients of ``optimizer``'s parameters to a total 2-norm of ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does; returns their norm before clipping.

    A fused optimizer (fused AdamW, which :func:`build_optimizer` builds) clips inside its next step: its kernel
    divides each gradient by ``optimizer.grad_scale`` as it reads it (the hook by which a float16 ``GradScaler``
    unscales) and stores the quotient back. Set to ``max(1, norm / max_norm)`` for that step alone, it clips by
    ``clip_grad_norm_``'s factor (a division where that multiplies: the same gradients up to rounding) without
    a pass of its own that reads and writes every gradient, a pass that grows with an MoE model's total
    parameters, not its active ones. DTensor parameters (FSDP) clip by ``clip_grad_norm_``.
    """
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    fused = getattr(optimizer, "_step_supports_amp_scaling", False)
    if not fused or any(isinstance(p, DTensor) for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    optimizer.grad_scale = norm.float().add(1e-6).div(max_norm).clamp(min=1.0)  # clip_grad_norm_'s eps

    def end_of_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        optimizer.__dict__.pop("grad_scale", None)
        handle.remove()

    handle = optimizer.register_step_post_hook(end_of_step)
    return norm
