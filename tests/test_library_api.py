"""The layer library used from one's own training code: activation checkpointing, dtypes, meta-device
construction, degenerate inputs."""

import moekit  # noqa: F401, I001 - before torch
import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from moekit.moe import DenseMoE, HierarchicalMoE, TopKMoE, build_moe_layer


# ----------------------------------------------------------------------------- activation checkpointing
@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize(
    "layer",
    [
        lambda: TopKMoE(8, 16, num_experts=4, top_k=2, overpower_margin=0.0),
        lambda: DenseMoE(8, 16, num_experts=4, overpower_margin=0.0),
        lambda: TopKMoE(8, 16, num_experts=4, top_k=2, bias_update_rate=0.01),
        lambda: TopKMoE(8, 16, num_experts=4, switch_loss_weight=0.01, switch_loss_scope="global_batch"),
    ],
    ids=["topk_overpower", "dense_overpower", "loss_free_bias", "global_batch_switch"],
)
def test_a_checkpointed_forward_gives_the_plain_gradients_and_counts_once(layer, use_reentrant):
    """The recomputation in backward routes as the original forward (Eigen et al.'s margin 0 drops the expert that
    the original forward's mass put ahead) and adds nothing to the counts and totals kept outside autograd."""
    plain = layer()
    checkpointed = copy.deepcopy(plain)
    x = torch.randn(2, 6, 8)
    for _ in range(2):
        plain(x).square().sum().backward()
        checkpoint(checkpointed, x.clone().requires_grad_(), use_reentrant=use_reentrant).square().sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    for (name, a), (_, b) in zip(plain.named_buffers(), checkpointed.named_buffers()):
        torch.testing.assert_close(b, a, msg=name)


# ----------------------------------------------------------------------------- dtypes
def test_hierarchical_moe_runs_in_float64_with_its_losses():
    layer = HierarchicalMoE(8, 16, num_experts=8, noisy_gating=True, importance_loss_weight=0.1, load_loss_weight=0.1)
    layer = layer.to(torch.float64)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    out = layer(x)
    assert out.dtype == torch.float64 and set(layer.aux_losses) == {"importance", "load"}
    assert all(loss.dtype == torch.float64 and loss.isfinite() for loss in layer.aux_losses.values())
    reference = copy.deepcopy(layer).float().eval()  # noise-free: the same routing in both precisions
    torch.testing.assert_close(layer.eval()(x).float(), reference(x.float()))


# ----------------------------------------------------------------------------- degenerate inputs
RECIPES = ["soft_moe", "switch", "top2", "vmoe", "mixtral", "deepseek", "noisy_top_k", "hierarchical"]
RECIPES += ["experts_choice", "base", "strictly_balanced", "dense_moe", "hash", "lory"]


def small_layer(name: str):
    return build_moe_layer(
        {"recipe": name, "num_experts": 4} if name not in ("hierarchical", "deepseek") else name,
        in_features=8,
        hidden_features=16,
        model_settings={"num_tokens": 6, "vocab_size": 50},
    )


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("shape", [(0, 6, 8), (2, 0, 8)], ids=["no_sequences", "no_tokens"])
def test_an_empty_input_is_refused_with_its_shape(name, shape):
    with pytest.raises(ValueError, match=rf"input of shape \({shape[0]}, {shape[1]}, 8\).*at least 1"):
        small_layer(name)(torch.randn(shape))


# ----------------------------------------------------------------------------- meta-device construction
def own_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


@pytest.mark.parametrize("name", RECIPES)
def test_a_layer_built_on_meta_and_reset_equals_one_built_on_the_cpu(name):
    """The FSDP / Lightning ``empty_init`` pattern: build on the meta device, ``to_empty``, then every module that owns
    tensors redoes its construction's initialisation in ``reset_parameters``: the same draws give the same layer,
    and nothing is left as the uninitialised memory ``to_empty`` hands out (here filled with 7s)."""
    torch.manual_seed(3)
    expected = small_layer(name)
    with torch.device("meta"):
        layer = small_layer(name)
    layer.to_empty(device="cpu")
    for tensor in (*layer.parameters(), *layer.buffers()):
        tensor.data.fill_(7)
    torch.manual_seed(3)
    for module in layer.modules():
        if own_tensors(module):
            assert hasattr(module, "reset_parameters"), f"{type(module).__name__} cannot be materialised"
            module.reset_parameters()
    for (key, value), (_, reference) in zip(layer.state_dict(keep_vars=True).items(), expected.state_dict().items()):
        torch.testing.assert_close(value.detach(), reference, msg=key)
    torch.testing.assert_close(dict(layer.named_buffers()), dict(expected.named_buffers()))  # non-persistent too
    x, kwargs = torch.randn(2, 6, 8), ({"token_ids": torch.randint(50, (2, 6))} if name == "hash" else {})
    torch.testing.assert_close(layer.eval()(x, **kwargs), expected.eval()(x, **kwargs))


def test_a_depth_router_built_on_meta_and_reset_equals_one_built_on_the_cpu():
    from moekit.moe import DepthRouter
    from moekit.recipes.depth import resolve_depth

    spec = resolve_depth({"capacity": 0.5, "causal_router": "predictor"})
    torch.manual_seed(3)
    expected = DepthRouter(8, spec, causal=True)
    layer = DepthRouter(8, spec, causal=True, device="meta").to_empty(device="cpu")
    torch.manual_seed(3)
    for module in layer.modules():
        if own_tensors(module):
            module.reset_parameters()
    torch.testing.assert_close(layer.state_dict(), expected.state_dict())
