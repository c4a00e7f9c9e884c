"""Post-training quantization of expert banks (GPTQ / QMoE), and inference with quantized experts.

An MoE's parameters grow with its experts while its compute does not, so memory is what stops it from
being served. This package rounds the expert banks of a trained model to 8, 4 or 2 bits or to ternary
weights, by round-to-nearest or by GPTQ with each expert's Hessian from the calibration tokens routed to
it (QMoE, Frantar & Alistarh 2023), stores ternary weights with a Tunstall code (well under 2 bits per
weight) and runs them with each expert dequantized only while its rows are computed.

* :mod:`~moekit.quant.formats` - the grids, group-wise scales, bit packing.
* :mod:`~moekit.quant.methods` - :func:`rtn_quantize`, :func:`gptq_quantize` (batched over experts).
* :mod:`~moekit.quant.ternary_code` - the Tunstall code of ternary weights.
* :mod:`~moekit.quant.bank` - :class:`QuantizedWeight`, :class:`QuantizedExpertBank`.
* :mod:`~moekit.quant.quantize` - :func:`quantize_experts` (calibration, sequential GPTQ), loading.

``scripts/quantize.py`` applies it to a training checkpoint; docs/quantization.md has the measurements.
"""

from .bank import QuantizedExpertBank, QuantizedWeight
from .formats import FORMATS, QuantFormat
from .methods import QuantizedCodes, gptq_quantize, rtn_quantize
from .quantize import (
    METHODS,
    QUANT_METADATA_KEY,
    BankReport,
    CalibrationError,
    ExpertMemory,
    QuantSpec,
    expert_banks,
    expert_memory,
    load_quantized_banks,
    quant_metadata,
    quantize_experts,
    quantized_banks,
)

__all__ = [
    "FORMATS",
    "METHODS",
    "QUANT_METADATA_KEY",
    "BankReport",
    "CalibrationError",
    "ExpertMemory",
    "QuantFormat",
    "QuantSpec",
    "QuantizedCodes",
    "QuantizedExpertBank",
    "QuantizedWeight",
    "expert_banks",
    "expert_memory",
    "gptq_quantize",
    "load_quantized_banks",
    "quant_metadata",
    "quantize_experts",
    "quantized_banks",
    "rtn_quantize",
]
