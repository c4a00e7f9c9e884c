"""Ragged groups padded to equal ones (moekit.moe.padded_groups): the bank's values and gradients are the ragged
loop's, padding adds nothing to the weights' gradients, and the path is taken only where the table says."""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from moekit.moe import ExpertBank, kernel_choices
from moekit.moe.padded_groups import PaddedGroups, padded_rows, plan_padding


@pytest.fixture
def amx(monkeypatch):
    """A CPU with AMX whatever this one is, padding taken whatever it adds."""
    monkeypatch.setattr(kernel_choices, "cpu_matrix_units", lambda: "AMX")
    monkeypatch.setattr(kernel_choices, "PADDED_GROUPS_MAX_PERCENT", {"AMX": 10_000})


def test_padded_rows_are_one_of_16_sizes_per_power_of_two():
    assert [padded_rows(n) for n in (1, 8, 9, 100, 256, 257, 3392, 4096, 4097)] == [
        8, 8, 16, 104, 256, 272, 3456, 4096, 4352
    ]  # fmt: skip
    sizes = {padded_rows(n) for n in range(2049, 4097)}
    assert len(sizes) == 16 and all(size % 128 == 0 for size in sizes)
    for n in range(1, 5000):
        assert n <= padded_rows(n) <= n + max(7, n // 16)


def test_pad_puts_each_expert_at_its_block_and_unpad_returns_the_rows_and_a_zero_tail():
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.arange(11 * 2, dtype=torch.float32).view(11, 2) + 1  # 9 rows of the groups, a tail of 2
    plan = PaddedGroups(dest_R=torch.tensor([0, 1, 2, 16, 17, 18, 19, 20, 24]), rows_per_expert=8, num_experts=4)
    buffer = plan.pad(x)
    assert buffer.shape == (32, 2)
    starts = [0, 3, 3, 8]
    for e, n in enumerate(counts.tolist()):
        block = buffer[8 * e : 8 * (e + 1)]
        assert torch.equal(block[:n], x[starts[e] : starts[e] + n]) and torch.all(block[n:] == 0)
    back = plan.unpad(buffer * 2, 11)
    assert torch.equal(back[:9], 2 * x[:9]) and torch.all(back[9:] == 0)


def test_plan_padding_maps_each_row_to_its_expert_block(amx):
    counts = torch.tensor([3, 0, 5, 1])
    plan = plan_padding(torch.zeros(11, 2, dtype=torch.bfloat16), counts, "auto")
    assert plan.rows_per_expert == 8 and plan.num_experts == 4  # the longest group, 5, rounded up to 8
    assert plan.dest_R.tolist() == [0, 1, 2, 16, 17, 18, 19, 20, 24]


@pytest.mark.parametrize("gated", [False, True])
def test_a_padded_bank_gives_the_ragged_loops_values_and_gradients(gated, amx, monkeypatch):
    """bf16 autocast, float32 parameters, an empty expert and a tail of dropped rows: with the padding and without it
    (the loop on the ragged rows), the same outputs and gradients, the tail zero; the padding is taken."""
    monkeypatch.setattr(kernel_choices, "FLOAT32_EXPERT_ROWS", {})  # every expert in bf16 on both paths
    torch.manual_seed(0)
    bank = ExpertBank(4, 16, 32, act_layer=nn.SiLU if gated else nn.GELU, gated=gated)
    counts = torch.tensor([9, 0, 14, 5])
    x = torch.randn(30, 16, requires_grad=True)  # 28 rows of the groups, a tail of 2
    grad = torch.randn(30, 16)
    pads = []
    real_pad = PaddedGroups.pad
    monkeypatch.setattr(PaddedGroups, "pad", lambda self, t: pads.append(self.rows_per_expert) or real_pad(self, t))

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = bank(x.to(torch.bfloat16), counts)
        out.float().backward(grad)
        grads = [x.grad.clone()] + [p.grad.clone() for p in bank.parameters()]
        x.grad = None
        bank.zero_grad(set_to_none=True)
        return out.detach(), grads

    out, grads = run()
    assert pads == [16], "the padding was taken: each expert's rows in a block of 16"
    monkeypatch.setattr(kernel_choices, "PADDED_GROUPS_MAX_PERCENT", {})
    want_out, want_grads = run()
    assert pads == [16], "the reference ran on the ragged rows"
    assert torch.all(out[28:] == 0)
    torch.testing.assert_close(out, want_out, rtol=2**-7, atol=1e-3)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=2**-6, atol=2e-3)
    assert torch.all(grads[1][1] == 0), "the empty expert's fc1 weight gets no gradient from its padded rows"


def test_padding_is_left_out_where_it_would_cost_or_mislead(amx, monkeypatch):
    x, counts = torch.zeros(13, 4, dtype=torch.bfloat16), torch.tensor([10, 1, 1, 1])
    assert plan_padding(x, counts, "auto") is not None  # 64 buffer rows for 13: taken at the fixture's limit
    assert plan_padding(x.float(), counts, "auto") is None  # float32 rows
    assert plan_padding(x, counts, "loop") is None  # a kernel the user chose
    with FlopCounterMode(display=False):  # the FLOP counter would count the padding
        assert plan_padding(x, counts, "auto") is None
    monkeypatch.setattr(kernel_choices, "PADDED_GROUPS_MAX_PERCENT", {"AMX": 25})
    assert plan_padding(x, counts, "auto") is None  # 64 rows for 13: 392% more
    assert plan_padding(x, torch.tensor([4, 3, 3, 3]), "auto") is None  # 32 rows for 13
    assert plan_padding(torch.zeros(64, 4, dtype=torch.bfloat16), torch.tensor([16] * 4), "auto") is not None
    monkeypatch.setattr(kernel_choices, "cpu_matrix_units", lambda: "")  # a CPU without an entry
    assert plan_padding(torch.zeros(64, 4, dtype=torch.bfloat16), torch.tensor([16] * 4), "auto") is None
