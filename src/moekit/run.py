"""What ``scripts/train.py`` and ``scripts/eval.py`` do, as functions of a composed Hydra config.

Kept apart from the scripts so tests (and notebooks) can call them with
``hydra.compose(config_name="train", overrides=[...])``.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import inspect
import logging
import os
import tempfile
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate as hydra_instantiate
from lightning import Callback, LightningDataModule, Trainer
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf

from moekit.callbacks.training_counter import TrainingCounter
from moekit.checkpoint import CheckpointError
from moekit.checkpoint import load_weights as _load_weights
from moekit.models.summary import LMSummary, ModelSummary, lm_summary, model_summary
from moekit.results import RESULTS_FILE, build_run_record, write_json_atomic
from moekit.tasks import ImageClassifier, LanguageModel, MoETask
from moekit.tasks.base import TASK_KEY

log = logging.getLogger("moekit")

__all__ = [
    "train",
    "evaluate",
    "export",
    "linear_probe",
    "sample",
    "plot_slots",
    "load_task",
    "OutputError",
    "USER_ERRORS",
]


class OutputError(OSError):
    """An output that cannot be written: a folder that is not writable, a full disk, a quota."""


# Errors caused by the user's input or environment: the scripts print them as one paragraph and exit
# with status 1. Lightning's MisconfigurationException is its own "bad Trainer argument" error.
USER_ERRORS = (ValueError, FileNotFoundError, CheckpointError, OutputError, MisconfigurationException)

# errno values of a failed write that the user fixes by freeing space or choosing another disk. (Not
# EACCES: a permission error may come from reading the data; output folders are probed before the run.)
_STORAGE_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EROFS", "EFBIG") if hasattr(errno, name)
)


def instantiate(config: Any, *args, **kwargs) -> Any:
    """``hydra.utils.instantiate`` that re-raises a user error (a bad value, a missing file) from a
    target's constructor as itself, not wrapped in Hydra's nested ``InstantiationException``."""
    try:
        return hydra_instantiate(config, *args, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        while isinstance(cause, InstantiationException):
            cause = cause.__cause__
        if isinstance(cause, USER_ERRORS):
            raise cause from None
        raise


def _instantiate_group(group: DictConfig | None) -> list:
    """Instantiate each ``_target_`` entry of a callbacks/logger group."""
    if not group:
        return []
    return [instantiate(entry) for entry in group.values() if isinstance(entry, DictConfig) and "_target_" in entry]


SHARDED_METADATA = "meta.pt"
"""The file of a sharded (FSDP ``state_dict_type=sharded``) checkpoint folder holding everything but
the weights and optimizer states (Lightning's ``ModelParallelStrategy`` layout)."""


def _is_sharded_checkpoint(ckpt_path: str) -> bool:
    return (Path(ckpt_path) / SHARDED_METADATA).is_file()


def _check_ckpt_path(ckpt_path: str | None, sharded_ok: bool = False) -> None:
    if ckpt_path and sharded_ok and _is_sharded_checkpoint(ckpt_path):
        return
    if ckpt_path and _is_sharded_checkpoint(ckpt_path):
        raise CheckpointError(
            f"ckpt_path={ckpt_path!r} is a sharded checkpoint (one file per rank); only training resumes from it "
            "(with trainer=fsdp). Save full checkpoints to evaluate or export: trainer.strategy.state_dict_type=full"
        )
    if ckpt_path and not Path(ckpt_path).is_file():
        raise CheckpointError(
            f"ckpt_path={ckpt_path!r} does not exist; give the path of a .ckpt file (e.g. <run>/checkpoints/last.ckpt)"
        )


def _check_writable_dir(directory: str | os.PathLike, key: str) -> Path:
    """Create ``directory`` and write a probe file in it, so an output folder that cannot be written
    fails before training (not at the first checkpoint); ``key`` names the setting in the message."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        raise OutputError(
            f"{key}={str(directory)!r} is not a writable folder ({type(err).__name__}: {err.strerror or err}); "
            f"set {key} to a folder you can write to"
        ) from None
    return directory


@contextlib.contextmanager
def _storage_errors(output_dir: str | os.PathLike) -> Iterator[None]:
    """Turn a failed write (disk full, quota, read-only file system) during a run into an
    :class:`OutputError` that names the file and what to do."""
    try:
        yield
    except OSError as err:
        if isinstance(err, OutputError) or err.errno not in _STORAGE_ERRNOS:
            raise
        where = err.filename or output_dir
        raise OutputError(
            f"writing {str(where)!r} failed: {err.strerror or err} ({errno.errorcode.get(err.errno, err.errno)}). "
            "Free disk space (or raise the quota), or set paths.output_dir to a folder "
            "on another disk, then resume with ckpt_path=<paths.output_dir>/checkpoints/last.ckpt"
        ) from None


def _primitive_types(annotation: Any) -> tuple[list[type], list[Any]] | None:
    """The plain types and ``Literal`` values an annotation allows, or None when it allows anything
    richer (a class, a container) that a config value may legitimately describe."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        parts = [_primitive_types(arg) for arg in typing.get_args(annotation)]
        if any(part is None for part in parts):
            return None
        return [t for part in parts for t in part[0]], [v for part in parts for v in part[1]]
    if origin is typing.Literal:
        return [], list(typing.get_args(annotation))
    if annotation in (int, float, bool, str, type(None)):
        return [annotation], []
    return None


def _matches(value: Any, allowed_types: list[type], literals: list[Any]) -> bool:
    if any(value == literal and type(value) is type(literal) for literal in literals):
        return True
    for allowed in allowed_types:
        if allowed is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if allowed is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if allowed in (bool, str, type(None)) and isinstance(value, allowed):
            return True
    return False


def _check_trainer_config(trainer_cfg: DictConfig) -> None:
    """Check ``cfg.trainer`` against ``lightning.Trainer``'s signature before building it: an unknown
    key (``trainer.max_epoch``) or a value of the wrong type (``trainer.max_epochs=abc``, which
    Lightning would otherwise accept and fail on much later) is a one-line error with the fix."""
    if not trainer_cfg or not str(trainer_cfg.get("_target_", "")).startswith("lightning"):
        return
    params = inspect.signature(Trainer.__init__).parameters
    try:
        hints = typing.get_type_hints(Trainer.__init__)
    except Exception:  # an annotation this Python cannot evaluate: check the names only
        hints = {}
    for key in trainer_cfg:
        if key.startswith("_"):
            continue
        if key not in params:
            close = difflib.get_close_matches(key, list(params), n=1)
            hint = f"did you mean trainer.{close[0]}?" if close else "see lightning.Trainer's arguments"
            raise ValueError(f"trainer.{key} is not an argument of lightning.Trainer; {hint} (remove or rename it)")
        value = trainer_cfg[key]
        allowed = _primitive_types(hints.get(key))
        if allowed is None or isinstance(value, DictConfig | list) or OmegaConf.is_list(value):
            continue
        if not _matches(value, *allowed):
            names = [t.__name__.replace("NoneType", "null") for t in allowed[0]] + [repr(v) for v in allowed[1]]
            raise ValueError(
                f"trainer.{key}={value!r} has the wrong type for lightning.Trainer({key}=...); "
                f"set it to one of: {', '.join(dict.fromkeys(names))}"
            )


def _check_resume_checkpoint(ckpt_path: str, module: MoETask) -> None:
    """A checkpoint to resume from must be a readable Lightning checkpoint of this very network: say
    so in one line instead of failing inside ``trainer.fit`` with a traceback. (A sharded checkpoint
    folder is checked by torch.distributed.checkpoint when it loads.)"""
    if _is_sharded_checkpoint(ckpt_path):
        return
    try:
        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:
        raise CheckpointError(
            f"ckpt_path={ckpt_path!r} could not be read ({type(err).__name__}: {str(err).splitlines()[0][:200]}). "
            "It is corrupt, truncated or not a PyTorch file; resume from another checkpoint (e.g. an earlier "
            "epoch_XXX.ckpt) or drop ckpt_path to start afresh"
        ) from None
    missing = [
        key
        for key in ("state_dict", "optimizer_states", "epoch")
        if not isinstance(checkpoint, dict) or key not in checkpoint
    ]
    if missing:
        raise CheckpointError(
            f"ckpt_path={ckpt_path!r} is not a Lightning training checkpoint (no {', '.join(missing)}); resume "
            "from a .ckpt written by scripts/train.py, or load plain weights with task.init_from=<file> instead"
        )
    state = {k.removeprefix("net."): v for k, v in checkpoint["state_dict"].items() if k.startswith("net.")}
    _load_weights(module.net, state, ckpt_path)  # the same weights fit() restores: a check with no effect


def _where(trainer: Trainer) -> str:
    lines = [f"outputs: {trainer.default_root_dir}"]
    for logger in trainer.loggers:
        lines.append(f"{type(logger).__name__}: {logger.log_dir}")
    if trainer.checkpoint_callback is not None and getattr(trainer.checkpoint_callback, "dirpath", None):
        lines.append(f"checkpoints: {trainer.checkpoint_callback.dirpath}")
        best = getattr(trainer.checkpoint_callback, "best_model_path", "")
        if best:
            lines.append(f"best checkpoint: {best}")
    return "\n  ".join(lines)


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit the task on the data, then test the best checkpoint. Returns the final metrics and writes
    them with the model's size, FLOPs, time and machine to ``<paths.output_dir>/results.json``."""
    L.seed_everything(cfg.seed, workers=True)
    _check_ckpt_path(cfg.get("ckpt_path"), sharded_ok=True)
    _check_trainer_config(cfg.trainer)
    output_dir = _check_writable_dir(cfg.paths.output_dir, "paths.output_dir")
    datamodule: LightningDataModule = instantiate(cfg.data, _convert_="all")
    run_config = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)
    module = instantiate(cfg.task, net=cfg.model, run_config=run_config, _recursive_=False)
    if cfg.get("ckpt_path"):
        _check_resume_checkpoint(cfg.ckpt_path, module)
    counter = TrainingCounter(count="elements" if isinstance(module, LanguageModel) else "rows")
    callbacks: list[Callback] = [*_instantiate_group(cfg.get("callbacks")), counter]
    loggers: list[Logger] = _instantiate_group(cfg.get("logger"))
    trainer: Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    summary = _summary(module, datamodule)
    log.info("model: %s", summary if summary is not None else f"{type(module.net).__name__} (summary unavailable)")
    metrics: dict[str, float] = {}
    with _storage_errors(output_dir):
        if cfg.get("train", True):
            trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
            metrics.update(_floats(trainer.callback_metrics))
        if cfg.get("test", True):
            best = getattr(trainer.checkpoint_callback, "best_model_path", "") if cfg.get("train", True) else ""
            trainer.test(module, datamodule=datamodule, ckpt_path=best or None, weights_only=False)
            metrics.update(_floats(trainer.callback_metrics))
        if trainer.is_global_zero:
            record = build_run_record(
                run_config=run_config,
                overrides=_hydra_overrides(),
                net=module.net,
                summary=summary,
                counter=counter,
                metrics=metrics,
                trainer=trainer,
            )
            write_json_atomic(output_dir / RESULTS_FILE, record)
    log.info("done.\n  %s\n  run record: %s", _where(trainer), output_dir / RESULTS_FILE)
    return metrics


def _task_class(checkpoint: dict) -> type[MoETask]:
    """The task class a checkpoint names (checkpoints without the entry are image classifiers)."""
    import importlib

    module_name, _, qualname = checkpoint.get(TASK_KEY, "moekit.tasks.classification:ImageClassifier").partition(":")
    if not module_name.startswith("moekit."):
        raise ValueError(f"unknown task {checkpoint[TASK_KEY]!r}")
    cls = getattr(importlib.import_module(module_name), qualname)
    if not (isinstance(cls, type) and issubclass(cls, MoETask)):
        raise ValueError(f"{checkpoint[TASK_KEY]!r} is not a moekit task")
    return cls


def load_task(ckpt_path: str) -> MoETask:
    """The task (image classifier, language model) of a checkpoint written by :func:`train`, in eval
    mode on the CPU, with a clear error for anything else."""
    _check_ckpt_path(ckpt_path)
    try:
        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        cls = _task_class(checkpoint)
        # The checkpoint holds the trained weights: do not read the run's initial weights file again.
        module = cls(**{**checkpoint["hyper_parameters"], "init_from": None})
        module.load_state_dict(checkpoint["state_dict"])
    except Exception as err:
        raise CheckpointError(
            f"ckpt_path={ckpt_path!r} is not a moekit training checkpoint that can be loaded "
            f"({type(err).__name__}: {err}). Pass a .ckpt written by scripts/train.py."
        ) from None
    return module.eval()


def _datamodule_for(cfg: DictConfig, module: MoETask) -> LightningDataModule:
    """``cfg.data`` when given, else the dataset the checkpoint was trained on."""
    data_cfg = cfg.get("data")
    if data_cfg is None:
        run_config = module.hparams.get("run_config") or {}
        if "data" not in run_config:
            raise ValueError(f"the checkpoint {cfg.ckpt_path!r} does not record its dataset; pass data=<dataset>")
        data_cfg = OmegaConf.create(run_config["data"])
        return instantiate(data_cfg, _convert_="all")
    datamodule = instantiate(data_cfg, _convert_="all")
    # A dataset other than the checkpoint's must have the shapes its network was built for.
    net_cfg = module.hparams.get("net") or {}
    for key in ("num_classes", "in_chans", "img_size", "vocab_size"):
        trained, given = net_cfg.get(key), getattr(datamodule, key, None)
        if trained is not None and given is not None and trained != given:
            raise ValueError(
                f"data={datamodule.hparams.get('dataset', type(datamodule).__name__)!r} has {key}={given} but the "
                f"checkpoint {cfg.ckpt_path!r} was trained with {key}={trained}; evaluate it on data of the same "
                "shape, or leave data unset to use the checkpoint's own dataset"
            )
    return datamodule


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Test a checkpoint: the network and, unless ``data`` is set, the dataset come from it."""
    module = load_task(cfg.ckpt_path)
    L.seed_everything(cfg.seed, workers=True)
    _check_trainer_config(cfg.trainer)
    output_dir = _check_writable_dir(cfg.paths.output_dir, "paths.output_dir")
    datamodule = _datamodule_for(cfg, module)
    trainer: Trainer = instantiate(cfg.trainer, logger=_instantiate_group(cfg.get("logger")) or False, callbacks=[])
    with _storage_errors(output_dir):
        trainer.test(module, datamodule=datamodule)
    metrics = _floats(trainer.callback_metrics)
    log.info("done.\n  %s", _where(trainer))
    return metrics


def export(cfg: DictConfig) -> Path:
    """Write the checkpoint's network as a safetensors state dict (timm loads those of the ViTs)."""
    from moekit.models import export_safetensors

    module = load_task(cfg.ckpt_path)
    output = Path(cfg.get("output_path") or Path(cfg.ckpt_path).with_suffix(".safetensors"))
    _check_writable_dir(output.parent, "the folder of output_path")
    with _storage_errors(output.parent):
        path = export_safetensors(module.net, output)
    net_cfg = {k: v for k, v in module.hparams["net"].items() if not k.startswith("_")}
    name = net_cfg.pop("model_name", None)
    args = ", ".join(f"{k}={v!r}" for k, v in net_cfg.items())
    if name is not None:  # a timm model
        how = (
            f"timm.create_model({name!r}, pretrained=True, pretrained_cfg_overlay=dict(file={str(path)!r}), {args})"
            "  (after `import moekit.models`)"
        )
    else:
        target = module.hparams["net"]["_target_"]
        how = f"{target}({args}).load_state_dict(safetensors.torch.load_file({str(path)!r}))"
    log.info("exported %s\n  load it with: %s", path, how)
    return path


def linear_probe(cfg: DictConfig) -> float:
    """Few-shot linear probe of a checkpoint's frozen network (see :mod:`moekit.tasks.fewshot`)."""
    from moekit.tasks.fewshot import fewshot_linear_probe

    module = load_task(cfg.ckpt_path)
    datamodule = _datamodule_for(cfg, module)
    result = fewshot_linear_probe(module.net, datamodule, shots=cfg.shots, seed=cfg.seed)
    log.info("%s", result)
    return result.accuracy


def sample(cfg: DictConfig) -> list[str]:
    """Generate ``num_samples`` continuations of ``prompt`` with a language-model checkpoint (the
    tokenizer comes from the checkpoint's data config). Prints and returns the texts."""
    from moekit.models.generate import generate

    module = load_task(cfg.ckpt_path)
    if not isinstance(module, LanguageModel):
        raise ValueError(
            f"ckpt_path={cfg.ckpt_path!r} holds a {type(module).__name__}, not a language model; "
            "sample from a checkpoint of a language-model experiment (e.g. experiment=moe_transformer_lm)"
        )
    tokenizer = _datamodule_for(cfg, module).tokenizer
    prompt_ids = tokenizer.encode(cfg.prompt)
    if not prompt_ids:
        raise ValueError(f"prompt={cfg.prompt!r} encodes to no tokens; give a prompt of at least one character")
    if cfg.num_samples < 1:
        raise ValueError(f"num_samples={cfg.num_samples} must be >= 1")
    max_seq_len = getattr(module.net, "max_seq_len", None)
    if max_seq_len is not None and len(prompt_ids) + cfg.max_new_tokens > max_seq_len:
        raise ValueError(
            f"the prompt ({len(prompt_ids)} tokens) + max_new_tokens={cfg.max_new_tokens} exceed the model's "
            f"max_seq_len={max_seq_len}; lower max_new_tokens to {max(0, max_seq_len - len(prompt_ids))} "
            "or shorten the prompt"
        )
    device = torch.device(cfg.device)
    net = module.net.to(device)
    prompt = torch.tensor([prompt_ids] * cfg.num_samples, device=device)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    tokens = generate(
        net,
        prompt,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        use_cache=cfg.use_cache,
        generator=generator,
    )
    texts = [tokenizer.decode(row.tolist()) for row in tokens.cpu()]
    for i, text in enumerate(texts):
        print(f"--- sample {i} ---\n{text}")
    return texts


def plot_slots(cfg: DictConfig) -> Path:
    """Draw the dispatch weights of a few slots of a Soft MoE checkpoint over ``num_images`` images of
    the checkpoint's dataset (``split``: val or test) and save them as one PNG at ``out`` (see
    :mod:`moekit.callbacks.slots`). Returns the path."""
    from omegaconf import ListConfig
    from torchvision.utils import save_image

    from moekit.callbacks.slots import pick_images, slot_picture_grid, soft_moe_layers
    from moekit.moe import moe_layers

    module = load_task(cfg.ckpt_path)
    if not isinstance(module, ImageClassifier) or not soft_moe_layers(module.net):
        kinds = sorted({type(layer).__name__ for _, layer in moe_layers(module.net)})
        raise ValueError(
            f"ckpt_path={cfg.ckpt_path!r} holds a {type(module).__name__} with no Soft MoE layer "
            f"(MoE modules: {kinds or 'none, a dense model'}); slot pictures need a Soft MoE ViT checkpoint, "
            "e.g. one trained with experiment=soft_moe_vit"
        )
    if cfg.split not in ("val", "test"):
        raise ValueError(f"split={cfg.split!r}; allowed: 'val', 'test'")
    datamodule = _datamodule_for(cfg, module)
    datamodule.setup("validate")
    dataset = datamodule.val_set if cfg.split == "val" and len(datamodule.val_set) else datamodule.test_set
    images = pick_images(dataset, cfg.num_images)
    slots = list(cfg.slots) if isinstance(cfg.slots, ListConfig) else cfg.slots
    device = torch.device(cfg.device)
    grid = slot_picture_grid(module.net.to(device), images.to(device), slots, cfg.layer, cfg.upscale, cfg.alpha)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_image(grid, out)
    log.info("slot pictures of %s: %s", cfg.ckpt_path, out)
    return out


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (torch.Tensor, float, int))}


def _summary(module: MoETask, datamodule: LightningDataModule) -> ModelSummary | LMSummary | None:
    """The network's parameters and forward FLOPs per image (:func:`~moekit.models.summary.model_summary`)
    or per token (:func:`~moekit.models.summary.lm_summary`); None when they cannot be measured (the
    summary is informative: the run goes on)."""
    try:
        if isinstance(module, ImageClassifier):
            size = (datamodule.in_chans, datamodule.img_size, datamodule.img_size)
            return model_summary(module.net, input_size=size)
        return lm_summary(module.net, seq_len=datamodule.seq_len)
    except Exception as err:
        log.warning("model summary unavailable: %s: %s", type(err).__name__, err)
        return None


def _hydra_overrides() -> list[str]:
    """The run's command-line and sweep overrides (``hydra.overrides.task``); [] outside Hydra."""
    if not HydraConfig.initialized():
        return []
    return list(HydraConfig.get().overrides.task)
