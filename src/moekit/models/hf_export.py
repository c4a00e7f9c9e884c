"""Export a :class:`~moekit.models.TransformerLM` to a transformers model folder (``config.json`` +
``model.safetensors``) that ``AutoModelForCausalLM.from_pretrained(folder)`` loads offline.

The layout (:mod:`moekit.models.hf_layout`) is Mixtral's when every block is MoE with renormalised top-k gates, no
shared experts and no query/key/value biases, Qwen2-MoE's otherwise. A model neither can express (LayerNorm, learned
positions, biases, another router, capacity limits at inference, Mixture-of-Depths, ...) is refused with every reason
and its fix. Writing needs no transformers.

Two exact rewrites make a moekit model a Qwen2-MoE one: shared experts without a gate get a zero gate weight
(``sigmoid(0) = 1/2``) and their down projection doubled (exact in floating point); a model without shared experts
gets a shared expert of hidden size 0.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch
from safetensors.torch import save
from timm.layers import SwiGLU
from torch import Tensor, nn

from moekit.moe import ExpertBank, TopKMoE
from moekit.moe.routers import TopKRouter
from moekit.utils.atomic import atomic_write

from .hf_layout import LAYOUTS, HFInterchangeError, expert_names, layer_prefix, mlp_prefix
from .transformer_lm import TransformerLM

__all__ = ["export_hf", "hf_config", "hf_layout"]

log = logging.getLogger("moekit")


def _expert_problems(where: str, bank: nn.Module) -> list[str]:
    if not isinstance(bank, ExpertBank):
        return [f"{where}: quantized experts ({type(bank).__name__}); export the float checkpoint (.ckpt) instead"]
    problems = []
    if not bank.gated or not isinstance(bank.act, nn.SiLU):
        problems.append(f"{where}: experts that are not SwiGLU; set model.gated=true and model.act_layer=silu")
    if bank.fc1_bias is not None or bank.fc2_bias is not None:
        problems.append(f"{where}: expert biases; set model.bias=false")
    return problems


def _layer_problems(where: str, layer: nn.Module) -> list[str]:
    if not isinstance(layer, TopKMoE) or not isinstance(layer.router, TopKRouter):
        return [f"{where}: a {type(layer).__name__} layer; these layouts route with softmax top-k (moe=mixtral)"]
    cfg = layer.router.config
    problems = _expert_problems(where, layer.experts)
    if cfg.score_func != "softmax":
        problems.append(f"{where}: score_func={cfg.score_func!r}; these layouts score experts with a softmax")
    if layer.router.expert_bias is not None:
        problems.append(f"{where}: loss-free balancing biases move the choice of experts; set moe.bias_update_rate=0")
    if cfg.overpower_margin is not None:
        problems.append(f"{where}: dropping overpowering experts (overpower_margin); set it to null")
    if layer.capacity.factor(training=False) is not None:
        problems.append(f"{where}: an inference capacity (experts drop tokens); set moe.eval_capacity_factor=null")
    if layer.shared_experts is not None:
        problems += _expert_problems(f"{where} shared experts", layer.shared_experts)
    return problems


def _dense_problems(where: str, mlp: nn.Module) -> list[str]:
    if not isinstance(mlp, SwiGLU) or not isinstance(mlp.act, nn.SiLU):
        return [f"{where}: a dense {type(mlp).__name__}; these layouts have SwiGLU MLPs (model.gated=true)"]
    if mlp.fc2.bias is not None:
        return [f"{where}: MLP biases; set model.bias=false"]
    return []


def _signature(layer: TopKMoE) -> tuple:
    shared = layer.shared_experts.hidden_features if layer.shared_experts is not None else 0
    return (
        layer.num_experts,
        layer.top_k,
        layer.router.config.normalize_gates,
        layer.experts.hidden_features,
        shared,
        layer.shared_expert_gate is not None,
    )


def hf_layout(model: nn.Module) -> str:
    """The transformers ``model_type`` that expresses ``model`` (``"mixtral"`` or ``"qwen2_moe"``).

    Raises:
        HFInterchangeError: every reason neither layout can express it, each with the setting to change.
    """
    if not isinstance(model, TransformerLM):
        raise HFInterchangeError(
            f"{type(model).__name__} has no transformers layout; only the Transformer LM (model=transformer_lm) exports"
        )
    problems = []
    if not isinstance(model.norm, nn.RMSNorm):
        problems.append("norm='layernorm': these layouts have RMSNorm; train with model.norm=rmsnorm")
    if model.position_embedding is not None:
        problems.append(
            "pos_embedding='learned': these layouts use rotary positions; train with model.pos_embedding=rope"
        )
    if model.mod_block_indices:
        problems.append("Mixture-of-Depths blocks have no transformers layout; train with mod=none")
    if model.blocks[0].attn.proj.bias is not None:
        problems.append("bias=true: these layouts have no output-projection or MLP biases; set model.bias=false")
    moe = [(i, b.mlp) for i, b in enumerate(model.blocks) if i in model.moe_block_indices]
    if not moe:
        problems.append("a dense model (moe=none) has no MoE layout; export an MoE model")
    for i, block in enumerate(model.blocks):
        where = f"block {i}"
        problems += (
            _layer_problems(where, block.mlp) if i in model.moe_block_indices else _dense_problems(where, block.mlp)
        )
    if not problems and len({_signature(layer) for _, layer in moe}) > 1:
        problems.append("MoE layers of different settings; a transformers config holds one set for every layer")
    if problems:
        raise HFInterchangeError(
            "this model cannot be written as a transformers Mixtral or Qwen2-MoE model:\n  - " + "\n  - ".join(problems)
        )
    _, first = moe[0]
    qkv_bias = model.blocks[0].attn.qkv.bias is not None
    all_moe = len(moe) == model.depth
    plain = first.shared_experts is None and first.router.config.normalize_gates and not qkv_bias
    return "mixtral" if all_moe and plain else "qwen2_moe"


def _norm_eps(norm: nn.RMSNorm) -> float:
    return norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps


def hf_config(model: TransformerLM, dtype: torch.dtype = torch.float32) -> dict:
    """The transformers ``config.json`` of ``model`` (:func:`hf_layout` decides the layout)."""
    layout = hf_layout(model)
    layer: TopKMoE = model.blocks[model.moe_block_indices[0]].mlp
    rope = model.blocks[0].attn.rope
    config = {
        "architectures": [LAYOUTS[layout]],
        "model_type": layout,
        "vocab_size": model.vocab_size,
        "hidden_size": model.dim,
        "num_hidden_layers": model.depth,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": _norm_eps(model.norm),
        "rope_theta": rope.base,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope.base},
        "tie_word_embeddings": model.head.weight is model.token_embedding.weight,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "num_experts_per_tok": layer.top_k,
        "router_aux_loss_coef": layer.router.config.switch_loss_weight,
        "output_router_logits": False,
        "sliding_window": None,
        "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if layout == "mixtral":
        config |= {"intermediate_size": layer.experts.hidden_features, "num_local_experts": layer.num_experts}
        return config
    dense = [i for i in range(model.depth) if i not in model.moe_block_indices]
    shared = layer.shared_experts.hidden_features if layer.shared_experts is not None else 0
    dense_hidden = model.blocks[dense[0]].mlp.fc2.in_features if dense else layer.experts.hidden_features
    return config | {
        "intermediate_size": dense_hidden,
        "moe_intermediate_size": layer.experts.hidden_features,
        "shared_expert_intermediate_size": shared,
        "num_experts": layer.num_experts,
        "norm_topk_prob": layer.router.config.normalize_gates,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "qkv_bias": model.blocks[0].attn.qkv.bias is not None,
        "use_sliding_window": False,
        "max_window_layers": model.depth,
    }


def _swiglu(prefix: str, names: tuple[str, str, str], fc1_DH2: Tensor, fc2_HD: Tensor) -> dict[str, Tensor]:
    """One SwiGLU MLP from an expert bank's ``fc1 [D, 2H]`` (gate half first) and ``fc2 [H, D]``."""
    gate, up, down = names
    gate_DH, up_DH = fc1_DH2.chunk(2, dim=-1)
    return {
        f"{prefix}{gate}.weight": gate_DH.t(),
        f"{prefix}{up}.weight": up_DH.t(),
        f"{prefix}{down}.weight": fc2_HD.t(),
    }


def _moe_tensors(layout: str, i: int, layer: TopKMoE) -> dict[str, Tensor]:
    prefix = mlp_prefix(layout, i)
    names = expert_names(layout)
    bank = layer.experts
    tensors = {f"{prefix}gate.weight": layer.router.weight}
    for e in range(bank.num_experts):
        tensors |= _swiglu(f"{prefix}experts.{e}.", names, bank.fc1_weight[e], bank.fc2_weight[e])
    if layout == "mixtral":
        return tensors
    shared, dim = layer.shared_experts, layer.router.weight.shape[1]
    if shared is None:  # a shared expert of hidden size 0 adds nothing
        empty = layer.router.weight.new_zeros(dim, 0)
        tensors |= _swiglu(f"{prefix}shared_expert.", names, empty, empty.t())
        gate = layer.router.weight.new_zeros(1, dim)
    elif layer.shared_expert_gate is None:  # sigmoid(0) * 2 W = W
        tensors |= _swiglu(f"{prefix}shared_expert.", names, shared.fc1_weight[0], 2 * shared.fc2_weight[0])
        gate = layer.router.weight.new_zeros(1, dim)
    else:
        tensors |= _swiglu(f"{prefix}shared_expert.", names, shared.fc1_weight[0], shared.fc2_weight[0])
        gate = layer.shared_expert_gate.weight
    return tensors | {f"{prefix}shared_expert_gate.weight": gate}


def hf_tensors(model: TransformerLM, layout: str) -> dict[str, Tensor]:
    """``model``'s weights under the layout's tensor names (views of the model's own tensors)."""
    tensors = {"model.embed_tokens.weight": model.token_embedding.weight, "model.norm.weight": model.norm.weight}
    if model.head.weight is not model.token_embedding.weight:
        tensors["lm_head.weight"] = model.head.weight
    q_width, kv_width = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    for i, block in enumerate(model.blocks):
        prefix = layer_prefix(i)
        tensors[f"{prefix}input_layernorm.weight"] = block.norm1.weight
        tensors[f"{prefix}post_attention_layernorm.weight"] = block.norm2.weight
        qkv = block.attn.qkv
        for name, weight in zip(("q", "k", "v"), qkv.weight.split((q_width, kv_width, kv_width))):
            tensors[f"{prefix}self_attn.{name}_proj.weight"] = weight
        if qkv.bias is not None:
            for name, bias in zip(("q", "k", "v"), qkv.bias.split((q_width, kv_width, kv_width))):
                tensors[f"{prefix}self_attn.{name}_proj.bias"] = bias
        tensors[f"{prefix}self_attn.o_proj.weight"] = block.attn.proj.weight
        if i in model.moe_block_indices:
            tensors |= _moe_tensors(layout, i, block.mlp)
        else:
            mlp = block.mlp
            tensors |= {
                f"{prefix}mlp.gate_proj.weight": mlp.fc1_g.weight,
                f"{prefix}mlp.up_proj.weight": mlp.fc1_x.weight,
                f"{prefix}mlp.down_proj.weight": mlp.fc2.weight,
            }
    return tensors


@torch.no_grad()
def _earlier_model_files(folder: Path) -> list[Path]:
    """The files of an earlier ``save_pretrained`` in ``folder`` that transformers would read beside (or instead of)
    an export's ``model.safetensors``: its weights in another name or in shards, and its generation config (the
    token ids of the earlier model's tokenizer)."""
    names = {
        "generation_config.json",
        "pytorch_model.bin",
        "model.safetensors.index.json",
        "pytorch_model.bin.index.json",
    }
    shard = re.compile(r"(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)")
    return sorted(p for p in folder.iterdir() if p.is_file() and (p.name in names or shard.fullmatch(p.name)))


def export_hf(model: TransformerLM, folder: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write ``model`` as a transformers model folder: ``model.safetensors`` then ``config.json`` (each written
    atomically; the config last, so a folder with a config is complete). ``dtype``: of the stored weights (default:
    the model's). Missing folders are created; the files of an earlier model there are replaced, and those this
    export does not write (shards and their index, ``pytorch_model.bin``, ``generation_config.json``) removed, as
    ``save_pretrained`` removes stale shards: transformers would read them as this model's.

    Returns:
        the folder, which ``transformers.AutoModelForCausalLM.from_pretrained`` loads; its logits equal ``model``'s
        up to float rounding (the tests check 1e-4 in float32).

    Raises:
        HFInterchangeError: the model has no transformers layout (every reason and its fix).
    """
    layout = hf_layout(model)
    dtype = dtype or model.token_embedding.weight.dtype
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", dtype).contiguous().clone() for name, t in hf_tensors(model, layout).items()}
    with atomic_write(folder / "model.safetensors", "wb") as file:
        file.write(save(tensors, metadata={"format": "pt"}))
    with atomic_write(folder / "config.json", "w") as file:
        json.dump(hf_config(model, dtype), file, indent=2)
    for path in _earlier_model_files(folder):  # after the export is whole: a failed export leaves the earlier model
        log.info("export_hf: removed %s, an earlier model's file", path)
        path.unlink()
    return folder
