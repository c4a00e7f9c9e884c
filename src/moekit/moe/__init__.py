"""The MoE layer library.

Layers (all built from the timm ``Mlp`` keywords plus their settings; registry names in brackets):

* :class:`SoftMoE` [``soft_moe``] - Soft MoE (Puigcerver et al.).
* :class:`TopKMoE` [``top_k``] - tokens-choice top-k: Switch, GShard/Mixtral, noisy top-k, V-MoE, capacity,
  Batch Prioritized Routing, shared + fine-grained experts, loss-free balancing.
* :class:`ExpertsChoiceMoE` [``experts_choice``] - experts choose their top-C tokens.
* :class:`BaseMoE` [``base``] - BASE layers' balanced assignment.
* :class:`HashMoE` [``hash``] - fixed token-id hashing (needs ``token_ids``: language models).
* :class:`DenseMoE` [``dense_moe``] - every expert on every token, softmax-gated.
* :class:`HierarchicalMoE` [``hierarchical``] - Shazeer's two-level gating.
* :class:`LoryMoE` [``lory``] - Lory's causal soft MoE: experts merged per segment, routed by the previous segment
  (needs positions: the Transformer LM).
* :class:`StrictlyBalancedMoE` [``strictly_balanced``] - Shazeer's strictly balanced gating (batchwise mask in
  training, learned thresholds at inference).

Mixture-of-Depths (:mod:`moekit.moe.depth`): :class:`DepthRouter` sends the top-C tokens of a sequence through
a whole block and the rest around it; :class:`MixtureOfDepths` wraps a ViT block with one (the language model
routes inside its own blocks).

The papers' settings are recipes (:mod:`moekit.recipes`); :func:`build_moe_layer` builds a recipe's layer
in place of an MLP.

Building blocks: :class:`ExpertBank`, the routers in :mod:`moekit.moe.routers`,
:mod:`moekit.moe.hash_routing` and :mod:`moekit.moe.hierarchical_routing`, capacity in
:mod:`moekit.moe.capacity`, dispatch in :mod:`moekit.moe.dispatch`, losses in :mod:`moekit.moe.losses`, a dropout
whose CPU masks are cheap in :mod:`moekit.moe.dropout` (the experts' and the models'); every kernel and path picked by
device, dtype or shape in one table, :mod:`moekit.moe.kernel_choices`.

Importing this package tunes glibc's malloc to keep the large blocks a training step frees
(:func:`moekit.utils.allocator.tune_glibc_malloc`; ``MOEKIT_ALLOCATOR=system`` opts out).

Training-loop helpers: :func:`collect_moe_outputs` (aux losses + statistics of the latest forward),
:func:`update_balancing_biases` (loss-free balancing, once per optimizer step; :func:`discard_balancing_updates`
for a skipped step), :func:`require_causal` (reject token-mixing routers in causal models).
"""

from moekit.utils.allocator import tune_by_default

from .balanced_gating import StrictlyBalancedMoE
from .base import (
    MlpSpec,
    MoELayer,
    MoEOutputs,
    RoutingModule,
    collect_moe_outputs,
    discard_balancing_updates,
    get_moe_layer,
    list_moe_layers,
    moe_layers,
    register_moe_layer,
    require_causal,
    routing_modules,
    update_balancing_biases,
)
from .build import build_moe_layer, expert_hidden_features
from .capacity import Capacity
from .dense_moe import DenseMoE
from .depth import DepthRouter, MixtureOfDepths, depth_routers, top_c_routing
from .experts import ExpertBank, ExpertsConfig
from .experts_choice import ExpertsChoiceMoE
from .grouped_linear import grouped_linear
from .lory import LoryMoE, SegmentState
from .soft_moe import SoftMoE
from .tokens_choice import BaseMoE, HashMoE, HierarchicalMoE, SharedExperts, TokensChoiceMoE, TopKMoE

# Expert gradients are large blocks that every step frees and allocates again: keep glibc's malloc from unmapping
# them (moekit.utils.allocator; MOEKIT_ALLOCATOR=system opts out). A no-op under tcmalloc.
tune_by_default()

__all__ = [
    "MlpSpec",
    "MoELayer",
    "MoEOutputs",
    "collect_moe_outputs",
    "discard_balancing_updates",
    "get_moe_layer",
    "list_moe_layers",
    "moe_layers",
    "routing_modules",
    "RoutingModule",
    "register_moe_layer",
    "require_causal",
    "update_balancing_biases",
    "build_moe_layer",
    "expert_hidden_features",
    "Capacity",
    "ExpertBank",
    "ExpertsConfig",
    "grouped_linear",
    "SoftMoE",
    "TokensChoiceMoE",
    "SharedExperts",
    "TopKMoE",
    "HashMoE",
    "BaseMoE",
    "HierarchicalMoE",
    "ExpertsChoiceMoE",
    "DenseMoE",
    "LoryMoE",
    "SegmentState",
    "DepthRouter",
    "MixtureOfDepths",
    "depth_routers",
    "top_c_routing",
    "StrictlyBalancedMoE",
]
