"""Quantize the expert banks of a trained model, and rebuild a quantized model from its stored tensors.

:func:`quantize_experts` replaces every :class:`~moekit.moe.ExpertBank` of a network (routed and shared
experts) by a :class:`~moekit.quant.QuantizedExpertBank`; routers, norms, attention and embeddings stay float.

With ``method="gptq"`` the banks are quantized one after the other in the network's order, each from the
calibration inputs as the banks before it (already quantized) pass them on, as GPTQ and QMoE do:

1. run the calibration inputs, and at the bank, add each expert's ``X^T X`` over the rows routed to it
   (the forward stops there);
2. GPTQ on ``fc1`` with those Hessians; the bank now computes with the rounded ``fc1``;
3. run again for the Hessians of what reaches ``fc2``, GPTQ on ``fc2``;
4. the quantized bank takes the float bank's place (whose weights are left as they were, to be put back if a
   later bank fails).

An expert that calibration reaches with fewer rows than its matrix has inputs (``min_rows``; the input size
by default) has a rank-deficient Hessian: GPTQ would fit the rounding to those few rows. Such an expert is
rounded to nearest instead (an identity Hessian) and counted in the report.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from moekit.moe import moe_layers
from moekit.moe.experts import ExpertBank
from moekit.moe.grouped_linear import GroupSizes

from .bank import QuantizedExpertBank, QuantizedWeight
from .formats import QuantFormat
from .methods import DAMPING, QuantizedCodes, gptq_quantize, rtn_quantize

__all__ = [
    "METHODS",
    "QuantSpec",
    "BankReport",
    "CalibrationError",
    "ExpertMemory",
    "expert_banks",
    "expert_memory",
    "quantize_experts",
    "quantized_banks",
    "load_quantized_banks",
    "quant_metadata",
    "QUANT_METADATA_KEY",
]

METHODS = ("rtn", "gptq")
QUANT_METADATA_KEY = "moekit_quant"
"""The safetensors metadata entry (JSON) describing a quantized network: format, method and bank names."""


@dataclass(frozen=True)
class QuantSpec:
    """What :func:`quantize_experts` does: the format, ``rtn`` or ``gptq``, and GPTQ's settings."""

    fmt: QuantFormat
    method: Literal["rtn", "gptq"] = "gptq"
    block_size: int = 128
    damping: float = DAMPING
    min_rows: int | None = None  # rows an expert needs for GPTQ; None: the matrix's input size

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is not one of {METHODS}")
        if not 0 <= self.damping < 1:
            raise ValueError(f"damping={self.damping} must be in [0, 1) (a fraction of the Hessian's mean diagonal)")
        if not _positive_int(self.block_size):
            raise ValueError(f"block_size={self.block_size!r} must be a positive int (rows per lazy GPTQ update)")
        if self.min_rows is not None and not _positive_int(self.min_rows):
            raise ValueError(
                f"min_rows={self.min_rows!r} must be a positive int, or None (null in the config: the matrix's "
                "input size); an expert with fewer calibration rows is rounded to nearest (with 0 rows GPTQ zeroes "
                "its weights)"
            )


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass
class BankReport:
    """How one bank was quantized: calibration rows per expert and the experts rounded to nearest."""

    name: str
    experts: int
    rows_min: int | None = None
    rows_max: int | None = None
    rtn_fallback: dict[str, int] = field(default_factory=dict)  # matrix -> experts with too few rows


def expert_banks(net: nn.Module) -> list[tuple[str, ExpertBank]]:
    """The float expert banks of ``net``, in module order (the order inputs pass through them)."""
    return [(name, m) for name, m in net.named_modules() if isinstance(m, ExpertBank)]


def quantized_banks(net: nn.Module) -> list[tuple[str, QuantizedExpertBank]]:
    return [(name, m) for name, m in net.named_modules() if isinstance(m, QuantizedExpertBank)]


@dataclass
class ExpertMemory:
    """The expert weights of a network (float or quantized banks; biases excluded) and their bytes."""

    weights: int
    stored: int  # bytes in a checkpoint
    resident: int  # bytes in memory (the ternary decoding tables included)
    ternary: dict[str, float] | None = None  # zero fraction, entropy and code bits, weighted over matrices

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.stored / max(self.weights, 1)


def expert_memory(net: nn.Module) -> ExpertMemory:
    """Count the expert weights of ``net`` and the bytes they take."""
    weights = stored = resident = ternary_weights = 0
    ternary: dict[str, float] = {}
    for _, bank in expert_banks(net):
        for w in (bank.fc1_weight, bank.fc2_weight):
            weights += w.numel()
            stored += w.numel() * w.element_size()
    resident += stored
    for _, bank in quantized_banks(net):
        for w in (bank.fc1, bank.fc2):
            n = w.num_experts * w.in_features * w.out_features
            weights += n
            stored += w.stored_bytes()
            resident += w.resident_bytes()
            stats = w.ternary_stats()
            if stats:
                ternary_weights += n
                for key, value in stats.items():
                    ternary[key] = ternary.get(key, 0.0) + value * n
    return ExpertMemory(weights, stored, resident, {k: v / ternary_weights for k, v in ternary.items()} or None)


class CalibrationError(ValueError):
    """The calibration inputs reach no expert of a bank with the rows GPTQ needs."""


class _Stop(Exception):
    """Ends a calibration forward once the bank being measured has its inputs."""


def _gram(x: Tensor, group_sizes: GroupSizes, experts: int) -> tuple[Tensor, Tensor]:
    """Each expert's ``X^T X`` ``[E, I, I]`` (float64) and row count ``[E]`` of rows sorted by expert."""
    x = x.detach().float()
    if isinstance(group_sizes, int):
        x_ECI = x[: experts * group_sizes].view(experts, group_sizes, -1)
        counts = torch.full((experts,), group_sizes, dtype=torch.int64)
        return torch.bmm(x_ECI.transpose(1, 2), x_ECI).double(), counts
    counts = group_sizes.detach().to("cpu", torch.int64, copy=True)  # a copy: the calibration sums into it
    parts = x[: int(counts.sum())].split(counts.tolist())
    return torch.stack([(p.t() @ p).double() for p in parts]), counts


Calibration = Callable[[], Iterable[Tensor | Mapping[str, Tensor]]]
"""Returns the calibration inputs: a tensor is run as ``net(x)``, a mapping as ``net(**x)`` (e.g. token ids with the
``padding_mask`` of unpacked text, so that padding reaches no expert)."""


def _run(net: nn.Module, x: Tensor | Mapping[str, Tensor]) -> None:
    if isinstance(x, Mapping):
        net(**x)
    else:
        net(x)


def _hessians(net: nn.Module, bank: ExpertBank, inputs: Calibration, fc2: bool) -> tuple[Tensor, Tensor]:
    """Summed ``X^T X`` per expert of the bank's ``fc1`` (or ``fc2``) inputs over the calibration inputs."""
    total: list[Tensor] = []
    rows: list[Tensor] = []

    def hook(module: ExpertBank, args: tuple) -> None:
        x, group_sizes = args[0], args[1]
        if fc2:
            x = module.hidden(x, group_sizes)
        gram, counts = _gram(x, group_sizes, module.num_experts)
        if total:
            total[0] += gram
            rows[0] += counts
        else:
            total.append(gram)
            rows.append(counts)
        raise _Stop

    handle = bank.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            for x in inputs():
                try:
                    _run(net, x)
                except _Stop:
                    pass
    finally:
        handle.remove()
    if not total:
        raise ValueError("the calibration inputs never reached the expert bank; check the calibration data")
    return total[0].cpu(), rows[0]  # GPTQ runs on the CPU, in float64


def _quantize_matrix(
    weight: Tensor,
    spec: QuantSpec,
    hessian: Tensor | None,
    rows: Tensor | None,
) -> tuple[QuantizedCodes, int]:
    """Codes of one ``[E, I, O]`` matrix, and how many experts fell back to round-to-nearest."""
    q, fallback = _codes(weight, spec, hessian, rows)
    if not bool(torch.isfinite(q.scale).all()):  # a group's range past float16: its scale inf, its weights NaN
        largest = torch.finfo(torch.float16).max
        raise ValueError(
            f"weights up to |w| = {float(weight.abs().max()):.4g} need scales past float16's largest value "
            f"{largest:.0f} in {spec.fmt.name} (the stored scales are float16); keep this model in float or scale "
            "its weights down"
        )
    return q, fallback


def _codes(weight: Tensor, spec: QuantSpec, hessian: Tensor | None, rows: Tensor | None) -> tuple[QuantizedCodes, int]:
    if spec.method == "rtn":
        return rtn_quantize(weight, spec.fmt), 0
    inputs = weight.shape[1]
    few = rows < (spec.min_rows if spec.min_rows is not None else inputs)
    if bool(few.all()):
        raise CalibrationError(
            f"the calibration inputs gave each expert at most {int(rows.max())} rows, fewer than the "
            f"{spec.min_rows or inputs} GPTQ needs for a {inputs}-input matrix"
        )
    if bool(few.any()):
        eye = torch.eye(inputs, dtype=hessian.dtype).expand_as(hessian)
        hessian = torch.where(few.view(-1, 1, 1), eye, hessian)
    q = gptq_quantize(weight, hessian, spec.fmt, block_size=spec.block_size, damping=spec.damping)
    return q, int(few.sum())


@torch.no_grad()
def quantize_experts(
    net: nn.Module,
    spec: QuantSpec,
    calibration: Calibration | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> list[BankReport]:
    """Replace every expert bank of ``net`` (in eval mode) by its quantized form, in place; an error (too few
    calibration rows, ...) leaves ``net`` as it was.

    Args:
        net: the network; ``net(x)`` (``net(**x)`` for a mapping) for each ``x`` of ``calibration()`` runs a forward.
        spec: format and method.
        calibration: a function returning an iterable of network inputs (called once per pass), needed by
            ``gptq``: batches of the training split; a mapping of keyword arguments passes e.g. a padding mask.
        log: receives a line per bank.
    """
    banks = expert_banks(net)
    if not banks:
        raise ValueError(f"{type(net).__name__} has no expert bank (ExpertBank) to quantize: it is a dense model")
    merging = [f"{name} ({type(layer).__name__})" for name, layer in moe_layers(net) if layer.merges_experts]
    if merging:
        raise ValueError(
            f"{', '.join(merging)}: a layer that merges the weights of all its experts for every token (Lory) cannot "
            "serve quantized experts, which are dequantized one at a time for the tokens routed to them; quantize a "
            "model of another recipe (moe=lory models stay in float)"
        )
    if spec.method == "gptq" and calibration is None:
        raise ValueError("method='gptq' needs calibration inputs (batches of the training split)")
    was_training = net.training
    net.eval()
    reports, done = [], {}  # done: the float banks already swapped out, swapped back if quantization fails
    try:
        for name, bank in banks:
            reports.append(_quantize_bank(net, name, bank, spec, calibration, log))
            done[name] = bank
    except BaseException:
        for name, bank in done.items():
            net.set_submodule(name, bank)
        raise
    finally:
        net.train(was_training)
    return reports


def _quantize_bank(
    net: nn.Module, name: str, bank: ExpertBank, spec: QuantSpec, calibration: Calibration | None, log
) -> BankReport:
    """Quantize one bank and swap it into ``net`` for the float one, whose weights are left as they were: the
    banks after it calibrate on what the quantized bank passes on."""
    report = BankReport(name, bank.num_experts)
    matrices = {}
    fc1 = bank.fc1_weight.data
    try:
        for fc in ("fc1", "fc2"):
            weight = getattr(bank, f"{fc}_weight")
            hessian = rows = None
            if spec.method == "gptq":
                hessian, rows = _hessians(net, bank, calibration, fc2=fc == "fc2")
                report.rows_min, report.rows_max = int(rows.min()), int(rows.max())
            try:
                q, fallback = _quantize_matrix(weight.detach().cpu(), spec, hessian, rows)
            except CalibrationError as err:
                raise CalibrationError(f"{name}.{fc}: {err}") from None
            except ValueError as err:
                raise ValueError(f"{name}.{fc}: {err}") from None
            if fallback:
                report.rtn_fallback[fc] = fallback
            if fc == "fc1":  # fc2's inputs come from the rounded fc1
                bank.fc1_weight.data = q.dequantize().to(weight)
            matrices[fc] = QuantizedWeight.from_codes(q)
    finally:
        bank.fc1_weight.data = fc1
    biases = {k: b.detach().clone() for k in ("fc1_bias", "fc2_bias") if (b := getattr(bank, k)) is not None}
    quantized = QuantizedExpertBank(bank, matrices["fc1"], matrices["fc2"], biases)
    net.set_submodule(name, quantized.to(bank.fc1_weight.device))
    note = ""
    if report.rows_min is not None:
        note += f", calibration rows per expert {report.rows_min}..{report.rows_max}"
    if report.rtn_fallback:
        note += f", rounded to nearest (too few rows): {report.rtn_fallback}"
    log(f"{name}: {bank.num_experts} experts quantized ({spec.fmt.name}, {spec.method}){note}")
    return report


def quant_metadata(spec: QuantSpec, net: nn.Module) -> str:
    """The JSON stored with a quantized network's tensors (:data:`QUANT_METADATA_KEY`)."""
    return json.dumps(
        {
            "format": spec.fmt.name,
            "group_size": spec.fmt.group_size,
            "method": spec.method,
            "banks": [name for name, _ in quantized_banks(net)],
        }
    )


def load_quantized_banks(net: nn.Module, tensors: dict[str, Tensor], metadata: str) -> QuantFormat:
    """Replace the banks named in ``metadata`` (from :func:`quant_metadata`) by quantized banks built from
    ``tensors`` (a quantized network's state dict). Build ``net`` under
    :func:`~moekit.moe.experts.experts_on_meta` so that its float experts never take memory."""
    info = json.loads(metadata)
    fmt = QuantFormat(info["format"], int(info["group_size"]))
    banks = dict(expert_banks(net))
    for name in info["banks"]:
        if name not in banks:
            raise KeyError(f"the stored quantized bank {name!r} is not an expert bank of {type(net).__name__}")
        bank = banks[name]
        matrices = {}
        for fc in ("fc1", "fc2"):
            shape = tuple(getattr(bank, f"{fc}_weight").shape)  # meta tensors: shapes only
            prefix = f"{name}.{fc}."
            stored = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            matrices[fc] = QuantizedWeight(fmt, shape, stored)
        biases = {k: tensors[f"{name}.{k}"] for k in ("fc1_bias", "fc2_bias") if f"{name}.{k}" in tensors}
        net.set_submodule(name, QuantizedExpertBank(bank, matrices["fc1"], matrices["fc2"], biases))
    return fmt
