"""Export a model's weights as a safetensors file that timm's ``pretrained=True`` loads, and read back files that
store a tied weight once (:func:`with_tied_names`).

Round trip::

    export_safetensors(model, "soft_moe_tiny.safetensors")
    same = timm.create_model("soft_moe_vit_tiny_patch4_28", pretrained=True,
                             pretrained_cfg_overlay=dict(file="soft_moe_tiny.safetensors"), **same_overrides)

``same_overrides`` are the architecture overrides ``model`` was created with (``depth``, ``moe``,
``moe_blocks``, ...); the file holds weights only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save
from torch import Tensor, nn

from moekit.utils.atomic import atomic_write

__all__ = ["export_safetensors", "with_tied_names"]


def with_tied_names(net: nn.Module, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with each weight that ``net`` ties under several names (an LM's embedding and output) given under
    all of them: safetensors' ``save_model`` and other writers that drop duplicates store it under one. Weights
    that ``state`` holds apart under names ``net`` ties are a ``ValueError``: loaded, one would overwrite the other."""
    state, names_of = dict(state), {}
    for name, tensor in net.state_dict(keep_vars=True).items():
        if tensor.numel() and not tensor.is_meta:  # meta tensors all sit at address 0
            names_of.setdefault((tensor.data_ptr(), tensor.shape), []).append(name)
    for names in names_of.values():
        held = [name for name in names if name in state]
        apart = [name for name in held[1:] if not torch.equal(state[name], state[held[0]])]
        if apart:
            raise ValueError(
                f"{held[0]} and {apart[0]} are one tensor in this model (tied) but differ in the weights given, "
                "which were trained with them apart; build the model untied (tie_embeddings=false for moekit's "
                "language models), as the model that wrote them"
            )
        for name in names if held else ():
            state.setdefault(name, state[held[0]])
    return state


def export_safetensors(model: nn.Module, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> Path:
    """Write ``model.state_dict()`` (parameters and persistent buffers, on CPU) to ``path``, with ``metadata``
    (strings) in the file's header. Tied parameters are written once per name, so ``model.load_state_dict``
    reads the file back.

    The write is atomic (:func:`moekit.utils.atomic.atomic_write`): readers never see a partial file.
    Missing parent folders are created.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    bad = {k: v for k, v in (metadata or {}).items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise ValueError(f"metadata {bad!r}: a safetensors header holds strings only; pass str(value) (or json.dumps)")
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
    with atomic_write(path, "wb") as file:
        file.write(save(tensors, metadata={"format": "pt", **(metadata or {})}))
    return path
