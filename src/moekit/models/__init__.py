"""MoE Vision Transformers on timm, and MoE language models.

* :func:`create_moe_vit` - a timm ``VisionTransformer`` with MoE layers as the MLP of chosen blocks;
  :func:`resolve_moe_blocks` - the placement forms (``"second_half"``, ``"every_2"``, ``"last_3"``, ...).
* Importing this package registers the models of :mod:`moekit.models.registry` with timm
  (``soft_moe_vit_small_patch16_224``, ``vmoe_vit_small_patch16_224``, ``soft_moe_vit_tiny_patch4_28``,
  the dense ``vit_tiny_patch4_28``, ...), so ``timm.create_model(name, **overrides)`` builds them.
* :class:`TransformerLM` (decoder-only, MoE feed-forwards, KV cache) and :class:`LSTMMoELM`
  (Shazeer et al. 2017) - causal language models; :func:`generate` / :func:`sample_next_token` sample
  from them; :func:`fit_hash_routing` fits the hash tables that come from data (token frequency, clusters).
* :func:`model_summary` - total / expert / active-per-token parameters and measured FLOPs per image;
  :func:`lm_summary` - the same per token for language models.
* :func:`upcycle_vit` / :func:`upcycle` - sparse upcycling from a dense ViT / any dense twin (the Transformer LM's).
* :func:`export_hf` / :func:`load_hf_lm` - the Transformer LM as a transformers model folder (Mixtral or Qwen2-MoE
  layout) and back (:mod:`moekit.models.hf_export`, :mod:`moekit.models.hf_import`).
* :func:`compile_network` - ``torch.compile`` a network in place (state-dict keys unchanged), also where
  ``Module.compile()`` compiles no frame.
* :func:`export_safetensors` - weights that ``timm.create_model(name, pretrained=True,
  pretrained_cfg_overlay=dict(file=path))`` loads.
"""

import timm
from torch import nn

from . import registry
from .compilation import compile_network
from .export import export_safetensors
from .generate import generate, sample_next_token
from .hf_export import export_hf
from .hf_import import load_hf_lm
from .lm_common import fit_hash_routing
from .lstm_lm import LSTMCache, LSTMMoELM
from .placement import MoEBlocks, resolve_moe_blocks
from .summary import LMSummary, ModelSummary, MoELayerSummary, lm_summary, model_summary
from .transformer_lm import LMCache, TransformerLM
from .upcycle import upcycle, upcycle_vit
from .vit import EXPERT_INIT_STD, create_moe_vit


def create_model(model_name: str, **kwargs) -> nn.Module:
    """``timm.create_model`` with moekit's models registered: the ``_target_`` of model configs.

    Unknown names raise ``ValueError`` listing the moekit models (timm's own names work as well).
    """
    if model_name not in timm.list_models():
        ours = sorted(n for n in timm.list_models() if "moe" in n or n.startswith("vit_tiny_patch4"))
        raise ValueError(
            f"unknown model_name={model_name!r}; moekit models: {ours} (or any timm model name, see timm.list_models())"
        )
    return timm.create_model(model_name, **kwargs)


__all__ = [
    "compile_network",
    "create_model",
    "registry",
    "create_moe_vit",
    "resolve_moe_blocks",
    "MoEBlocks",
    "EXPERT_INIT_STD",
    "model_summary",
    "ModelSummary",
    "MoELayerSummary",
    "lm_summary",
    "LMSummary",
    "TransformerLM",
    "LSTMMoELM",
    "LMCache",
    "LSTMCache",
    "generate",
    "sample_next_token",
    "fit_hash_routing",
    "upcycle",
    "upcycle_vit",
    "export_hf",
    "load_hf_lm",
    "export_safetensors",
]
