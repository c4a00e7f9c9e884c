"""Muon for a model's hidden matrices, AdamW for the rest of its parameters, in one optimizer.

Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers in neural networks"; Liu et al. 2025, "Muon is
scalable for LLM training", arXiv:2502.16982) updates a weight matrix W [m, n] with gradient G by

    M  <- mu M + (1 - mu) G                           momentum
    U  =  G + mu (M - G)    (nesterov; else U = M)
    O  =  NS(U)             ~ the orthogonal polar factor of U: U = P S Q^T  ->  P S' Q^T with S' near 1
    W  <- (1 - lr wd) W - lr 0.2 sqrt(max(m, n)) O

NS is five steps of the quintic Newton-Schulz iteration X <- a X + (b A + c A^2) X, A = X X^T, from
X = U / ||U||_F, with Jordan's (a, b, c) = (3.4445, -4.7750, 2.0315). The factor 0.2 sqrt(max(m, n)) gives O
the RMS of a typical AdamW update (Liu et al.), so AdamW's learning rate and weight decay carry over. The updates
are torch's ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")``, which takes 2-D weights only; here the Newton-
Schulz steps of all matrices of one shape run as one batched product, and an expert bank ``[E, in, out]`` is E
matrices, each orthogonalised on its own, as a dense layer's weight would be.

Which parameters Muon takes is :func:`hidden_matrices`: the weights of ``nn.Linear``, convolutions (flattened to
``[out, in * kernel]``), ``nn.LSTM`` (each gate's matrix) and :class:`~moekit.moe.ExpertBank`. Routers, the
output head (and the embedding a head is tied to), embeddings, position embeddings, Soft MoE's dispatch
``phi``, matrices with a side of 1, norms and biases train with AdamW. A fused weight is one matrix: timm's
``qkv`` ``[3 D, D]``, and a gated expert bank's gate and up projections (``fc1`` ``[E, in, 2 H]``) per expert
(the main job trained to the same accuracy with the query, key and value projections orthogonalised apart:
docs/results.md).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Literal, get_args

import torch
from torch import Tensor, nn
from torch.optim.adamw import adamw

from moekit.config_checks import NS_DTYPES

from .optim import param_groups

__all__ = ["MuonAdamW", "hidden_matrices", "muon_param_groups", "orthogonalize"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
Layout = Literal["matrix", "experts", "lstm"]
LAYOUTS: tuple[Layout, ...] = get_args(Layout)


def orthogonalize(u_BMN: Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype | None = None) -> Tensor:
    """The quintic Newton-Schulz iteration on each matrix of ``u_BMN`` [B, m, n]: about its polar factor
    ``P Q^T`` (singular values in about [0.7, 1.2], not exactly 1: the coefficients trade that for speed).
    Runs in ``dtype`` (default the input's) and returns it."""
    x = u_BMN.to(dtype or u_BMN.dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT  # the Gram matrix X X^T of the shorter side
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= Frobenius norm = 1
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT  # [B, m, m]
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.baddbmm(x, poly, x, beta=a)  # a X + (b A + c A^2) X
    return x.mT if tall else x


def _as_matrices(tensor: Tensor, layout: Layout) -> Tensor:
    """A parameter (or its gradient) as the batch of matrices Muon orthogonalises: ``[B, m, n]``."""
    if layout == "experts":
        return tensor  # [E, in, out]: one matrix per expert
    if layout == "lstm":
        return tensor.reshape(4, tensor.shape[0] // 4, -1)  # [4H, in]: the input, forget, cell and output gates
    return tensor.reshape(1, tensor.shape[0], -1)  # [out, in, *kernel] -> [1, out, in * kernel]


def hidden_matrices(model: nn.Module) -> dict[str, Layout]:
    """The parameters Muon trains, by name (as ``model.named_parameters()`` gives it), each with how it is a
    batch of matrices: ``"matrix"`` (a linear or convolution weight), ``"experts"`` (an expert bank's
    ``[E, in, out]``), ``"lstm"`` (``[4 H, in]``: four gate matrices). Everything else is left to AdamW."""
    from moekit.moe import ExpertBank
    from moekit.moe.depth import DepthRouter
    from moekit.moe.routing import Router

    head = model.get_classifier() if hasattr(model, "get_classifier") else getattr(model, "head", None)
    excluded = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    layouts: dict[int, Layout] = {}
    for module in model.modules():
        if isinstance(module, (Router, DepthRouter, nn.Embedding)):
            excluded.update(id(p) for p in module.parameters())
        elif isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            layouts[id(module.weight)] = "matrix"
        elif isinstance(module, ExpertBank):
            layouts.update({id(module.fc1_weight): "experts", id(module.fc2_weight): "experts"})
        elif isinstance(module, nn.LSTM) and not module.proj_size:
            layouts.update({id(p): "lstm" for name, p in module.named_parameters() if name.startswith("weight_")})
    chosen = {}
    for name, param in model.named_parameters():
        layout = layouts.get(id(param))
        if layout is None or id(param) in excluded or not param.requires_grad:
            continue
        if min(_as_matrices(param.detach(), layout).shape[-2:]) > 1:  # a [1, n] matrix is a vector: AdamW's
            chosen[name] = layout
    return chosen


def muon_param_groups(model: nn.Module, weight_decay: float, decay_1d: bool = False) -> list[dict]:
    """:func:`~moekit.tasks.optim.param_groups`' decayed and non-decayed groups, with the hidden matrices
    (:func:`hidden_matrices`) taken out into Muon groups, one per layout (``"algorithm": "muon"``)."""
    chosen = hidden_matrices(model)
    by_id = {id(p): chosen[name] for name, p in model.named_parameters() if name in chosen}
    groups = []
    for group in param_groups(model, weight_decay, decay_1d):
        rest = [p for p in group["params"] if id(p) not in by_id]
        for layout in LAYOUTS:
            params = [p for p in group["params"] if by_id.get(id(p)) == layout]
            if params:
                groups.append({**group, "params": params, "algorithm": "muon", "layout": layout})
        if rest:
            groups.append({**group, "params": rest, "algorithm": "adamw"})
    return groups


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the param groups marked ``"algorithm": "muon"`` (with their ``"layout"``), AdamW on the others,
    one learning rate schedule for both (Muon's updates are scaled to AdamW's RMS). Build the groups with
    :func:`muon_param_groups`.

    Args:
        lr, weight_decay: both algorithms' (decoupled weight decay: ``W <- (1 - lr wd) W``).
        momentum, nesterov: Muon's momentum.
        betas, eps: AdamW's.
        ns_steps: Newton-Schulz steps.
        ns_dtype: ``"auto"``: bfloat16 where its matmuls outrun float32 ones: GPUs with bf16 in hardware (compute
            capability 8.0 on), CPUs with AMX, and CPUs with ``avx512_bf16`` alone where the run trains in bf16
            (``run_precision="bf16-mixed"``, which ``trainer.precision=auto`` chooses there by timing the
            run's step both ways: the flag does not tell, and a 2-core Zen 4 EPYC ran the main job's Newton-Schulz
            steps 2x faster in bf16, a Xeon whose oneDNN was held to ``avx512_bf16`` 1.2-1.7x slower); float32
            elsewhere, where bf16 matmuls are emulated. Or ``"float32"``, ``"bfloat16"``.
        run_precision: the training run's ``trainer.precision``, for ``ns_dtype="auto"`` (None: not known).
        fused: AdamW's fused kernel for the AdamW groups where all their tensors are plain (not DTensor).

    FSDP's sharded (DTensor) matrices are gathered whole for the Newton-Schulz steps, which every rank
    computes, and each keeps its shard of the result.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        ns_steps: int = 5,
        ns_dtype: str = "auto",
        fused: bool = True,
        run_precision: str | None = None,
    ):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum!r} must be in [0, 1)")
        if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
            raise ValueError(f"ns_steps={ns_steps!r} must be a positive int (5 is Muon's)")
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype={ns_dtype!r}; allowed: {', '.join(map(repr, NS_DTYPES))}")
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, betas=tuple(betas), eps=eps,
            algorithm="adamw", layout="matrix",
        )  # fmt: skip
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["algorithm"] not in ("muon", "adamw") or group["layout"] not in LAYOUTS:
                raise ValueError(
                    f"param group algorithm={group['algorithm']!r}, layout={group['layout']!r}; allowed: algorithm "
                    f"'muon' or 'adamw', layout one of {', '.join(LAYOUTS)} (muon_param_groups builds them)"
                )
        self.ns_steps = ns_steps
        self.ns_dtype = ns_dtype
        self.run_precision = run_precision
        self.fused = fused
        self._auto_dtypes: dict[str, torch.dtype] = {}

    def _ns_dtype(self, device: torch.device) -> torch.dtype:
        if self.ns_dtype != "auto":
            return getattr(torch, self.ns_dtype)
        if device.type not in self._auto_dtypes:  # read /proc/cpuinfo once, not at every step
            from moekit.utils.machine import bf16_in_hardware, cpu_bf16_pays

            bf16 = cpu_bf16_pays() if device.type == "cpu" else bf16_in_hardware(device.type)
            if bf16 is None:  # avx512_bf16 alone: the run's precision was measured
                bf16 = str(self.run_precision).startswith("bf16")
            self._auto_dtypes[device.type] = torch.bfloat16 if bf16 else torch.float32
        return self._auto_dtypes[device.type]

    def summary(self) -> str:
        """What trains with which algorithm, and the Newton-Schulz dtype ``auto`` chose, for the run's log."""
        counts = {"muon": [0, 0], "adamw": [0, 0]}
        for group in self.param_groups:
            counts[group["algorithm"]][0] += len(group["params"])
            counts[group["algorithm"]][1] += sum(p.numel() for p in group["params"])
        devices = {p.device for group in self.param_groups if group["algorithm"] == "muon" for p in group["params"]}
        dtypes = ", ".join(f"{str(self._ns_dtype(d)).removeprefix('torch.')} on {d.type}" for d in devices) or "-"
        return (
            f"Muon for {counts['muon'][0]} hidden matrices ({counts['muon'][1]:,} weights), AdamW for "
            f"{counts['adamw'][0]} other tensors ({counts['adamw'][1]:,}); Newton-Schulz steps in {dtypes} "
            f"(ns_dtype={self.ns_dtype})"
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group["algorithm"] == "adamw":
                self._adamw_step(group, params)
            else:
                muon += [(p, group, self._momentum_update(p, group)) for p in params]
        self._muon_step(muon)
        return loss

    def _momentum_update(self, param: Tensor, group: dict) -> Tensor:
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        buf, grad, mu = state["momentum_buffer"], param.grad, group["momentum"]
        buf.lerp_(grad, 1 - mu)
        return grad.lerp(buf, mu) if group["nesterov"] else buf

    def _muon_step(self, items: list[tuple[Tensor, dict, Tensor]]) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        # Every matrix of one shape (and device) in one batched Newton-Schulz run; a tall one goes in transposed.
        buckets = defaultdict(list)
        for param, group, update in items:
            full = update.full_tensor() if isinstance(update, DTensor) else update
            u_BMN = _as_matrices(full, group["layout"])
            tall = u_BMN.size(-2) > u_BMN.size(-1)
            buckets[(tuple(sorted(u_BMN.shape[-2:])), full.device)].append((param, group, u_BMN, tall))
        for (shape, device), members in buckets.items():
            stacked = torch.cat([u.mT if tall else u for _, _, u, tall in members])
            ortho = orthogonalize(stacked, self.ns_steps, dtype=self._ns_dtype(device))
            scale = 0.2 * math.sqrt(max(shape))  # the RMS of AdamW's update (Liu et al. 2025)
            for (param, group, _, tall), o in zip(members, ortho.split([m[2].shape[0] for m in members])):
                o = (o.mT if tall else o).reshape(param.shape).to(param.dtype)
                if isinstance(param, DTensor):
                    o = distribute_tensor(o, param.device_mesh, param.placements, src_data_rank=None)
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(o, alpha=-group["lr"] * scale)

    def _adamw_step(self, group: dict, params: list[Tensor]) -> None:
        from torch.distributed.tensor import DTensor

        fused = self.fused and not any(isinstance(p, DTensor) for p in params)
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        if fused:  # a checkpoint from an unfused run holds its steps on the host
            for p, state in zip(params, states):
                state["step"] = state["step"].to(p.device)
        beta1, beta2 = group["betas"]
        adamw(
            params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
            [], [s["step"] for s in states], fused=fused or None, foreach=None,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=False,
        )  # fmt: skip
