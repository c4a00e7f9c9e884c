"""Resuming a training run: which checkpoint ``ckpt_path=last`` / ``auto`` means (:func:`find_resume_checkpoint`),
and whether a checkpoint fits the run that resumes it (:func:`check_resume_checkpoint`).

Both take a sharded checkpoint folder (``trainer=fsdp trainer.strategy.state_dict_type=sharded``) as they take a
``.ckpt`` file: :func:`moekit.checkpoint.read_training_checkpoint` reads either, so that a requeued FSDP job resumes
its own progress and a foreign or changed run is refused before ``trainer.fit`` starts.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moekit.checkpoint import (
    TASK_KEY,
    CheckpointError,
    checkpoints_in,
    is_sharded_checkpoint,
    load_weights,
    read_training_checkpoint,
)
from moekit.configs import CONFIG_DIR

if TYPE_CHECKING:
    from moekit.tasks import MoETask

__all__ = ["FIT_STARTED_KEY", "RESUME_ALIASES", "find_resume_checkpoint", "check_resume_checkpoint"]

RESUME_ALIASES = ("last", "auto")
"""``ckpt_path`` values that name no file: resume from the checkpoint with the most training progress that loads
(``auto``: or start afresh when there is none); see :func:`find_resume_checkpoint`."""

FIT_STARTED_KEY = "moekit_fit_started_at"
"""Checkpoint entry: when the training process that wrote it started (seconds since the epoch; rank 0's clock). All
checkpoints of one process share it; a resumed process writes its own, later one."""


def find_resume_checkpoint(alias: str, output_dir: Path, runs_dir: Path | None) -> tuple[Path | None, list[Path]]:
    """What ``ckpt_path=last`` / ``auto`` means: the checkpoint (``.ckpt`` file or sharded folder) that loads with the
    most training progress of the latest training process (:func:`_progress`: the start time of the process that
    wrote it, then its ``global_step``, then ``epoch``; modification time breaks ties, ``last.ckpt`` first among
    equals) in this run's own ``checkpoints/`` folder if it has any, else in the newest run folder of ``runs_dir``
    that has one (run folders are named by their start time; ``runs_dir=None``: the own folder only, as for a sweep's
    job, which resumes itself and never another setting's run). What the checkpoints hold decides, not their files'
    modification times: a folder copied without its timestamps has them in copy order. The latest process comes
    first so that a run rewound in its own folder (resumed from an earlier checkpoint) goes on from where the rewound
    branch got to, not from the abandoned branch's checkpoints with more steps. Returns ``(checkpoint,
    that folder's checkpoints that did not load)``; ``(None, [])`` for ``auto`` when no run has a checkpoint (start
    afresh). A :class:`CheckpointError` for ``last`` without any checkpoint, and when none of that folder's
    checkpoints loads (naming them)."""
    if alias not in RESUME_ALIASES:
        raise ValueError(f"ckpt_path={alias!r} is not one of {RESUME_ALIASES}")
    own = output_dir.resolve()
    runs = runs_dir.glob("*") if runs_dir is not None else ()
    earlier = sorted((p for p in runs if p.is_dir() and p.resolve() != own), reverse=True)
    for folder in [output_dir / "checkpoints", *(run / "checkpoints" for run in earlier)]:
        found = checkpoints_in(folder)  # newest first, last.ckpt first among equals: max() keeps the first of ties
        loaded: list[tuple[tuple[float, int, int], Path]] = []
        skipped: list[Path] = []
        for path in found:
            try:
                loaded.append((_progress(read_training_checkpoint(path)), path))
            except CheckpointError:
                skipped.append(path)
        if loaded:
            return max(loaded, key=lambda item: item[0])[1], skipped
        if found:
            raise CheckpointError(
                f"ckpt_path={alias}: none of the checkpoints of {folder} loads ({', '.join(p.name for p in found)}: "
                "corrupt, truncated or not training checkpoints); give an older run's checkpoint as ckpt_path=<file>, "
                "or drop ckpt_path to start afresh"
            )
    if alias == "last":
        none = (
            f"no run of this task has a checkpoint ({runs_dir}/*/checkpoints/*.ckpt)"
            if runs_dir is not None
            else f"this sweep job has no checkpoint ({output_dir}/checkpoints/*.ckpt)"
        )
        raise CheckpointError(
            f"ckpt_path=last: {none}; drop ckpt_path to start afresh, or use ckpt_path=auto (resumes when a "
            "checkpoint exists, else starts afresh)"
        )
    return None, []


def _progress(checkpoint: Mapping[str, Any]) -> tuple[float, int, int]:
    """Which process wrote a checkpoint and how far training had got: ``(FIT_STARTED_KEY, global_step, epoch)``
    (Lightning writes the last two, a sharded folder's metadata file too); -inf for a checkpoint of a moekit without
    the stamp, -1 for a count it lacks or that is not a whole number."""

    def number(key: str) -> int:
        try:
            return int(checkpoint.get(key, -1))
        except (TypeError, ValueError, RuntimeError):
            return -1

    try:
        started = float(checkpoint.get(FIT_STARTED_KEY, -math.inf))
    except (TypeError, ValueError, RuntimeError):
        started = -math.inf
    return started if not math.isnan(started) else -math.inf, number("global_step"), number("epoch")


def check_resume_checkpoint(ckpt_path: str, module: MoETask) -> dict:
    """A checkpoint to resume from must be a readable Lightning checkpoint of this very task and network, built
    with the same settings: say so in one line instead of failing inside ``trainer.fit`` with a traceback. (A sharded
    checkpoint folder needs a fully sharded run; its weights are checked by torch.distributed.checkpoint when they
    load.) Returns the checkpoint read (its tensors memory-mapped)."""
    checkpoint = read_training_checkpoint(ckpt_path)
    _check_same_task(ckpt_path, checkpoint, module)
    saved = (checkpoint.get("hyper_parameters") or {}).get("run_config")
    current = module.hparams.get("run_config")
    if isinstance(saved, Mapping) and isinstance(current, Mapping):
        _check_resume_overrides(ckpt_path, saved, current)
    if is_sharded_checkpoint(ckpt_path) and isinstance(current, Mapping):
        _check_reads_sharded(ckpt_path, (current.get("trainer") or {}).get("strategy") or "auto")
    if not is_sharded_checkpoint(ckpt_path):
        state = {k.removeprefix("net."): v for k, v in checkpoint["state_dict"].items() if k.startswith("net.")}
        load_weights(module.net, state, ckpt_path)  # the same weights fit() restores: a check with no effect
    return checkpoint


def _check_same_task(ckpt_path: str, checkpoint: Mapping[str, Any], module: MoETask) -> None:
    """Refuse a checkpoint of another task or network class (a language model's in an image classifier's run) in
    one sentence naming both: the setting-by-setting comparison would list every model setting as an override,
    and ``task.init_from`` fails on such weights as well."""
    saved = (checkpoint.get("hyper_parameters") or {}).get("run_config") or {}
    current = module.hparams.get("run_config") or {}
    saved_task = str(checkpoint.get(TASK_KEY, "")).rpartition(":")[2]
    saved_target, current_target = _model_target(saved), _model_target(current)
    other_task = bool(saved_task) and saved_task != type(module).__name__
    if not other_task and (saved_target is None or current_target is None or saved_target == current_target):
        return
    task_name = saved.get("task_name")
    experiment = task_name if task_name and (CONFIG_DIR / "experiment" / f"{task_name}.yaml").is_file() else None
    fix = f"experiment={experiment}" if experiment else "the experiment of the run that wrote it"
    raise CheckpointError(
        f"ckpt_path={ckpt_path!r} holds {_a(saved_task or 'task')} of {_a(_model_name(saved) or 'unknown model')} "
        f"(task_name {task_name or 'not recorded'}), but this run builds {_a(type(module).__name__)} of "
        f"{_a(type(module.net).__name__)}: resume it with {fix}, or drop ckpt_path to train this run afresh"
    )


def _check_reads_sharded(ckpt_path: str, strategy: Any) -> None:
    """A sharded checkpoint folder loads only under a strategy that reads one (``trainer=fsdp``): any other fails
    inside ``trainer.fit`` with ``IsADirectoryError``. ``strategy``: the run config's ``trainer.strategy``."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    target = strategy.get("_target_") if isinstance(strategy, Mapping) else None
    if isinstance(strategy, str) and strategy.startswith("fsdp"):
        return
    if isinstance(target, str):
        module_name, _, name = target.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError, ValueError):
            return  # instantiating the trainer names the bad target
        if isinstance(cls, type) and issubclass(cls, (FSDPStrategy, ModelParallelStrategy)):
            return
    raise CheckpointError(
        f"ckpt_path={ckpt_path!r} is a sharded checkpoint (one file per rank), which only a fully sharded run reads "
        f"(this run's strategy: {target or strategy!r}); resume it with trainer=fsdp, or write full checkpoints "
        "(trainer.strategy.state_dict_type=full) to resume under another strategy"
    )


def _model_target(run_config: Mapping[str, Any]) -> str | None:
    model = run_config.get("model")
    return model.get("_target_") if isinstance(model, Mapping) else None


def _model_name(run_config: Mapping[str, Any]) -> str | None:
    """The network a run config builds: its class, or the registry name ``create_model`` builds."""
    target = _model_target(run_config)
    if target is None:
        return None
    if target.endswith("create_model"):
        return run_config["model"].get("model_name")
    return target.rpartition(".")[2]


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


# Settings a resumed run takes from the checkpoint whatever the config says, with the reason.
_RESTORED_ON_RESUME = {
    "task.optimizer": "the optimizer's state and hyper-parameters (learning rate, betas, weight decay) are restored",
    "seed": "the data order and random states are restored",
}


def _flatten(node: Any, prefix: str) -> dict[str, Any]:
    if isinstance(node, Mapping):
        return {k: v for key, value in node.items() for k, v in _flatten(value, f"{prefix}.{key}").items()}
    return {prefix: node}


def _changed(saved: Any, current: Any, key: str) -> list[str]:
    """``key=<new> (the checkpoint's: <old>)`` for every setting under ``key`` that differs; the model's copies of
    the ``moe`` and ``mod`` groups under the names a command line gives them."""
    old, new = _flatten(saved, key), _flatten(current, key)
    return [
        f"{k.removeprefix('model.') if k.startswith(('model.moe.', 'model.mod.')) else k}={new.get(k)!r} "
        f"(the checkpoint's: {old.get(k)!r})"
        for k in sorted(old.keys() | new.keys())
        if old.get(k) != new.get(k)
    ]


def _check_resume_overrides(ckpt_path: str, saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Refuse a model that differs from the checkpoint's run (resuming continues that run: a changed router or norm
    would train on silently as another model), and settings that resuming would silently ignore."""
    fix = f"train on from the checkpoint's weights with the new settings as a new run: task.init_from={ckpt_path}"
    model_changes = _changed(saved.get("model"), current.get("model"), "model") if "model" in saved else []
    if model_changes:
        raise CheckpointError(
            f"ckpt_path={ckpt_path!r} continues its run, whose model was built with other settings: "
            f"{', '.join(model_changes)}. Drop these overrides to resume, or {fix} without ckpt_path"
        )
    ignored = []
    for key, reason in _RESTORED_ON_RESUME.items():
        node_saved, node_current = saved, current
        for part in key.split("."):
            node_saved = node_saved.get(part) if isinstance(node_saved, Mapping) else None
            node_current = node_current.get(part) if isinstance(node_current, Mapping) else None
        if node_saved is None:
            continue
        changed = _changed(node_saved, node_current, key)
        if changed:
            ignored.append(f"{', '.join(changed)}: {reason}")
    init_from, saved_init = (current.get("task") or {}).get("init_from"), (saved.get("task") or {}).get("init_from")
    if init_from and init_from != saved_init:  # none, or the run's own (a requeued fine-tune), is fine
        ignored.append(
            f"task.init_from={init_from} (the checkpoint's: {saved_init}): the weights it loads are replaced by the "
            "checkpoint's"
        )
    if ignored:
        message = f"ckpt_path={ckpt_path!r} continues its run, which would ignore {'; '.join(ignored)}"
        raise CheckpointError(f"{message}. Drop these overrides to resume, or {fix} without ckpt_path")
