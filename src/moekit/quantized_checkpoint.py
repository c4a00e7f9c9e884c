"""Quantized checkpoints (``scripts/quantize.py``): one safetensors file holding a task whose expert banks are
quantized (:mod:`moekit.quant`): the packed codes and scales, the float rest of the network, and as metadata the
task class, its hyper-parameters, its class names and the quantization. :func:`moekit.checkpoint.load_task`
reads them (``ckpt_path=<file>.safetensors`` of ``eval.py``, ``predict.py``, ``sample.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open
from safetensors.torch import load_file

from moekit.checkpoint import CLASS_NAMES_KEY, TASK_KEY, CheckpointError, load_weights, task_class
from moekit.models.export import export_safetensors
from moekit.moe.experts import experts_on_meta
from moekit.quant import load_quantized_banks
from moekit.quant.quantize import QUANT_METADATA_KEY

if TYPE_CHECKING:
    from moekit.tasks import MoETask

__all__ = ["HPARAMS_KEY", "save_quantized_task", "load_quantized_task", "saved_hyper_parameters"]

HPARAMS_KEY = "moekit_hyper_parameters"
"""The metadata entry (JSON) of a quantized checkpoint holding the task's hyper-parameters."""


def save_quantized_task(module: MoETask, quant_metadata: str, path: str | os.PathLike) -> Path:
    """Write a task whose expert banks are quantized as one safetensors file (atomically): the network's
    tensors (packed codes, scales, the float rest) and, as metadata, the task class, its hyper-parameters,
    class names and the quantization (``quant_metadata``, from :func:`moekit.quant.quant_metadata`)."""
    try:
        hparams = json.dumps(dict(module.hparams))
    except TypeError as err:
        raise CheckpointError(f"the task's hyper-parameters cannot be stored as JSON ({err})") from None
    metadata = {
        TASK_KEY: f"{type(module).__module__}:{type(module).__qualname__}",
        HPARAMS_KEY: hparams,
        CLASS_NAMES_KEY: json.dumps(getattr(module, "class_names", None)),
        QUANT_METADATA_KEY: quant_metadata,
    }
    return export_safetensors(module.net, path, metadata)


def _quantized_metadata(path: str) -> dict[str, str]:
    """The metadata of a file written by :func:`save_quantized_task`; a :class:`CheckpointError` for any other
    safetensors file."""
    with safe_open(path, "pt") as file:
        metadata = file.metadata() or {}
    if QUANT_METADATA_KEY not in metadata or HPARAMS_KEY not in metadata:
        raise CheckpointError(
            f"ckpt_path={path!r} is a safetensors file but not a quantized moekit checkpoint (its metadata has no "
            f"{QUANT_METADATA_KEY!r}); pass a .ckpt written by scripts/train.py or a file from scripts/quantize.py"
        )
    return metadata


def saved_hyper_parameters(path: str) -> dict:
    """The task's hyper-parameters a quantized checkpoint keeps (its training run's ``run_config`` among them)."""
    return json.loads(_quantized_metadata(path)[HPARAMS_KEY])


def load_quantized_task(path: str) -> MoETask:
    """The task of a file written by :func:`save_quantized_task` (a :class:`CheckpointError` for any other
    safetensors file), built without ever holding its float experts."""
    metadata = _quantized_metadata(path)
    cls = task_class(metadata)
    with experts_on_meta():  # the stored codes replace the experts: never hold them in float
        module = cls(**{**json.loads(metadata[HPARAMS_KEY]), "init_from": None, "compile": False})
    tensors = load_file(path)
    load_quantized_banks(module.net, tensors, metadata[QUANT_METADATA_KEY])
    load_weights(module.net, tensors, path)
    module.on_load_checkpoint({CLASS_NAMES_KEY: json.loads(metadata.get(CLASS_NAMES_KEY, "null"))})
    module.quantization = json.loads(metadata[QUANT_METADATA_KEY])
    return module
