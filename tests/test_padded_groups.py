"""Ragged groups padded to equal ones, or each to a multiple of the row block (moekit.moe.padded_groups): the dispatch
fills the buffer and the combine reads it, the layers' values and gradients are the ragged loop's, padding adds nothing
to the weights' gradients, and each path is taken only where the table says."""

import pytest
import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from moekit.moe import StrictlyBalancedMoE, TopKMoE, kernel_choices
from moekit.moe.padded_groups import PaddedGroups, padded_rows, plan_padding

BF16 = torch.bfloat16


@pytest.fixture
def amx(monkeypatch):
    """A CPU with AMX whatever this one is, padding taken whatever it adds."""
    monkeypatch.setattr(kernel_choices, "cpu_matrix_units", lambda: "AMX")
    monkeypatch.setattr(kernel_choices, "PADDED_GROUPS_MAX_PERCENT", {"AMX": 10_000})
    monkeypatch.setattr(kernel_choices, "PADDED_GROUPS_MAX_PERCENT_DROPOUT", {"AMX": 10_000})


@pytest.fixture
def blocks(amx, monkeypatch):
    """Never equal groups; every ragged group padded to a multiple of 8 rows."""
    monkeypatch.setattr(kernel_choices, "PADDED_GROUPS_MAX_PERCENT", {})
    monkeypatch.setattr(kernel_choices, "PADDED_GROUPS_MAX_PERCENT_DROPOUT", {})
    monkeypatch.setattr(kernel_choices, "BLOCK_PADDING_MAX_PERCENT", {"AMX": 10_000})
    monkeypatch.setattr(kernel_choices, "ROW_BLOCK", 8)


def test_padded_rows_are_one_of_16_sizes_per_power_of_two():
    assert [padded_rows(n) for n in (1, 8, 9, 100, 256, 257, 3392, 4096, 4097)] == [
        8, 8, 16, 104, 256, 272, 3456, 4096, 4352
    ]  # fmt: skip
    sizes = {padded_rows(n) for n in range(2049, 4097)}
    assert len(sizes) == 16 and all(size % 128 == 0 for size in sizes)
    for n in range(1, 5000):
        assert n <= padded_rows(n) <= n + max(7, n // 16)


def test_plan_padding_maps_each_row_to_its_expert_block(amx):
    plan = plan_padding(torch.tensor([3, 0, 5, 1]), BF16, "auto")
    assert plan.group_sizes == 8 and plan.buffer_rows == 32  # the longest group, 5, rounded up to 8
    assert plan.dest_R.tolist() == [0, 1, 2, 16, 17, 18, 19, 20, 24]
    assert plan.pad_rows.tolist() == [3, 4, 5, 6, 7, *range(8, 16), 21, 22, 23, *range(25, 32)]


def test_block_padding_rounds_each_group_up_to_the_row_block_in_place(blocks):
    plan = plan_padding(torch.tensor([10, 0, 13, 8]), BF16, "auto")
    assert plan.group_sizes.tolist() == [16, 0, 16, 8] and plan.buffer_rows == 40
    assert plan.dest_R.tolist() == [*range(10), *range(16, 29), *range(32, 40)]
    assert plan.pad_rows.tolist() == [*range(10, 16), 29, 30, 31]
    x = torch.arange(4, dtype=torch.float32).view(4, 1) + 1
    tokens_R = torch.tensor([0, 1, 2, 3] * 8)[:31]
    buffer = plan.gather(x, tokens_R)
    assert torch.equal(buffer[plan.dest_R], x[tokens_R]) and torch.all(buffer[plan.pad_rows] == 0)


def test_the_buffer_holds_each_experts_tokens_in_its_block_and_zeros_and_the_combine_reads_them_back(amx):
    counts = [3, 0, 5, 1]  # 9 kept rows in dispatch order, then 2 dropped
    plan = plan_padding(torch.tensor(counts), BF16, "auto")
    x = torch.arange(6 * 2, dtype=torch.float32).view(6, 2) + 1  # 6 tokens
    tokens_R = torch.tensor([5, 0, 2, 1, 1, 3, 4, 0, 2, 3, 4])  # the token of each dispatched row
    buffer = plan.gather(x, tokens_R)
    assert buffer.shape == (32, 2)
    starts = [0, 3, 3, 8]
    for e, n in enumerate(counts):
        block = buffer[8 * e : 8 * (e + 1)]
        assert torch.equal(block[:n], x[tokens_R[starts[e] : starts[e] + n]]) and torch.all(block[n:] == 0)
    rows_A = torch.tensor([10, 4, 0, 8, 9, 1, 2, 3, 5, 6, 7])  # each assignment's row in dispatch order (9, 10 dropped)
    assert plan.buffer_rows_of(rows_A).tolist() == [0, 17, 0, 24, 0, 1, 2, 16, 18, 19, 20]


def _run(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with torch.autocast("cpu", dtype=BF16):
        out = layer(x)
    out.float().backward(grad)
    grads = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters() if p.grad is not None]
    x.grad = None
    layer.zero_grad(set_to_none=True)
    return out.detach(), grads


LAYERS = {
    "top2-swiglu-dropless": lambda: TopKMoE(16, 32, num_experts=4, top_k=2, act_layer=nn.SiLU, gated=True),
    "top2-gelu-capacity": lambda: TopKMoE(16, 32, num_experts=4, top_k=2, capacity_factor=0.75),
    "top1-six-experts": lambda: TopKMoE(16, 32, num_experts=6, top_k=1),
}


@pytest.mark.parametrize("padding", ["equal", "blocks"])
@pytest.mark.parametrize("name", LAYERS)
def test_a_padded_layer_gives_the_ragged_loops_values_and_gradients(name, padding, amx, monkeypatch, request):
    """bf16 autocast, float32 parameters: with the padding (equal groups, or each group rounded up to a block of 8
    rows) and without it (the loop on the ragged rows), the same outputs and gradients; the padding is taken."""
    monkeypatch.setattr(kernel_choices, "FLOAT32_EXPERT_ROWS", {})  # every expert in bf16 on both paths
    if padding == "blocks":
        request.getfixturevalue("blocks")
    torch.manual_seed(0)
    layer = LAYERS[name]().train()
    x = torch.randn(2, 15, 16, requires_grad=True)
    grad = torch.randn(2, 15, 16)
    gathers = []
    real_gather = PaddedGroups.gather
    monkeypatch.setattr(PaddedGroups, "gather", lambda self, *a: gathers.append(self) or real_gather(self, *a))
    out, grads = _run(layer, x, grad)
    assert len(gathers) == 1, "the padding was taken"
    assert isinstance(gathers[0].group_sizes, int) == (padding == "equal")
    monkeypatch.setattr(kernel_choices, "PADDED_GROUPS_MAX_PERCENT", {})
    monkeypatch.setattr(kernel_choices, "BLOCK_PADDING_MAX_PERCENT", {})
    want_out, want_grads = _run(layer, x, grad)
    assert len(gathers) == 1, "the reference ran on the ragged rows"
    torch.testing.assert_close(out, want_out, rtol=2**-7, atol=1e-3)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=2**-6, atol=2e-3)


def test_an_expert_without_rows_gets_no_gradient_from_its_padding_rows(amx, monkeypatch):
    torch.manual_seed(0)
    layer = TopKMoE(16, 32, num_experts=4, top_k=1).train()
    x = torch.randn(2, 15, 16).abs().requires_grad_()  # positive features: expert 3's logit is -100 x their sum
    with torch.no_grad():
        layer.router.weight[3] = -100.0
    gathers = []
    real_gather = PaddedGroups.gather
    monkeypatch.setattr(PaddedGroups, "gather", lambda self, *a: gathers.append(self) or real_gather(self, *a))
    with torch.autocast("cpu", dtype=BF16):
        out = layer(x)
    out.float().backward(torch.randn(2, 15, 16))
    (plan,) = gathers
    has_rows = torch.bincount(plan.dest_R // plan.group_sizes, minlength=4) > 0
    assert not has_rows[3] and has_rows.any(), "expert 3's block is all padding"
    bank = layer.experts
    for grad in (bank.fc1_weight.grad, bank.fc1_bias.grad, bank.fc2_weight.grad, bank.fc2_bias.grad):
        assert torch.equal(grad.flatten(1).abs().sum(1) > 0, has_rows)  # a gradient exactly where an expert has rows


def test_strictly_balanced_gating_at_its_thresholds_runs_padded_like_ragged(amx, monkeypatch):
    monkeypatch.setattr(kernel_choices, "FLOAT32_EXPERT_ROWS", {})
    torch.manual_seed(0)
    layer = StrictlyBalancedMoE(16, 32, num_experts=4, top_k=2).train()
    x = torch.randn(2, 15, 16, requires_grad=True)
    grad = torch.randn(2, 15, 16)
    layer(x)  # the first training batch sets the thresholds
    layer.eval()  # then a tokens-choice dispatch at the thresholds
    gathers = []
    real_gather = PaddedGroups.gather
    monkeypatch.setattr(PaddedGroups, "gather", lambda self, *a: gathers.append(self) or real_gather(self, *a))
    out, grads = _run(layer, x, grad)
    assert len(gathers) == 1
    monkeypatch.setattr(kernel_choices, "PADDED_GROUPS_MAX_PERCENT", {})
    want_out, want_grads = _run(layer, x, grad)
    torch.testing.assert_close(out, want_out, rtol=2**-7, atol=1e-3)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=2**-6, atol=2e-3)


def test_padding_is_left_out_where_it_would_cost_or_mislead(amx, monkeypatch):
    counts = torch.tensor([10, 1, 1, 1])
    assert plan_padding(counts, BF16, "auto") is not None  # 64 buffer rows for 13: taken at the fixture's limit
    assert plan_padding(counts, torch.float32, "auto") is None  # float32 rows
    assert plan_padding(counts, BF16, "loop") is None  # a kernel the user chose
    with FlopCounterMode(display=False):  # the FLOP counter would count the padding
        assert plan_padding(counts, BF16, "auto") is None
    monkeypatch.setattr(kernel_choices, "PADDED_GROUPS_MAX_PERCENT", {"AMX": 25})
    assert plan_padding(counts, BF16, "auto") is None  # 64 rows for 13: 392% more
    assert plan_padding(torch.tensor([4, 3, 3, 3]), BF16, "auto") is None  # 32 rows for 13
    assert plan_padding(torch.tensor([16] * 4), BF16, "auto") is not None
    monkeypatch.setattr(kernel_choices, "cpu_matrix_units", lambda: "")  # a CPU without an entry
    assert plan_padding(torch.tensor([16] * 4), BF16, "auto") is None


def test_block_padding_is_taken_within_its_limit_where_equal_groups_are_not(blocks, monkeypatch):
    monkeypatch.setattr(kernel_choices, "BLOCK_PADDING_MAX_PERCENT", {"AMX": 20})
    assert isinstance(plan_padding(torch.tensor([30, 0, 11]), BF16, "auto").group_sizes, Tensor)  # 48 for 41: 17%
    assert plan_padding(torch.tensor([30, 0, 11]), BF16, "auto", dropout=True) is not None  # dropout: the same limit
    assert plan_padding(torch.tensor([30, 0, 9]), BF16, "auto") is None  # 48 for 39: 23%
    assert plan_padding(torch.tensor([16, 0, 8]), BF16, "auto") is None  # whole blocks already: nothing to pad
    assert plan_padding(torch.tensor([30, 0, 11]), torch.float32, "auto") is None  # float32 rows: no blocks
    monkeypatch.setattr(kernel_choices, "PADDED_GROUPS_MAX_PERCENT", {"AMX": 50})
    assert plan_padding(torch.tensor([30, 24, 28]), BF16, "auto").group_sizes == 32  # equal groups where they fit
    monkeypatch.setattr(kernel_choices, "cpu_matrix_units", lambda: "")
    assert plan_padding(torch.tensor([30, 0, 11]), BF16, "auto") is None


def test_experts_that_drop_out_take_the_dropout_limit_in_training_only(amx, monkeypatch):
    monkeypatch.setattr(kernel_choices, "PADDED_GROUPS_MAX_PERCENT", {"AMX": 30})
    monkeypatch.setattr(kernel_choices, "PADDED_GROUPS_MAX_PERCENT_DROPOUT", {"AMX": 15})
    counts = torch.tensor([24, 20, 20, 16])  # 96 buffer rows for 80: 20% more
    assert plan_padding(counts, BF16, "auto") is not None
    assert plan_padding(counts, BF16, "auto", dropout=True) is None
    assert plan_padding(torch.tensor([24, 24, 22, 22]), BF16, "auto", dropout=True) is not None  # 96 for 92
    x = torch.zeros(1, 16, dtype=BF16)
    for drop, padded_in_training in ((0.1, False), ((0.0, 0.1), False), (0.0, True)):
        layer = TopKMoE(16, 32, num_experts=4, top_k=2, drop=drop)
        assert (layer.experts.padding(counts, x) is not None) == padded_in_training, drop
        layer.eval()  # no masks drawn
        assert layer.experts.padding(counts, x) is not None


def test_an_expert_parallel_bank_runs_its_ragged_rows(amx):
    layer = TopKMoE(16, 32, num_experts=4, top_k=2)
    counts = torch.tensor([8, 8, 8, 6])
    assert layer.experts.padding(counts, torch.zeros(1, 16, dtype=BF16)) is not None
    layer.experts.ep_group = object()  # as shard_ leaves it: the rows arrive from the other ranks
    assert layer.experts.padding(counts, torch.zeros(1, 16, dtype=BF16)) is None
