"""No host synchronisation in a training step, checked on the CPU: every operator that reads a tensor's values on
the host (on an accelerator, a wait for the device) is intercepted while each recipe's layer, and each kind of model
with its optimizer step, runs the code paths it takes on an accelerator (the ``grouped_mm`` expert kernel, BASE's
sync-free solver). The GPU tier's ``test_no_host_synchronisation_in_a_layers_training_step`` checks the layers
with CUDA's sync debug mode, where a GPU is at hand."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moekit.models import LSTMMoELM, TransformerLM, create_model
from moekit.moe import BaseMoE, ExpertBank, build_moe_layer, collect_moe_outputs, update_balancing_biases
from moekit.moe.routers import BalancedRouter
from moekit.recipes import list_recipes
from moekit.tasks.optim import clip_grad_norm

# Operators whose result needs the device's data on the host: a scalar read (``item``, ``bool``, ``tolist``),
# outputs whose size depends on values, value comparisons returned as Python bools; and moekit's custom operators
# that read the host inside (the CPU expert loop and the exact balanced assignment).
HOST_READS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::bincount",
    "aten::histc",
    "aten::equal",
    "aten::is_nonzero",
    "moekit::grouped_linear_loop",
    "moekit::grouped_linear_loop_backward",
    "moekit::balanced_assignment",
}


def _sized_by_values(func, args, kwargs) -> bool:
    """Indexing with a boolean mask (its ``True`` count sizes the result) and ``repeat_interleave`` by a tensor of
    counts without ``output_size``."""
    name = func._schema.name
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if name == "aten::repeat_interleave":
        repeats = args[0] if func._overloadname == "Tensor" else args[1]
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    return False


class HostReads(TorchDispatchMode):
    """Records each host-reading operator run inside it (``found``: the operator and where it was called).
    ``Tensor.tolist`` and ``Tensor.numpy`` read a CPU tensor's memory without an operator: they are wrapped."""

    _UNDISPATCHED = ("tolist", "numpy")

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, str]] = []

    def _record(self, name: str) -> None:
        self.found.append((name, "".join(traceback.format_stack(limit=12)[:-2])))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name in HOST_READS or _sized_by_values(func, args, kwargs):
            self._record(func._schema.name)
        return func(*args, **kwargs)

    def __enter__(self):
        def wrap(name, method):
            def read(tensor, *args, **kwargs):
                self._record(f"Tensor.{name}")
                return method(tensor, *args, **kwargs)

            return read

        self._saved = {name: torch.Tensor.__dict__.get(name) for name in self._UNDISPATCHED}
        for name in self._UNDISPATCHED:
            setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)


def _as_on_an_accelerator(layer: torch.nn.Module) -> torch.nn.Module:
    """The choices ``"auto"`` makes off CPUs: the device-side expert kernel and BASE's sync-free solver."""
    for module in layer.modules():
        if isinstance(module, ExpertBank):
            module.kernel = "grouped_mm"
        if isinstance(module, BalancedRouter):
            module.solver = "sync_free"
    return layer


def _layer_and_inputs(name: str):
    torch.manual_seed(0)
    settings = {"vocab_size": 64} if name == "hash" else {"num_tokens": 16} if name == "soft_moe" else {}
    layer = build_moe_layer(name, in_features=32, hidden_features=64, model_settings=settings)
    kwargs = {"token_ids": torch.randint(64, (4, 16))} if name == "hash" else {}
    return _as_on_an_accelerator(layer), torch.randn(4, 16, 32, requires_grad=True), kwargs


def _step(layer, x, kwargs) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x, **kwargs)
        loss = out.float().square().mean() + collect_moe_outputs(layer).aux_loss
    loss.backward()


def _reads(fn) -> list[tuple[str, str]]:
    with HostReads() as mode:
        fn()
    return mode.found


def test_the_detector_sees_each_kind_of_host_read():
    x = torch.randn(8, 4)
    assert not _reads(lambda: (x @ x.t()).softmax(-1).topk(2))
    assert [op for op, _ in _reads(lambda: x.sum().item())] == ["aten::_local_scalar_dense"]
    assert [op for op, _ in _reads(lambda: x[x > 0])] == ["aten::index"]
    assert [op for op, _ in _reads(lambda: x.nonzero())] == ["aten::nonzero"]
    assert [op for op, _ in _reads(lambda: torch.repeat_interleave(torch.tensor([1, 2])))] == [
        "aten::repeat_interleave"
    ]
    assert not _reads(lambda: torch.tensor([1, 2]).repeat_interleave(torch.tensor([1, 2]), output_size=3))
    exact = BaseMoE(32, 64, num_experts=4, solver="exact").train()
    assert "moekit::balanced_assignment" in [op for op, _ in _reads(lambda: exact(torch.randn(2, 8, 32)))]
    assert [op for op, _ in _reads(lambda: x.tolist())] == ["Tensor.tolist"]
    cpu_loop = build_moe_layer("mixtral", in_features=32, hidden_features=64)  # the CPU's kernel reads the counts
    assert "Tensor.tolist" in [op for op, _ in _reads(lambda: cpu_loop(torch.randn(2, 8, 32)))]
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist, "the wrapper is removed on exit"


@pytest.mark.parametrize("name", sorted(set(list_recipes()) - {"none"}))
def test_a_layers_training_step_reads_nothing_on_the_host(name):
    layer, x, kwargs = _layer_and_inputs(name)
    _step(layer.train(), x, kwargs)  # warm-up: lazy initialisation (strictly balanced thresholds) may read once
    found = _reads(lambda: _step(layer, x, kwargs))
    assert not found, f"{name}: {found[0][0]} reads the host, called at\n{found[0][1]}"
    found = _reads(lambda: layer.eval()(x, **kwargs))
    assert not found, f"{name} in evaluation: {found[0][0]} reads the host, called at\n{found[0][1]}"


@pytest.mark.parametrize("name", ["base", "mixtral", "switch", "experts_choice", "soft_moe"])
def test_padding_reads_nothing_on_the_host(name):
    layer, x, kwargs = _layer_and_inputs(name)
    mask = torch.ones(4, 16, dtype=torch.bool)
    mask[1, 5:] = mask[3, 11:] = False
    _step(layer.train(), x, {"padding_mask": mask})
    found = _reads(lambda: _step(layer, x, {"padding_mask": mask}))
    assert not found, f"{name} with padding: {found[0][0]} reads the host, called at\n{found[0][1]}"


LM = dict(vocab_size=50, dim=32, depth=2, num_heads=2, max_seq_len=16)
MODELS = {
    "transformer_lm_deepseek": lambda: TransformerLM(**LM, moe="deepseek"),  # shared experts, loss-free balancing
    "transformer_lm_mode": lambda: TransformerLM(**LM, moe="mixtral", mod={"capacity": 0.5, "blocks": "all"}),
    "lstm_lm": lambda: LSTMMoELM(vocab_size=50, dim=32, expert_hidden=64),
    "soft_moe_vit": lambda: create_model("soft_moe_vit_tiny_patch4_28"),
    "top2_vit": lambda: create_model("soft_moe_vit_tiny_patch4_28", moe="top2"),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_models_training_step_reads_nothing_on_the_host(name):
    """Forward, backward, gradient clipping, the fused AdamW step and the loss-free balancing update, as the
    template's training step runs them."""
    torch.manual_seed(0)
    net = _as_on_an_accelerator(MODELS[name]()).train()
    x = torch.randn(2, 1, 28, 28) if name.endswith("vit") else torch.randint(50, (2, 16))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)

    def step():
        out = net(x)
        (out.float().square().mean() + collect_moe_outputs(net).aux_loss).backward()
        clip_grad_norm(optimizer, 1.0)  # inside the fused step, as MoETask clips
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_balancing_biases(net)

    step()
    found = _reads(step)
    assert not found, f"{name}: {found[0][0]} reads the host, called at\n{found[0][1]}"
