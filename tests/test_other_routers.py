"""Experts-choice, BASE, hash, hierarchical, dense-mixture and Lory layers."""

import pytest
import torch
from scipy.optimize import linear_sum_assignment

from conftest import reference_expert, reference_lory, reference_tokens_choice
from moekit.models import TransformerLM, fit_hash_routing
from moekit.moe import BaseMoE, DenseMoE, ExpertsChoiceMoE, HashMoE, HierarchicalMoE, LoryMoE
from moekit.moe.assignment import balanced_assignment, balanced_capacities, resolve_solver
from moekit.moe.losses import cv_squared, load_probabilities, smooth_load

TINY_LM = dict(max_seq_len=24, dim=32, depth=2, num_heads=2, mlp_ratio=2.0)


# ----------------------------------------------------------------------------- experts-choice
def test_experts_choice_exact_loads_and_reference_output():
    layer = ExpertsChoiceMoE(8, 16, num_experts=4, capacity_factor=1.5)
    x = torch.randn(2, 10, 8)
    flat = x.reshape(-1, 8)
    token_idx, gates, probs, _ = layer.route(flat)
    torch.testing.assert_close(probs, torch.softmax(flat @ layer.router_weight.t(), -1))  # over the experts
    assert token_idx.shape == (4, 8)  # C = round(20 * 1.5 / 4) = 7.5 -> 8
    for e in range(4):
        assert len(set(token_idx[e].tolist())) == 8, "an expert takes C distinct tokens"
        # its top-C tokens by router probability
        assert set(token_idx[e].tolist()) == set(probs[:, e].topk(8).indices.tolist())
    torch.testing.assert_close(gates, probs.gather(0, token_idx.t()).t())
    expected = torch.zeros(20, 8)
    for e in range(4):
        for c in range(8):
            n = token_idx[e, c]
            expected[n] += gates[e, c] * reference_expert(layer.experts, e, flat[n : n + 1])[0]
    torch.testing.assert_close(layer(x), expected.view(2, 10, 8), rtol=1e-5, atol=1e-6)
    assert layer.stats["mean_experts_per_token"] == pytest.approx(32 / 20)


def test_experts_choice_eval_capacity_and_errors():
    layer = ExpertsChoiceMoE(8, 16, num_experts=4, capacity_factor=1.0, eval_capacity_factor=2.0)
    assert layer.train().tokens_per_expert(20) == 5 and layer.eval().tokens_per_expert(20) == 10
    with pytest.raises(ValueError, match="capacity_factor=0"):
        ExpertsChoiceMoE(8, 16, num_experts=4, capacity_factor=0)
    with pytest.raises(ValueError, match="capacity_factor=5"):
        ExpertsChoiceMoE(8, 16, num_experts=4, capacity_factor=5)
    assert not layer.causal_safe


# ----------------------------------------------------------------------------- BASE
def _optimal_total(scores, caps):
    columns = torch.repeat_interleave(torch.arange(scores.shape[1]), caps)
    cost = scores[:, columns].double().numpy()
    rows, cols = linear_sum_assignment(-cost)
    return cost[rows, cols].sum()


@pytest.mark.parametrize("tokens, experts, skew", [(24, 4, 0.0), (50, 8, 0.0), (60, 6, 3.0), (200, 16, 1.0)])
def test_balanced_assignment_is_exact_and_optimal(tokens, experts, skew):
    scores = torch.randn(tokens, experts)
    scores[:, 0] += skew  # one popular expert
    caps = balanced_capacities(tokens, experts)
    assignment = balanced_assignment(scores, caps)
    assert torch.equal(torch.bincount(assignment, minlength=experts), caps)
    total = scores.double().gather(1, assignment.unsqueeze(1)).sum().item()
    assert total == pytest.approx(_optimal_total(scores, caps), abs=1e-6)


def test_balanced_assignment_ties_and_uneven_capacities():
    assert torch.bincount(balanced_assignment(torch.zeros(10, 3)), minlength=3).tolist() == [4, 3, 3]
    caps = torch.tensor([5, 0, 1, 2])
    scores = torch.randn(8, 4)
    assert torch.equal(torch.bincount(balanced_assignment(scores, caps), minlength=4), caps)
    with pytest.raises(ValueError, match="summing to the 8 tokens"):
        balanced_assignment(scores, torch.tensor([1, 1, 1, 1]))


@pytest.mark.parametrize("tokens, experts, skew", [(200, 16, 1.0), (1024, 64, 2.0), (4096, 8, 0.5)])
def test_the_sync_free_solver_is_balanced_and_near_the_optimum(tokens, experts, skew):
    """Exact loads; on these random affinities 95-100% of the tokens where the exact solver puts them (95.0%, 97.2%,
    99.9% here) and a total affinity within 2% of the optimum (0.95%, 0.42%, 0.03% below it)."""
    scores = torch.randn(tokens, experts)
    scores[:, 0] += skew
    caps = balanced_capacities(tokens, experts)
    assignment = balanced_assignment(scores, caps, solver="sync_free")
    assert torch.equal(torch.bincount(assignment, minlength=experts), caps)
    exact = balanced_assignment(scores, caps, solver="exact")
    assert (assignment == exact).float().mean() >= 0.94
    total, optimum = (scores.double().gather(1, a.unsqueeze(1)).sum() for a in (assignment, exact))
    assert (optimum - total) / optimum.abs() <= 0.02
    # Where each token's favourite already balances the loads, both solvers give it.
    favourites = torch.arange(tokens) % experts
    easy = torch.randn(tokens, experts) + 10 * torch.nn.functional.one_hot(favourites, experts)
    assert torch.equal(balanced_assignment(easy, caps, solver="sync_free"), favourites)


def test_the_sync_free_solver_takes_uneven_and_zero_capacities_and_device_counts():
    scores = torch.randn(8, 4)
    caps = torch.tensor([5, 0, 1, 2])
    assert torch.equal(torch.bincount(balanced_assignment(scores, caps, solver="sync_free"), minlength=4), caps)
    with pytest.raises(RuntimeError, match="capacities must sum to the tokens"):
        balanced_assignment(scores, torch.tensor([1, 1, 1, 1]), solver="sync_free")
    for n in (0, 3, 8, 13):  # a count held on the device gives the same capacities as the int
        assert torch.equal(balanced_capacities(torch.tensor(n), 4), balanced_capacities(n, 4))
    assert resolve_solver("auto", torch.device("cpu")) == "exact"
    assert resolve_solver("auto", torch.device("cuda")) == "sync_free"
    with pytest.raises(ValueError, match="solver='hungarian'; allowed: 'auto', 'exact', 'sync_free'"):
        BaseMoE(8, 16, num_experts=4, solver="hungarian")


@pytest.mark.parametrize("solver", ["exact", "sync_free"])
def test_base_layer_shares_the_experts_among_the_real_tokens(solver):
    layer = BaseMoE(8, 16, num_experts=4, solver=solver).train()
    x = torch.randn(2, 12, 8)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 7:] = False  # 19 real tokens
    routing = layer.router(x.reshape(-1, 8), None, mask.reshape(-1))
    experts = routing.expert_ids[:, 0]
    assert torch.bincount(experts[mask.reshape(-1)], minlength=4).tolist() == [5, 5, 5, 4]
    assert experts[~mask.reshape(-1)].tolist() == [0] * 5
    out = layer(x, padding_mask=mask)
    assert torch.equal(out[1, 7:], torch.zeros(5, 8)), "padding is dropped"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_base_layer_expert_embeddings_start_orthogonal_with_gain_a_tenth(dtype):
    """As the paper's code (fairseq's BaseLayer): W W^T = 0.01 I for E <= d (and W^T W = 0.01 I for E > d)."""
    for experts, dim in ((4, 8), (16, 8)):
        weight = BaseMoE(dim, 16, num_experts=experts, dtype=dtype).router.weight.float()
        gram = weight @ weight.t() if experts <= dim else weight.t() @ weight
        torch.testing.assert_close(
            gram, 0.01 * torch.eye(min(experts, dim)), atol=2e-4 if dtype == torch.float32 else 2e-3, rtol=0
        )


def test_base_layer_balanced_in_training_greedy_at_inference():
    layer = BaseMoE(8, 16, num_experts=4)
    x = torch.randn(2, 12, 8)
    flat = x.reshape(-1, 8)
    layer.train()
    routing = layer.router(flat, None)
    assert torch.bincount(routing.expert_ids[:, 0], minlength=4).tolist() == [6, 6, 6, 6]
    scores = flat @ layer.router.weight.t()
    torch.testing.assert_close(routing.gates[:, 0], torch.sigmoid(scores.gather(1, routing.expert_ids)[:, 0]))
    plan = layer.plan(routing, x.shape[0], x.shape[1])
    ref = reference_tokens_choice(layer, x, routing.expert_ids, routing.gates, plan.keep)
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-6)
    assert layer.stats["load_cv"] == 0
    layer.eval()
    assert torch.equal(layer.router(flat, None).expert_ids[:, 0], scores.argmax(-1))
    assert not layer.causal_safe


# ----------------------------------------------------------------------------- hash
def test_hash_routing_is_fixed_balanced_and_needs_ids():
    layer = HashMoE(8, 16, num_experts=4, vocab_size=10, hash_seed=3)
    table = layer.router.expert_of_token
    assert sorted(torch.bincount(table, minlength=4).tolist()) == [2, 2, 3, 3]
    again = HashMoE(8, 16, num_experts=4, vocab_size=10, hash_seed=3)
    assert torch.equal(table, again.router.expert_of_token), "the map depends on the seed only"
    ids = torch.tensor([[1, 2, 1, 9]])
    x = torch.randn(1, 4, 8)
    out = layer(x, token_ids=ids)
    for t in range(4):
        e = int(table[ids[0, t]])
        torch.testing.assert_close(out[0, t], reference_expert(layer.experts, e, x[0, t : t + 1])[0])
    assert layer.causal_safe
    with pytest.raises(ValueError, match="token_ids"):
        layer(x)
    with pytest.raises(ValueError, match="4 tokens"):
        layer(x, token_ids=torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="vocab_size"):
        HashMoE(8, 16, num_experts=4, vocab_size=0)


def test_modulo_hash():
    layer = HashMoE(8, 16, num_experts=4, vocab_size=10, hash_method="modulo")
    assert layer.router.expert_of_token.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


def test_frequency_hash_balances_the_corpus_tokens_not_the_vocabulary():
    # Zipf-like counts: the random table, balanced over ids, is unbalanced over tokens
    counts = torch.tensor([400, 200, 130, 100, 80, 65, 57, 50, 44, 40, 36, 33, 30, 28, 26, 25])
    tokens = torch.repeat_interleave(torch.arange(16), counts)
    model = TransformerLM(
        **{**TINY_LM, "vocab_size": 16}, moe=dict(recipe="hash", num_experts=4, hash_method="frequency")
    )
    layer = model.blocks[1].mlp
    with pytest.raises(ValueError, match="has no table yet: fit it first with moekit.models.fit_hash_routing"):
        model(tokens[None, :8])
    assert fit_hash_routing(model, tokens) == ["blocks.0.mlp", "blocks.1.mlp"]
    table = layer.router.expert_of_token
    per_expert = torch.zeros(4, dtype=torch.long).index_add_(0, table, counts)
    # the greedy assignment by hand (each count, largest first, to the lightest expert, ties to the lower index):
    # 400 | 200 44 36 26 25 | 130 65 50 33 28 | 100 80 57 40 30
    assert per_expert.tolist() == [400, 331, 306, 307]
    random_table = HashMoE(8, 16, num_experts=4, vocab_size=16).router.expert_of_token
    random_load = torch.zeros(4, dtype=torch.long).index_add_(0, random_table, counts)
    assert per_expert.float().std() < random_load.float().std()
    assert fit_hash_routing(model, tokens) == [], "a fitted table is kept"
    restored = TransformerLM(
        **{**TINY_LM, "vocab_size": 16}, moe=dict(recipe="hash", num_experts=4, hash_method="frequency")
    )
    restored.load_state_dict(model.state_dict())
    assert not restored.blocks[1].mlp.router.needs_fit and torch.equal(
        restored.blocks[1].mlp.router.expert_of_token, table
    )


def test_clustered_hash_sends_each_embedding_cluster_to_one_expert():
    torch.manual_seed(0)
    model = TransformerLM(
        **{**TINY_LM, "vocab_size": 40}, moe=dict(recipe="hash", num_experts=4, hash_method="clustered")
    )
    centres = torch.randn(4, 32) * 10
    true_cluster = torch.arange(40) % 4
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(centres[true_cluster] + torch.randn(40, 32))
    fit_hash_routing(model)
    table = model.blocks[1].mlp.router.expert_of_token
    # the same partition as the true clusters, up to the names of the experts
    for cluster in range(4):
        assert table[true_cluster == cluster].unique().numel() == 1
    assert table.unique().numel() == 4
    with pytest.raises(ValueError, match="fit_clusters is for hash_method='clustered'; this router's is 'random'"):
        HashMoE(8, 16, num_experts=4, vocab_size=10).router.fit_clusters(torch.randn(10, 8))
    with pytest.raises(ValueError, match="hash_method='md5'; allowed: 'random', 'modulo', 'frequency', 'clustered'"):
        HashMoE(8, 16, num_experts=4, vocab_size=10, hash_method="md5")


# ----------------------------------------------------------------------------- hierarchical
def test_hierarchical_routing_structure_and_output():
    layer = HierarchicalMoE(8, 16, num_experts=12, num_groups=3, top_k_groups=2, top_k=2).eval()
    x = torch.randn(2, 6, 8)
    flat = x.reshape(-1, 8)
    routing = layer.router(flat, None)
    assert routing.expert_ids.shape == (12, 4)
    groups = routing.expert_ids // 4
    for row in groups.tolist():
        assert len(set(row)) == 2 and sorted(row).count(row[0]) == 2, "2 experts in each of 2 groups"
    torch.testing.assert_close(routing.gates.sum(-1), torch.ones(12))  # product of two softmaxes over top-k
    router = layer.router  # Shazeer's appendix B, token by token: softmax(KeepTopK) over groups, then inside each
    primary, secondary = flat @ router.primary_weight.t(), (flat @ router.secondary_weight.t()).view(12, 3, 4)
    for n in range(12):
        top_groups = primary[n].topk(2)
        expected = {}
        for g, g_gate in zip(top_groups.indices.tolist(), torch.softmax(top_groups.values, -1).tolist()):
            top = secondary[n, g].topk(2)
            for e, e_gate in zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()):
                expected[4 * g + e] = g_gate * e_gate
        got = dict(zip(routing.expert_ids[n].tolist(), routing.gates[n].tolist()))
        assert got.keys() == expected.keys() and all(got[e] == pytest.approx(expected[e], rel=1e-5) for e in got)
    plan = layer.plan(routing, x.shape[0], x.shape[1])
    ref = reference_tokens_choice(layer, x, routing.expert_ids, routing.gates, plan.keep)
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-6)


def test_hierarchical_groups_default_to_a_balanced_divisor():
    assert HierarchicalMoE(8, 16, num_experts=64, top_k_groups=2, top_k=2).router.num_groups == 8
    assert HierarchicalMoE(8, 16, num_experts=16, top_k=2).router.experts_per_group == 4
    with pytest.raises(ValueError, match="num_groups=3 must divide num_experts=16"):
        HierarchicalMoE(8, 16, num_experts=16, num_groups=3)
    with pytest.raises(ValueError, match=r"top_k \(experts per chosen group\)=3 must be an int in \[1, 2\]"):
        HierarchicalMoE(8, 16, num_experts=8, num_groups=4, top_k=3)


def test_hierarchical_losses_follow_appendix_b():
    layer = HierarchicalMoE(
        8,
        16,
        num_experts=6,
        num_groups=2,
        top_k_groups=1,
        top_k=2,
        importance_loss_weight=1.0,
        load_loss_weight=1.0,
    ).train()
    with torch.no_grad():
        for p in (layer.router.primary_noise, layer.router.secondary_noise):
            p.normal_(0, 0.3)
    flat = torch.randn(40, 8)
    torch.manual_seed(5)
    routing = layer.router(flat, None)
    # Recompute with the same noise draws: importance over the flat [groups * experts] gates.
    dense = torch.zeros(40, 6).scatter(1, routing.expert_ids, routing.gates)
    torch.testing.assert_close(routing.aux_losses["importance"], cv_squared(dense.sum(0)))
    torch.manual_seed(5)
    r = layer.router
    p_clean = flat @ r.primary_weight.t()
    p_std = torch.nn.functional.softplus(flat @ r.primary_noise.t())
    p_noisy = p_clean + torch.randn_like(p_clean) * p_std
    s_clean = flat @ r.secondary_weight.t()
    s_std = torch.nn.functional.softplus(flat @ r.secondary_noise.t())
    s_noisy = s_clean + torch.randn_like(s_clean) * s_std
    group = p_noisy.argmax(-1)
    load_primary = smooth_load(p_clean, p_noisy, p_std, 1)
    load_h = torch.zeros(2, 3)
    for g in range(2):
        members = group == g
        sl = slice(3 * g, 3 * g + 3)
        secondary = load_probabilities(s_clean[members, sl], s_noisy[members, sl], s_std[members, sl], 2).sum(0)
        load_h[g] = load_primary[g] * secondary / members.sum().clamp_min(1)
    torch.testing.assert_close(routing.aux_losses["load"], cv_squared(load_h.reshape(-1)), rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- dense mixture
def test_dense_mixture_runs_every_expert_on_every_token():
    layer = DenseMoE(8, 16, num_experts=3)
    x = torch.randn(2, 5, 8)
    flat = x.reshape(-1, 8)
    gates = torch.softmax(flat @ layer.router_weight.t(), -1)
    expected = sum(gates[:, e : e + 1] * reference_expert(layer.experts, e, flat) for e in range(3))
    torch.testing.assert_close(layer(x), expected.view(2, 5, 8), rtol=1e-5, atol=1e-6)
    assert layer.causal_safe


# ----------------------------------------------------------------------------- Lory
@pytest.mark.parametrize("gated, bias", [(True, False), (False, True)])
def test_lory_equals_the_segment_loop_of_the_paper(gated, bias):
    layer = LoryMoE(
        8, 16, num_experts=4, segment_len=3, act_layer=torch.nn.SiLU, bias=bias, **({"gated": True} if gated else {})
    )
    with torch.no_grad():
        layer.router_weight.normal_()
        layer.prior_logits.normal_()
    x = torch.randn(2, 10, 8)  # segments of 3, 3, 3 and 1 tokens
    torch.testing.assert_close(layer(x), reference_lory(layer, x), rtol=1e-5, atol=1e-6)
    assert layer.stats["expert_load"].sum() == pytest.approx(1.0)


def test_lory_is_fully_differentiable_and_decodes_in_pieces():
    layer = LoryMoE(8, 16, num_experts=4, segment_len=4, z_loss_weight=1e-3)
    x = torch.randn(3, 13, 8, requires_grad=True)
    out = layer(x)
    (out.square().sum() + sum(layer.aux_losses.values())).backward()
    assert layer.router_weight.grad.abs().sum() > 0 and layer.prior_logits.grad.abs().sum() > 0
    assert (layer.experts.fc1_weight.grad.flatten(1).abs().sum(1) > 0).all(), "every expert learns from every segment"
    assert x.grad[:, :12].abs().sum() > 0 and set(layer.aux_losses) == {"z"}
    with torch.no_grad():  # a decode: 5 tokens, then 1 at a time, with the carried state
        state = layer.init_state(3, x)
        pieces = [layer(x[:, :5], start=0, state=state)] + [
            layer(x[:, t : t + 1], start=t, state=state) for t in range(5, 13)
        ]
        torch.testing.assert_close(torch.cat(pieces, dim=1), out, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="start=5 without a state"):
        layer(x[:, 5:], start=5)
    with pytest.raises(ValueError, match="segment_len=0 must be a positive int"):
        LoryMoE(8, 16, segment_len=0)
