"""Export a model's weights as a safetensors file that timm's ``pretrained=True`` loads.

Round trip::

    export_safetensors(model, "soft_moe_tiny.safetensors")
    same = timm.create_model("soft_moe_vit_tiny_patch4_28", pretrained=True,
                             pretrained_cfg_overlay=dict(file="soft_moe_tiny.safetensors"), **same_overrides)

``same_overrides`` are the architecture overrides ``model`` was created with (``depth``, ``moe``,
``moe_blocks``, ...); the file holds weights only.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from safetensors.torch import save_file
from torch import nn

__all__ = ["export_safetensors"]


def export_safetensors(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write ``model.state_dict()`` (parameters and persistent buffers, on CPU) to ``path``. Tied
    parameters are written once per name, so ``model.load_state_dict`` reads the file back.

    The file is written next to ``path`` under a temporary name and moved into place with
    ``os.replace``, so readers never see a partial file. Missing parent folders are created.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().to("cpu").contiguous()
        if (
            tensor.numel() and tensor.data_ptr() in seen
        ):  # tied weights (an LM's embedding and output): safetensors stores copies
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        tensors[name] = tensor
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
