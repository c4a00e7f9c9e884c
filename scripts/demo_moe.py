"""A tour of the MoE recipes: each one's layer as the MLP of a timm ViT block, one training step each, and the
routing statistics and auxiliary losses it records.

    python scripts/demo_moe.py
"""

import moekit  # noqa: F401, I001 - before torch: it shortens OpenMP's idle spin (moekit/utils/openmp.py)
import torch
from timm.models.vision_transformer import Block

from moekit.moe import build_moe_layer, collect_moe_outputs
from moekit.recipes import list_recipes, load_recipe


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 16, 64)  # [batch, tokens, dim]
    token_ids = torch.randint(0, 100, (4, 16))
    print(f"input {tuple(x.shape)}; a timm ViT Block (dim 64, mlp_ratio 4) with each recipe's layer as its MLP\n")
    for name in list_recipes():
        block = Block(dim=64, num_heads=4)
        # the recipe, with 8 experts, sized for this block's MLP (Soft MoE's slots for its 16 tokens)
        block.mlp = build_moe_layer(
            {**load_recipe(name), "num_experts": 8},
            in_features=64,
            hidden_features=256,
            model_settings={"num_tokens": 16, "vocab_size": 100},
        )
        optimizer = torch.optim.AdamW(block.parameters(), lr=1e-3)
        if name == "hash":  # hash routing reads token ids, which a timm Block does not pass: call the layer
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
    print("\nEach recipe is one file of src/moekit/recipes/moe/ and a choice of the template's moe= group.")


if __name__ == "__main__":
    main()
