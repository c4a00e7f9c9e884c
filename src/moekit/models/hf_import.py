"""Read a transformers model folder of the Mixtral or Qwen2-MoE layout (:mod:`moekit.models.hf_layout`) into a
:class:`~moekit.models.TransformerLM`: its architecture (:func:`hf_model_settings`), its weights under moekit's names
(:func:`read_hf_state_dict`), or both (:func:`load_hf_lm`). Reading needs no transformers.

Folders hold ``config.json`` and ``model.safetensors``, or shards listed in ``model.safetensors.index.json``. Experts
may be stored one per tensor (what ``save_pretrained`` writes) or fused (``experts.gate_up_proj`` /
``experts.down_proj``, transformers 5's in-memory layout). Anything else is refused, naming the file or key.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .hf_layout import LAYOUTS, HFInterchangeError, expert_names, layer_prefix, mlp_prefix
from .transformer_lm import TransformerLM

__all__ = [
    "read_hf_config",
    "hf_model_settings",
    "check_attention_window",
    "read_hf_state_dict",
    "load_hf_lm",
    "apply_hf_settings",
]


# transformers' defaults (MixtralConfig, Qwen2MoeConfig) of the settings moekit reads that a config.json may leave
# out: save_pretrained writes them all, a hand-written config need not, and transformers then takes these.
_COMMON_DEFAULTS = {"hidden_act": "silu", "tie_word_embeddings": False, "router_aux_loss_coef": 0.001}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": _COMMON_DEFAULTS
    | {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-5,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "qwen2_moe": _COMMON_DEFAULTS
    | {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_position_embeddings": 32768,
        "rope_theta": 1e4,
        "rms_norm_eps": 1e-6,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "qkv_bias": True,
    },
}


def _with_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with transformers' default for each setting of :data:`HF_DEFAULTS` it leaves out."""
    return {**HF_DEFAULTS.get(config.get("model_type"), {}), **config}


def read_hf_config(folder: str | os.PathLike) -> dict[str, Any]:
    """``folder/config.json``, checked to be a layout moekit reads."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise HFInterchangeError(
            f"{str(folder)!r} has no config.json; point it at a transformers model folder (what save_pretrained wrote)"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise HFInterchangeError(f"{path} could not be read as JSON ({err}); the folder is damaged") from None
    model_type = config.get("model_type")
    if model_type not in LAYOUTS:
        raise HFInterchangeError(
            f"{path} describes model_type={model_type!r} ({', '.join(config.get('architectures') or [])}); "
            f"moekit reads the {' and '.join(LAYOUTS)} layouts ({', '.join(LAYOUTS.values())})"
        )
    return config


def _rope_base(config: Mapping[str, Any], path: str) -> float:
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling")
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) != "default"):
        raise HFInterchangeError(
            f"{path}: rope scaling {scaling or rope!r}; moekit's rotary positions are the default (unscaled) ones"
        )
    return float(rope.get("rope_theta", config["rope_theta"]))


def _attention_window(config: Mapping[str, Any]) -> int | None:
    """The sliding window of the folder's attention (None: every layer attends to all earlier tokens)."""
    if config["model_type"] == "qwen2_moe":
        layer_types = config.get("layer_types")
        if not config.get("use_sliding_window") or (layer_types and "sliding_attention" not in layer_types):
            return None
    return config.get("sliding_window") or None


def check_attention_window(config: Mapping[str, Any], max_seq_len: int, path: str = "config.json") -> None:
    """Refuse a ``max_seq_len`` past the folder's sliding window: there its attention and moekit's differ."""
    window = _attention_window(config)
    if window is not None and max_seq_len > window:
        raise HFInterchangeError(
            f"{path}: sliding_window={window}: each token attends to the last {window} tokens only, and moekit's "
            f"attention sees them all; use max_seq_len <= {window} (the run's data.seq_len, or "
            f"load_hf_lm(folder, max_seq_len={window})), not {max_seq_len}"
        )


def hf_model_settings(config: Mapping[str, Any], path: str = "config.json") -> dict[str, Any]:
    """The :class:`~moekit.models.TransformerLM` keywords of a transformers config (all but ``max_seq_len`` and
    ``dropout``, which are not the architecture's). ``moe`` is a recipe mapping of the ``top_k`` layer. A setting
    the config leaves out takes transformers' default for its layout (:data:`HF_DEFAULTS`)."""
    config = _with_defaults(config)
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    depth = config["num_hidden_layers"]
    if config["hidden_act"] != "silu":
        raise HFInterchangeError(f"{path}: hidden_act={config['hidden_act']!r}; moekit reads SwiGLU (silu) models")
    if config.get("head_dim") not in (None, dim // heads):
        raise HFInterchangeError(
            f"{path}: head_dim={config['head_dim']} differs from hidden_size / num_attention_heads = {dim // heads}; "
            "moekit's attention has heads of hidden_size / num_attention_heads channels"
        )
    if config["model_type"] == "mixtral":
        expert_hidden, experts, normalize = config["intermediate_size"], config["num_local_experts"], True
        dense_hidden, shared, moe_blocks = expert_hidden, 0, list(range(depth))
    else:
        expert_hidden, experts = config["moe_intermediate_size"], config["num_experts"]
        normalize, shared = config["norm_topk_prob"], config["shared_expert_intermediate_size"]
        step, only_dense = config["decoder_sparse_step"], set(config.get("mlp_only_layers") or [])
        moe_blocks = [i for i in range(depth) if i not in only_dense and experts > 0 and (i + 1) % step == 0]
        dense_hidden = config["intermediate_size"] if len(moe_blocks) < depth else expert_hidden
    if not moe_blocks:
        raise HFInterchangeError(f"{path}: no MoE layer (num_experts=0 or every layer in mlp_only_layers)")
    if shared % expert_hidden:
        raise HFInterchangeError(
            f"{path}: shared_expert_intermediate_size={shared} is not a multiple of moe_intermediate_size="
            f"{expert_hidden}; moekit's shared experts are whole experts of the routed experts' size"
        )
    mlp_ratio = dense_hidden / dim
    if int(dim * mlp_ratio) != dense_hidden:  # int() of a product that rounds below the integer
        mlp_ratio = (dense_hidden + 0.5) / dim
    moe = {
        "layer": "top_k",
        "num_experts": experts,
        "top_k": config["num_experts_per_tok"],
        "score_func": "softmax",
        "normalize_gates": bool(normalize),
        "num_shared_experts": shared // expert_hidden,
        "shared_expert_gate": shared > 0,
        "granularity": dense_hidden / expert_hidden,
        "switch_loss_weight": float(config["router_aux_loss_coef"]),
    }
    qkv_bias = config["qkv_bias"] if config["model_type"] == "qwen2_moe" else False
    return {
        "vocab_size": config["vocab_size"],
        "dim": dim,
        "depth": depth,
        "num_heads": heads,
        "num_kv_heads": config.get("num_key_value_heads") or heads,
        "mlp_ratio": mlp_ratio,
        "gated": True,
        "act_layer": "silu",
        "bias": False,
        "qkv_bias": qkv_bias,
        "tie_embeddings": bool(config["tie_word_embeddings"]),
        "norm": "rmsnorm",
        "norm_eps": float(config["rms_norm_eps"]),
        "pos_embedding": "rope",
        "rope_base": _rope_base(config, path),
        "moe": moe,
        "moe_blocks": moe_blocks,
        "mod": None,
    }


def _read_tensors(folder: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():  # before the index, as transformers reads them: an index beside it is an older model's
        shards = [single.name]
    elif index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        found = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
        raise HFInterchangeError(
            f"{str(folder)!r} has neither model.safetensors nor model.safetensors.index.json (found {found}); "
            "re-save the model with save_pretrained(folder), which writes safetensors"
        )
    tensors = {}
    for shard in shards:
        if not (folder / shard).is_file():
            raise HFInterchangeError(
                f"{folder / shard} is missing: {index.name} lists it; copy every shard of the model into the folder"
            )
        tensors |= load_file(str(folder / shard))
    return tensors


class _Taker:
    """Pops tensors by name, remembering the names asked for and not found."""

    def __init__(self, tensors: dict[str, Tensor]) -> None:
        self.tensors, self.missing = dict(tensors), []

    def has(self, name: str) -> bool:
        return name in self.tensors

    def __call__(self, name: str) -> Tensor:
        if name not in self.tensors:
            self.missing.append(name)
            return torch.empty(0)
        return self.tensors.pop(name)


def _bank(take: _Taker, prefix: str, names: tuple[str, str, str], count: int) -> tuple[Tensor, Tensor]:
    """An expert bank's ``fc1 [E, D, 2H]`` (gate half first) and ``fc2 [E, H, D]``."""
    if take.has(f"{prefix}gate_up_proj"):  # fused: [E, 2H, D] (gate first) and [E, D, H]
        return take(f"{prefix}gate_up_proj").transpose(1, 2), take(f"{prefix}down_proj").transpose(1, 2)
    gate, up, down = names
    fc1 = [torch.cat([take(f"{prefix}{e}.{gate}.weight"), take(f"{prefix}{e}.{up}.weight")]).t() for e in range(count)]
    fc2 = [take(f"{prefix}{e}.{down}.weight").t() for e in range(count)]
    if take.missing:
        return torch.empty(0), torch.empty(0)
    return torch.stack(fc1), torch.stack(fc2)


def read_hf_state_dict(folder: str | os.PathLike, config: Mapping[str, Any] | None = None) -> dict[str, Tensor]:
    """The weights of a transformers folder under :class:`~moekit.models.TransformerLM`'s state-dict names.

    Raises:
        HFInterchangeError: a missing file or shard, or tensors missing or left over (named).
    """
    folder = Path(folder)
    config = config or read_hf_config(folder)
    settings = hf_model_settings(config, str(folder / "config.json"))
    layout = config["model_type"]
    take = _Taker(_read_tensors(folder))
    state = {"token_embedding.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not settings["tie_embeddings"]:
        state["head.weight"] = take("lm_head.weight")
    else:
        if take.has("lm_head.weight"):
            take("lm_head.weight")  # the tied copy
        state["head.weight"] = state["token_embedding.weight"]
    experts = settings["moe"]["num_experts"]
    for i in range(settings["depth"]):
        src, dst = layer_prefix(i), f"blocks.{i}."
        state[f"{dst}norm1.weight"] = take(f"{src}input_layernorm.weight")
        state[f"{dst}norm2.weight"] = take(f"{src}post_attention_layernorm.weight")
        attn = f"{src}self_attn."
        state[f"{dst}attn.qkv.weight"] = torch.cat([take(f"{attn}{n}_proj.weight") for n in "qkv"])
        if settings["qkv_bias"]:
            state[f"{dst}attn.qkv.bias"] = torch.cat([take(f"{attn}{n}_proj.bias") for n in "qkv"])
        state[f"{dst}attn.proj.weight"] = take(f"{attn}o_proj.weight")
        if i not in settings["moe_blocks"]:
            for ours, theirs in (("fc1_g", "gate_proj"), ("fc1_x", "up_proj"), ("fc2", "down_proj")):
                state[f"{dst}mlp.{ours}.weight"] = take(f"{src}mlp.{theirs}.weight")
            continue
        moe = mlp_prefix(layout, i)
        if not take.has(f"{moe}gate.weight") and take.has(f"{src}mlp.gate.weight"):
            moe = f"{src}mlp."  # transformers 5's in-memory names (Mixtral's too)
        names = expert_names(layout)
        state[f"{dst}mlp.router.weight"] = take(f"{moe}gate.weight")
        fc1, fc2 = _bank(take, f"{moe}experts.", names, experts)
        state[f"{dst}mlp.experts.fc1_weight"], state[f"{dst}mlp.experts.fc2_weight"] = fc1, fc2
        if layout == "qwen2_moe":
            shared = [take(f"{moe}shared_expert.{n}.weight") for n in names]
            gate = take(f"{moe}shared_expert_gate.weight")
            if settings["moe"]["num_shared_experts"]:
                state[f"{dst}mlp.shared_experts.fc1_weight"] = torch.cat(shared[:2]).t().unsqueeze(0)
                state[f"{dst}mlp.shared_experts.fc2_weight"] = shared[2].t().unsqueeze(0)
                state[f"{dst}mlp.shared_expert_gate.weight"] = gate
    leftover = sorted(k for k in take.tensors if not k.endswith("rotary_emb.inv_freq"))
    if take.missing or leftover:
        parts = [
            f"{what}: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''} ({len(keys)})"
            for what, keys in (("missing", take.missing), ("unexpected", leftover))
            if keys
        ]
        raise HFInterchangeError(
            f"the weights in {str(folder)!r} do not fit its config.json ({layout}) - {'; '.join(parts)}; "
            "the folder is incomplete or of another model"
        )
    return {name: tensor.contiguous() for name, tensor in state.items()}


def load_hf_lm(folder: str | os.PathLike, max_seq_len: int | None = None, **overrides: Any) -> TransformerLM:
    """A :class:`~moekit.models.TransformerLM` with the architecture and weights of a transformers folder.

    Args:
        folder: the model folder (``config.json`` + safetensors).
        max_seq_len: the longest sequence the model serves (its KV cache's length); default: the config's
            ``max_position_embeddings``.
        overrides: other ``TransformerLM`` keywords that are not the architecture's (``dropout``).

    The model's logits equal transformers' for the same folder (1e-4 in float32, tested); weights keep their stored
    dtype's values, in float32.
    """
    config = read_hf_config(folder)
    path = str(Path(folder) / "config.json")
    settings = hf_model_settings(config, path)
    max_seq_len = _with_defaults(config)["max_position_embeddings"] if max_seq_len is None else max_seq_len
    check_attention_window(config, max_seq_len, path)
    model = TransformerLM(**settings, max_seq_len=max_seq_len, **overrides)
    model.load_state_dict(read_hf_state_dict(folder, config))
    return model


_DEFAULT_MAX_SEQ_LEN = inspect.signature(TransformerLM).parameters["max_seq_len"].default
"""A network config without ``max_seq_len`` builds the model with this one."""

_KEPT_MOE_KEYS = ("switch_loss_weight", "z_loss_weight")
"""The run's own ``moe`` settings that starting from a transformers folder keeps: the training losses."""


def apply_hf_settings(net: Mapping[str, Any], folder: str | os.PathLike) -> tuple[dict[str, Any], list[str]]:
    """A Transformer LM network config (a Hydra ``_target_`` mapping) with the architecture of a transformers
    folder: every :func:`hf_model_settings` key replaced, and ``moe`` the folder's routing with the run's
    ``switch_loss_weight`` and ``z_loss_weight`` (training settings) kept. Returns it and the changes, one line each.
    """
    target = net.get("_target_")
    if target != "moekit.models.TransformerLM":
        raise HFInterchangeError(
            f"task.init_from=hf:{folder} starts a Transformer LM, but the run's model is {target}; "
            "use experiment=moe_transformer_lm"
        )
    config, path = read_hf_config(folder), str(Path(folder) / "config.json")
    settings = hf_model_settings(config, path)
    check_attention_window(config, net.get("max_seq_len", _DEFAULT_MAX_SEQ_LEN), path)
    own_moe = net.get("moe") if isinstance(net.get("moe"), Mapping) else {}
    settings["moe"] |= {k: own_moe[k] for k in _KEPT_MOE_KEYS if k in own_moe}
    merged = {**net, **settings}
    changes = [f"model.{k}: {net.get(k)!r} -> {merged[k]!r}" for k in settings if net.get(k) != merged[k]]
    return merged, changes
