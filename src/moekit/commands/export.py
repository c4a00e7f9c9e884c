"""``scripts/export.py``: a checkpoint's network as a safetensors state dict (timm loads those of the ViTs)."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from moekit.checkpoint import CheckpointError, load_task
from moekit.errors import check_writable_dir, storage_errors
from moekit.models import export_safetensors

log = logging.getLogger("moekit")

__all__ = ["export"]


def export(cfg: DictConfig) -> Path:
    """Write the checkpoint's network as a safetensors state dict (timm loads those of the ViTs)."""
    if str(cfg.ckpt_path).endswith(".safetensors"):
        raise CheckpointError(
            f"ckpt_path={cfg.ckpt_path!r} is a safetensors file: a quantized checkpoint (eval.py, predict.py and "
            "sample.py load it) or an export already; export the training checkpoint (.ckpt)"
        )
    module = load_task(cfg.ckpt_path)
    output = Path(cfg.get("output_path") or Path(cfg.ckpt_path).with_suffix(".safetensors"))
    check_writable_dir(output.parent, "the folder of output_path")
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
        how = f"{target}({args}).load_state_dict(safetensors.torch.load_file({str(path)!r}))"
    log.info("exported %s\n  load it with: %s", path, how)
    return path
