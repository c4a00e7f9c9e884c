"""Expert parallelism equals the unsharded layer: on every rank, the output and input gradient of
the expert-parallel layer equal those of the full layer on that rank's tokens; router gradients are
the local ones; each expert's gradient on its holder is the sum over ranks of the full layer's
gradients. Tokens-choice (dropless and with binding capacity + BPR), experts-choice and Soft MoE, on
2 and 4 gloo processes; ranks get different batch sizes so the exchanged counts are uneven."""

import copy

import pytest
import torch
import torch.distributed as dist

from distributed import spawn
from moekit.moe import ExpertsChoiceMoE, LoryMoE, SoftMoE, TopKMoE
from moekit.parallel import ExpertParallelGroups, new_expert_parallel_groups, shard_experts, sharded_expert_banks

pytestmark = pytest.mark.e2e  # fits models in subprocesses (make test-fast leaves it out)

DIM, HIDDEN, EXPERTS = 12, 16, 8

CASES = {
    "top2_dropless": lambda: TopKMoE(DIM, HIDDEN, num_experts=EXPERTS, top_k=2, normalize_gates=True),
    "top1_capacity_bpr": lambda: TopKMoE(
        DIM, HIDDEN, num_experts=EXPERTS, top_k=1, capacity_factor=0.5, batch_priority=True, switch_loss_weight=0.01
    ),
    "top2_gated_shared": lambda: TopKMoE(
        DIM, HIDDEN, num_experts=EXPERTS, top_k=2, gated=True, num_shared_experts=1, capacity_factor=1.0
    ),
    "experts_choice": lambda: ExpertsChoiceMoE(DIM, HIDDEN, num_experts=EXPERTS, capacity_factor=1.5),
    "soft_moe": lambda: SoftMoE(DIM, HIDDEN, num_experts=EXPERTS, slots_per_expert=2),
}


def _check_layer(rank: int, world: int, name: str) -> None:
    torch.manual_seed(0)
    full = CASES[name]()
    parallel = copy.deepcopy(full)
    shard_experts(parallel, new_expert_parallel_groups(world))
    bank = parallel.experts
    assert bank.num_local_experts == EXPERTS // world and bank.expert_offset == rank * EXPERTS // world

    torch.manual_seed(100 + rank)
    batch = 2 + rank  # uneven token counts across ranks
    x = torch.randn(batch, 5, DIM)
    probe = torch.randn(batch, 5, DIM)  # a random linear functional of the output as the loss
    x_full, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_full, out_par = full(x_full), parallel(x_par)
    torch.testing.assert_close(out_par, out_full, rtol=1e-5, atol=1e-6, msg=f"{name}: output, rank {rank}")
    (out_full * probe).sum().backward()
    (out_par * probe).sum().backward()
    torch.testing.assert_close(x_par.grad, x_full.grad, rtol=1e-5, atol=1e-6, msg=f"{name}: input grad")

    expert_names = {f"experts.{p}" for p, _ in bank.named_parameters()}
    full_params = dict(full.named_parameters())
    for pname, param in parallel.named_parameters():
        reference = full_params[pname].grad
        if pname in expert_names:
            reference = reference.clone()
            dist.all_reduce(reference)  # the holder's gradient sums every rank's tokens
            reference = reference[bank.expert_offset : bank.expert_offset + bank.num_local_experts]
        torch.testing.assert_close(param.grad, reference, rtol=1e-4, atol=1e-6, msg=f"{name}: grad of {pname}")
    assert set(sharded_expert_banks(parallel)) == {"experts"}  # shared experts stay replicated


def _all_cases(rank: int, world: int) -> None:
    for name in CASES:
        _check_layer(rank, world, name)
    odd = TopKMoE(DIM, HIDDEN, num_experts=world + 1, top_k=1)
    with pytest.raises(ValueError, match=f"num_experts={world + 1} cannot be split.*expert_parallel_size"):
        shard_experts(odd, new_expert_parallel_groups(world))
    with pytest.raises(ValueError, match="expert_parallel_size=3 must be a positive int dividing the world size"):
        new_expert_parallel_groups(3)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_full_layer(world):
    spawn(_all_cases, world)


def _data_parallel_step(rank: int, world: int, expert_parallel_size: int) -> None:
    """Data parallel over ``world`` ranks with experts split over groups of ``expert_parallel_size``:
    after DDP's mean of the replicated gradients and :func:`sync_expert_gradients`, every gradient
    equals the full layer's gradient of the mean loss over all ranks' batches, and
    :func:`clip_grad_norm_` sees the full model's gradient norm."""
    from moekit.parallel import clip_grad_norm_, sync_expert_gradients

    torch.manual_seed(0)
    full = CASES["top2_gated_shared"]()
    parallel = copy.deepcopy(full)
    groups = new_expert_parallel_groups(expert_parallel_size)
    shard_experts(parallel, groups)
    bank = parallel.experts

    inputs = [torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
    probes = [torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(50 + r)) for r in range(world)]
    reference_loss = sum((full(x) * probe).sum() for x, probe in zip(inputs, probes)) / world
    reference_loss.backward()
    (parallel(inputs[rank]) * probes[rank]).sum().backward()

    experts = list(bank.parameters())
    expert_ids = {id(p) for p in experts}
    for param in parallel.parameters():  # what DDP does to the replicated parameters
        if id(param) not in expert_ids:
            dist.all_reduce(param.grad)
            param.grad /= world
    sync_expert_gradients(experts, groups)

    full_params = dict(full.named_parameters())
    local = slice(bank.expert_offset, bank.expert_offset + bank.num_local_experts)
    for name, param in parallel.named_parameters():
        reference = full_params[name].grad
        reference = reference[local] if id(param) in expert_ids else reference
        torch.testing.assert_close(param.grad, reference, rtol=1e-4, atol=1e-6, msg=f"grad of {name}")

    reference_norm = torch.nn.utils.clip_grad_norm_(full.parameters(), max_norm=0.1)
    norm = clip_grad_norm_(list(parallel.parameters()), experts, 0.1, groups)
    torch.testing.assert_close(norm, reference_norm, rtol=1e-5, atol=1e-7)
    for name, param in parallel.named_parameters():  # both clipped by the same factor
        reference = full_params[name].grad
        reference = reference[local] if id(param) in expert_ids else reference
        torch.testing.assert_close(param.grad, reference, rtol=1e-4, atol=1e-7, msg=f"clipped grad of {name}")


def test_data_parallel_with_expert_groups_matches_full_model():
    spawn(_data_parallel_step, 4, 2)  # 2 expert groups of 2 ranks: experts replicated twice


def test_merged_experts_are_refused_before_any_bank_is_sharded():
    """Lory merges every expert into one for each token: no rank could compute a token with a block of them."""
    model = torch.nn.Sequential(TopKMoE(DIM, HIDDEN, num_experts=EXPERTS), LoryMoE(DIM, HIDDEN, num_experts=EXPERTS))
    with pytest.raises(ValueError, match=r"cannot split 1 \(LoryMoE\): a layer that merges .*expert_parallel_size=1"):
        shard_experts(model, ExpertParallelGroups(None, None, size=2, world_size=2))  # before any process group
    assert not sharded_expert_banks(model), "nothing may be sharded when the model is refused"


def test_fsdp_strategy_refuses_bad_settings_with_the_fix():
    from moekit.parallel import MoEFSDPStrategy

    with pytest.raises(ValueError, match="state_dict_type='sharded' with expert_parallel_size=2.*state_dict_type=full"):
        MoEFSDPStrategy(expert_parallel_size=2, state_dict_type="sharded")
    with pytest.raises(ValueError, match="expert_parallel_size=0 must be a positive int"):
        MoEFSDPStrategy(expert_parallel_size=0)
    with pytest.raises(ValueError, match="state_dict_type='zip'"):
        MoEFSDPStrategy(state_dict_type="zip")


def test_bench_parallel_counts_the_bytes_of_the_cost_model(tmp_path):
    """scripts/bench_parallel.py on 2 processes: Soft MoE with 32 experts x 1 slot on sequences of 64
    tokens sends r = 0.5 rows per token; expert parallelism moves 4 r d b (P - 1) / P bytes per token
    and layer (d = 256, float32, P = 2): 1024 tokens x 2 layers x 1 KiB = 2 MiB per step."""
    from conftest import run_script

    args = ["--worlds", "2", "--layer", "soft_moe", "--experts", "32", "--dim", "256", "--hidden", "64"]
    result = run_script("bench_parallel.py", *args, "--tokens", "1024", "--steps", "1", "--warmup", "0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {line.split()[2]: line.split() for line in result.stdout.splitlines() if line.startswith(" 2 soft_moe")}
    assert float(rows["expert-parallel"][4]) == pytest.approx(2.0, abs=0.005)
    assert float(rows["replicated"][4]) == 0.0
    assert float(rows["expert-parallel"][5]) < float(rows["replicated"][5]) / 10  # only the router's gradient
