"""A tour of the MoE layer library: every layer in a timm ViT block, one training step each, and the
routing statistics and auxiliary losses it records.

    python scripts/demo_moe.py
"""

from __future__ import annotations

from functools import partial

import torch
from timm.models.vision_transformer import Block

from moekit.moe import collect_moe_outputs, get_moe_layer, list_moe_layers

LAYER_KWARGS = {
    "soft_moe": dict(num_experts=8, slots_per_expert=2),
    "top_k": dict(num_experts=8, top_k=2, capacity_factor=1.25, batch_priority=True, switch_loss_weight=0.01),
    "experts_choice": dict(num_experts=8, capacity_factor=1.0),
    "base": dict(num_experts=8),
    "hash": dict(num_experts=8, vocab_size=100),
    "dense": dict(num_experts=4),
    "hierarchical": dict(num_groups=2, experts_per_group=4, importance_loss_weight=0.1, load_loss_weight=0.1),
}


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 16, 64)  # [batch, tokens, dim]
    token_ids = torch.randint(0, 100, (4, 16))
    print(f"input {tuple(x.shape)}; a timm ViT Block (dim 64, mlp_ratio 4) with each MoE layer as its MLP\n")
    for name in list_moe_layers():
        block = Block(dim=64, num_heads=4, mlp_layer=partial(get_moe_layer(name), **LAYER_KWARGS[name]))
        optimizer = torch.optim.AdamW(block.parameters(), lr=1e-3)
        if name == "hash":  # hash routing needs the token ids; call the layer directly
            out = x + block.mlp(block.norm2(x), token_ids=token_ids)
        else:
            out = block(x)
        moe = collect_moe_outputs(block)
        loss = out.pow(2).mean() + moe.aux_loss
        loss.backward()
        optimizer.step()
        stats = moe.stats.get("mlp", {})
        shown = {k: round(v.item(), 3) for k, v in stats.items() if v.numel() == 1}
        load = stats.get("expert_load")
        print(f"{name:>15}: {type(block.mlp).__name__}, {sum(p.numel() for p in block.mlp.parameters()):,} params")
        print(f"{'':>15}  aux losses { ({k: round(v.item(), 4) for k, v in moe.aux_losses.items()}) }")
        print(f"{'':>15}  stats {shown}")
        if load is not None:
            print(f"{'':>15}  expert load {[round(v, 3) for v in load.tolist()]}")
    print("\nEvery layer is also a Hydra config: see configs/moe/*.yaml.")


if __name__ == "__main__":
    main()
