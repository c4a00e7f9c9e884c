"""One rounding rule for the rows an expert processes: tokens-choice capacity, experts-choice capacity and
Soft MoE slots, against hand-computed values."""

import pytest
import torch

from moekit.moe import Capacity, ExpertsChoiceMoE, SoftMoE, TopKMoE
from moekit.moe.capacity import experts_choice_capacity, round_capacity, soft_moe_slots, tokens_choice_capacity


@pytest.mark.parametrize(
    ("rows", "expected"),
    [(2.5, 3), (2.49, 2), (3.5, 4), (0.2, 1), (0.0, 1), (7.0, 7), (3.3000000000000003, 3), (2.4999999999, 3)],
)
def test_round_capacity_is_nearest_with_halves_up_and_at_least_one(rows, expected):
    assert round_capacity(rows) == expected


def test_tokens_choice_capacity_hand_computed():
    assert tokens_choice_capacity(num_tokens=10, top_k=2, num_experts=4, capacity_factor=1.0) == 5
    assert tokens_choice_capacity(10, 1, 4, 1.0) == 3  # 2.5, half up
    assert tokens_choice_capacity(6, 2, 4, 1.1) == 3  # 3.3000000000000003
    assert tokens_choice_capacity(100, 2, 8, 1.25) == 31  # 31.25
    assert tokens_choice_capacity(12544, 2, 8, 1.25) == 3920  # the tokens-choice ViT's batch: 256 x 49 tokens


def test_experts_choice_capacity_hand_computed_and_bounded_by_the_tokens():
    assert experts_choice_capacity(num_tokens=12544, num_experts=8, capacity_factor=2.0) == 3136
    assert experts_choice_capacity(10, 4, 1.0) == 3  # 2.5
    assert experts_choice_capacity(10, 2, 2.0) == 10  # 10 x 2 / 2 = 10 = all tokens
    assert experts_choice_capacity(5, 1, 1.0) == 5


def test_soft_moe_slots_hand_computed():
    assert soft_moe_slots(num_tokens=196, num_experts=128, capacity_factor=0.653) == 1  # the paper's S/16
    assert soft_moe_slots(49, 16, 0.653) == 2  # the main job: 16 experts x 2 slots for 49 tokens
    assert soft_moe_slots(197, 128, 0.653) == 1  # a class token does not add a slot per expert
    assert soft_moe_slots(49, 8, 256 / 49) == 32  # the scaling sweep's fixed 256 slots


def test_layers_use_the_rule():
    assert TopKMoE(8, 8, num_experts=4, top_k=1, capacity_factor=1.0).expert_capacity(10) == 3
    assert ExpertsChoiceMoE(8, 8, num_experts=4, capacity_factor=1.0).tokens_per_expert(10) == 3
    assert SoftMoE(8, 8, num_experts=16, capacity_factor=0.653, num_tokens=49).slots_per_expert == 2


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"capacity_factor": 0}, r"capacity_factor=0 must be a positive finite number, or null"),
        ({"capacity_factor": -1.0}, r"capacity_factor=-1.0 must be a positive finite number"),
        ({"eval_capacity_factor": "x"}, r"eval_capacity_factor='x' must be a positive finite number"),
        # inf passed, then every forward failed with "OverflowError: cannot convert float infinity to integer"
        ({"capacity_factor": float("inf")}, r"capacity_factor=inf must be a positive finite number, or null"),
        ({"eval_capacity_factor": float("inf")}, r"eval_capacity_factor=inf must be a positive finite number"),
        ({"capacity_scope": "sequence"}, r"capacity_scope='sequence'; allowed: 'batch', 'position', 'group'"),
        ({"capacity_scope": "group", "group_size": 0}, r"group_size=0 must be a positive int"),
        (
            {"group_size": 64},
            r"group_size=64 counts capacity per group, but capacity_scope='batch'; set capacity_scope",
        ),
    ],
)
def test_bad_capacity_settings_name_the_value(settings, message):
    with pytest.raises(ValueError, match=message):
        Capacity(**settings)


@pytest.mark.parametrize("layer", [TopKMoE, ExpertsChoiceMoE])
def test_an_infinite_factor_is_refused_when_the_layer_is_built(layer):
    """Not at the first forward, with an OverflowError that names nothing."""
    with pytest.raises(ValueError, match=r"capacity_factor=inf must be a positive finite number"):
        layer(8, 16, num_experts=4, capacity_factor=float("inf"))


@pytest.mark.parametrize("name", ["capacity_factor", "eval_capacity_factor"])
@pytest.mark.parametrize("value", [0, -1.0, float("inf"), "1.25"])
def test_setting_a_bad_factor_on_a_built_layer_is_refused_and_keeps_the_old_one(name, value):
    """What the capacity tuner and a user's own code set; 0 would silently give a capacity of one token."""
    layer = TopKMoE(8, 16, num_experts=4, capacity_factor=1.25, eval_capacity_factor=2.0)
    with pytest.raises(ValueError, match=rf"{name}={value!r} must be a positive finite number"):
        setattr(layer, name, value)
    assert getattr(layer, name) == {"capacity_factor": 1.25, "eval_capacity_factor": 2.0}[name]
    setattr(layer, name, 1.5)
    assert getattr(layer, name) == 1.5


def test_eval_capacity_factor_same_follows_the_training_factor():
    assert Capacity(capacity_factor=1.25).eval_capacity_factor == 1.25
    assert Capacity(capacity_factor=1.25, eval_capacity_factor=2.0).eval_capacity_factor == 2.0
    assert Capacity().dropless and not Capacity(eval_capacity_factor=2.0).dropless


def per_group_keep(expert_ids, batch: int, tokens: int, group_size: int, capacity: int, num_experts: int):
    """The drops of a group capacity, one sequence, group and token at a time: each token's choices in order,
    kept while the expert has taken fewer than ``capacity`` assignments of the group."""
    keep = torch.zeros_like(expert_ids, dtype=torch.bool)
    for b in range(batch):
        for begin in range(0, tokens, group_size):
            taken = [0] * num_experts
            for t in range(begin, min(begin + group_size, tokens)):
                for j, e in enumerate(expert_ids[b * tokens + t].tolist()):
                    keep[b * tokens + t, j] = taken[e] < capacity
                    taken[e] += 1
    return keep


@pytest.mark.parametrize("group_size, tokens", [(5, 12), (4, 12), (None, 12)])
def test_group_capacity_equals_the_per_group_loop_and_decodes_in_pieces(group_size, tokens):
    torch.manual_seed(0)
    layer = TopKMoE(8, 16, num_experts=4, top_k=2, capacity_factor=1.0, capacity_scope="group", group_size=group_size)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 3.0)  # decisive routing: the capacity binds
    x = torch.randn(3, tokens, 8)
    routing = layer.router(x.reshape(-1, 8))
    plan = layer.plan(routing, 3, tokens)
    size = group_size or tokens
    capacity = tokens_choice_capacity(size, 2, 4, 1.0)
    assert torch.equal(plan.keep, per_group_keep(routing.expert_ids, 3, tokens, size, capacity, 4))
    assert not plan.keep.all(), "some assignments are dropped"
    layer.eval()
    if group_size is None:  # each call would be a group of its own: a decode in pieces is refused
        with pytest.raises(ValueError, match="group_size=None counts the tokens of each call as one group"):
            layer(x[:, :3], start=0, state=layer.init_state(3, x))
        return
    with torch.no_grad():  # a decode: 3 tokens, then one at a time, carrying the group counts
        state = layer.init_state(3, x)
        pieces = [layer(x[:, :3], start=0, state=state)]
        pieces += [layer(x[:, t : t + 1], start=t, state=state) for t in range(3, tokens)]
        torch.testing.assert_close(torch.cat(pieces, dim=1), layer(x), rtol=1e-5, atol=1e-6)


def test_experts_choice_groups_equal_routing_each_group_alone():
    torch.manual_seed(0)
    grouped = ExpertsChoiceMoE(8, 16, num_experts=4, capacity_factor=1.0, group_size=6)
    whole = ExpertsChoiceMoE(8, 16, num_experts=4, capacity_factor=1.0)
    whole.load_state_dict(grouped.state_dict())
    x = torch.randn(18, 8)
    token_idx, gates, _, _ = grouped.route(x)
    assert token_idx.shape == (4, 3 * experts_choice_capacity(6, 4, 1.0)) == (4, 6)
    for g in range(3):
        idx_g, gates_g, _, _ = whole.route(x[6 * g : 6 * (g + 1)])
        torch.testing.assert_close(token_idx[:, 2 * g : 2 * (g + 1)], idx_g + 6 * g)
        torch.testing.assert_close(gates[:, 2 * g : 2 * (g + 1)], gates_g)
    assert grouped.tokens_per_expert(18) == 6
    with pytest.raises(ValueError, match=r"20 tokens \(batch x tokens\) are not whole groups of group_size=6"):
        grouped.route(torch.randn(20, 8))


def vmoe_group_keep(expert_ids, priority, num_groups: int, group_size: int, capacity: int, num_experts: int):
    """V-MoE's dispatch of each group (Riquelme et al. 2021; vmoe's ``_get_top_experts_per_item_common``): with Batch
    Prioritized Routing the group's tokens are sorted by their top gate, and all first choices claim buffer places
    before any second choice."""
    keep = torch.zeros_like(expert_ids, dtype=torch.bool)
    for g in range(num_groups):
        rows = range(g * group_size, (g + 1) * group_size)
        order = sorted(rows, key=lambda n: (-priority[n].item(), n))
        taken = [0] * num_experts
        for j in range(expert_ids.shape[1]):
            for n in order:
                e = int(expert_ids[n, j])
                keep[n, j], taken[e] = taken[e] < capacity, taken[e] + 1
    return keep


def test_group_capacity_with_batch_priority_serves_first_choices_first_as_vmoe():
    torch.manual_seed(0)
    layer = TopKMoE(
        8, 16, num_experts=4, top_k=2, capacity_factor=0.75, capacity_scope="group", group_size=6, batch_priority=True
    )
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 3.0)  # decisive routing: the capacity binds
    x = torch.randn(2, 12, 8)
    routing = layer.router(x.reshape(-1, 8))
    plan = layer.plan(routing, 2, 12)
    capacity = tokens_choice_capacity(6, 2, 4, 0.75)
    expected = vmoe_group_keep(routing.expert_ids, routing.priority, 4, 6, capacity, 4)
    assert not expected.all(), "some assignments are dropped"
    assert torch.equal(plan.keep, expected)
