"""``scripts/quantize.py``: post-training quantization of a checkpoint's expert banks (:mod:`moekit.quant`)."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig

from moekit.checkpoint import CheckpointError, load_task
from moekit.errors import check_writable_dir, storage_errors
from moekit.quant import (
    CalibrationError,
    QuantFormat,
    QuantSpec,
    expert_banks,
    expert_memory,
    quant_metadata,
    quantize_experts,
)
from moekit.quantized_checkpoint import save_quantized_task

from .common import check_not_checkpoint, check_output_file, datamodule_for

log = logging.getLogger("moekit")

__all__ = ["quantize", "calibration_inputs", "FORMAT_OF_BITS"]

FORMAT_OF_BITS = {8: "int8", 4: "int4", 2: "int2", "ternary": "ternary"}


def calibration_inputs(datamodule, batches: int) -> list[torch.Tensor | dict[str, torch.Tensor]]:
    """The inputs of the first ``batches`` batches of ``datamodule``'s training split (its seeded shuffle): the
    images, or the token ids; for text with ``pack=false`` (batches ``(inputs, targets, padding_mask)``) the
    keyword arguments ``input_ids`` and ``padding_mask``, so that padding reaches no expert's Hessian."""
    datamodule.prepare_data()
    datamodule.setup("fit")
    inputs = []
    for batch in datamodule.train_dataloader():
        inputs.append(batch[0] if len(batch) < 3 else {"input_ids": batch[0], "padding_mask": batch[2]})
        if len(inputs) == batches:
            return inputs
    raise ValueError(
        f"calibration_batches={batches} but the training split has only {len(inputs)} batches; "
        f"lower calibration_batches to {len(inputs)} or less"
    )


def quantize(cfg: DictConfig) -> Path:
    """Quantize the expert banks of ``cfg.ckpt_path`` and write them, with the float rest, as safetensors."""
    if str(cfg.ckpt_path).endswith(".safetensors"):
        raise CheckpointError(
            f"ckpt_path={cfg.ckpt_path!r} is a safetensors file; quantize the training checkpoint (.ckpt) it came from"
        )
    name = FORMAT_OF_BITS[cfg.bits]  # settings out of range fail here, before the checkpoint loads
    spec = QuantSpec(QuantFormat(name, cfg.group_size), cfg.method, damping=cfg.damping, min_rows=cfg.min_rows)
    default = Path(cfg.ckpt_path).with_suffix(f".{name}-{cfg.method}.safetensors")
    output = Path(cfg.output_path or default)
    check_not_checkpoint(output, cfg.ckpt_path, default)
    module = load_task(cfg.ckpt_path)
    if not expert_banks(module.net):
        raise ValueError(
            f"ckpt_path={cfg.ckpt_path!r} holds a model without MoE layers ({module.hparams['net'].get('_target_')}, "
            f"moe={module.hparams['net'].get('moe')!r}): only expert banks are quantized; pass a checkpoint of an "
            "MoE experiment"
        )
    L.seed_everything(cfg.seed, workers=True)
    check_output_file(output, default.name)
    check_writable_dir(output.parent, "the folder of output_path")
    float_bytes = expert_memory(module.net)
    inputs = None
    if cfg.method == "gptq":  # calibration reads the inputs alone (and a padding mask), whatever their labels
        inputs = calibration_inputs(datamodule_for(cfg, module, same_labels=False), cfg.calibration_batches)
    try:
        quantize_experts(module.net, spec, (lambda: inputs) if inputs else None, log=log.info)
    except CalibrationError as err:
        raise CalibrationError(
            f"calibration_batches={cfg.calibration_batches} is too few: {err}. Raise calibration_batches, or use "
            "method=rtn (no calibration)"
        ) from None
    with storage_errors(output.parent):
        save_quantized_task(module, quant_metadata(spec, module.net), output)
    quantized = expert_memory(module.net)
    ternary = quantized.ternary
    code = (
        f"; ternary: {ternary['zero_fraction']:.0%} zeros, entropy {ternary['entropy_bits']:.3f} bits, "
        f"Tunstall code {ternary['code_bits_per_weight']:.3f} bits per weight"
        if ternary
        else ""
    )
    log.info(
        "wrote %s\n  experts: %s in float -> %s stored (%.3f bits per expert weight, scales included)%s\n"
        "  evaluate it with: python scripts/eval.py ckpt_path=%s",
        output,
        _mib(float_bytes.stored),
        _mib(quantized.stored),
        quantized.bits_per_weight,
        code,
        output,
    )
    return output


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
