"""What the commands share: an output file's path checked before the work, the precision ``auto`` stands for,
the dataset a checkpoint is tested on, the device the inference scripts run on, the exit status of a phase a signal
ended, and the lines a command prints at its end."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning import LightningDataModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from moekit.checkpoint import read_training_checkpoint
from moekit.configs import check_target_keys, family_of, group_choice, instantiate
from moekit.errors import OutputError
from moekit.moe import kernel_choices
from moekit.moe.cpu_matmul import float32_library
from moekit.tasks import MoETask
from moekit.tasks.precision import forward_backward_seconds, random_batch
from moekit.utils.machine import bf16_in_hardware, resolve_precision, trains_on_cuda

__all__ = [
    "check_output_file",
    "check_trainer_keys",
    "choose_precision",
    "datamodule_for",
    "inference_device",
    "signal_ends_phase",
    "where",
    "floats",
]

log = logging.getLogger("moekit")


def check_output_file(path: Path, name: str) -> None:
    """Refuse an ``output_path`` that is a folder, before any work: a file cannot replace it (``name``: the file's
    default name, for the example)."""
    if path.is_dir():
        raise OutputError(f"output_path={str(path)!r} is a folder; give a file's path, e.g. output_path={path / name}")


def check_not_checkpoint(output: Path, ckpt_path: str, example: Path) -> None:
    """Refuse an ``output_path`` that is the checkpoint read (``ckpt_path``), before any work: the write would replace
    the training checkpoint."""
    if output.resolve() == Path(ckpt_path).resolve():
        raise OutputError(
            f"output_path={str(output)!r} is ckpt_path itself: writing there would replace the training checkpoint; "
            f"give another file, e.g. output_path={example}"
        )


@contextlib.contextmanager
def signal_ends_phase(phase: str, rerun: str) -> Iterator[None]:
    """Exit with status 143 (128 + SIGTERM) and say what to rerun when SIGTERM ends ``phase``: Lightning ends
    an evaluation loop on SIGTERM with a ``SystemExit`` of status 0, which a scheduler takes for success.
    (Training has :class:`~moekit.callbacks.PreemptionCheckpoint`, which saves a checkpoint first.)"""
    try:
        yield
    except SIGTERMException:
        log.error("received SIGTERM during %s, which did not finish; %s", phase, rerun)
        raise SystemExit(128 + signal.SIGTERM) from None


def check_trainer_keys(trainer: DictConfig) -> None:
    """:func:`~moekit.configs.check_target_keys` of the trainer config, where ``precision=auto`` (moekit's value,
    which :func:`choose_precision` replaces) passes."""
    if trainer.get("precision") == "auto":
        trainer = OmegaConf.merge(trainer, {"precision": "32-true"})
    check_target_keys(trainer, "trainer")


PRECISION_HANDOVER = "MOEKIT_AUTO_PRECISION"
"""The environment variable by which a process hands its measured choice for ``auto`` to the processes it starts (the
ranks Lightning's DDP launches run the command again, and must train in the precision rank 0 chose)."""


def apply_kernel_choices(cfg: DictConfig) -> None:
    """The table of :mod:`moekit.moe.kernel_choices` as shipped, with the run's ``kernel_choices`` (``NAME=VALUE``
    entries) set: a sweep's jobs in one process each get their own. A bad entry is refused with the config key and
    what the entry takes."""
    kernel_choices.reset()
    for spec in cfg.get("kernel_choices") or []:
        try:
            kernel_choices.set_choice(spec)
        except ValueError as error:
            raise ValueError(f"kernel_choices: {error}") from None


def choose_precision(
    cfg: DictConfig, datamodule: LightningDataModule | None = None, checkpoint: str | None = None
) -> str:
    """Replace ``trainer.precision=auto`` by this machine's fastest setting (:func:`resolve_precision`), log which
    and why, and return why (``"as configured"`` for another value).

    Where the CPU's flags leave it open, the run's training step is timed in both precisions on a copy of its model,
    built from ``cfg`` (the run's own model and random state are untouched) on a random batch of ``datamodule``'s
    shapes; without ``datamodule`` nothing is measured. A run that resumes or tests ``checkpoint`` keeps the precision
    the checkpoint's run trained in, where this machine runs it natively. A rank started by the process that chose
    (Lightning's DDP ranks) takes its choice; one of several processes started together (torchrun, Slurm, MPI),
    which could each measure otherwise, does not measure.

    First, for a run on the CPU, the library of float32 CPU products is chosen
    (:func:`~moekit.moe.cpu_matmul.float32_library`, logged): a float32 step is then timed as the run would take it.
    """
    if not trains_on_cuda(cfg.trainer.get("accelerator")):
        float32_library()
    if cfg.trainer.get("precision") != "auto":
        return "as configured"
    handed = os.environ.get(PRECISION_HANDOVER, "").split(":", 2)
    if os.environ.get("LOCAL_RANK", "0") != "0" and len(handed) == 3 and handed[0] == str(os.getppid()):
        precision, why = handed[1], f"the choice of the process that started this one: {handed[2]}"
    else:
        precision, why = _this_machines_precision(cfg, datamodule, checkpoint)
        os.environ[PRECISION_HANDOVER] = f"{os.getpid()}:{precision}:{why}"
    cfg.trainer.precision = precision
    log.info("trainer.precision=auto: %s (%s)", precision, why)
    return why


def _this_machines_precision(
    cfg: DictConfig, datamodule: LightningDataModule | None, checkpoint: str | None
) -> tuple[str, str]:
    """``(precision, why)`` for ``auto`` in a process that chooses for itself: the checkpoint's run's, where native,
    else :func:`resolve_precision`'s, measured where it can be."""
    accelerator = cfg.trainer.get("accelerator", "auto")
    if checkpoint and (kept := _trained_precision(checkpoint, accelerator)):
        return kept, f"the precision the run of ckpt_path={checkpoint} trained in"
    measure = None
    if datamodule is not None and _started_with_others():
        log.info(
            "trainer.precision=auto: not measured in one of several processes started together, which could each "
            "measure otherwise; set trainer.precision=bf16-mixed or 32-true to choose"
        )
    elif datamodule is not None:
        measure = functools.partial(_time_step_precisions, cfg, datamodule)
    return resolve_precision("auto", accelerator, measure=measure)


def _trained_precision(ckpt_path: str, accelerator: Any) -> str | None:
    """The precision the checkpoint's run trained in (its run config's; a quantized checkpoint keeps it too) where
    this machine runs it natively: float32 anywhere, bf16 autocast on a GPU or a CPU with bf16 dot products, float16
    autocast on a GPU; else None."""
    if str(ckpt_path).endswith(".safetensors"):
        from moekit.quantized_checkpoint import saved_hyper_parameters

        hyper_parameters = saved_hyper_parameters(ckpt_path)
    else:
        hyper_parameters = read_training_checkpoint(ckpt_path).get("hyper_parameters") or {}
    saved = hyper_parameters.get("run_config") or {}
    precision = str((saved.get("trainer") or {}).get("precision"))
    on_gpu = trains_on_cuda(accelerator)
    if precision == "32-true" or (precision in ("bf16-mixed", "16-mixed") and on_gpu):
        return precision
    if precision == "bf16-mixed" and not on_gpu and bf16_in_hardware("cpu"):
        return precision
    return None


def _started_with_others() -> bool:
    """Whether a launcher started this process with others, each running the command: torchrun
    (``TORCHELASTIC_RUN_ID``), Slurm's ``srun`` or MPI. (Lightning's own DDP ranks are started by rank 0, which hands
    them its choice.)"""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    return any(int(os.environ.get(name, "1") or 1) > 1 for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))


def _time_step_precisions(cfg: DictConfig, datamodule: LightningDataModule) -> dict[str, float]:
    """Seconds of the training step's forward and backward in float32 and in bf16 autocast, on a model built from
    ``cfg`` without its ``init_from`` weights and eager (compiling it twice would cost more than it tells), at the
    data's batch size; the random state is restored after."""
    plain = {key: value for key, value in (("init_from", None), ("compile", False)) if key in cfg.task}
    with torch.random.fork_rng(devices=[]):
        task = instantiate(cfg.task, net=cfg.model, **plain, _recursive_=False)
        batch = random_batch(task, datamodule, datamodule.batch_size)
        try:
            return forward_backward_seconds(task, batch, ("32-true", "bf16-mixed"))
        except RuntimeError as err:  # a bf16 kernel this CPU lacks; a float32 failure recurs in the run itself
            log.warning("trainer.precision=auto: a training step failed when measured: %s", str(err).splitlines()[0])
            return {"32-true": 1.0, "bf16-mixed": math.inf}


def datamodule_for(cfg: DictConfig, module: MoETask, same_labels: bool = True) -> LightningDataModule:
    """``cfg.data`` when given, else the dataset the checkpoint was trained on. With ``same_labels`` (what testing
    the checkpoint's classifier needs), the dataset must have the checkpoint's class count, and one whose class names
    are known before it is read (imagefolder: its class folders) must name label i as the checkpoint does; without
    (a probe, calibration, pictures) any class count serves."""
    data_cfg = cfg.get("data")
    if data_cfg is None:
        run_config = module.hparams.get("run_config") or {}
        if "data" not in run_config:
            raise ValueError(f"the checkpoint {cfg.ckpt_path!r} does not record its dataset; pass data=<dataset>")
        data_cfg = OmegaConf.create(run_config["data"])
        return instantiate(data_cfg, _convert_="all")
    target = str(data_cfg.get("_target_", ""))
    trained_on, given = family_of(type(module).__name__), family_of(target)
    if trained_on and given and trained_on != given:
        raise ValueError(
            f"{group_choice('data', target)} holds {given}, but the checkpoint {cfg.ckpt_path!r} holds a model of "
            f"{trained_on} ({type(module).__name__}); give data of that kind, or leave data unset to use the "
            "checkpoint's own dataset"
        )
    datamodule = instantiate(data_cfg, _convert_="all")
    # A dataset other than the checkpoint's must have the shapes its network was built for (and its classes, where
    # the checkpoint's classifier is what is evaluated).
    net_cfg = module.hparams.get("net") or {}
    keys = (
        ("num_classes", "in_chans", "img_size", "vocab_size") if same_labels else ("in_chans", "img_size", "vocab_size")
    )
    for key in keys:
        trained, given = net_cfg.get(key), getattr(datamodule, key, None)
        if trained is not None and given is not None and trained != given:
            raise ValueError(
                f"data={datamodule.hparams.get('dataset', type(datamodule).__name__)!r} has {key}={given} but the "
                f"checkpoint {cfg.ckpt_path!r} was trained with {key}={trained}; evaluate it on data of the same "
                "shape, or leave data unset to use the checkpoint's own dataset"
            )
    trained_names, given_names = getattr(module, "class_names", None), getattr(datamodule, "label_names", None)
    if same_labels and trained_names and given_names and list(trained_names) != list(given_names):
        differ = [(i, a, b) for i, (a, b) in enumerate(zip(trained_names, given_names, strict=False)) if a != b]
        raise ValueError(
            f"the classes of data.root={datamodule.hparams.get('root')} differ from those the checkpoint "
            f"{cfg.ckpt_path!r} was trained on (label, checkpoint, data): {differ[:5]}; its predictions would be "
            "scored against other classes. Name the class folders as in training (sorted, they give the labels)"
        )
    return datamodule


def inference_device(value: Any) -> torch.device:
    """The ``device=`` of the inference scripts, refused with the fix when torch does not know it or this machine
    lacks it (where ``module.to`` would fail with a traceback)."""
    try:
        device = torch.device(str(value))
    except RuntimeError:
        raise ValueError(f"device={value!r} is not a device; use device=cpu, or device=cuda (cuda:1, ...)") from None
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ValueError(f"device={value} but this machine has {count} CUDA GPU(s); use device=cpu or device=cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={value} but this machine has no CUDA GPU; use device=cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={value}: the scripts run on cpu or cuda; use device=cpu or device=cuda")
    if device.type == "cpu":
        float32_library()  # measured and logged now, not in the middle of the script's output
    return device


def where(trainer: Trainer) -> str:
    lines = [f"outputs: {trainer.default_root_dir}"]
    for logger in trainer.loggers:
        if logger.log_dir is not None:  # fast_dev_run's DummyLogger writes nothing
            lines.append(f"{type(logger).__name__}: {logger.log_dir}")
    dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
    if dirpath and Path(dirpath).is_dir():  # fast_dev_run writes no checkpoint
        lines.append(f"checkpoints: {dirpath}")
        best = getattr(trainer.checkpoint_callback, "best_model_path", "")
        if best:
            lines.append(f"best checkpoint: {best}")
    return "\n  ".join(lines)


def floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (torch.Tensor, float, int))}
