"""The expert bank: ``num_experts`` MLPs stored as stacked weights and computed in one batched call.

Layout. ``fc1_weight`` is ``[experts, in, hidden]`` (``[experts, in, 2 * hidden]`` for gated experts:
the gate columns first, then the up-projection columns), ``fc2_weight`` is ``[experts, hidden, out]``.
A token row ``x`` of expert ``e`` computes ``fc2(act(x @ fc1_weight[e] + fc1_bias[e]))`` like timm's
``Mlp``; gated experts compute ``act(x @ W_gate) * (x @ W_up)`` (SwiGLU with ``act_layer=nn.SiLU``, the
Mixtral expert).

Input layout. :meth:`ExpertBank.forward` takes rows sorted by expert, ``x: [rows, in]``, and the rows
per expert, either

* an ``int`` ``C`` - every expert owns ``C`` consecutive rows (``rows == experts * C``): Soft MoE slots,
  experts-choice buffers, balanced assignment; or
* a ``LongTensor [experts]`` of counts - ragged groups (dropless tokens-choice). Rows after
  ``counts.sum()`` (dropped assignments) come out as zeros.

Kernels (``kernel=``): ``"loop"``, ``"bmm"``, ``"grouped_mm"`` or ``"auto"``, see
:mod:`moekit.moe.grouped_linear`. With ``"auto"`` under bf16 on a CPU with AMX, a tokens-choice layer's nearly equal
ragged groups run zero-padded as equal ones (:meth:`ExpertBank.padding`, :mod:`moekit.moe.padded_groups`).

Expert parallelism. :meth:`ExpertBank.shard_` keeps only this rank's block of experts of an
expert-parallel process group; ``forward`` then takes the same input (rows sorted by global expert)
and exchanges rows with the other ranks (:func:`moekit.moe.all_to_all.expert_parallel_apply`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from timm.layers import get_act_layer
from torch import Tensor, nn

from moekit.utils.machine import check_fits_in_memory

from .all_to_all import expert_parallel_apply
from .dropout import Dropout
from .gated_activation import expert_activation
from .grouped_linear import GroupSizes, Kernel, grouped_linear, reads_counts_on_host
from .padded_groups import PaddedGroups, plan_padding

if TYPE_CHECKING:
    from .base import MlpSpec

__all__ = ["ExpertBank", "ExpertsConfig", "compute_dtype", "experts_on_meta"]


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the experts compute ``x`` in: autocast's where it is on for ``x``'s device, else ``x``'s own (e.g.
    FSDP mixed precision)."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


_EXPERTS_ON_META: ContextVar[bool] = ContextVar("experts_on_meta", default=False)


FIT_FIX = "use fewer experts (moe.num_experts) or smaller ones (moe.granularity, mlp_ratio)"


def experts_built_on_meta() -> bool:
    """Whether new :class:`ExpertBank` weights go to the meta device here (inside :func:`experts_on_meta`)."""
    return _EXPERTS_ON_META.get()


@contextmanager
def experts_on_meta() -> Iterator[None]:
    """Within this context new :class:`ExpertBank` weights live on the meta device (no memory): a model
    whose banks are about to be replaced by stored ones (:mod:`moekit.quant`) is built without ever holding
    its float experts."""
    token = _EXPERTS_ON_META.set(True)
    try:
        yield
    finally:
        _EXPERTS_ON_META.reset(token)


class ExpertBank(nn.Module):
    """``num_experts`` MLP experts with stacked weights (see the module docstring for layouts).

    Args:
        num_experts: number of experts ``n``.
        in_features, hidden_features, out_features: expert sizes ``d -> h -> o``.
        act_layer: activation (class, factory, or timm name such as ``"gelu"`` / ``"silu"``).
        gated: GLU experts ``act(x W_gate) * (x W_up)``; with ``act_layer=nn.SiLU`` this is SwiGLU.
        bias: bias of (fc1, fc2), one bool for both.
        drop: dropout after the activation and after fc2 (each expert's output rows), one float for both or a pair.
        init: ``"independent"`` (each expert its own draw) or ``"shared"`` (all experts start as copies
            of one draw, as V-MoE). The draw is ``nn.Linear``'s default; models redraw with
            :meth:`init_normal_`. For sparse upcycling from a dense MLP see :meth:`load_dense_mlp`.
        kernel: ``"auto" | "loop" | "bmm" | "grouped_mm"``, see :func:`grouped_linear`.
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        hidden_features: int,
        out_features: int | None = None,
        act_layer: str | type | None = nn.GELU,
        gated: bool = False,
        bias: bool | tuple[bool, bool] = True,
        drop: float | tuple[float, float] = 0.0,
        init: Literal["independent", "shared"] = "independent",
        kernel: Kernel = "auto",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"ExpertBank: num_experts={num_experts!r} must be a positive int")
        if init not in ("independent", "shared"):
            raise ValueError(f"ExpertBank: init={init!r}; allowed: 'independent', 'shared'")
        if kernel not in ("auto", "loop", "bmm", "grouped_mm"):
            raise ValueError(f"ExpertBank: kernel={kernel!r}; allowed: 'auto', 'loop', 'bmm', 'grouped_mm'")
        out_features = out_features or in_features
        bias1, bias2 = bias if isinstance(bias, (tuple, list)) else (bias, bias)
        drop1, drop2 = drop if isinstance(drop, (tuple, list)) else (drop, drop)
        self.num_experts = num_experts
        self.in_features = in_features
        self.hidden_features = hidden_features
        self.out_features = out_features
        self.gated = gated
        self.init = init
        self.kernel = kernel
        self.ep_group = None  # expert-parallel process group once sharded (see shard_)
        self.expert_offset = 0  # global index of the first expert held here
        fc1_out = 2 * hidden_features if gated else hidden_features
        if _EXPERTS_ON_META.get():
            device = torch.device("meta")
        dd = {"device": device, "dtype": dtype}
        weights = in_features * fc1_out + hidden_features * out_features
        what = f"ExpertBank: num_experts={num_experts} experts of {weights:,} weights each"
        check_fits_in_memory(num_experts * weights * torch.empty((), dtype=dtype).element_size(), device, what, FIT_FIX)
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, in_features, fc1_out, **dd))
        self.fc1_bias = nn.Parameter(torch.empty(num_experts, fc1_out, **dd)) if bias1 else None
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, hidden_features, out_features, **dd))
        self.fc2_bias = nn.Parameter(torch.empty(num_experts, out_features, **dd)) if bias2 else None
        act = get_act_layer(act_layer) if isinstance(act_layer, str) else act_layer
        self.act = act() if act is not None else nn.Identity()
        self.drop1 = Dropout(drop1)
        self.drop2 = Dropout(drop2)
        self.reset_parameters()

    def _pairs(self):
        return ((self.fc1_weight, self.fc1_bias), (self.fc2_weight, self.fc2_bias))

    @torch.no_grad()
    def _share_first(self) -> None:
        """With ``init="shared"``, make every expert a copy of expert 0."""
        if self.init == "shared":
            for weight, bias in self._pairs():
                weight.copy_(weight[:1].expand_as(weight))
                if bias is not None:
                    bias.copy_(bias[:1].expand_as(bias))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``nn.Linear``'s default draw, ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, for every expert (or one)."""
        for weight, bias in self._pairs():
            bound = 1.0 / math.sqrt(weight.shape[1])
            weight.uniform_(-bound, bound)
            if bias is not None:
                bias.uniform_(-bound, bound)
        self._share_first()

    @torch.no_grad()
    def init_normal_(self, std: float, out_std: float | None = None, *, truncate: bool = False) -> None:
        """Redraw the weights from ``N(0, std)`` (fc2 from ``N(0, out_std)``, default ``std``), zero the
        biases, keep the ``init`` mode. ``truncate`` cuts the normal at two std (timm's ViT initialisation has the
        same std but cuts at +-2, which at std 0.02 leaves it uncut); without it this is GPT-2's."""
        for (weight, bias), s in zip(self._pairs(), (std, std if out_std is None else out_std)):
            if truncate:
                nn.init.trunc_normal_(weight, std=s, a=-2 * s, b=2 * s)
            else:
                weight.normal_(0.0, s)
            if bias is not None:
                bias.zero_()
        self._share_first()

    @torch.no_grad()
    def load_dense_mlp(self, mlp: nn.Module, noise_std: float = 0.0) -> None:
        """Sparse upcycling: make every expert a copy of a dense MLP.

        Accepts timm ``Mlp`` (``fc1``, ``fc2``) for plain experts and timm ``SwiGLU`` (``fc1_g``,
        ``fc1_x``, ``fc2``) or ``GluMlp`` (``fc1`` holding both halves) for gated experts.
        ``noise_std`` > 0 adds independent Gaussian noise to each copy to break the symmetry.
        """
        if self.gated:
            if hasattr(mlp, "fc1_g"):
                w_in = torch.cat([mlp.fc1_g.weight, mlp.fc1_x.weight], dim=0)
                b_in = torch.cat([mlp.fc1_g.bias, mlp.fc1_x.bias], dim=0) if mlp.fc1_g.bias is not None else None
            elif hasattr(mlp, "fc1") and mlp.fc1.weight.shape[0] == 2 * self.hidden_features:
                # timm GluMlp chunks fc1's output as (x, gate) (gate_last, its default) or (gate, x): to (gate, up).
                order = slice(None, None, -1) if getattr(mlp, "gate_last", True) else slice(None)
                w_in = torch.cat(mlp.fc1.weight.chunk(2, dim=0)[order], dim=0)
                b_in = torch.cat(mlp.fc1.bias.chunk(2)[order]) if mlp.fc1.bias is not None else None
            else:
                raise ValueError(
                    f"load_dense_mlp: {type(mlp).__name__} is not a gated MLP; gated experts need timm SwiGLU "
                    "(fc1_g, fc1_x, fc2) or GluMlp"
                )
        else:
            if not hasattr(mlp, "fc1") or not hasattr(mlp, "fc2"):
                raise ValueError(
                    f"load_dense_mlp: {type(mlp).__name__} has no fc1/fc2 linear layers (gated experts take a gated "
                    "MLP such as timm's SwiGLU, plain experts a plain one: give both the same gating)"
                )
            w_in, b_in = mlp.fc1.weight, mlp.fc1.bias
        w_out, b_out = mlp.fc2.weight, mlp.fc2.bias
        expected = (self.fc1_weight.shape[2], self.in_features)
        if tuple(w_in.shape) != expected or tuple(w_out.shape) != (self.out_features, self.hidden_features):
            raise ValueError(
                f"load_dense_mlp: dense MLP sizes fc1 {tuple(w_in.shape)}, fc2 {tuple(w_out.shape)} do not match the "
                f"experts' fc1 {expected}, fc2 {(self.out_features, self.hidden_features)}: each expert must have the "
                "dense MLP's hidden size (e.g. the same mlp_ratio) and gating (gated=)"
            )
        for target, source in (
            (self.fc1_weight, w_in.t()),
            (self.fc1_bias, b_in),
            (self.fc2_weight, w_out.t()),
            (self.fc2_bias, b_out),
        ):
            if target is None:
                continue
            if source is None:
                target.zero_()
                continue
            target.copy_(source.unsqueeze(0).expand_as(target))
            if noise_std > 0:
                target.add_(torch.randn_like(target) * noise_std)

    @property
    def num_local_experts(self) -> int:
        """Experts whose weights this process holds (``num_experts`` unless sharded)."""
        return self.fc1_weight.shape[0]

    @torch.no_grad()
    def shard_(self, group) -> None:
        """Keep only this rank's ``num_experts / W`` experts of the ``W``-rank process group ``group``
        (rank ``r`` keeps experts ``r * L ... (r + 1) * L - 1``). Call before building the optimizer;
        every rank must hold the same full bank beforehand."""
        if self.ep_group is not None:
            raise RuntimeError("ExpertBank.shard_: the bank is already sharded")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if self.num_experts % world:
            raise ValueError(
                f"ExpertBank: num_experts={self.num_experts} cannot be split over an expert-parallel group of {world} "
                f"ranks; choose expert_parallel_size dividing {self.num_experts}"
            )
        local = self.num_experts // world
        self.expert_offset = rank * local
        for name in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"):
            param = getattr(self, name)
            if param is not None:
                block = param[self.expert_offset : self.expert_offset + local].clone()
                setattr(self, name, nn.Parameter(block, requires_grad=param.requires_grad))
        self.ep_group = group

    def forward(self, x: Tensor, group_sizes: GroupSizes, no_tail: bool = False) -> Tensor:
        """Args: ``x: [rows, in]`` sorted by expert; ``group_sizes``: ``int`` rows per expert or
        ``LongTensor [experts]`` counts; ``no_tail``: the counts sum to ``rows`` (a dropless dispatch), so no
        row past the last group needs zeroing. Returns ``[rows, out]`` (rows past the last group are zero)."""
        if self.ep_group is not None:  # the rows received from other ranks: the tail is zeroed as always
            return expert_parallel_apply(self._local_forward, x, group_sizes, self.num_experts, self.ep_group)
        return self._local_forward(x, group_sizes, no_tail)

    def _cast(self, x: Tensor, weights_too: bool = True) -> tuple[Tensor, tuple[Tensor | None, ...]]:
        """``x`` in the compute dtype (autocast's when enabled, else the input's), and the weights in it too unless
        ``weights_too`` is False (:func:`grouped_linear` takes them in their own dtype and casts them itself)."""
        weights = (self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias)
        x = x.to(compute_dtype(x))
        if weights_too and x.dtype != self.fc1_weight.dtype:
            weights = tuple(w.to(x.dtype) if w is not None else None for w in weights)
        return x, weights

    def padding(self, counts: Tensor, x: Tensor) -> PaddedGroups | None:
        """How ragged groups of ``counts`` rows (``[experts]``) of ``x``'s tokens run as equal, zero-padded ones where
        :mod:`moekit.moe.padded_groups` finds that faster (the dispatch then fills the buffer and the combine reads
        it: :func:`~moekit.moe.dispatch.apply_experts`), else None; None under expert parallelism."""
        if self.ep_group is not None:
            return None
        dropout = self.training and (self.drop1.p > 0 or self.drop2.p > 0)
        return plan_padding(counts, compute_dtype(x), self.kernel, dropout)

    def reads_counts_on_host(self, x: Tensor) -> bool:
        """Whether this bank reads the rows per expert of ragged groups of ``x``'s tokens on the host (the CPU loop):
        a dispatch may then read them too, for free (:func:`~moekit.moe.dispatch.kept_rows`)."""
        return reads_counts_on_host(self.kernel, x)

    def _local_forward(self, x: Tensor, group_sizes: GroupSizes, no_tail: bool = False) -> Tensor:
        """The experts held here on rows sorted by local expert."""
        x, (w1, b1, w2, b2) = self._cast(x, weights_too=False)
        with torch.autocast(x.device.type, enabled=False):
            h = self.drop1(self._fc1_activation(x, w1, b1, group_sizes, no_tail))
            return self.drop2(grouped_linear(h, w2, b2, group_sizes, self.kernel, no_tail))

    def _fc1_activation(
        self, x: Tensor, w1: Tensor, b1: Tensor | None, group_sizes: GroupSizes, no_tail: bool = False
    ) -> Tensor:
        """``act(fc1(x))`` of rows sorted by expert; a gated expert's gate and up come as two planes."""
        planes = 2 if self.gated else 1
        h = grouped_linear(x, w1, b1, group_sizes, self.kernel, no_tail, planes=planes)
        return expert_activation(h, self.act, self.gated, planes=self.gated)

    def merged(self, x_BTD: Tensor, weights_BE: Tensor) -> Tensor:
        """Experts merged in parameter space (SMEAR, Muqeeth et al. 2023; Lory): sequence ``b`` of ``x_BTD`` goes
        through one MLP whose weights are ``sum_e weights_BE[b, e] * expert_e``'s. ``[B, T, in] -> [B, T, out]``.
        Merging costs ``E / T`` of the tokens' compute; the merged weights are materialised per sequence."""
        x_BTD, (w1, b1, w2, b2) = self._cast(x_BTD)
        weights_BE = weights_BE.to(x_BTD.dtype)
        with torch.autocast(x_BTD.device.type, enabled=False):
            w1_BDH = (weights_BE @ w1.flatten(1)).view(-1, *w1.shape[1:])  # [B, in, hidden (x2 gated)]
            h_BTH = torch.bmm(x_BTD, w1_BDH)
            if b1 is not None:
                h_BTH = h_BTH + (weights_BE @ b1).unsqueeze(1)
            h_BTH = self.drop1(expert_activation(h_BTH, self.act, self.gated))
            w2_BHD = (weights_BE @ w2.flatten(1)).view(-1, *w2.shape[1:])  # [B, hidden, out]
            y_BTD = torch.bmm(h_BTH, w2_BHD)
            if b2 is not None:
                y_BTD = y_BTD + (weights_BE @ b2).unsqueeze(1)
        return self.drop2(y_BTD)

    def hidden(self, x: Tensor, group_sizes: GroupSizes) -> Tensor:
        """``[rows, hidden]``: what reaches ``fc2`` for rows sorted by (local) expert, before dropout (the
        inputs whose statistics GPTQ needs for ``fc2``)."""
        x, (w1, b1, _, _) = self._cast(x, weights_too=False)
        with torch.autocast(x.device.type, enabled=False):
            return self._fc1_activation(x, w1, b1, group_sizes)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, {self.in_features}->{self.hidden_features}->{self.out_features}, "
            f"gated={self.gated}, kernel={self.kernel!r}"
            + (
                f", local_experts={self.expert_offset}..{self.expert_offset + self.num_local_experts - 1}"
                if self.ep_group is not None
                else ""
            )
        )


@dataclass(kw_only=True)
class ExpertsConfig:
    """The routed experts of an MoE layer: how many, their form and first draw, the kernel that runs them.
    Their sizes, activation, biases and dropout come from the timm ``Mlp`` keywords of the layer."""

    num_experts: int = 8
    gated: bool = False
    expert_init: Literal["independent", "shared"] = "independent"
    kernel: Kernel = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"num_experts={self.num_experts!r} must be a positive int")

    def build(
        self,
        mlp: MlpSpec,
        *,
        num_experts: int | None = None,
        hidden_features: int | None = None,
        device=None,
        dtype=None,
    ) -> ExpertBank:
        """An :class:`ExpertBank` of ``num_experts`` (default: this config's) MLPs shaped by ``mlp``
        (``hidden_features`` overrides its hidden size)."""
        return ExpertBank(
            self.num_experts if num_experts is None else num_experts,
            mlp.in_features,
            hidden_features or mlp.hidden_features,
            mlp.out_features,
            act_layer=mlp.act_layer,
            gated=self.gated,
            bias=mlp.bias,
            drop=mlp.drop,
            init=self.expert_init,
            kernel=self.kernel,
            device=device,
            dtype=dtype,
        )
