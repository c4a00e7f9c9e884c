"""The Transformer LM's attention maths: rotary positions against transformers' (and their float32 tables through
casts, moves and meta-device construction), grouped-query attention and masks against a float64 softmax reference,
and the refusal of head counts that do not fit."""

from __future__ import annotations

import math

import pytest
import torch

from moekit.models import TransformerLM
from moekit.models.attention import CausalSelfAttention
from moekit.models.rotary import RotaryEmbedding

TINY = dict(vocab_size=50, max_seq_len=16, dim=32, depth=2, num_heads=4, moe=None)


@pytest.mark.parametrize("theta", [10000.0, 1e6])
def test_rope_matches_transformers_rotate_half(theta):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    head_dim, length = 16, 64
    q, k = torch.randn(2, 3, length, head_dim), torch.randn(2, 3, length, head_dim)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.cat([torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)] * 2, dim=-1)
    q_ref, k_ref = llama.apply_rotary_pos_emb(q, k, angles.cos(), angles.sin(), unsqueeze_dim=0)
    rope = RotaryEmbedding(head_dim, length, base=theta)
    torch.testing.assert_close(rope(q, 0), q_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rope(k, 0), k_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rope(q[:, :, 40:], 40), q_ref[:, :, 40:], atol=1e-4, rtol=1e-4)


def test_rope_tables_stay_float32_when_the_model_is_cast():
    """``model.to(torch.bfloat16)`` cast the cos / sin tables to bf16 (2^-9 steps): the rotation was no longer the
    documented float32 one, and a bf16 model rotated otherwise than the float32 model on the same bf16 input."""
    model = TransformerLM(**TINY)
    rope = model.blocks[0].attn.rope
    x = torch.randn(1, 4, 16, 8).bfloat16()
    expected = rope(x, 0)
    model.to(torch.bfloat16)
    assert rope.cos.dtype == rope.sin.dtype == torch.float32
    assert torch.equal(rope(x, 0), expected)
    model.double()
    assert rope.cos.dtype == torch.float32


def test_a_transformer_lm_built_on_meta_and_materialised_has_its_rope_tables():
    """The tables are non-persistent buffers (not in the state dict): after ``to_empty`` they were uninitialised
    memory, so a model built on the meta device and loaded from a state dict computed other logits."""
    torch.manual_seed(0)
    reference = TransformerLM(**TINY).eval()
    with torch.device("meta"):
        model = TransformerLM(**TINY)
    model.to_empty(device="cpu")
    for block in model.blocks:
        block.attn.rope.cos.fill_(7.0)  # what to_empty may hand out, if the move did not recompute them
        block.attn.rope.sin.fill_(7.0)
    for module in model.modules():  # the empty_init pattern: redo each owner's initialisation, then load
        if hasattr(module, "reset_parameters") and list(module.buffers(recurse=False)):
            module.reset_parameters()
    model.load_state_dict(reference.state_dict())
    input_ids = torch.randint(50, (2, 16))
    torch.testing.assert_close(model.eval()(input_ids), reference(input_ids))
    with torch.device("meta"):
        moved = TransformerLM(**TINY)
    moved.to_empty(device="cpu").load_state_dict(reference.state_dict())  # to_empty alone recomputes them
    torch.testing.assert_close(moved.eval()(input_ids), reference(input_ids))


def test_rope_past_its_table_is_refused_naming_the_length():
    rope = RotaryEmbedding(8, 16)
    message = r"positions 14 \.\. 17 exceed max_seq_len=16; build it with max_seq_len >= 18"
    with pytest.raises(ValueError, match=message):
        rope(torch.randn(1, 2, 4, 8), 14)


def reference_attention(attn: CausalSelfAttention, x, start=0, key_mask=None):
    """softmax(q k^T / sqrt(d)) v in float64 with the key/value heads repeated, causal (and key-masked)."""
    batch, tokens, dim = x.shape
    hd, heads, kv_heads = attn.head_dim, attn.num_heads, attn.num_kv_heads
    q, k, v = attn.qkv(x).split((heads * hd, kv_heads * hd, kv_heads * hd), dim=-1)
    q = attn.rope(q.view(batch, tokens, heads, hd).transpose(1, 2), start)
    k = attn.rope(k.view(batch, tokens, kv_heads, hd).transpose(1, 2), start)
    v = v.view(batch, tokens, kv_heads, hd).transpose(1, 2)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1).double() for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(hd)
    allowed = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    if key_mask is not None:
        allowed = allowed & (key_mask[:, None, None, :] | torch.eye(tokens, dtype=torch.bool))
    out = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
    return attn.proj(out.transpose(1, 2).reshape(batch, tokens, dim).to(x.dtype))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_grouped_query_attention_with_a_cache_and_padding_is_the_reference(dtype, tol, kv_heads):
    torch.manual_seed(0)
    rope = RotaryEmbedding(8, 16)
    attn = CausalSelfAttention(32, 4, num_kv_heads=kv_heads, bias=False, dropout=0.5, rope=rope).to(dtype)
    attn.eval()  # no attention dropout outside training
    x = torch.randn(2, 10, 32, dtype=dtype)
    with torch.no_grad():
        expected = reference_attention(attn, x)
        torch.testing.assert_close(attn(x), expected, atol=tol, rtol=tol)
        keys = torch.zeros(2, kv_heads, 16, 8, dtype=dtype)
        cache = (keys, keys.clone())
        pieces = [attn(x[:, a:b], a, cache) for a, b in ((0, 4), (4, 7), (7, 8), (8, 10))]
        torch.testing.assert_close(torch.cat(pieces, 1), expected, atol=tol, rtol=tol)
        key_mask = torch.ones(2, 10, dtype=torch.bool)
        key_mask[0, 6:] = False  # right padding
        key_mask[1] = False  # a sequence of padding only: every query sees just itself, finite
        out = attn(x, key_mask=key_mask)
        assert out.isfinite().all()
        torch.testing.assert_close(out, reference_attention(attn, x, key_mask=key_mask), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dim=30, num_heads=4), "dim=30 is not divisible by num_heads=4; pick a divisor of dim"),
        (dict(num_kv_heads=3), "num_heads=4 is not divisible by num_kv_heads=3; pick a divisor of num_heads"),
        (dict(num_kv_heads=8), "num_heads=4 is not divisible by num_kv_heads=8"),
        (dict(num_kv_heads=0), "num_kv_heads=0 must be a positive int"),
        (dict(rope=RotaryEmbedding(4, 16)), r"head_dim=4 but dim / num_heads = 8; build it with RotaryEmbedding\(8"),
    ],
)
def test_bad_attention_head_counts_are_refused(kwargs, message):
    arguments = {"dim": 32, "num_heads": 4, "bias": False, "dropout": 0.0, "rope": None, **kwargs}
    with pytest.raises(ValueError, match=message):
        CausalSelfAttention(**arguments)
