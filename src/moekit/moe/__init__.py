"""The MoE layer library.

Layers (all drop-in replacements for ``timm.layers.Mlp``; registry names in brackets):

* :class:`SoftMoE` [``soft_moe``] - Soft MoE (Puigcerver et al.).
* :class:`TopKMoE` [``top_k``] - tokens-choice top-k: Switch, GShard/Mixtral, noisy top-k, capacity,
  Batch Prioritized Routing, shared + fine-grained experts, loss-free balancing.
* :class:`ExpertsChoiceMoE` [``experts_choice``] - experts choose their top-C tokens.
* :class:`BaseMoE` [``base``] - BASE layers' balanced assignment.
* :class:`HashMoE` [``hash``] - fixed token-id hashing.
* :class:`DenseMoE` [``dense``] - every expert on every token, softmax-gated.
* :class:`HierarchicalMoE` [``hierarchical``] - Shazeer's two-level gating.

Building blocks: :class:`ExpertBank`, the routers in :mod:`moekit.moe.routers`, dispatch in
:mod:`moekit.moe.dispatch`, losses in :mod:`moekit.moe.losses`.

Training-loop helpers: :func:`collect_moe_outputs` (aux losses + statistics of the latest forward),
:func:`update_balancing_biases` (loss-free balancing, once per optimizer step; :func:`discard_balancing_updates`
for a skipped step),
:func:`require_causal` (reject token-mixing routers in causal models).
"""

from .base import (
    MoELayer,
    MoEOutputs,
    collect_moe_outputs,
    discard_balancing_updates,
    get_moe_layer,
    list_moe_layers,
    moe_layers,
    register_moe_layer,
    require_causal,
    update_balancing_biases,
)
from .dense import DenseMoE
from .experts import ExpertBank, grouped_linear
from .experts_choice import ExpertsChoiceMoE
from .soft_moe import SoftMoE
from .token_choice import BaseMoE, HashMoE, HierarchicalMoE, TokenChoiceMoE, TopKMoE

__all__ = [
    "MoELayer",
    "MoEOutputs",
    "collect_moe_outputs",
    "discard_balancing_updates",
    "get_moe_layer",
    "list_moe_layers",
    "moe_layers",
    "register_moe_layer",
    "require_causal",
    "update_balancing_biases",
    "ExpertBank",
    "grouped_linear",
    "SoftMoE",
    "TokenChoiceMoE",
    "TopKMoE",
    "HashMoE",
    "BaseMoE",
    "HierarchicalMoE",
    "ExpertsChoiceMoE",
    "DenseMoE",
]
