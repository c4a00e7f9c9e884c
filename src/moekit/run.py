"""What ``scripts/train.py`` and ``scripts/eval.py`` do, as functions of a composed Hydra config.

Kept apart from the scripts so tests (and notebooks) can call them with
``hydra.compose(config_name="train", overrides=[...])``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate as hydra_instantiate
from lightning import Callback, LightningDataModule, Trainer
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf

from moekit.checkpoint import CheckpointError
from moekit.tasks import ImageClassifier, LanguageModel, MoETask
from moekit.tasks.base import TASK_KEY

log = logging.getLogger("moekit")

__all__ = ["train", "evaluate", "export", "linear_probe", "sample", "plot_slots", "load_task", "USER_ERRORS"]

# Errors caused by the user's input: the scripts print them as one paragraph and exit with status 1.
USER_ERRORS = (ValueError, FileNotFoundError, CheckpointError)


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


def _check_ckpt_path(ckpt_path: str | None) -> None:
    if ckpt_path and not Path(ckpt_path).is_file():
        raise CheckpointError(
            f"ckpt_path={ckpt_path!r} does not exist; give the path of a .ckpt file (e.g. <run>/checkpoints/last.ckpt)"
        )


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
    """Fit the task on the data, then test the best checkpoint. Returns the final metrics."""
    L.seed_everything(cfg.seed, workers=True)
    _check_ckpt_path(cfg.get("ckpt_path"))
    datamodule: LightningDataModule = instantiate(cfg.data, _convert_="all")
    run_config = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)
    module = instantiate(cfg.task, net=cfg.model, run_config=run_config, _recursive_=False)
    callbacks: list[Callback] = _instantiate_group(cfg.get("callbacks"))
    loggers: list[Logger] = _instantiate_group(cfg.get("logger"))
    trainer: Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    log.info("model: %s", _summary_line(module, datamodule))
    metrics: dict[str, float] = {}
    if cfg.get("train", True):
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
        metrics.update(_floats(trainer.callback_metrics))
    if cfg.get("test", True):
        best = getattr(trainer.checkpoint_callback, "best_model_path", "") if cfg.get("train", True) else ""
        trainer.test(module, datamodule=datamodule, ckpt_path=best or None, weights_only=False)
        metrics.update(_floats(trainer.callback_metrics))
    log.info("done.\n  %s", _where(trainer))
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


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Test a checkpoint: the network and, unless ``data`` is set, the dataset come from it."""
    module = load_task(cfg.ckpt_path)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = _datamodule_for(cfg, module)
    trainer: Trainer = instantiate(cfg.trainer, logger=_instantiate_group(cfg.get("logger")) or False, callbacks=[])
    trainer.test(module, datamodule=datamodule)
    metrics = _floats(trainer.callback_metrics)
    log.info("done.\n  %s", _where(trainer))
    return metrics


def export(cfg: DictConfig) -> Path:
    """Write the checkpoint's network as a safetensors state dict (timm loads those of the ViTs)."""
    from moekit.models import export_safetensors

    module = load_task(cfg.ckpt_path)
    output = Path(cfg.get("output_path") or Path(cfg.ckpt_path).with_suffix(".safetensors"))
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


def _summary_line(module: MoETask, datamodule: LightningDataModule) -> str:
    try:
        from moekit.models.summary import lm_summary, model_summary

        if isinstance(module, ImageClassifier):
            size = (datamodule.in_chans, datamodule.img_size, datamodule.img_size)
            return str(model_summary(module.net, input_size=size))
        return str(lm_summary(module.net, seq_len=datamodule.seq_len))
    except Exception as err:  # the summary is informative only
        return f"{type(module.net).__name__} (summary unavailable: {err})"
