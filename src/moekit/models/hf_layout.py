"""What the Hugging Face interchange of :class:`~moekit.models.TransformerLM` shares: the two transformers layouts
it reads and writes, their tensor names, and the error it raises.

- **Mixtral** (``model_type: mixtral``): every block MoE, softmax top-k gates renormalised over the chosen experts,
  no shared experts, no biases.
- **Qwen2-MoE** (``model_type: qwen2_moe``): MoE and dense blocks (``mlp_only_layers``), top-k gates with or without
  renormalisation (``norm_topk_prob``), one shared expert MLP scaled by a learned ``sigmoid`` gate, and optional
  query/key/value biases (``qkv_bias``).

Both are pre-norm decoders with RMSNorm, rotary positions (rotate-half layout), SwiGLU feed-forwards and grouped-query
attention: moekit's Transformer LM with ``norm=rmsnorm``, ``pos_embedding=rope``, ``gated=true`` and ``bias=false``.
The tensor names are those of the files ``save_pretrained`` writes (one ``w1``/``w2``/``w3`` or
``gate_proj``/``up_proj``/``down_proj`` per expert), which transformers 4.x and 5.x and the serving stacks read.
"""

from __future__ import annotations

__all__ = ["HF_PREFIX", "LAYOUTS", "HFInterchangeError", "layer_prefix", "expert_names", "mlp_prefix"]

HF_PREFIX = "hf:"
"""``task.init_from=hf:<folder>``: start from a transformers model folder."""

LAYOUTS = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
"""model_type -> the transformers class of each layout."""


class HFInterchangeError(ValueError):
    """A model that a transformers layout cannot express, or a transformers folder moekit cannot read."""


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def mlp_prefix(layout: str, i: int) -> str:
    """The MoE block's prefix: Mixtral's ``block_sparse_moe.``, Qwen2-MoE's ``mlp.``."""
    return layer_prefix(i) + ("block_sparse_moe." if layout == "mixtral" else "mlp.")


def expert_names(layout: str) -> tuple[str, str, str]:
    """One expert's (gate, up, down) projection names."""
    return ("w1", "w3", "w2") if layout == "mixtral" else ("gate_proj", "up_proj", "down_proj")
