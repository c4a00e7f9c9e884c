"""Mixture-of-Depths models under FSDP2 (``trainer=fsdp``): ``fully_shard`` takes no scalar parameter, so the depth
router's bias is ``[1]``; checkpoints with the earlier scalar bias still load."""

from __future__ import annotations

import torch

from distributed import spawn
from moekit.models import TransformerLM, create_model
from moekit.moe import DepthRouter
from moekit.parallel import sharding_units
from moekit.recipes.depth import DepthSpec

LM = dict(vocab_size=50, max_seq_len=16, dim=32, depth=2, num_heads=2, moe=None)


def _train_step_sharded(rank: int, world: int) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    for mod in (dict(capacity=0.25, blocks="all"), dict(capacity=0.25, blocks="all", causal_router="predictor")):
        torch.manual_seed(0)
        net = TransformerLM(**LM, mod=mod).train()
        reference = TransformerLM(**LM, mod=mod).train()
        reference.load_state_dict(net.state_dict())
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if "causal_router" in mod else MixedPrecisionPolicy()
        for unit in sharding_units(net):
            fully_shard(unit, mp_policy=policy)
        fully_shard(net, mp_policy=policy)
        ids = torch.randint(50, (2, 16), generator=torch.Generator().manual_seed(rank))
        logits = net(ids)
        logits.float().square().mean().backward()
        if "causal_router" not in mod:  # float32: the sharded model computes the unsharded one's logits
            torch.testing.assert_close(logits, reference(ids), atol=1e-5, rtol=1e-5)


def test_a_mod_lm_trains_under_fsdp2():
    spawn(_train_step_sharded, 2)


def test_a_checkpoint_with_the_earlier_scalar_router_bias_loads():
    router = DepthRouter(8, DepthSpec(), causal=True)
    assert all(p.dim() >= 1 for p in router.parameters()), "fully_shard refuses scalar parameters"
    state = {"weight": torch.randn(1, 8), "bias": torch.tensor(0.5)}
    router.load_state_dict(state)
    assert router.bias.shape == (1,) and router.bias.item() == 0.5
    vit = create_model("vit_tiny_patch4_28", num_classes=10, in_chans=1, img_size=28, mod=dict(capacity=0.25))
    old = {k: v.reshape(()) if k.endswith("depth_router.bias") else v for k, v in vit.state_dict().items()}
    vit.load_state_dict(old)
