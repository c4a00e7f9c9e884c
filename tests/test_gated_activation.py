"""The experts' gated activation: ``act(gate) * up`` in values and gradients, the gradient in ``fc1``'s layout."""

import pytest
import torch
from timm.layers.activations import GELU, GELUTanh
from torch import nn

from moekit.moe.gated_activation import expert_activation

ROWS, HIDDEN = 37, 24
ACTIVATIONS = [nn.SiLU(), nn.GELU(), nn.GELU(approximate="tanh"), GELU(), GELUTanh(), nn.ReLU()]


def _h(layout: str, base: torch.Tensor) -> torch.Tensor:
    """fc1's output ``[rows, 2 * hidden]`` as the experts hand it to the activation."""
    if layout == "columns":
        return base
    if layout == "planes":  # the CPU loop's contiguous planes
        return base.view(ROWS, 2, HIDDEN).transpose(0, 1).contiguous()
    return base.unflatten(-1, (2, -1)).transpose(0, 1)  # "plane-views": grouped_linear's planes of one product


@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: f"{type(a).__name__}-{getattr(a, 'approximate', '')}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["columns", "planes", "plane-views"])
def test_gated_activation_is_act_of_gate_times_up_bit_for_bit(act, dtype, layout):
    base = torch.randn(ROWS, 2 * HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype)
    grad = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    planes = layout != "columns"
    a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
    got = expert_activation(_h(layout, a), act, gated=True, planes=planes)
    gate, up = _h(layout, b).unbind(0) if planes else b.chunk(2, dim=-1)
    want = act(gate) * up
    assert torch.equal(got, want)
    got.backward(grad)
    want.backward(grad)
    assert torch.equal(a.grad, b.grad)
    with torch.no_grad():
        assert torch.equal(expert_activation(_h(layout, base), act, gated=True, planes=planes), want)


@pytest.mark.parametrize("layout", ["columns", "planes", "plane-views"])
def test_the_gradient_comes_back_in_the_layout_of_fc1s_output(layout):
    """Laid out as ``h``, the gradient reaches fc1 without a copy: a transposed view's gradient is the transpose of
    a contiguous ``[rows, 2 * hidden]``, where stacking the gate's and the up's gradients gives contiguous planes."""
    h = _h(layout, torch.randn(ROWS, 2 * HIDDEN, requires_grad=True))
    strides = []
    h.register_hook(lambda g: strides.append(g.stride()))
    expert_activation(h, nn.SiLU(), gated=True, planes=layout != "columns").sum().backward()
    assert strides == [h.stride()]


def test_ungated_experts_take_the_activation_alone():
    h = torch.randn(ROWS, HIDDEN)
    assert torch.equal(expert_activation(h, nn.GELU(), gated=False), nn.functional.gelu(h))
