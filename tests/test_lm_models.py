"""Language models with MoE: causality of every offered router, the refusal of token-mixing routers,
incremental decoding against the full forward, Shazeer's losses in the LSTM-MoE LM, sampling and
generation, the LM summary, bad input."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moekit.models import (
    LMCache,
    LSTMCache,
    LSTMMoELM,
    TransformerLM,
    generate,
    lm_summary,
    sample_next_token,
    upcycle,
)
from moekit.moe import ExpertBank, HashMoE, MoELayer, collect_moe_outputs, get_moe_layer, moe_layers, require_causal
from moekit.moe.dropout import Dropout
from moekit.recipes import list_recipes

VOCAB = 50
TINY_TRANSFORMER = dict(vocab_size=VOCAB, max_seq_len=24, dim=32, depth=2, num_heads=2, mlp_ratio=2.0)
TINY_LSTM = dict(vocab_size=VOCAB, dim=32, expert_hidden=32, dropout=0.0)
POSITION = dict(capacity_scope="position")

# Every recipe the LMs accept (those with a capacity over the batch, with capacity_scope: position), small:
# name -> the moe argument.
TRANSFORMER_ROUTERS = {
    "switch_position_capacity": dict(recipe="switch", num_experts=4, **POSITION),
    "top2_position_capacity": dict(recipe="top2", num_experts=4, **POSITION),
    "vmoe_position_capacity": dict(recipe="vmoe", num_experts=4, **POSITION),
    "mixtral": dict(recipe="mixtral", num_experts=4),
    "noisy_top_k_position_capacity": dict(
        recipe="noisy_top_k", num_experts=4, top_k=2, capacity_factor=1.0, **POSITION
    ),
    "deepseek": dict(recipe="deepseek", num_experts=8, top_k=4),
    "deepseek_position_capacity": dict(recipe="deepseek", num_experts=4, top_k=2, capacity_factor=1.25, **POSITION),
    "hash": "hash",
    "hierarchical_position_capacity": dict(
        recipe="hierarchical", num_experts=4, num_groups=2, top_k_groups=1, capacity_factor=1.0, **POSITION
    ),
    "dense_moe": dict(recipe="dense_moe", num_experts=3),
    "strictly_balanced_position": dict(recipe="strictly_balanced", num_experts=4, top_k=2, balance_scope="position"),
    "top2_group_capacity": dict(
        recipe="top2", num_experts=4, eval_capacity_factor=0.75, capacity_scope="group", group_size=5
    ),  # 2 of the 10 assignments of a group per expert: drops
    "mixtral_sequence_capacity": dict(recipe="mixtral", num_experts=4, capacity_factor=1.0, capacity_scope="group"),
    "lory": dict(recipe="lory", num_experts=4, segment_len=4),  # 3 segments of the 12 tokens
    "dense_model": None,
}

# The recipes of the LSTM-MoE LM (the paper's noisy top-k and hierarchical MoE, and the other per-token ones).
LSTM_ROUTERS = {
    "noisy_top_k_position_capacity": dict(
        recipe="noisy_top_k", num_experts=4, top_k=2, capacity_factor=1.0, **POSITION
    ),
    "switch_position_capacity": dict(recipe="switch", num_experts=4, **POSITION),
    "deepseek": dict(recipe="deepseek", num_experts=4, top_k=2),
    "hierarchical_position_capacity": dict(recipe="hierarchical", num_experts=4, capacity_factor=1.0, **POSITION),
    "hash": dict(recipe="hash", num_experts=4),
    "dense_moe": dict(recipe="dense_moe", num_experts=3),
    "strictly_balanced_position": dict(recipe="strictly_balanced", num_experts=4, top_k=2, balance_scope="position"),
}


def test_the_routers_cover_every_recipe():
    covered = {spec if isinstance(spec, str) else spec["recipe"] for spec in TRANSFORMER_ROUTERS.values() if spec}
    assert covered == set(list_recipes()) - {"soft_moe", "experts_choice", "base"}, "all but the token-mixing ones"


def randomize_routers(model: nn.Module, std: float = 1.0) -> nn.Module:
    """Give every router (and noise) weight a random value: the LSTM LM starts them at zero, and large
    logits make the routing decisive and the capacity limits bind."""
    with torch.no_grad():
        for _, layer in moe_layers(model):
            router = getattr(layer, "router", None)
            params = list(router.parameters()) if router is not None else [layer.router_weight]
            for p in params:
                p.normal_(0.0, std)
    return model


def build(kind: str, router: str, **overrides) -> nn.Module:
    if kind == "transformer":
        moe = TRANSFORMER_ROUTERS[router]
        model = TransformerLM(**{**TINY_TRANSFORMER, "moe": moe, "moe_blocks": "all", **overrides})
    else:
        model = LSTMMoELM(**{**TINY_LSTM, "moe": LSTM_ROUTERS[router], **overrides})
    return randomize_routers(model)


def logits_and_grads(model: nn.Module, input_ids, targets, upto: int):
    """Logits, and the gradient of the summed cross-entropy at positions ``<= upto`` w.r.t. every
    parameter. The MoE auxiliary losses are left out: they are batch-level statistics over all
    positions (the future ones included), not per-token predictions."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # the same gating noise (noisy top-k in training) for both inputs
    logits = model(input_ids)
    loss = F.cross_entropy(
        logits[:, : upto + 1].reshape(-1, VOCAB), targets[:, : upto + 1].reshape(-1), reduction="sum"
    )
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def assert_causal(model: nn.Module, batch: int = 4, tokens: int = 12, upto: int = 5) -> None:
    input_ids = torch.randint(VOCAB, (batch, tokens))
    changed = input_ids.clone()
    changed[:, upto + 1 :] = (input_ids[:, upto + 1 :] + torch.randint(1, VOCAB, (batch, tokens - upto - 1))) % VOCAB
    targets = torch.randint(VOCAB, (batch, tokens))
    logits, grads = logits_and_grads(model, input_ids, targets, upto)
    logits_changed, grads_changed = logits_and_grads(model, changed, targets, upto)
    assert (logits[:, upto + 1 :] - logits_changed[:, upto + 1 :]).abs().max() > 1e-4, "the future did change"
    torch.testing.assert_close(logits_changed[:, : upto + 1], logits[:, : upto + 1], atol=1e-5, rtol=1e-5)
    assert grads.keys() == grads_changed.keys()
    for name in grads:
        torch.testing.assert_close(grads_changed[name], grads[name], atol=1e-5, rtol=1e-4, msg=name)


# ------------------------------------------------------------------------------------------------
# Causality
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("router", sorted(TRANSFORMER_ROUTERS))
def test_transformer_lm_is_causal(router, training):
    model = build("transformer", router).train(training)
    assert_causal(model)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("router", sorted(LSTM_ROUTERS))
def test_lstm_moe_lm_is_causal(router, training):
    model = build("lstm", router).train(training)
    assert_causal(model)


def test_the_causality_check_catches_a_capacity_over_the_batch():
    """The check has teeth: with the capacity over all tokens of the batch (what require_causal
    refuses), later tokens take earlier tokens' expert slots."""
    model = build("transformer", "switch_position_capacity").train()
    for _, layer in moe_layers(model):
        layer.capacity.capacity_scope = "batch"  # bypass the construction-time refusal
    with pytest.raises(AssertionError):
        assert_causal(model)


@pytest.mark.parametrize(
    "moe, fix",
    [
        ("soft_moe", "use a per-token router: moe=mixtral"),
        ("experts_choice", "use a per-token router"),
        ("base", "use a per-token router"),
        ("switch", "set moe.capacity_scope=position"),
        (dict(recipe="mixtral", eval_capacity_factor=2.0), "set +moe.capacity_scope=position"),  # not in its file
        ("strictly_balanced", "set moe.balance_scope=position"),
        (dict(recipe="top2", capacity_scope="group", batch_priority=True), "set moe.capacity_scope=position"),
    ],
)
def test_token_mixing_recipes_are_refused(moe, fix):
    with pytest.raises(ValueError, match=r"routes a token by looking at the other tokens of the batch") as err:
        TransformerLM(**TINY_TRANSFORMER, moe=moe)
    assert fix in str(err.value), "the message names the fix"
    with pytest.raises(ValueError, match=r"so the LSTM MoE LM \(causal\) would see the future"):
        LSTMMoELM(**TINY_LSTM, moe=moe)


def test_what_routes_by_position_is_refused_without_positions_and_groups_are_sequences():
    with pytest.raises(ValueError, match=r"capacity_scope=group\), which a cached decode must carry"):
        LSTMMoELM(**TINY_LSTM, moe=dict(recipe="top2", capacity_scope="group"))
    with pytest.raises(ValueError, match=r"needs the tokens' positions and a decoding state; the LSTM MoE LM"):
        LSTMMoELM(**TINY_LSTM, moe="lory")
    model = TransformerLM(**TINY_TRANSFORMER, moe=dict(recipe="top2", capacity_scope="group"))
    assert {layer.capacity.group_size for _, layer in moe_layers(model)} == {24}, "a group is a whole sequence"
    for moe in ("lory", dict(recipe="top2", capacity_scope="group")):
        with pytest.raises(ValueError, match="routes by the tokens' positions .* use mod=none"):
            TransformerLM(**TINY_TRANSFORMER, moe=moe, mod=dict(capacity=0.5, blocks="every_2"))


@pytest.mark.parametrize("layer", ["soft_moe", "experts_choice", "base"])
def test_require_causal_also_refuses_a_token_mixing_layer(layer):
    """Defence in depth: a model that got a token-mixing layer past the recipe check is refused too."""
    model = TransformerLM(**TINY_TRANSFORMER, moe="mixtral")
    model.blocks[1].mlp = get_moe_layer(layer)(
        32, 64, num_experts=4, **({"num_tokens": 8} if layer == "soft_moe" else {})
    )
    with pytest.raises(ValueError, match=r"MoE layer 'blocks.1.mlp' \(\w+\) is not causal"):
        require_causal(model)


# ------------------------------------------------------------------------------------------------
# Incremental decoding
# ------------------------------------------------------------------------------------------------
def decode_in_pieces(model: nn.Module, input_ids: torch.Tensor, prefill: int, chunk: int) -> torch.Tensor:
    """Logits of ``input_ids`` computed as a prefill, one chunk of several tokens, then one token at a time."""
    cache = model.init_cache(input_ids.shape[0])
    pieces = [model(input_ids[:, :prefill], cache=cache), model(input_ids[:, prefill : prefill + chunk], cache=cache)]
    for t in range(prefill + chunk, input_ids.shape[1]):
        pieces.append(model(input_ids[:, t : t + 1], cache=cache))
    assert cache.position == input_ids.shape[1]
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("pos_embedding", ["rope", "learned"])
@pytest.mark.parametrize(
    "router",
    ["mixtral", "switch_position_capacity", "hash", "lory", "top2_group_capacity", "mixtral_sequence_capacity"],
)
@torch.no_grad()
def test_kv_cache_decoding_equals_the_full_forward(router, pos_embedding):
    model = build("transformer", router, pos_embedding=pos_embedding).eval()
    input_ids = torch.randint(VOCAB, (4, 16))
    full = model(input_ids)
    if router in ("switch_position_capacity", "top2_group_capacity"):  # the capacity binds: drops
        dropped = [s["dropped_fraction"] for s in collect_moe_outputs(model).stats.values()]
        assert max(dropped) > 0, "the capacity binds, so the test compares dropping too"
    torch.testing.assert_close(decode_in_pieces(model, input_ids, prefill=5, chunk=4), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("router", ["noisy_top_k_position_capacity", "hierarchical_position_capacity"])
@torch.no_grad()
def test_lstm_state_carrying_equals_the_full_forward(router):
    model = build("lstm", router, num_lstm_layers_before=2).eval()
    input_ids = torch.randint(VOCAB, (3, 11))
    cache = model.init_cache(3)
    assert isinstance(cache, LSTMCache) and cache.hidden.shape == (3, 3, 32)
    torch.testing.assert_close(decode_in_pieces(model, input_ids, prefill=4, chunk=3), model(input_ids))


def test_transformer_cache_layout():
    model = TransformerLM(**TINY_TRANSFORMER)
    cache = model.init_cache(3)
    assert isinstance(cache, LMCache) and cache.position == 0 and len(cache.keys) == 2
    assert cache.keys[0].shape == cache.values[1].shape == (3, 2, 24, 16)


# ------------------------------------------------------------------------------------------------
# Shazeer et al. 2017 in the LSTM LM
# ------------------------------------------------------------------------------------------------
def cv_squared(values: torch.Tensor) -> torch.Tensor:
    """Squared coefficient of variation std / mean (population std)."""
    return values.var(unbiased=False) / values.mean() ** 2


def test_lstm_moe_lm_defaults_follow_the_paper():
    model = LSTMMoELM(vocab_size=VOCAB)
    router = model.moe.router
    cfg = router.config
    assert cfg.noisy_gating and cfg.normalize_gates and router.top_k == 4 and model.moe.num_experts == 32
    assert cfg.importance_loss_weight == cfg.load_loss_weight == 0.1
    assert model.moe.experts.hidden_features == 1024 and isinstance(model.moe.experts.act, nn.ReLU)
    assert not router.weight.any() and not router.noise_weight.any(), "W_g and W_noise start at zero"
    hierarchical = LSTMMoELM(vocab_size=VOCAB, dim=8, expert_hidden=8, moe=dict(recipe="hierarchical", num_experts=256))
    hierarchical = hierarchical.moe.router
    assert (hierarchical.num_groups, hierarchical.top_k_groups, hierarchical.top_k_per_group) == (16, 2, 2)
    assert not hierarchical.primary_weight.any(), "the hierarchical gates start at zero too"


def test_lstm_moe_lm_importance_and_load_losses_match_the_paper():
    moe = dict(recipe="noisy_top_k", num_experts=4, top_k=2)
    model = randomize_routers(LSTMMoELM(vocab_size=VOCAB, dim=16, expert_hidden=16, moe=moe)).train()
    router = model.moe.router
    seen = {}
    model.moe.register_forward_pre_hook(lambda module, args: seen.update(x=args[0].detach()))
    router.register_forward_pre_hook(lambda module, args: seen.update(rng=torch.get_rng_state()))
    model(torch.randint(VOCAB, (3, 7)))
    losses = collect_moe_outputs(model).aux_losses

    # By hand, in float64: H = x W_g + eps * softplus(x W_noise), G = softmax(KeepTopK(H, k)).
    x = seen["x"].reshape(-1, 16).double()
    clean = x @ router.weight.double().t()
    noise_std = F.softplus(x @ router.noise_weight.double().t())
    torch.set_rng_state(seen["rng"])
    eps = torch.randn(clean.shape).double()
    noisy = clean + eps * noise_std
    k, num_experts = 2, 4
    kth = noisy.topk(k, dim=-1).values[:, -1:]
    gates = torch.softmax(noisy.masked_fill(noisy < kth, float("-inf")), dim=-1)
    importance = gates.sum(dim=0)
    # P(x, i) = Phi((clean_i - kth_excluding(H, k, i)) / softplus(x W_noise)_i)
    load_prob = torch.empty_like(clean)
    for i in range(num_experts):
        others = torch.cat([noisy[:, :i], noisy[:, i + 1 :]], dim=1)
        threshold = others.topk(k, dim=-1).values[:, -1]
        z = (clean[:, i] - threshold) / noise_std[:, i]
        load_prob[:, i] = 0.5 * (1 + torch.erf(z / math.sqrt(2)))
    load = load_prob.sum(dim=0)

    assert losses.keys() == {"importance", "load"}
    torch.testing.assert_close(losses["importance"].double(), 0.1 * cv_squared(importance), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(losses["load"].double(), 0.1 * cv_squared(load), rtol=1e-4, atol=1e-7)
    assert losses["importance"] > 1e-4 and losses["load"] > 1e-4, "unbalanced random routers: non-trivial values"


def test_lstm_moe_lm_architecture_residuals_and_sigmoid():
    """logits = head(m + lstm2(m)), m = h + sigmoid(moe(h)), h = e + lstm1(e), e = embedding(ids)."""
    model = randomize_routers(LSTMMoELM(**TINY_LSTM, moe=dict(recipe="noisy_top_k", num_experts=4, top_k=2))).eval()
    input_ids = torch.randint(VOCAB, (2, 6))
    with torch.no_grad():
        e = model.embedding(input_ids)
        h = e + model.lstm_before[0](e)[0]
        m = h + torch.sigmoid(model.moe(h))
        expected = F.linear(m + model.lstm_after[0](m)[0], model.embedding.weight, model.head.bias)
        torch.testing.assert_close(model(input_ids), expected)


# ------------------------------------------------------------------------------------------------
# Sampling and generation
# ------------------------------------------------------------------------------------------------
@torch.no_grad()
def argmax_rollout(model: nn.Module, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    tokens = prompt
    for _ in range(steps):
        tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


@pytest.mark.parametrize(
    "kind, router", [("transformer", "switch_position_capacity"), ("lstm", "noisy_top_k_position_capacity")]
)
def test_greedy_generation_is_the_argmax_rollout_with_and_without_cache(kind, router):
    # Untied embeddings: a random tied model mostly repeats its last token, whatever the context.
    model = build(kind, router, tie_embeddings=False).eval()
    if kind == "lstm":  # its small initial embeddings leave the logits to the constant sigmoid(MoE) offset
        with torch.no_grad():
            model.embedding.weight.normal_()
    prompt = torch.randint(VOCAB, (3, 4))
    expected = argmax_rollout(model, prompt, 10)
    assert len(expected[:, 4:].unique()) > 3, "a rollout that depends on the context"
    model.train()
    for use_cache in (True, False):
        out = generate(model, prompt, 10, temperature=0, use_cache=use_cache)
        assert torch.equal(out, expected), use_cache
        top1 = generate(model, prompt, 10, temperature=1.0, top_k=1, use_cache=use_cache)
        assert torch.equal(top1, expected), "top_k=1 is greedy"
    assert model.training, "generate restores the mode"


@torch.no_grad()
def windowed_argmax_rollout(model: nn.Module, prompt: torch.Tensor, steps: int, window: int) -> torch.Tensor:
    """Greedy tokens past ``window``: each one is the argmax of the model on a context that starts at ``start``,
    which jumps to the last ``window // 2`` tokens when the context would exceed ``window``."""
    tokens, start = prompt, max(0, prompt.shape[1] - window)
    for _ in range(steps):
        if tokens.shape[1] - start > window:
            start = tokens.shape[1] - window // 2
        tokens = torch.cat([tokens, model(tokens[:, start:])[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


@pytest.mark.parametrize("prompt_len", [4, 30], ids=["short_prompt", "prompt_beyond_the_window"])
def test_generation_slides_past_max_seq_len_with_and_without_cache(prompt_len):
    model = build("transformer", "mixtral", tie_embeddings=False).eval()  # max_seq_len 24
    prompt = torch.randint(VOCAB, (2, prompt_len))
    expected = windowed_argmax_rollout(model, prompt, 40, window=24)
    for use_cache in (True, False):
        out = generate(model, prompt, 40, temperature=0, use_cache=use_cache, slide=True)
        assert out.shape == (2, prompt_len + 40) and torch.equal(out, expected), use_cache
    if prompt_len < 24:  # until the window is full, sliding changes nothing
        assert torch.equal(expected[:, :24], argmax_rollout(model, prompt, 24 - prompt_len))


def test_sampled_generation_is_reproducible_and_the_same_with_and_without_cache():
    model = build("transformer", "mixtral", tie_embeddings=False)
    prompt = torch.randint(VOCAB, (2, 3))

    def sample(use_cache: bool) -> torch.Tensor:
        generator = torch.Generator().manual_seed(7)
        return generate(model, prompt, 12, temperature=1.5, top_p=0.9, use_cache=use_cache, generator=generator)

    assert torch.equal(sample(True), sample(True))
    assert torch.equal(sample(True), sample(False))


def test_each_token_reaches_on_token_as_it_is_sampled():
    model = build("transformer", "mixtral", tie_embeddings=False)
    prompt = torch.randint(VOCAB, (2, 3))
    seen: list[torch.Tensor] = []

    def on_token(next_token: torch.Tensor) -> None:
        seen.append(next_token.clone())
        assert len(seen) == len(steps), "called once per step, before the next forward"

    steps: list[int] = []
    model.register_forward_pre_hook(lambda *_: steps.append(1))
    tokens = generate(model, prompt, 6, temperature=1.0, generator=torch.Generator().manual_seed(0), on_token=on_token)
    assert torch.equal(torch.stack(seen, dim=1), tokens[:, 3:])


def test_the_sample_stream_prints_whole_characters_as_they_come(capsys):
    from moekit.commands.sample import _Stream
    from moekit.data.tokenizers import ByteTokenizer

    tokenizer = ByteTokenizer()
    prompt = list(b"caf")
    stream = _Stream(tokenizer, prompt)
    outputs = []
    for byte in "é!".encode():  # é is two bytes: nothing is printed after the first
        stream(torch.tensor([byte]))
        outputs.append(capsys.readouterr().out)
    stream.finish("café!")
    assert outputs == ["--- sample 0 ---\ncaf", "é", "!"] and capsys.readouterr().out == "\n"


def test_sampled_tokens_lie_in_the_top_k_set_and_the_nucleus():
    logits = torch.randn(64, VOCAB) * 3
    generator = torch.Generator().manual_seed(0)
    top5 = logits.topk(5, dim=-1).indices
    probs = logits.softmax(-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    nucleus_size = ((sorted_probs.cumsum(-1) - sorted_probs) < 0.8).sum(-1)  # smallest set reaching 0.8
    seen_k, seen_p = set(), set()
    for _ in range(50):
        k_tokens = sample_next_token(logits, top_k=5, generator=generator)
        assert (k_tokens.unsqueeze(1) == top5).any(dim=1).all()
        p_tokens = sample_next_token(logits, top_p=0.8, generator=generator)
        rank = (order == p_tokens.unsqueeze(1)).float().argmax(dim=1)
        assert (rank < nucleus_size).all()
        seen_k.add(k_tokens[0].item())
        seen_p.add(p_tokens[nucleus_size.argmax()].item())
    assert len(seen_k) > 1 and len(seen_p) > 1, "it samples, it does not just take the argmax"
    both = sample_next_token(logits, top_k=1, top_p=0.5, generator=generator)
    assert torch.equal(both, logits.argmax(-1))
    assert torch.equal(sample_next_token(logits, temperature=0), logits.argmax(-1))


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    logits = probs.log().expand(20000, -1)
    tokens = sample_next_token(logits, generator=torch.Generator().manual_seed(0))
    frequency = torch.bincount(tokens, minlength=5).float() / tokens.numel()
    torch.testing.assert_close(frequency, probs, atol=0.015, rtol=0)
    # temperature 0.5 squares the probabilities (renormalised)
    tokens = sample_next_token(logits, temperature=0.5, generator=torch.Generator().manual_seed(1))
    frequency = torch.bincount(tokens, minlength=5).float() / tokens.numel()
    torch.testing.assert_close(frequency, probs**2 / (probs**2).sum(), atol=0.015, rtol=0)


def test_a_tiny_temperature_or_huge_logits_sample_the_argmax():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(16, VOCAB, generator=generator)
    for temperature in (1e-30, 1e-40, 1e-300):  # logits / temperature overflowed to inf: softmax NaN, token 0
        assert torch.equal(sample_next_token(logits, temperature, generator=generator), logits.argmax(-1))
    huge = logits / logits.abs().max() * 3e38  # finite, but twice them is not
    assert torch.equal(sample_next_token(huge, 0.5, top_p=0.9, generator=generator), huge.argmax(-1))


# ------------------------------------------------------------------------------------------------
# Construction, initialisation, summary
# ------------------------------------------------------------------------------------------------
def test_transformer_lm_structure():
    model = TransformerLM(
        **{**TINY_TRANSFORMER, "depth": 4}, moe=dict(recipe="mixtral", num_experts=4), moe_blocks="every_2"
    )
    assert model.moe_block_indices == (1, 3)
    assert [isinstance(b.mlp, MoELayer) for b in model.blocks] == [False, True, False, True]
    assert model.head.weight is model.token_embedding.weight
    bank = model.blocks[1].mlp.experts
    assert (bank.in_features, bank.hidden_features, bank.num_experts) == (32, 64, 4), "the dense MLP's sizes"
    dense = TransformerLM(**TINY_TRANSFORMER, moe=None, gated=True, norm="rmsnorm", tie_embeddings=False)
    assert dense.moe_block_indices == () and not list(moe_layers(dense))
    assert isinstance(dense.norm, nn.RMSNorm) and dense.head.weight is not dense.token_embedding.weight
    hashed = TransformerLM(**TINY_TRANSFORMER, moe=dict(recipe="hash", num_experts=4))
    assert isinstance(hashed.blocks[1].mlp, HashMoE) and hashed.blocks[1].mlp.router.vocab_size == VOCAB


def test_the_feed_forward_output_drops_once_per_token_after_an_moe_layer_s_combine():
    """The block drops the feed-forward's output, one mask per token (Switch Transformer's and fairseq's place for it
    in an MoE layer): at dropout 0.5 half of a top-2 layer's contributions to the residual stream are zero, where a
    mask per expert copy (timm's drop2 inside each expert) zeroes a quarter, the coordinates both copies lost."""
    torch.manual_seed(0)
    model = TransformerLM(**{**TINY_TRANSFORMER, "depth": 1}, moe=dict(recipe="mixtral", num_experts=4), dropout=0.5)
    block = model.train().blocks[0]
    assert (block.mlp.experts.drop1.p, block.mlp.experts.drop2.p) == (0.5, 0.0), "the experts drop their hidden units"
    seen = {}
    block.norm2.register_forward_pre_hook(lambda module, args: seen.update(residual=args[0]))
    block.register_forward_hook(lambda module, args, out: seen.update(out=out))
    model(torch.randint(VOCAB, (8, 24)))
    contribution = seen["out"] - seen["residual"]  # [8, 24, 32]: what the feed-forward added
    assert 0.45 < (contribution == 0).float().mean().item() < 0.55


def test_the_dense_twin_drops_its_feed_forward_output_as_timm_s_mlp_does():
    """The dense feed-forward's output dropout, moved from timm's Mlp (its drop2) into the block, draws the same mask at
    the same point of the generator: a training forward equals the Mlp's own, bit for bit."""
    model = TransformerLM(**TINY_TRANSFORMER, moe=None, dropout=0.3).train()
    reference = copy.deepcopy(model)
    for block in reference.blocks:
        block.mlp.drop2, block.mlp_drop = Dropout(0.3), nn.Identity()
    input_ids = torch.randint(VOCAB, (4, 24))
    torch.manual_seed(1)
    ours = model(input_ids)
    torch.manual_seed(1)
    torch.testing.assert_close(ours, reference(input_ids), rtol=0, atol=0)
    torch.manual_seed(2)
    assert not torch.equal(model(input_ids), ours), "the forward drops"


def test_gpt2_initialisation_and_experts_like_the_dense_mlp():
    depth, dim = 4, 64
    model = TransformerLM(vocab_size=VOCAB, dim=dim, depth=depth, num_heads=2, moe="mixtral", moe_blocks="all")
    dense = TransformerLM(vocab_size=VOCAB, dim=dim, depth=depth, num_heads=2, moe=None)
    residual_std = 0.02 / math.sqrt(2 * depth)
    bank: ExpertBank = model.blocks[0].mlp.experts
    assert bank.fc1_weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert bank.fc2_weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert dense.blocks[0].mlp.fc1.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert dense.blocks[0].mlp.fc2.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(residual_std, rel=0.1)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert bank.fc1_weight.abs().max() > 3 * 0.02, "a plain normal like GPT-2, not cut at 2 std"


@pytest.mark.parametrize("recipe", ["mixtral", "deepseek"])
@torch.no_grad()
def test_an_upcycled_transformer_lm_computes_its_dense_twin(recipe):
    """Sparse upcycling: experts copy the dense MLP of their block. With gates renormalised over the chosen experts
    and no capacity limit, the MoE model is the dense model (shared experts, which start fresh, are zeroed here)."""
    common = dict(TINY_TRANSFORMER, gated=True, tie_embeddings=False)
    dense = TransformerLM(**common, moe=None).eval()
    moe = dict(recipe=recipe, num_experts=4, top_k=2, granularity=1)
    if recipe == "deepseek":
        moe |= dict(num_shared_experts=1)
    upcycled = upcycle(TransformerLM(**common, moe=moe, moe_blocks="every_2").eval(), dense)
    for _, layer in moe_layers(upcycled):
        if layer.shared_experts is not None:
            layer.shared_experts.fc2_weight.zero_()
    input_ids = torch.randint(VOCAB, (3, 12))
    torch.testing.assert_close(upcycled(input_ids), dense(input_ids), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"upcycle: the dense weights do not fit the MoE model: .*shape mismatches"):
        upcycle(TransformerLM(**{**common, "mlp_ratio": 4.0}, moe=moe), dense)
    with pytest.raises(
        ValueError,
        match=r"token_embedding.weight and head.weight are one tensor in this model .* "
        r"differ .*tie_embeddings=false",
    ):  # else the head's weights would overwrite the embedding
        upcycle(TransformerLM(**{**common, "tie_embeddings": True}, moe=moe), dense)


def test_upcycling_names_what_the_dense_twin_computes_otherwise_with_weights_of_the_same_shapes():
    """One attention head of width 32 where the MoE model has 2 of 16, the rotary base of Mixtral and another norm
    epsilon: every weight has the MoE model's shape, and each setting is refused with its modules, from the dense
    module or from its weights with the module they belong to; nothing is written. Weights alone cannot tell."""
    common = dict(TINY_TRANSFORMER, gated=True, tie_embeddings=False)
    moe = TransformerLM(**common, moe="mixtral")
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    other = TransformerLM(**{**common, "num_heads": 1}, rope_base=1e6, norm_eps=1e-6, moe=None)
    for dense, architecture in ((other, None), (other.state_dict(), other)):
        with pytest.raises(ValueError) as info:
            upcycle(moe, dense, architecture=architecture)
        message = str(info.value)
        assert (
            "architecture differences ['num_heads: dense 1 vs MoE 2 (the model, blocks.0.attn, blocks.1.attn)'"
            in message
        )
        assert "'base: dense 1000000.0 vs MoE 10000.0 (blocks.0.attn.rope)'" in message
        assert "'eps: dense 1e-06 vs MoE 1e-05 (blocks.0.norm1, blocks.0.norm2, blocks.1.norm1" in message
        assert all(torch.equal(v, before[k]) for k, v in moe.state_dict().items())
    assert upcycle(moe, other.state_dict()) is moe


@torch.no_grad()
def test_upcycling_into_a_mixture_of_depths_lm_keeps_its_routers_fresh():
    """The dense twin has no Mixture-of-Depths routers: they keep their fresh values, every other weight is copied."""
    common = dict(TINY_TRANSFORMER, gated=True)
    dense = TransformerLM(**common, moe=None)
    mod = {"capacity": 0.5, "blocks": "all"}
    torch.manual_seed(0)
    fresh = TransformerLM(**common, moe="mixtral", mod=mod).state_dict()
    torch.manual_seed(0)
    upcycled = upcycle(TransformerLM(**common, moe="mixtral", mod=mod), dense)
    dense_state = dense.state_dict()
    for name, value in upcycled.state_dict().items():
        if "depth_router" in name or ".mlp.router." in name:
            assert torch.equal(value, fresh[name]), name
        elif ".mlp.experts." not in name:
            assert torch.equal(value, dense_state[name]), name
    assert torch.equal(upcycled.blocks[1].mlp.experts.fc2_weight[3], dense.blocks[1].mlp.fc2.weight.t())


@torch.no_grad()
def test_a_bf16_mixture_of_depths_lm_evaluates_in_bf16():
    """Evaluation decides per token (the causal router): the gated update goes back in the model's dtype."""
    model = TransformerLM(**TINY_TRANSFORMER, moe=None, mod={"capacity": 0.5, "blocks": "all"}).eval()
    input_ids = torch.randint(VOCAB, (2, 16))
    logits = model.to(torch.bfloat16)(input_ids)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), model.float()(input_ids), atol=0.1, rtol=0.05)


def test_lm_summary_dense_twin_matches_top1_and_twice_wide_twin_matches_top2():
    common = dict(vocab_size=VOCAB, max_seq_len=16, dim=32, depth=2, num_heads=2, mlp_ratio=2.0)
    dense = lm_summary(TransformerLM(**common, moe=None), seq_len=16)
    top1 = lm_summary(TransformerLM(**common, moe=dict(recipe="mixtral", num_experts=4, top_k=1)), seq_len=16)
    router_flops = 2 * 32 * 4
    assert top1.flops_per_token == dense.flops_per_token + 2 * router_flops
    assert top1.active_params_per_token == dense.total_params + 2 * 4 * 32, "plus the router weights"
    assert dense.active_params_per_token == dense.total_params and dense.expert_params == 0

    wide = lm_summary(TransformerLM(**{**common, "mlp_ratio": 4.0}, moe=None), seq_len=16)
    top2 = lm_summary(TransformerLM(**common, moe=dict(recipe="mixtral", num_experts=4)), seq_len=16)
    combine_flops = 2 * 2 * 32  # the gate-weighted sum of the two expert outputs (a bmm)
    assert top2.flops_per_token == wide.flops_per_token + 2 * (router_flops + combine_flops)
    assert top2.active_params_per_token == wide.total_params + 2 * 4 * 32
    assert top2.expert_params == 2 * 4 * (2 * 32 * 64)
    assert [s.expert_rows_per_token for s in top2.moe_layers] == [2.0, 2.0]
    assert "FLOPs / token" in str(top2) and "blocks.1.mlp" in str(top2)


def test_lm_summary_counts_the_lstm_and_the_experts():
    model = LSTMMoELM(
        vocab_size=VOCAB, dim=16, expert_hidden=24, moe=dict(recipe="noisy_top_k", num_experts=4, top_k=2)
    )
    summary = lm_summary(model, seq_len=8)
    lstm = 2 * 2 * 4 * 16 * (16 + 16)
    experts = 2 * (2 * 16 * 24 + 2 * 24 * 16)
    router, combine, head = 2 * 16 * 4, 2 * 2 * 16, 2 * 16 * VOCAB
    assert summary.flops_per_token == lstm + experts + router + combine + head
    assert model.training, "the mode is restored"


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------
def test_sequences_longer_than_max_seq_len_are_refused():
    model = TransformerLM(**TINY_TRANSFORMER)
    message = r"sequence length 25 exceeds max_seq_len=24; use shorter inputs or a model with max_seq_len >= 25"
    with pytest.raises(ValueError, match=message):
        model(torch.randint(VOCAB, (1, 25)))
    cache = model.init_cache(1)
    model(torch.randint(VOCAB, (1, 20)), cache=cache)
    with pytest.raises(ValueError, match=message):
        model(torch.randint(VOCAB, (1, 5)), cache=cache)
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(torch.is_grad_enabled()))
    with pytest.raises(ValueError, match="length 25 exceeds max_seq_len=24.*or pass slide=True"):
        generate(model, torch.randint(VOCAB, (1, 20)), max_new_tokens=6)
    assert not calls, "refused before any forward"
    tokens = generate(model, torch.randint(VOCAB, (1, 20)), max_new_tokens=5)
    assert tokens.shape == (1, 25), "the last token is not run: 24 tokens fit"
    assert calls and not any(calls), "generation runs without autograd"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.5), r"temperature=-0.5 must be a finite number >= 0"),
        (dict(temperature=math.inf), r"temperature=inf must be a finite number >= 0"),  # every logit became 0
        (dict(temperature=1e39), r"temperature=1e\+39 must be a finite number >= 0"),  # past float32: the same
        (dict(top_k=0), r"top_k=0 must be an int >= 1"),
        (dict(top_p=0.0), r"top_p=0.0 must lie in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p=1.5 must lie in \(0, 1\]"),
        (dict(max_new_tokens=-1), r"max_new_tokens=-1 must be an int >= 0"),
        (dict(prompt_ids=torch.zeros(3, dtype=torch.long)), r"prompt_ids of shape \(3,\)"),
        (dict(prompt_ids=torch.zeros(2, 0, dtype=torch.long)), "at least one token"),
        (dict(prompt_ids=torch.tensor([[1, VOCAB]])), rf"token id {VOCAB}, outside the model's vocabulary 0 .. 49"),
        (dict(prompt_ids=torch.tensor([[-1, 2]])), "token id -1, outside"),  # were IndexErrors of the embedding
        (dict(vocab_limit=0), r"vocab_limit=0 must be an int >= 1"),  # every logit -inf: NaN, then token 0
        (dict(vocab_limit=-3), r"vocab_limit=-3 must be an int >= 1"),  # counted from the end of the vocabulary
    ],
)
def test_bad_generate_arguments(kwargs, message):
    model = TransformerLM(**TINY_TRANSFORMER)
    arguments = {"prompt_ids": torch.zeros(2, 3, dtype=torch.long), "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(model, **arguments)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(moe="nope"), r"unknown MoE recipe 'nope'; recipes: base, deepseek, dense_moe"),
        (dict(moe=dict(layer="nope")), r"unknown MoE layer 'nope'; registered layers: \['base', 'dense_moe'"),
        (dict(num_heads=3), "dim=32 is not divisible by num_heads=3"),
        (dict(dim=24, num_heads=8), "rotary positions need an even head size"),
        (dict(pos_embedding="alibi"), "pos_embedding='alibi'; allowed: 'rope', 'learned'"),
        (dict(norm="batchnorm"), "norm='batchnorm'"),
        (dict(moe_blocks="every_3_last_5"), "asks for 5 MoE blocks but a TransformerLM of depth=2 has only 1"),
        (dict(moe_blocks=[]), "must select at least one MoE block"),
        (dict(moe=dict(recipe="mixtral", in_features=8)), r"recipe 'mixtral' sets \['in_features'\], which TopKMoE"),
        (dict(moe=dict(recipe="mixtral", slots_per_expert=2)), r"sets \['slots_per_expert'\], which TopKMoE does not"),
        (dict(dropout=1.0), r"dropout=1.0 must lie in \[0, 1\)"),
    ],
)
def test_bad_transformer_lm_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransformerLM(**{**TINY_TRANSFORMER, **kwargs})


def test_bad_lm_inputs():
    model = TransformerLM(**TINY_TRANSFORMER)
    with pytest.raises(ValueError, match=r"input_ids of shape \(4,\); expected \[batch, tokens\]"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="expected torch.long token ids"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"the cache holds 2 sequences but input_ids has batch 3"):
        model(torch.zeros(3, 4, dtype=torch.long), cache=model.init_cache(2))
    lstm = LSTMMoELM(**TINY_LSTM, moe=dict(recipe="noisy_top_k", num_experts=4, top_k=2))
    with pytest.raises(ValueError, match=r"the cache holds 2 sequences but input_ids has batch 3"):
        lstm(torch.zeros(3, 4, dtype=torch.long), cache=lstm.init_cache(2))
    with pytest.raises(ValueError, match="unknown MoE recipe 'nope'"):
        LSTMMoELM(**TINY_LSTM, moe="nope")
    with pytest.raises(ValueError, match="the LSTM MoE LM needs an MoE recipe"):
        LSTMMoELM(**TINY_LSTM, moe=None)
    with pytest.raises(ValueError, match="num_groups=3 must divide num_experts=16"):
        LSTMMoELM(**TINY_LSTM, moe=dict(recipe="hierarchical", num_experts=16, num_groups=3))


def test_a_runs_summary_measures_a_batch_wide_capacity_as_training_routes_it():
    """Strictly balanced gating over each position gives each expert R(k B / E) tokens of the B at a position, at
    least one: at 2 sequences every token took 16 of the 32 experts; from 8 on, the recipe's k = 4."""
    from types import SimpleNamespace

    from moekit.commands.train import _summary
    from moekit.tasks import LanguageModel

    net = {
        "_target_": "moekit.models.TransformerLM",
        **TINY_TRANSFORMER,
        "moe": {"recipe": "strictly_balanced", "balance_scope": "position"},
    }
    task = LanguageModel(net=net, vocab_size=VOCAB)
    recorded = _summary(task, SimpleNamespace(batch_size=64, seq_len=16))
    assert recorded.flops_per_token == lm_summary(task.net, seq_len=16, batch_size=64).flops_per_token
    assert recorded.flops_per_token < lm_summary(task.net, seq_len=16, batch_size=2).flops_per_token
