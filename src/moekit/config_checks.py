"""Range checks of a run's numeric settings, on the resolved config, before torch is imported.

Hydra and the constructors accept many values that cost a run later: a learning rate of ``inf`` writes NaN
weights at the first step, a negative weight decay or warm-up trains silently with it, gradient accumulation 0
or a label smoothing of 1 fail deep inside Lightning or the loss. :func:`check_settings` refuses each with one
sentence naming the key, the value and what to give instead. Keys a config does not have are skipped (each
task and model has its own).

Importing this module imports no torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["check_settings"]

PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true", "32", "bf16", "16", "64")
"""``trainer.precision``'s values: Lightning's names (and its 16 / 32 / 64) and ``auto`` (the machine's best)."""
OPTIMIZERS = ("adamw", "sgd", "muon")
"""``task.optimizer.name``'s values (:func:`moekit.tasks.optim.build_optimizer`)."""
NS_DTYPES = ("auto", "float32", "bfloat16")
"""``task.optimizer.ns_dtype``'s values (:class:`moekit.tasks.muon.MuonAdamW`)."""
SCHEDULES = ("cosine", "rsqrt", "constant")
"""``task.scheduler.name``'s values (:class:`moekit.tasks.optim.ScheduleConfig`)."""


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: Any) -> bool:
    return _number(value) and value > 0


def _non_negative(value: Any) -> bool:
    return _number(value) and value >= 0


def _fraction(value: Any) -> bool:  # [0, 1)
    return _number(value) and 0 <= value < 1


def _unit(value: Any) -> bool:  # [0, 1]
    return _number(value) and 0 <= value <= 1


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _seed(value: Any) -> bool:  # what numpy's and torch's generators take
    return _whole(value) and value < 2**32


def _epochs(value: Any) -> bool:  # Lightning's limits: -1 for none
    return value is None or isinstance(value, int) and not isinstance(value, bool) and value >= -1


_DEVICE_INDICES = re.compile(r"^\s*\d+\s*(,\s*\d+\s*)*,?\s*$")  # "0,1" or "1,": Lightning's device indices


def _devices(value: Any) -> bool:  # a count (-1: every device), "auto", a list of indices or "0,1"
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():  # "2" or "-1": Lightning reads a count
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value >= 1 or value == -1
    if isinstance(value, str):
        return value == "auto" or bool(_DEVICE_INDICES.match(value))
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(_whole(i) for i in value)


def _precision(value: Any) -> bool:  # Lightning's names, its 16 / 32 / 64, and moekit's auto
    return value in PRECISIONS if isinstance(value, str) else value in (16, 32, 64) and not isinstance(value, bool)


def _betas(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(_fraction(b) for b in value)


def _bits(value: Any) -> bool:
    return value in (8, 4, 2, "ternary") and not isinstance(value, bool)


# key -> (valid?, what it must be, what to give instead)
_RULES: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "task.optimizer.lr": (_positive, "a finite number > 0", "e.g. 1e-3"),
    "task.optimizer.weight_decay": (_non_negative, "a finite number >= 0", "0 turns it off"),
    "task.optimizer.betas": (_betas, "two numbers in [0, 1)", "e.g. [0.9, 0.999]"),
    "task.optimizer.eps": (_positive, "a finite number > 0", "e.g. 1e-8"),
    "task.optimizer.name": (lambda v: v in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)}", "e.g. adamw"),
    "task.optimizer.momentum": (_optional(_fraction), "a number in [0, 1) or null", "null: sgd 0.9, muon 0.95"),
    "task.optimizer.ns_steps": (_count, "a positive int", "Muon's Newton-Schulz steps, 5 in the paper"),
    "task.optimizer.ns_dtype": (
        lambda v: v in NS_DTYPES,
        f"one of {', '.join(NS_DTYPES)}",
        "auto: bfloat16 on GPUs with bf16 in hardware, CPUs with AMX, and CPUs with avx512_bf16 alone in a "
        "bf16-mixed run; else float32",
    ),
    "task.scheduler.name": (lambda v: v in SCHEDULES, f"one of {', '.join(SCHEDULES)}", "e.g. cosine"),
    "task.scheduler.warmup_steps": (
        _non_negative,
        "a number >= 0",
        "a fraction of all steps in (0, 1), a step count, or 0 for no warm-up",
    ),
    "task.scheduler.min_lr_ratio": (_unit, "a number in [0, 1]", "the cosine floor as a fraction of the peak lr"),
    "task.scheduler.cooldown_steps": (_non_negative, "a number >= 0", "a fraction of all steps or a step count"),
    "task.scheduler.timescale": (_optional(_positive), "a number > 0 or null", "null uses the warm-up length"),
    "task.label_smoothing": (_fraction, "a number in [0, 1)", "e.g. 0.1, or 0 for none"),
    "trainer.accumulate_grad_batches": (_count, "a positive int", "1 steps after every batch"),
    "seed": (_seed, "a whole number in [0, 2**32)", "e.g. seed=42"),
    "trainer.max_epochs": (_epochs, "a whole number >= 0, -1 for no limit, or null", "e.g. trainer.max_epochs=10"),
    "trainer.max_steps": (_epochs, "a whole number >= 0, or -1 for no limit", "e.g. trainer.max_steps=1000"),
    "trainer.precision": (
        _precision,
        f"one of {', '.join(PRECISIONS)}",
        "auto: bf16-mixed on GPUs and AMX CPUs, measured on CPUs with avx512_bf16 alone, else 32-true",
    ),
    "trainer.devices": (
        _devices,
        "a positive count, -1 (all), auto, or device indices (a list, or a string such as '0,1')",
        "e.g. trainer.devices=1",
    ),
    "trainer.num_nodes": (_count, "a positive int", "the machines the run spans, e.g. trainer.num_nodes=1"),
    "kernel_choices": (
        lambda v: isinstance(v, list) and all(isinstance(s, str) and "=" in s for s in v),
        "a list of NAME=VALUE strings",
        """e.g. "kernel_choices=['ROW_BLOCK=128']" (docs/performance.md, "The choice table")""",
    ),
    "data.num_workers": (_whole, "a whole number >= 0", "0 loads batches in the training process"),
    "moe.num_experts": (_count, "a positive int", "e.g. moe.num_experts=8"),
    "moe.top_k": (_count, "a positive int, at most moe.num_experts", "e.g. moe.top_k=2"),
    "moe.capacity_factor": (
        _optional(_positive),
        "a number > 0 or null",
        "null: no capacity limit (Soft MoE: moe.slots_per_expert sets the slots)",
    ),
    "moe.eval_capacity_factor": (
        lambda v: v == "same" or _optional(_positive)(v),
        "a number > 0, same or null",
        "same: the training factor; null: no capacity limit in evaluation",
    ),
    "moe.slots_per_expert": (_optional(_count), "a positive int or null", "null: from moe.capacity_factor"),
    "data.batch_size": (_count, "a positive integer", "the images or sequences of one step, e.g. 128"),
    "data.eval_batch_size": (_optional(_count), "a positive integer or null", "null uses data.batch_size"),
    "data.seq_len": (_count, "a positive integer", "the tokens of one training sequence, e.g. 256"),
    "callbacks.last_checkpoint_steps.every_n_train_steps": (
        _whole,
        "a whole number of optimizer steps >= 0",
        "0 turns the step checkpoints off",
    ),
    "trainer.gradient_clip_val": (_optional(_non_negative), "a number >= 0 or null", "null (or 0) turns clipping off"),
    "model.drop_path_rate": (_fraction, "a number in [0, 1)", "e.g. 0.1, or 0 for none"),
    "model.drop_rate": (_fraction, "a number in [0, 1)", "e.g. 0.1, or 0 for none"),
    "model.proj_drop_rate": (_fraction, "a number in [0, 1)", "e.g. 0.1, or 0 for none"),
    "model.attn_drop_rate": (_fraction, "a number in [0, 1)", "e.g. 0.1, or 0 for none"),
    "model.dropout": (_fraction, "a number in [0, 1)", "e.g. 0.1, or 0 for none"),
    # scripts/quantize.py
    "bits": (_bits, "8, 4, 2 or ternary (both methods support each)", "e.g. bits=4, or bits=ternary (sub-2-bit)"),
    "method": (lambda v: v in ("rtn", "gptq"), "rtn or gptq", "gptq uses calibration batches, rtn rounds to nearest"),
    "group_size": (_count, "a positive int (input rows per scale)", "e.g. 128"),
    "calibration_batches": (_count, "a positive int", "GPTQ needs batches of the training split, e.g. 32"),
    "damping": (_fraction, "a number in [0, 1)", "GPTQ's default is 0.01"),
    "min_rows": (_optional(_count), "a positive int or null", "null: the matrix's input size"),
}

_MISSING = object()


def _get(settings: Mapping[str, Any], key: str) -> Any:
    node: Any = settings
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def check_settings(settings: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for the first setting of ``settings`` (a resolved run config as plain containers)
    out of its range, and for a model width its attention heads do not divide."""
    for key, (valid, requirement, fix) in _RULES.items():
        value = _get(settings, key)
        if value is not _MISSING and not valid(value):
            raise ValueError(f"{key}={value!r} must be {requirement}; {fix}")
    moe = settings.get("moe")
    if isinstance(moe, Mapping) and _count(moe.get("top_k")) and _count(moe.get("num_experts")):
        if moe["top_k"] > moe["num_experts"]:
            raise ValueError(
                f"moe.top_k={moe['top_k']} is more than moe.num_experts={moe['num_experts']}: a token cannot choose "
                f"more experts than there are; use moe.top_k <= {moe['num_experts']}, or more experts"
            )
    _check_cpu_devices(settings.get("trainer"))
    model = settings.get("model")
    if not isinstance(model, Mapping):
        return
    data = settings.get("data")
    context, seq_len = model.get("max_seq_len"), data.get("seq_len") if isinstance(data, Mapping) else None
    if _count(context) and _count(seq_len) and context < seq_len:
        raise ValueError(
            f"model.max_seq_len={context} is shorter than data.seq_len={seq_len}, the length of every training "
            f"sequence; set model.max_seq_len >= {seq_len} (by default it is data.seq_len) or data.seq_len <= {context}"
        )
    for width_key in ("embed_dim", "dim"):
        width, heads = model.get(width_key), model.get("num_heads")
        if _count(width) and _count(heads) and width % heads:
            divisors = [h for h in range(1, min(width, 16) + 1) if width % h == 0]
            raise ValueError(
                f"model.{width_key}={width} is not divisible by model.num_heads={heads}; pick heads that divide "
                f"the width (for {width}: {', '.join(map(str, divisors))}, ...) or another width"
            )


def _check_cpu_devices(trainer: Any) -> None:
    """Lightning's CPU accelerator takes a count of processes (or ``auto``), not device indices nor -1."""
    if not isinstance(trainer, Mapping) or trainer.get("accelerator") != "cpu":
        return
    devices = trainer.get("devices", "auto")
    if devices == "auto" or (_devices(devices) and str(devices).strip().isdigit()):
        return
    raise ValueError(
        f"trainer.devices={devices!r} with trainer.accelerator=cpu must be a count of processes or auto (the CPU has "
        "no device indices, and -1 means every GPU); e.g. trainer.devices=2 with trainer=ddp"
    )
