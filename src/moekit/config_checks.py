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
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["check_settings"]


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
    "task.optimizer.momentum": (_fraction, "a number in [0, 1)", "e.g. 0.9"),
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
    "data.batch_size": (_count, "a positive integer", "the images or sequences of one step, e.g. 128"),
    "data.eval_batch_size": (_optional(_count), "a positive integer or null", "null uses data.batch_size"),
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
    model = settings.get("model")
    if not isinstance(model, Mapping):
        return
    for width_key in ("embed_dim", "dim"):
        width, heads = model.get(width_key), model.get("num_heads")
        if _count(width) and _count(heads) and width % heads:
            divisors = [h for h in range(1, min(width, 16) + 1) if width % h == 0]
            raise ValueError(
                f"model.{width_key}={width} is not divisible by model.num_heads={heads}; pick heads that divide "
                f"the width (for {width}: {', '.join(map(str, divisors))}, ...) or another width"
            )
