"""``scripts/export.py``: a checkpoint's network as a safetensors state dict (timm loads those of the ViTs), or, with
``format=hf``, a Transformer LM as a transformers model folder (``AutoModelForCausalLM.from_pretrained`` loads it)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import DictConfig

from moekit.checkpoint import CheckpointError, load_task
from moekit.data.tokenizers import TOKENIZER_KEYS, build_tokenizer
from moekit.errors import OutputError, check_writable_dir, storage_errors
from moekit.models import export_hf, export_safetensors
from moekit.utils.atomic import atomic_write

from .common import check_not_checkpoint, check_output_file

log = logging.getLogger("moekit")

__all__ = ["export"]


EXPORT_FORMATS = ("safetensors", "hf")


def export(cfg: DictConfig) -> Path:
    """Write the checkpoint's network as a safetensors state dict (timm loads those of the ViTs), or as a transformers
    model folder (``format=hf``)."""
    if cfg.format not in EXPORT_FORMATS:
        raise ValueError(f"format={cfg.format!r}; allowed: {', '.join(EXPORT_FORMATS)}")
    if str(cfg.ckpt_path).endswith(".safetensors"):
        raise CheckpointError(
            f"ckpt_path={cfg.ckpt_path!r} is a safetensors file: a quantized checkpoint (eval.py, predict.py and "
            "sample.py load it) or an export already; export the training checkpoint (.ckpt)"
        )
    if cfg.format == "safetensors":  # the output checked before the checkpoint is read
        default = Path(cfg.ckpt_path).with_suffix(".safetensors")
        output = Path(cfg.get("output_path") or default)
        check_not_checkpoint(output, cfg.ckpt_path, default)
        check_output_file(output, default.name)
        check_writable_dir(output.parent, "the folder of output_path")
    module = load_task(cfg.ckpt_path)
    if cfg.format == "hf":
        return _export_hf(module, cfg)
    with storage_errors(output.parent):
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
        how = f"model = {target}({args}); model.load_state_dict(safetensors.torch.load_file({str(path)!r}))"
    log.info("exported %s\n  load it with: %s", path, how)
    return path


def _run_tokenizer(module):
    """The run's tokenizer (None when the checkpoint records none), built before anything is written: a tokenizer
    file gone since training stops the export before it leaves a folder without its tokenizer."""
    settings = ((module.hparams.get("run_config") or {}).get("data") or {}).get("tokenizer")
    if settings is None:
        return None
    return build_tokenizer(**{k: v for k, v in settings.items() if k in TOKENIZER_KEYS})


def _export_tokenizer(tokenizer, module, folder: Path) -> None:
    """The run's tokenizer as ``tokenizer.json`` + ``tokenizer_config.json`` (transformers' ``AutoTokenizer``)."""
    if tokenizer is None:
        log.warning("the checkpoint records no tokenizer: %s holds the model only", folder)
        return
    with atomic_write(folder / "tokenizer.json", "w") as file:
        file.write(tokenizer.hf_backend().to_str())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": module.net.max_seq_len,
        "clean_up_tokenization_spaces": False,
    }
    with atomic_write(folder / "tokenizer_config.json", "w") as file:
        json.dump(config, file, indent=2)


def _export_hf(module, cfg: DictConfig) -> Path:
    ckpt = Path(cfg.ckpt_path)
    folder = Path(cfg.get("output_path") or ckpt.with_name(f"{ckpt.stem}-hf"))
    if folder.exists() and not folder.is_dir():
        raise OutputError(
            f"output_path={str(folder)!r} is a file; format=hf writes a folder (config.json, model.safetensors, "
            f"the tokenizer): give a folder's path, e.g. output_path={folder.with_name(f'{ckpt.stem}-hf')}"
        )
    tokenizer = _run_tokenizer(module)
    check_writable_dir(folder.parent, "the folder of output_path")
    with storage_errors(folder.parent):
        export_hf(module.net, folder)
        _export_tokenizer(tokenizer, module, folder)
    config = json.loads((folder / "config.json").read_text())
    log.info(
        "exported %s (%s layout)\n  load it with: transformers.AutoModelForCausalLM.from_pretrained(%r) (and "
        "AutoTokenizer)\n"
        "  moekit reads it back with task.init_from=hf:%s or moekit.models.load_hf_lm(%r)",
        folder,
        config["model_type"],
        str(folder),
        folder,
        str(folder),
    )
    return folder
