"""Hugging Face interchange of the Transformer LM: moekit models exported to transformers folders give transformers
the same logits and greedy continuations; random transformers Mixtral and Qwen2-MoE models (saved whole, sharded or
with fused experts) load into moekit with transformers' logits; the task starts from them; models a layout cannot
express and damaged folders are refused, naming the fix. Grouped-query attention (which the imports need) against
multi-head attention with repeated key/value heads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from moekit.models import TransformerLM, export_hf, generate, load_hf_lm
from moekit.models.hf_export import hf_layout
from moekit.models.hf_import import apply_hf_settings, read_hf_state_dict
from moekit.models.hf_layout import HFInterchangeError
from moekit.quant import QuantFormat, QuantSpec, quantize_experts
from moekit.tasks import LanguageModel

transformers = pytest.importorskip("transformers")

VOCAB = 50
EXPORTABLE = dict(vocab_size=VOCAB, max_seq_len=32, dim=32, depth=3, num_heads=4, gated=True, norm="rmsnorm")
TOL = dict(atol=1e-5, rtol=1e-5)  # float32; the differences seen are 1e-7


def moekit_lm(**kwargs) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(**{**EXPORTABLE, "mlp_ratio": 2.0, **kwargs}).eval()


def hf_lm(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


@torch.no_grad()
def assert_same_logits(ours: TransformerLM, theirs, batch: int = 3, tokens: int = 20) -> None:
    input_ids = torch.randint(VOCAB, (batch, tokens))
    torch.testing.assert_close(ours(input_ids), theirs(input_ids).logits, **TOL)


EXPORT_CASES = {
    "mixtral": (dict(moe=dict(recipe="mixtral", num_experts=4)), "mixtral"),
    "mixtral_gqa_untied": (
        dict(moe=dict(recipe="mixtral", num_experts=4), num_kv_heads=2, tie_embeddings=False, rope_base=1e6),
        "mixtral",
    ),
    "shared_experts_dense_blocks": (
        dict(moe=dict(recipe="mixtral", num_experts=4, num_shared_experts=2), moe_blocks="every_2", norm_eps=1e-6),
        "qwen2_moe",
    ),
    "gated_shared_no_renorm_qkv_bias": (
        dict(
            moe=dict(
                recipe="mixtral", num_experts=4, normalize_gates=False, num_shared_experts=1, shared_expert_gate=True
            ),
            qkv_bias=True,
            num_kv_heads=1,
        ),
        "qwen2_moe",
    ),
    "dense_blocks_no_shared": (dict(moe=dict(recipe="mixtral", num_experts=4), moe_blocks=[1]), "qwen2_moe"),
}


@pytest.mark.parametrize("case", sorted(EXPORT_CASES))
def test_an_exported_lm_gives_transformers_the_same_logits(case, tmp_path):
    kwargs, layout = EXPORT_CASES[case]
    ours = moekit_lm(**kwargs)
    with torch.no_grad():  # non-zero norm weights and biases, so that a misplaced one shows
        for name, p in ours.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    assert hf_layout(ours) == layout
    export_hf(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == layout and config["num_key_value_heads"] == ours.num_kv_heads
    theirs = hf_lm(tmp_path)
    assert type(theirs).__name__ == {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[layout]
    assert_same_logits(ours, theirs)
    # and back: the folder read by moekit is the model it came from
    again = load_hf_lm(tmp_path, max_seq_len=32).eval()
    input_ids = torch.randint(VOCAB, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids), ours(input_ids), **TOL)


def test_transformers_generate_continues_an_exported_lm_as_moekit_does(tmp_path):
    ours = moekit_lm(moe=dict(recipe="mixtral", num_experts=4), num_kv_heads=2)
    export_hf(ours, tmp_path)
    prompt = torch.randint(VOCAB, (2, 5))
    expected = generate(ours, prompt, max_new_tokens=12, temperature=0)
    theirs = hf_lm(tmp_path)
    got = theirs.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(got, expected)


def test_export_stores_the_requested_dtype(tmp_path):
    export_hf(moekit_lm(moe=dict(recipe="mixtral", num_experts=4)), tmp_path, dtype=torch.bfloat16)
    assert {t.dtype for t in load_file(str(tmp_path / "model.safetensors")).values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize(
    "kwargs, reasons",
    [
        (dict(norm="layernorm", pos_embedding="learned"), ["model.norm=rmsnorm", "model.pos_embedding=rope"]),
        (dict(bias=True), ["set model.bias=false"]),
        (dict(gated=False), ["model.gated=true"]),
        (dict(moe=dict(recipe="deepseek", num_experts=8, top_k=2)), ["score_func='sigmoid'", "bias_update_rate=0"]),
        (dict(moe=dict(recipe="mixtral", eval_capacity_factor=1.0, capacity_scope="position")), ["eval_capacity"]),
        (dict(moe="hash"), ["a HashMoE layer"]),
        (dict(moe=None), ["a dense model (moe=none)"]),
        (dict(mod=dict(capacity=0.5, blocks="every_2")), ["Mixture-of-Depths"]),
    ],
)
def test_models_a_layout_cannot_express_are_refused_with_every_reason(kwargs, reasons, tmp_path):
    with pytest.raises(HFInterchangeError, match="cannot be written as a transformers Mixtral or Qwen2-MoE") as err:
        export_hf(moekit_lm(**kwargs), tmp_path)
    for reason in reasons:
        assert reason in str(err.value)
    assert not (tmp_path / "config.json").exists(), "nothing written"


def test_a_model_with_quantized_experts_is_refused_naming_the_float_checkpoint(tmp_path):
    ours = moekit_lm(moe=dict(recipe="mixtral", num_experts=4))
    quantize_experts(ours, QuantSpec(QuantFormat("int8"), "rtn"))  # was an AttributeError on fc1_weight
    with pytest.raises(
        HFInterchangeError, match=r"block 0: quantized experts \(QuantizedExpertBank\); export the float"
    ):
        export_hf(ours, tmp_path)
    assert not any(tmp_path.iterdir()), "nothing written"


# ------------------------------------------------------------------------------------------------
# Import: random transformers models
# ------------------------------------------------------------------------------------------------
def random_hf(model_type: str, **kwargs):
    kwargs = {"num_key_value_heads": 4, **kwargs}  # Mixtral's default is 8
    common = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64
    )
    if model_type == "mixtral":
        config = transformers.MixtralConfig(
            **common, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **kwargs
        )
    else:
        config = transformers.Qwen2MoeConfig(
            **common, intermediate_size=40, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, **kwargs
        )
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random everything (transformers starts norms at 1 and some gates at 0)
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model


IMPORT_CASES = {
    "mixtral_gqa": ("mixtral", dict(num_key_value_heads=2, rope_theta=1e6)),
    "mixtral_tied": ("mixtral", dict(tie_word_embeddings=True)),
    "qwen2_moe_shared_dense_layers": (
        "qwen2_moe",
        dict(shared_expert_intermediate_size=32, mlp_only_layers=[0], norm_topk_prob=False, num_key_value_heads=2),
    ),
    "qwen2_moe_sparse_step_no_shared": (
        "qwen2_moe",
        dict(shared_expert_intermediate_size=0, decoder_sparse_step=2, norm_topk_prob=True, qkv_bias=False),
    ),
}


@pytest.mark.parametrize("case", sorted(IMPORT_CASES))
def test_a_transformers_model_loads_with_its_logits(case, tmp_path):
    model_type, kwargs = IMPORT_CASES[case]
    theirs = random_hf(model_type, **kwargs)
    theirs.save_pretrained(tmp_path)
    ours = load_hf_lm(tmp_path, max_seq_len=32).eval()
    assert_same_logits(ours, theirs)
    input_ids = torch.randint(VOCAB, (2, 12))  # the KV cache of the imported (maybe grouped-query) model
    with torch.no_grad():
        cache = ours.init_cache(2)
        pieces = [ours(input_ids[:, :5], cache=cache), ours(input_ids[:, 5:], cache=cache)]
        torch.testing.assert_close(torch.cat(pieces, dim=1), ours(input_ids), **TOL)


@pytest.mark.parametrize(
    "model_type, left_out",
    [
        ("mixtral", ["rope_parameters", "rope_theta", "rms_norm_eps"]),
        (
            "qwen2_moe",
            ["rope_parameters", "rope_theta", "rms_norm_eps", "shared_expert_intermediate_size", "norm_topk_prob"],
        ),
    ],
)
def test_settings_a_config_leaves_out_take_transformers_defaults(model_type, left_out, tmp_path):
    """save_pretrained writes every setting, a hand-written config.json need not: transformers then takes its config
    class's defaults (Mixtral: rope_theta 1e6 and rms_norm_eps 1e-5; Qwen2-MoE: a shared expert of 5632), and so
    does moekit. Also: max_seq_len=0 is passed on (and refused), not read as 'the config's'."""
    random_hf(model_type).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in left_out}))
    theirs = hf_lm(tmp_path)
    if model_type == "mixtral":
        assert (theirs.config.rope_parameters["rope_theta"], theirs.config.rms_norm_eps) == (1e6, 1e-5)
    else:
        assert theirs.config.shared_expert_intermediate_size == 5632
    assert_same_logits(load_hf_lm(tmp_path, max_seq_len=32).eval(), theirs)
    with pytest.raises(ValueError, match="max_seq_len=0"):
        load_hf_lm(tmp_path, max_seq_len=0)


def test_sharded_and_fused_expert_folders_load_the_same_weights(tmp_path):
    theirs = random_hf("mixtral", num_key_value_heads=2)
    theirs.save_pretrained(tmp_path / "whole")
    theirs.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    whole = read_hf_state_dict(tmp_path / "whole")
    sharded = read_hf_state_dict(tmp_path / "sharded")
    assert whole.keys() == sharded.keys() and all(torch.equal(whole[k], sharded[k]) for k in whole)
    # transformers 5's in-memory layout: each layer's experts as [E, 2H, D] (gate rows first) and [E, D, H]
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((tmp_path / "whole" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, str(fused / "model.safetensors"))
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(str(fused / "model.safetensors")))
    from_fused = read_hf_state_dict(fused)
    assert all(torch.equal(whole[k], from_fused[k]) for k in whole)


@pytest.mark.parametrize(
    "damage, message",
    [
        ("no_config", "has no config.json; point it at a transformers model folder"),
        ("llama", r"model_type='llama' \(LlamaForCausalLM\); moekit reads the mixtral and qwen2_moe layouts"),
        ("missing_shard", r"model-00002-of-\d+.safetensors is missing: model.safetensors.index.json lists it"),
        ("bin_only", r"neither model.safetensors nor model.safetensors.index.json \(found \['pytorch_model.bin'\]\)"),
        ("missing_tensor", r"missing: model.layers.1.block_sparse_moe.experts.2.w3.weight \(1\)"),
        ("rope_scaling", "rope scaling"),
    ],
)
def test_damaged_or_foreign_folders_are_refused_naming_the_file_or_key(damage, message, tmp_path):
    theirs = random_hf("mixtral")
    theirs.save_pretrained(tmp_path, max_shard_size="20KB" if damage == "missing_shard" else "50GB")
    config = json.loads((tmp_path / "config.json").read_text())
    if damage == "no_config":
        (tmp_path / "config.json").unlink()
    elif damage == "llama":
        (tmp_path / "config.json").write_text(
            json.dumps(config | {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
        )
    elif damage == "missing_shard":
        sorted(tmp_path.glob("model-00002-*.safetensors"))[0].unlink()
    elif damage == "bin_only":
        (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    elif damage == "missing_tensor":
        tensors = load_file(str(tmp_path / "model.safetensors"))
        del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
        save_file(tensors, str(tmp_path / "model.safetensors"))
    elif damage == "rope_scaling":
        scaled = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
        (tmp_path / "config.json").write_text(json.dumps(config | {"rope_parameters": scaled}))
    with pytest.raises(HFInterchangeError, match=message):
        load_hf_lm(tmp_path)


def test_a_sliding_window_folder_is_refused_past_its_window_and_exact_within(tmp_path):
    theirs = random_hf("mixtral", sliding_window=8)  # each token sees the last 8 tokens only
    theirs.save_pretrained(tmp_path)
    with pytest.raises(HFInterchangeError, match=r"sliding_window=8: .* use max_seq_len <= 8 .* not 32"):
        load_hf_lm(tmp_path, max_seq_len=32)
    with pytest.raises(HFInterchangeError, match=r"sliding_window=8: .* not 32"):
        apply_hf_settings(NET, tmp_path)
    assert_same_logits(load_hf_lm(tmp_path, max_seq_len=8).eval(), theirs, tokens=8)


def test_an_export_over_an_older_sharded_model_reads_back_as_the_export(tmp_path):
    random_hf("mixtral").save_pretrained(tmp_path, max_shard_size="20KB")  # shards + model.safetensors.index.json
    earlier = {p.name for p in tmp_path.iterdir()}
    assert {"generation_config.json", "model.safetensors.index.json", "model-00001-of-00013.safetensors"} <= earlier
    (tmp_path / "README.md").write_text("the user's own notes")
    ours = load_hf_lm(tmp_path, max_seq_len=32).eval()  # the same architecture, other weights
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0.0, 0.1)
    export_hf(ours, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors", "README.md"}, (
        "the earlier model's shards, index and generation config (its tokenizer's ids) are gone, other files stay"
    )
    input_ids = torch.randint(VOCAB, (2, 16))
    with torch.no_grad():  # not the shards' weights, but what transformers reads too
        torch.testing.assert_close(load_hf_lm(tmp_path, max_seq_len=32).eval()(input_ids), ours(input_ids), **TOL)
    assert_same_logits(ours, hf_lm(tmp_path))


# ------------------------------------------------------------------------------------------------
# The task: task.init_from=hf:<folder>
# ------------------------------------------------------------------------------------------------
NET = {
    "_target_": "moekit.models.TransformerLM",
    "vocab_size": VOCAB,
    "max_seq_len": 32,
    "dim": 64,
    "depth": 2,
    "num_heads": 2,
    "dropout": 0.0,
    "moe": {"name": "deepseek", "layer": "top_k", "num_experts": 8, "score_func": "sigmoid", "z_loss_weight": 0.002},
}


def test_the_task_takes_the_architecture_and_weights_of_a_transformers_folder(tmp_path):
    theirs = random_hf("qwen2_moe", shared_expert_intermediate_size=32, mlp_only_layers=[0])
    theirs.save_pretrained(tmp_path)
    task = LanguageModel(net=NET, vocab_size=VOCAB, init_from=f"hf:{tmp_path}").eval()
    assert_same_logits(task.net, theirs)
    net = task.hparams["net"]  # what a checkpoint rebuilds the network from
    assert (net["dim"], net["depth"], net["max_seq_len"], net["moe_blocks"]) == (32, 3, 32, [1, 2])
    assert net["moe"]["z_loss_weight"] == 0.002, "the run's own loss weights stay"
    assert net["moe"]["score_func"] == "softmax" and net["moe"]["num_shared_experts"] == 2
    _, changes = apply_hf_settings(NET, tmp_path)
    assert "model.dim: 64 -> 32" in changes


def test_the_task_refuses_a_vocabulary_mismatch_and_upcycling_from_a_transformers_folder(tmp_path):
    random_hf("mixtral").save_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=rf"vocabulary of {VOCAB} tokens but the data's tokenizer has 256; .*"
        rf"data.tokenizer.path={tmp_path}/tokenizer.json data.vocab_size={VOCAB}",
    ):
        LanguageModel(net=NET, vocab_size=256, init_from=f"hf:{tmp_path}")
    with pytest.raises(ValueError, match="holds an MoE model already; use init_mode=finetune"):
        LanguageModel(net=NET, vocab_size=VOCAB, init_from=f"hf:{tmp_path}", init_mode="upcycle")
    with pytest.raises(
        HFInterchangeError, match="starts a Transformer LM, but the run's model is moekit.models.LSTMMoELM"
    ):
        LanguageModel(net={**NET, "_target_": "moekit.models.LSTMMoELM"}, vocab_size=VOCAB, init_from=f"hf:{tmp_path}")


def test_a_transformers_model_whose_embedding_pads_its_tokenizer_fine_tunes_and_samples_real_tokens(tmp_path):
    """Qwen's folders pad the embedding past the tokenizer (151936 rows, 151646 tokens): the task takes the folder
    with its own tokenizer's vocabulary, a checkpoint of it loads again, a tokenizer of another size is refused
    naming the folder's own, and sampling never draws a padding row (the tokenizer could not decode it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokens = VOCAB - 6  # 6 padding rows
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(tokens)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    theirs = random_hf("qwen2_moe")
    theirs.save_pretrained(tmp_path)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    task = LanguageModel(net=NET, vocab_size=tokens, init_from=f"hf:{tmp_path}").eval()
    assert task.net.vocab_size == VOCAB
    assert_same_logits(task.net, theirs)
    again = LanguageModel(**{**task.hparams, "init_from": None})  # what load_task rebuilds from a checkpoint
    assert again.net.vocab_size == VOCAB
    with pytest.raises(ValueError, match=rf"tokenizer has {tokens - 4}; .* data.vocab_size={tokens}"):
        LanguageModel(net=NET, vocab_size=tokens - 4, init_from=f"hf:{tmp_path}")
    with pytest.raises(ValueError, match=rf"the network has vocab_size={VOCAB} but the tokenizer has vocab_size=60"):
        LanguageModel(net={**NET, "vocab_size": VOCAB}, vocab_size=60)  # fewer rows than tokens: refused still

    class PaddingWins(nn.Module):  # logits that favour the padding rows by far
        vocab_size, max_seq_len = VOCAB, 32

        def forward(self, ids):
            return torch.arange(VOCAB, dtype=torch.float32).expand(*ids.shape, VOCAB) * 100

    prompt = torch.zeros(2, 3, dtype=torch.long)
    free = generate(PaddingWins(), prompt, max_new_tokens=8, use_cache=False)
    assert (free[:, 3:] >= tokens).all(), "without the limit the padding rows win"
    for temperature in (0, 1.0):
        limited = generate(PaddingWins(), prompt, max_new_tokens=8, temperature=temperature, use_cache=False,
                           vocab_limit=tokens)  # fmt: skip
        assert (limited[:, 3:] == tokens - 1).all(), "the most likely of the tokens the tokenizer has"


# ------------------------------------------------------------------------------------------------
# Grouped-query attention
# ------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_grouped_query_attention_is_multi_head_attention_with_shared_key_value_heads():
    gqa = moekit_lm(moe=None, num_kv_heads=2)
    mha = moekit_lm(moe=None)
    state = gqa.state_dict()
    head_dim, groups = 8, 2
    for i in range(gqa.depth):
        q, k, v = state[f"blocks.{i}.attn.qkv.weight"].split((32, 16, 16))
        repeat = lambda w: w.view(2, head_dim, 32).repeat_interleave(groups, dim=0).reshape(32, 32)  # noqa: E731
        state[f"blocks.{i}.attn.qkv.weight"] = torch.cat([q, repeat(k), repeat(v)])
    mha.load_state_dict(state)
    input_ids = torch.randint(VOCAB, (2, 16))
    torch.testing.assert_close(gqa(input_ids), mha(input_ids), **TOL)
    assert gqa.init_cache(3).keys[0].shape == (3, 2, 32, 8), "the cache holds the key/value heads only"


def test_bad_grouped_query_and_norm_settings():
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by num_kv_heads=3"):
        moekit_lm(num_kv_heads=3)
    with pytest.raises(ValueError, match="norm_eps=0 must be a positive number"):
        moekit_lm(norm_eps=0)
    with pytest.raises(ValueError, match="shared_expert_gate=True gates the shared experts, but num_shared_experts=0"):
        moekit_lm(moe=dict(recipe="mixtral", shared_expert_gate=True))
