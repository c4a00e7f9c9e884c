"""Edge cases of the language models and their Hugging Face interchange: hand-written transformers configs that leave
out routing and size settings, rotary positions of float64 models, and settings that are not numbers or names."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moekit.models import LSTMMoELM, TransformerLM, load_hf_lm
from moekit.models.hf_import import hf_model_settings
from moekit.models.rotary import RotaryEmbedding

VOCAB = 50


def _saved_hf(model_type: str, folder, **kwargs) -> torch.nn.Module:
    """A random transformers model of ``model_type`` saved in ``folder``."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if model_type == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=24, **kwargs)
    else:
        config = transformers.Qwen2MoeConfig(
            **common, intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=16, **kwargs
        )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize(
    "model_type, kwargs, left_out",
    [
        (  # transformers' defaults: 8 experts, top-2, 131072 positions, aux loss 0.001
            "mixtral",
            dict(num_local_experts=8, num_experts_per_tok=2),
            ["num_local_experts", "num_experts_per_tok", "max_position_embeddings", "router_aux_loss_coef"],
        ),
        ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=4), ["num_experts_per_tok", "hidden_act"]),
    ],
)
def test_a_hand_written_config_without_routing_settings_takes_transformers_defaults(
    model_type, kwargs, left_out, tmp_path
):
    theirs = _saved_hf(model_type, tmp_path, **kwargs)
    path = tmp_path / "config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in left_out}
    path.write_text(json.dumps(config))
    settings = hf_model_settings(config)
    assert settings["moe"]["top_k"] == kwargs["num_experts_per_tok"]
    assert settings["moe"]["num_experts"] == next(v for k, v in kwargs.items() if k != "num_experts_per_tok")
    ours = load_hf_lm(tmp_path, max_seq_len=None if model_type == "mixtral" else 16).eval()
    if model_type == "mixtral":
        assert ours.max_seq_len == 131072 and settings["moe"]["switch_loss_weight"] == 0.001
    input_ids = torch.randint(VOCAB, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids), theirs(input_ids).logits, atol=1e-5, rtol=1e-5)


def test_rotary_positions_of_float64_inputs_are_computed_in_float64():
    """A float64 model keeps float64 through the rotation (float32 would round the queries and keys): the rotation is
    exactly the float64 one of its tables, and finite differences agree with its gradient."""
    rope = RotaryEmbedding(8, 16)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 10, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = rope.cos[2:12].double(), rope.sin[2:12].double()
    first, second = x.detach().chunk(2, dim=-1)
    expected = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    out = rope(x, 2)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out.detach(), expected, atol=1e-15, rtol=1e-14)
    assert torch.autograd.gradcheck(lambda t: rope(t, 2), (x,))
    assert rope(x.float(), 2).dtype == torch.float32 and rope(x.bfloat16(), 2).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: TransformerLM(vocab_size=VOCAB, act_layer="swishy"), r"act_layer='swishy' is not a timm activation"),
        (lambda: LSTMMoELM(vocab_size=VOCAB, act_layer="swishy"), r"act_layer='swishy' is not a timm activation"),
        (lambda: TransformerLM(vocab_size=VOCAB, rope_base=math.nan), r"rope_base=nan must be a positive number"),
        (lambda: TransformerLM(vocab_size=VOCAB, rope_base=math.inf), r"rope_base=inf must be a positive number"),
        (lambda: TransformerLM(vocab_size=VOCAB, norm_eps=math.inf), r"norm_eps=inf must be a positive number"),
        (lambda: TransformerLM(vocab_size=VOCAB, mlp_ratio=math.nan), r"mlp_ratio=nan must give a positive hidden"),
    ],
    ids=["transformer_act", "lstm_act", "rope_base_nan", "rope_base_inf", "norm_eps_inf", "mlp_ratio_nan"],
)
def test_unknown_activations_and_non_finite_settings_are_refused_naming_them(build, message):
    with pytest.raises(ValueError, match=message):
        build()
