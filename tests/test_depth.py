"""Mixture-of-Depths (Raposo et al. 2024): the routed block against a loop over sequences, the causal
router's loss and stop-gradient, its agreement with top-C after training, causality and cached decoding at
sampling time, the FLOPs and active parameters the summary counts, and bad settings."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf
from test_lm_models import assert_causal, decode_in_pieces
from timm.models.vision_transformer import Block

from conftest import REPO, compose_config
from moekit.analysis.records import model_family
from moekit.commands.train import train
from moekit.models import TransformerLM, create_model, lm_summary, model_summary
from moekit.models.flops import flop_counter
from moekit.models.rotary import RotaryEmbedding
from moekit.moe import DepthRouter, MixtureOfDepths, collect_moe_outputs, top_c_routing
from moekit.moe.capacity import soft_moe_slots
from moekit.moe.depth import capacity_tokens
from moekit.recipes.depth import DepthSpec, resolve_depth

VOCAB = 50
TINY = dict(vocab_size=VOCAB, max_seq_len=32, dim=32, depth=4, num_heads=2, mlp_ratio=2.0, dropout=0.0)


def randomize(router: DepthRouter, std: float = 1.0) -> DepthRouter:
    """Large router and predictor weights, zero biases (about half the tokens pass the per-token decision);
    far from ties."""
    with torch.no_grad():
        for name, p in router.named_parameters():
            p.zero_() if name.endswith("bias") else p.normal_(0.0, std)
    return router


def mod_lm(mod: dict, **overrides) -> TransformerLM:
    model = TransformerLM(**{**TINY, "moe": None, "mod": mod, **overrides})
    for block in model.blocks:
        if block.depth_router is not None:
            randomize(block.depth_router)
    return model


def reference_block_update(block, x_BSD, chosen_BS, gates_BS, run_block):
    """The paper's equation, one sequence at a time: the chosen tokens (in order) go through the block
    alone; each adds gate * (block output - input) to its place; the others pass unchanged."""
    out = x_BSD.clone()
    for b in range(x_BSD.shape[0]):
        idx = chosen_BS[b].nonzero().squeeze(-1)
        sub = x_BSD[b, idx].unsqueeze(0)
        update = run_block(sub, idx) - sub
        out[b, idx] += gates_BS[b, idx].unsqueeze(-1) * update[0]
    return out


def top_c_mask(logits_BS, capacity):
    top = logits_BS.topk(capacity_tokens(capacity, logits_BS.shape[1]), dim=1).indices
    return torch.zeros_like(logits_BS, dtype=torch.bool).scatter_(1, top, True)


# ------------------------------------------------------------------------------------------------
# The routed block
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gate", ["logit", "sigmoid"])
def test_lm_block_routes_the_top_c_tokens_as_the_paper_loop(gate):
    torch.manual_seed(0)
    model = mod_lm(dict(capacity=0.25, blocks=[1], gate=gate), pos_embedding="learned").train()
    block = model.blocks[1]
    plain = copy.deepcopy(block)
    plain.depth_router = None
    x = torch.randn(3, 16, 32)
    token_ids = torch.randint(VOCAB, (3, 16))
    logits = x @ block.depth_router.weight[0] + block.depth_router.bias
    chosen = top_c_mask(logits, 0.25)
    gates = logits.sigmoid() if gate == "sigmoid" else logits
    expected = reference_block_update(block, x, chosen, gates, lambda sub, idx: plain(sub, token_ids[:1, idx]))
    out = block(x, token_ids)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert chosen.sum(1).tolist() == [4, 4, 4], "C = ceil(0.25 * 16) per sequence"
    assert torch.equal(out[~chosen], x[~chosen]), "the tokens not chosen pass exactly unchanged"


def test_rope_rotates_gathered_tokens_at_their_own_positions():
    rope = RotaryEmbedding(8, 20)
    x = torch.randn(2, 3, 20, 8)
    positions = torch.tensor([[0, 4, 9, 19], [2, 3, 5, 7]])
    gathered = torch.stack([x[b, :, positions[b]] for b in range(2)])  # [2, heads, 4, 8]
    expected = torch.stack([rope(x, 0)[b, :, positions[b]] for b in range(2)])
    torch.testing.assert_close(rope(gathered, 0, positions), expected)


def test_the_router_learns_through_the_gate():
    torch.manual_seed(0)
    model = mod_lm(dict(capacity=0.25, aux_loss_weight=0.01)).train()
    logits = model(torch.randint(VOCAB, (2, 16)))
    F.cross_entropy(logits.reshape(-1, VOCAB), torch.randint(VOCAB, (32,))).backward()
    for block in model.blocks:
        if block.depth_router is not None:
            assert block.depth_router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("prefix", [0, 1])
def test_vit_wrapper_routes_the_top_c_patches_and_always_the_prefix(prefix):
    torch.manual_seed(0)
    block = Block(16, 2).eval()
    router = randomize(DepthRouter(16, DepthSpec(capacity=0.3, gate="sigmoid"), causal=False))
    wrapped = MixtureOfDepths(copy.deepcopy(block), router, prefix_tokens=prefix).eval()
    x = torch.randn(2, 10 + prefix, 16)
    patches = x[:, prefix:]
    logits = patches @ router.weight[0] + router.bias
    chosen = top_c_mask(logits, 0.3)
    assert chosen.sum(1).tolist() == [3, 3]

    out = wrapped(x)
    for b in range(2):  # the paper loop; the prefix rides along with the chosen patches through the block
        idx = chosen[b].nonzero().squeeze(-1)
        sub = torch.cat([x[b, :prefix], patches[b, idx]]).unsqueeze(0)
        through = block(sub)[0]
        expected = patches[b].clone()
        expected[idx] += logits[b, idx].sigmoid().unsqueeze(-1) * (through[prefix:] - sub[0, prefix:])
        torch.testing.assert_close(out[b, prefix:], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[b, :prefix], through[:prefix], atol=1e-5, rtol=1e-5)


def test_vit_with_mod_and_moe_in_the_same_block_runs_soft_moe_on_the_chosen_tokens():
    model = create_model(
        "vit_tiny_patch4_28",
        num_classes=10,
        in_chans=1,
        img_size=28,
        moe=dict(recipe="soft_moe", num_experts=8),
        mod=dict(capacity=0.25),
    )
    assert model.mod_block_indices == (1, 3, 5) and model.moe_block_indices == (3, 4, 5)
    routed, full = model.blocks[3].block.mlp, model.blocks[4].mlp
    assert routed.slots_per_expert == soft_moe_slots(13, 8, 0.653), "Soft MoE's slots sized for the 13 chosen tokens"
    assert full.slots_per_expert == soft_moe_slots(49, 8, 0.653) > routed.slots_per_expert
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    stats = collect_moe_outputs(model).stats
    assert stats["blocks.1.depth_router"]["processed_fraction"].item() == pytest.approx(13 / 49)


# ------------------------------------------------------------------------------------------------
# The causal router
# ------------------------------------------------------------------------------------------------
def test_aux_loss_is_the_bce_of_the_router_logits_against_the_top_c_choice():
    torch.manual_seed(0)
    router = randomize(DepthRouter(8, DepthSpec(capacity=0.25, aux_loss_weight=0.3), causal=True)).train()
    x = torch.randn(4, 12, 8)
    router.route(x)
    logits = x @ router.weight[0] + router.bias
    expected = 0.3 * F.binary_cross_entropy_with_logits(logits, top_c_mask(logits, 0.25).float())
    torch.testing.assert_close(router.aux_losses["mod_bce"], expected)


def test_the_predictor_learns_from_its_loss_alone():
    torch.manual_seed(0)
    router = DepthRouter(8, DepthSpec(causal_router="predictor"), causal=True).train()
    x = torch.randn(4, 16, 8, requires_grad=True)
    router.route(x)
    router.aux_losses["mod_bce"].backward()
    assert router.weight.grad is None and router.bias.grad is None and x.grad is None, "stopped at the predictor"
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in router.predictor.parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_the_predictor_decides_in_a_model_cast_to_bf16_or_float64(dtype):
    """``model.to(dtype)`` (``bf16-true``, ``64-true``): the predictor computes as the router does, in float32
    for bf16 weights and in float64 for float64 ones, and learns from its loss."""
    torch.manual_seed(0)
    router = randomize(DepthRouter(8, DepthSpec(capacity=0.25, causal_router="predictor"), causal=True)).to(dtype)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    x = torch.randn(3, 16, 8).to(dtype)
    router.train().route(x)
    router.aux_losses["mod_bce"].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in router.predictor.parameters())
    expected = copy.deepcopy(router.predictor).to(compute)(x.to(compute)).squeeze(-1)
    processed, _ = router.eval().decide(x)
    assert torch.equal(processed, expected > 0) and 0 < processed.float().mean() < 1
    model = mod_lm(dict(capacity=0.25, blocks="all", causal_router="predictor"), pos_embedding="learned").to(dtype)
    model.train()(torch.randint(VOCAB, (2, 16))).float().sum().backward()


@pytest.mark.parametrize("causal_router", ["aux_loss", "predictor"])
def test_the_causal_decision_agrees_with_top_c_after_training(causal_router):
    """Tokens from a fixed distribution, the router trained by its cross-entropy alone (its top-C choice
    fixed for the predictor, moving with it for the logits): the per-token decision then matches the top-C
    choice of held-out sequences on most tokens (measured: 0.96-0.97; the paper reports ~97%)."""
    torch.manual_seed(0)
    spec = DepthSpec(capacity=0.125, causal_router=causal_router, aux_loss_weight=1.0)
    router = DepthRouter(16, spec, causal=True)
    optimizer = torch.optim.Adam(router.parameters(), lr=1e-2)
    before = None
    for step in range(400):
        router.train()
        router.route(torch.randn(16, 64, 16))
        if step == 0:
            before = router.stats["topc_agreement"].item()
        optimizer.zero_grad()
        router.aux_losses["mod_bce"].backward()
        optimizer.step()
    router.eval()
    x = torch.randn(64, 64, 16)
    processed, gates = router.decide(x)
    with torch.no_grad():  # each sequence's top C = 8 of its router logits, recomputed
        logits = (x @ router.weight.t()).squeeze(-1) + router.bias
    top_c = torch.zeros_like(processed).scatter_(1, logits.topk(8, dim=1).indices, True)
    agreement = (processed == top_c).float().mean().item()
    assert agreement == pytest.approx(router.stats["topc_agreement"].item(), abs=1e-6)
    assert agreement > 0.93 and agreement > before + 0.05, (before, agreement)
    assert processed.float().mean().item() == pytest.approx(0.125, abs=0.03), "about C tokens processed"
    assert torch.equal(gates == 0, ~processed)


# ------------------------------------------------------------------------------------------------
# Sampling: causal, and cached decoding equals the full forward
# ------------------------------------------------------------------------------------------------
MOD_SETTINGS = {
    "aux_loss": dict(capacity=0.25, blocks="every_2"),
    "predictor": dict(capacity=0.25, blocks="all", causal_router="predictor", gate="sigmoid"),
}


@pytest.mark.parametrize("moe", [None, dict(recipe="mixtral", num_experts=4)], ids=["mod", "mode"])
@pytest.mark.parametrize("router", sorted(MOD_SETTINGS))
def test_mod_lm_is_causal_at_sampling_time(router, moe):
    model = mod_lm(MOD_SETTINGS[router], moe=moe).eval()
    assert_causal(model)
    fractions = [
        s["processed_fraction"].item() for name, s in collect_moe_outputs(model).stats.items() if "depth" in name
    ]
    assert fractions and all(0 < f < 1 for f in fractions), "some tokens skip the routed blocks, some do not"


def test_top_c_training_looks_ahead_which_is_why_sampling_decides_per_token():
    torch.manual_seed(0)
    model = mod_lm(dict(capacity=0.25, blocks="all")).train()
    ids = torch.randint(VOCAB, (4, 16))
    changed = ids.clone()
    changed[:, 8:] = (ids[:, 8:] + 1) % VOCAB
    assert (model(ids)[:, :8] - model(changed)[:, :8]).abs().max() > 1e-4
    with top_c_routing(model.eval()):
        assert all(b.depth_router.routes_top_c for b in model.blocks)
    assert not any(b.depth_router.routes_top_c for b in model.blocks), "the flag is restored"


@pytest.mark.parametrize("pos_embedding", ["rope", "learned"])
@pytest.mark.parametrize("router", sorted(MOD_SETTINGS))
@torch.no_grad()
def test_kv_cache_decoding_of_a_mod_lm_equals_the_full_forward(router, pos_embedding):
    torch.manual_seed(0)
    model = mod_lm(MOD_SETTINGS[router], moe=dict(recipe="mixtral", num_experts=4), pos_embedding=pos_embedding)
    model.eval()
    input_ids = torch.randint(VOCAB, (4, 20))
    full = model(input_ids)
    cache = model.init_cache(4)
    assert [p is not None for p in cache.processed] == [i in model.mod_block_indices for i in range(4)]
    torch.testing.assert_close(decode_in_pieces(model, input_ids, prefill=5, chunk=4), full, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# Compute
# ------------------------------------------------------------------------------------------------
def test_lm_summary_counts_the_tokens_a_routed_block_processes():
    """FLOPs: a routed block's matmuls scale with C / S and its attention with (C / S)^2; the router adds
    2 * dim per token. Active parameters: a routed block's count with the share of tokens it processes."""
    dim, hidden, seq = 32, 64, 32
    dense = lm_summary(TransformerLM(**{**TINY, "moe": None}), seq)
    mod = lm_summary(mod_lm(dict(capacity=0.25, blocks=[1, 3])), seq)
    chosen = capacity_tokens(0.25, seq)
    matmuls = 2 * (4 * dim * dim + 2 * dim * hidden)  # qkv + proj, fc1 + fc2 per token (GELU MLP)
    attention = 4 * seq * seq * dim  # QK^T and AV per sequence

    def saved(tokens):
        return (seq - tokens) * matmuls + attention - 4 * tokens * tokens * dim - 2 * dim * seq

    assert dense.flops_per_token - mod.flops_per_token == pytest.approx(2 * saved(chosen) / seq)
    block = sum(p.numel() for p in TransformerLM(**{**TINY, "moe": None}).blocks[1].parameters())
    assert [b.processed_fraction for b in mod.mod_blocks] == [0.25, 0.25]
    assert mod.active_params_per_token == pytest.approx(dense.total_params + 2 * (dim + 1) - 2 * 0.75 * block)
    assert "MoD block" in str(mod)


def test_model_summary_of_a_mod_vit_counts_fewer_flops():
    dense_net = create_model("vit_tiny_patch4_28", num_classes=10, in_chans=1, img_size=28).eval()
    dense = model_summary(dense_net, (1, 28, 28))
    model = create_model("vit_tiny_patch4_28", num_classes=10, in_chans=1, img_size=28, mod=dict(capacity=0.125))
    routed = model_summary(model, (1, 28, 28))
    assert [b.tokens for b in routed.mod_blocks] == [49, 49, 49]
    assert all(b.processed_fraction == 7 / 49 for b in routed.mod_blocks), "ceil(0.125 * 49) = 7 tokens"

    def block_flops(tokens: int) -> int:
        with flop_counter() as counter, torch.no_grad():
            dense_net.blocks[0](torch.randn(1, tokens, dense_net.embed_dim))
        return counter.get_total_flops()

    # 3 of 6 blocks on 7 of 49 tokens, each with its router's one score per token (2 * width multiply-adds)
    router = 2 * 49 * dense_net.embed_dim
    expected = dense.flops_per_image - 3 * (block_flops(49) - block_flops(7) - router)
    assert routed.flops_per_image == expected


# ------------------------------------------------------------------------------------------------
# Bad settings
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mod, message",
    [
        (dict(capacity=0), "capacity=0 must be a fraction in \\(0, 1\\]"),
        (dict(capacity=1.5), "capacity=1.5 must be a fraction"),
        (dict(capacity="half"), "capacity='half'"),
        (dict(gate="relu"), "gate='relu'; allowed: 'logit', 'sigmoid'"),
        (dict(causal_router="oracle"), "causal_router='oracle'"),
        (dict(aux_loss_weight=-1), "aux_loss_weight=-1"),
        (dict(aux_loss_weight=math.nan), "aux_loss_weight=nan must be a finite number >= 0"),
        (dict(aux_loss_weight=math.inf), "aux_loss_weight=inf must be a finite number >= 0"),
        (dict(predictor_hidden=0), "predictor_hidden=0"),
        (dict(predictor_hidden=16), "predictor_hidden=16 sizes the predictor of causal_router='predictor'"),
        (dict(blocks=3), "blocks=3 must be a placement \\('every_2'.* or a list of block indices"),
        (dict(blocks=None), "blocks=None must be a placement"),
        (dict(capcity=0.5), "unknown setting\\(s\\) \\['capcity'\\]"),
        (dict(name="none", capacity=0.5), "mod=none with settings"),
    ],
)
def test_bad_mod_settings_name_the_value(mod, message):
    with pytest.raises(ValueError, match=message):
        resolve_depth(mod)


def test_models_refuse_bad_placements_and_an_untrained_causal_router():
    with pytest.raises(ValueError, match="mod.blocks index 9 is out of range for depth=4"):
        TransformerLM(**TINY, mod=dict(blocks=[9]))
    with pytest.raises(ValueError, match="mod.aux_loss_weight=0 leaves the causal router untrained"):
        TransformerLM(**TINY, mod=dict(aux_loss_weight=0))
    assert resolve_depth({"name": "none"}) is None and resolve_depth({}) is None
    assert resolve_depth({"name": "my_mod"}) == DepthSpec(), "a named config without settings: the defaults"
    assert math.isclose(resolve_depth({"name": "interleaved", "capacity": 0.5}).capacity, 0.5)


# ------------------------------------------------------------------------------------------------
# The template
# ------------------------------------------------------------------------------------------------
def test_the_template_sets_every_mod_setting_from_the_command_line(tmp_path):
    """``mod=interleaved`` holds every setting, so each takes a plain override (not ``+mod.<key>=``)."""
    assert set(OmegaConf.load(REPO / "configs/mod/interleaved.yaml")) == {"name", *DepthSpec.__dataclass_fields__}
    overrides = ["experiment=mod_transformer_lm", "mod.causal_router=predictor", "mod.predictor_hidden=8"]
    net = instantiate(compose_config("train", overrides, tmp_path).model)
    assert net.blocks[0].depth_router.predictor[0].out_features == 8


@pytest.mark.e2e
def test_the_template_trains_a_mode_vit(tmp_path):
    """mod=interleaved over the Soft MoE ViT experiment: routed blocks with Soft MoE sized for their tokens."""
    overrides = ["experiment=soft_moe_vit", "mod=interleaved", "mod.capacity=0.25", "debug=tiny"]
    cfg = compose_config("train", [*overrides, "trainer.fast_dev_run=true"], tmp_path)
    net = instantiate(cfg.model)
    assert net.mod_block_indices and set(net.mod_block_indices) & set(net.moe_block_indices)
    assert math.isfinite(train(cfg)["train/loss_step"])


def test_run_records_group_mod_models_apart():
    assert model_family(mod_lm(dict(blocks="all"))) == "transformer/dense+mod"
    assert model_family(mod_lm(dict(blocks="all"), moe=dict(recipe="mixtral", num_experts=4))) == "transformer/top2+mod"
