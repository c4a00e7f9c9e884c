"""The MoE recipes: one file each, selectable as moe=<name> with every experiment family, refused where they
cannot serve a model, and built as their comment line says (layer, experts, k, capacity, losses, compute)."""

from __future__ import annotations

import io
import math
import re

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

import moekit.models  # noqa: F401  (registers the models with timm)
from conftest import CONFIGS, compose_config
from moekit.models import lm_summary, model_summary
from moekit.moe import ExpertsChoiceMoE, HierarchicalMoE, MoELayer, SoftMoE, TokensChoiceMoE, get_moe_layer, moe_layers
from moekit.moe.capacity import experts_choice_capacity, soft_moe_slots
from moekit.recipes import (
    _FOLDER,
    check_expert_parallel,
    check_fits,
    list_recipes,
    load_recipe,
    mixes_tokens,
    recipe_citation,
    resolve_recipe,
)

RECIPES = list_recipes()
LOSSES = ("switch", "importance", "load", "z")

# Each family: its base experiment, sized down (debug=tiny) but with the recipe's own expert count; the ViT
# reads 56 px images so that its tokens are the 196 of the Soft MoE paper's S/16 (the conv stem downsamples 4x),
# the LSTM's experts are wide enough to be cut into DeepSeek's ninths.
FAMILIES = {
    "vit": ["experiment=base/vit", "model.img_size=56"],
    "transformer_lm": ["experiment=base/transformer_lm", "data.seq_len=64"],
    "lstm_lm": ["experiment=base/lstm_lm", "data.seq_len=64", "model.expert_hidden=288"],  # fine-grained: 288 / 9
}
# What each family cannot serve: hash routing needs token ids; a causal LM refuses token-mixing routing.
# Lory routes by position: only the Transformer LM passes positions and a decoding state.
REFUSED = {
    "vit": {"hash": "has no token ids", "lory": "needs the tokens' positions"},
    "transformer_lm": {
        name: "would see the future"
        for name in ("soft_moe", "experts_choice", "base", "switch", "top2", "vmoe", "strictly_balanced")
    },
}
REFUSED["lstm_lm"] = {**REFUSED["transformer_lm"], "lory": "needs the tokens' positions"}


def stated_compute(name: str) -> float:
    """The expert compute per token the recipe's comment line states, in dense MLPs ("expert compute 2x")."""
    line = recipe_citation(name)
    match = re.search(r"expert compute ([0-9.]+)x the dense MLP's", line)
    assert match, f"{name}.yaml: the first comment line states the expert compute: {line}"
    return float(match.group(1))


def test_the_recipes_of_the_issue_exist_with_one_file_each():
    assert set(RECIPES) >= {
        "soft_moe",
        "switch",
        "top2",
        "vmoe",
        "mixtral",
        "deepseek",
        "noisy_top_k",
        "experts_choice",
        "base",
        "hash",
        "hierarchical",
        "dense_moe",
    }
    for name in RECIPES:
        text = (_FOLDER / f"{name}.yaml").read_text()
        first = text.splitlines()[0]
        assert first.startswith("# ") and re.search(r"(19|20)\d\d", first), f"{name}: the paper cited first: {first}"
        recipe = load_recipe(name)
        assert recipe["name"] == name and get_moe_layer(recipe["layer"]) is not None
        assert set(recipe) - {"name", "layer", "granularity"} <= set(get_moe_layer(recipe["layer"]).settings())
    assert not (CONFIGS / "moe" / "switch.yaml").exists(), "no second copy in configs/"


def test_resolve_recipe_forms():
    assert resolve_recipe(None) is None and resolve_recipe("none") is None
    assert resolve_recipe("switch") == load_recipe("switch")
    assert resolve_recipe({"recipe": "switch", "num_experts": 8}) == {**load_recipe("switch"), "num_experts": 8}
    assert resolve_recipe("switch", top_k=2)["top_k"] == 2
    with pytest.raises(ValueError, match="unknown MoE recipe 'swich'; recipes: base, deepseek"):
        resolve_recipe("swich")
    with pytest.raises(ValueError, match="names no layer"):
        resolve_recipe({"num_experts": 8})


@pytest.mark.parametrize("name", RECIPES)
def test_token_mixing_follows_the_built_layer(name):
    """The torch-free rule the configs are checked with agrees with the layers' own causality, for every recipe
    as it is and with its capacity or balance per position."""
    recipe = load_recipe(name)
    settings_of_layer = get_moe_layer(recipe["layer"]).settings()
    variants = [{**recipe, key: "position"} for key in ("capacity_scope", "balance_scope") if key in settings_of_layer]
    for spec in (recipe, *variants):
        settings = {k: v for k, v in spec.items() if k not in ("name", "layer", "granularity")}
        extra = (
            {"vocab_size": 10} if spec["layer"] == "hash" else {"num_tokens": 16} if spec["layer"] == "soft_moe" else {}
        )
        layer = get_moe_layer(spec["layer"])(8, 16, **settings, **extra)
        assert mixes_tokens(spec) == (not layer.causal_safe), spec


@pytest.mark.parametrize("name", RECIPES)
def test_the_expert_parallel_rule_follows_the_layer(name):
    """The torch-free refusal of expert parallelism agrees with the layer's own ``merges_experts``."""
    recipe = load_recipe(name)
    check_expert_parallel(recipe, 1)  # data parallel serves every recipe
    if get_moe_layer(recipe["layer"]).merges_experts:
        with pytest.raises(ValueError, match="expert_parallel_size=2 cannot split them"):
            check_expert_parallel(recipe, 2)
    else:
        check_expert_parallel(recipe, 2)


@pytest.mark.parametrize("name", RECIPES)
def test_a_layer_pickles_after_a_training_step_without_that_steps_record(name):
    """``torch.save(layer)`` after a training forward (whose statistics are closures over its tensors): the loaded
    layer computes what the layer computes and starts without a record; the layer keeps its own."""
    torch.manual_seed(0)
    recipe = load_recipe(name)
    settings = {k: v for k, v in recipe.items() if k not in ("name", "layer", "granularity")}
    extra = (
        {"vocab_size": 10} if recipe["layer"] == "hash" else {"num_tokens": 16} if recipe["layer"] == "soft_moe" else {}
    )
    layer = get_moe_layer(recipe["layer"])(8, 16, **settings, **extra)
    x = torch.randn(2, 16, 8)
    kwargs = {"token_ids": torch.randint(10, (2, 16))} if recipe["layer"] == "hash" else {}
    layer(x, **kwargs).square().sum().backward()
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.forward_tokens == 0 and loaded.stats == {} and loaded.aux_losses == {}
    assert layer.forward_tokens == 32 and layer.stats
    torch.testing.assert_close(loaded.eval()(x, **kwargs), layer.eval()(x, **kwargs))


def _dense_mlp(width: int, hidden: int, gated: bool) -> tuple[int, int]:
    """Parameters and forward FLOPs per token of a dense MLP (fc1 + fc2, with biases when not gated)."""
    matrices = (3 if gated else 2) * width * hidden
    return matrices + (0 if gated else hidden + width), 2 * matrices


def _routing_flops(layer: MoELayer, tokens: int) -> float:
    """Per token, the FLOPs of a layer besides its experts: router logits, Soft MoE's dispatch and combine, the
    gate-weighted sum of the expert outputs (what the FLOP counter sees in eval mode)."""
    d, e = layer.in_features, layer.num_experts
    if layer.registry_name == "lory":  # per segment: merging the E experts' weights, and router logits but the first
        segments = math.ceil(tokens / layer.segment_len)
        merge = 2 * e * (layer.experts.fc1_weight[0].numel() + layer.experts.fc2_weight[0].numel())
        return (segments * merge + (segments - 1) * 2 * d * e) / tokens
    if isinstance(layer, SoftMoE):
        return 3 * 2 * d * layer.num_slots  # logits, dispatch, combine
    if isinstance(layer, ExpertsChoiceMoE):
        return 2 * d * e + 2 * d * layer.expert_rows_per_token(tokens)
    router = 0 if layer.registry_name == "hash" else 2 * d * e
    if isinstance(layer, HierarchicalMoE):
        router += 2 * d * layer.router.num_groups
    if layer.registry_name == "dense_moe":
        return router + 2 * d * e
    return router + 2 * d * layer.top_k


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_with_every_family(name, family, tmp_path):
    overrides = [*FAMILIES[family], f"moe={name}", "debug=tiny"]
    refused = REFUSED.get(family, {}).get(name)
    if refused:
        with pytest.raises(ValueError, match=refused):
            compose_config("train", overrides, tmp_path)
        return
    cfg = compose_config("train", overrides, tmp_path)
    spec = resolve_recipe(dict(cfg.moe))
    assert spec == load_recipe(name), "moe= selects the recipe file as it is"
    torch.manual_seed(0)
    net = instantiate(cfg.model).eval()
    layers = [m for m in net.modules() if isinstance(m, MoELayer)]
    assert layers and all(type(m) is get_moe_layer(spec["layer"]) for m in layers)

    # the built layers carry the recipe's settings
    for layer in layers:
        assert layer.num_experts == spec["num_experts"]
        if isinstance(layer, TokensChoiceMoE):
            top_k = spec.get("top_k", 1) * spec.get("top_k_groups", 1) if spec["layer"] != "hash" else 1
            assert layer.top_k == (1 if spec["layer"] == "base" else top_k)
            assert (layer.capacity_factor, layer.eval_capacity_factor) == (
                spec.get("capacity_factor"),
                spec.get("eval_capacity_factor", spec.get("capacity_factor")),
            )
            assert layer.capacity.batch_priority == spec.get("batch_priority", False)
            weights = {loss: getattr(layer.router, "config", None) for loss in LOSSES}
            for loss, config in weights.items():
                assert getattr(config, f"{loss}_loss_weight", 0.0) == spec.get(f"{loss}_loss_weight", 0.0), loss

    # the active parameters and the FLOPs per token are the recipe's stated expert compute
    ratio = stated_compute(name)
    if family == "vit":
        summary = model_summary(net, (1, 56, 56))
        width, hidden, gated, tokens = net.embed_dim, int(net.embed_dim * 4), False, 196
    else:
        summary = lm_summary(net, seq_len=64)
        tokens, width, gated = 64, net.dim, family == "transformer_lm"
        hidden = int(net.dim * 4) if gated else cfg.model.expert_hidden
    dense_params, dense_flops = _dense_mlp(width, hidden, gated)
    if isinstance(layers[0], SoftMoE):
        assert layers[0].num_slots == spec["num_experts"] * soft_moe_slots(tokens, spec["num_experts"], 0.653)
    if isinstance(layers[0], ExpertsChoiceMoE):
        assert layers[0].tokens_per_expert(2 * tokens) == experts_choice_capacity(2 * tokens, spec["num_experts"], 2.0)
    for layer_summary, layer in zip(summary.moe_layers, layers, strict=True):
        active = layer_summary.active_params_per_token
        assert active == pytest.approx(ratio * dense_params, rel=0.10), (name, family, active, dense_params)
        expert_flops = layer_summary.flops_per_image / layer_summary.tokens - _routing_flops(layer, tokens)
        dropless = not isinstance(layer, TokensChoiceMoE) or layer.eval_capacity_factor is None
        assert expert_flops <= ratio * dense_flops * 1.10, (name, family)
        if dropless:  # a capacity limit can only lower the work
            assert expert_flops >= ratio * dense_flops * 0.90, (name, family)


def test_deepseek_routed_and_shared_experts_match_the_dense_mlp_flops(tmp_path):
    """DeepSeek-V3's 8 routed + 1 shared experts of 1/9 the MLP: within 10% of the dense MLP, measured."""
    dense = compose_config("train", [*FAMILIES["transformer_lm"], "moe=none", "debug=tiny"], tmp_path)
    moe = compose_config("train", [*FAMILIES["transformer_lm"], "moe=deepseek", "debug=tiny"], tmp_path)
    dense_summary, moe_summary = (lm_summary(instantiate(c.model), seq_len=64) for c in (dense, moe))
    net = instantiate(moe.model)
    layer = net.blocks[0].mlp
    assert layer.experts.hidden_features == round(128 / 9) and layer.shared_experts.hidden_features == round(128 / 9)
    routing = 2 * 32 * 64 + 2 * 32 * 8  # router logits over 64 experts, the weighted sum of 8 outputs
    extra = moe_summary.flops_per_token - dense_summary.flops_per_token - len(net.blocks) * routing
    _, mlp_flops = _dense_mlp(32, 128, gated=True)
    assert abs(extra) <= 0.10 * len(net.blocks) * mlp_flops


@pytest.mark.parametrize(
    "experiment", ["soft_moe_vit", "tokens_choice_vit", "experts_choice_vit", "moe_transformer_lm"]
)
def test_moe_none_gives_the_dense_twin_of_an_experiment_that_sizes_its_recipe(experiment, tmp_path):
    """`moe=none` over an experiment that sets its recipe's settings (moe.num_experts=16) is the dense model:
    the settings have nothing to apply to, and every other key of the run is the experiment's."""
    moe = compose_config("train", [f"experiment={experiment}", "debug=tiny"], tmp_path)
    dense = compose_config("train", [f"experiment={experiment}", "debug=tiny", "moe=none"], tmp_path)
    assert list(moe_layers(instantiate(moe.model))) and not list(moe_layers(instantiate(dense.model)))
    for key in ("data", "task", "trainer", "task_name"):
        assert OmegaConf.select(dense, key) == OmegaConf.select(moe, key), key


def test_check_fits_names_the_reason_and_the_fix():
    with pytest.raises(ValueError, match=r"hash routing serves the language models"):
        check_fits(load_recipe("hash"), model="a ViT", causal=False, token_ids=False)
    with pytest.raises(ValueError, match=r"set moe.capacity_scope=position .* or make it dropless"):
        check_fits(load_recipe("switch"), model="the LM", causal=True, token_ids=True)
    check_fits({**load_recipe("switch"), "capacity_scope": "position"}, model="the LM", causal=True, token_ids=True)


def test_gating_options_are_overrides_of_any_recipe(tmp_path):
    options = ["+moe.jitter_eps=0.01", "+moe.overpower_margin=2.0", "+moe.bengio_variance_loss_weight=0.01"]
    cfg = compose_config("train", [*FAMILIES["transformer_lm"], "moe=deepseek", "debug=tiny", *options], tmp_path)
    net = instantiate(cfg.model)
    routers = [layer.router for _, layer in moe_layers(net)]
    assert routers
    for router in routers:
        assert (router.config.jitter_eps, router.overpowering.margin) == (0.01, 2.0)
        assert router.config.bengio_variance_loss_weight == 0.01
