"""Quantization, export and upcycling at their edges: the Tunstall code of a (nearly) constant ternary matrix,
upcycling from timm GluMlp MLPs whose gate comes first, and export / quantize refusing to write over the checkpoint
they read."""

from __future__ import annotations

import pytest
import torch
from timm.layers import GluMlp, SwiGLUPacked

from moekit.quant import QuantFormat, QuantizedWeight, rtn_quantize, ternary_code


def test_the_code_of_an_all_zero_ternary_matrix_builds_no_table_larger_than_the_one_it_keeps(monkeypatch):
    """Choosing between the 8- and 16-bit codes built both decoding tables: for a constant source the 16-bit one
    is a chain of 32,767 symbols per codeword (2 GiB and minutes for a zero matrix of 100k weights)."""
    built = []
    real = ternary_code.build_code

    def spy(counts, bits):
        code = real(counts, bits)
        built.append(code.table_bytes())
        return code

    monkeypatch.setattr(ternary_code, "build_code", spy)
    q = rtn_quantize(torch.zeros(2, 16, 10), QuantFormat("ternary", 8))  # 320 weights, all rounded to 0
    assert int((q.codes != 1).sum()) == 0
    weight = QuantizedWeight.from_codes(q)
    kept = weight.word_table.numel() * weight.word_table.element_size() + weight.word_lengths.numel() * 8
    assert max(built) <= kept, (built, kept)  # was also 16-bit's table: 65,535 words x 1,116 symbols
    assert kept < 2**16
    for e in range(2):
        assert torch.equal(weight.codes(e), q.codes[e]) and bool((weight.dequantize(e) == 0).all())


VIT = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=32, depth=2, num_heads=4)
GATED = dict(recipe="top2", num_experts=4, normalize_gates=True, gated=True, granularity=2)  # GluMlp's hidden size


@torch.no_grad()
@pytest.mark.parametrize("mlp_layer", [GluMlp, SwiGLUPacked], ids=["gate_last", "gate_first"])
@pytest.mark.parametrize("given", ["module", "state_dict"])
def test_upcycling_from_glu_mlps_computes_the_dense_vit_whichever_half_holds_the_gate(mlp_layer, given):
    """A GluMlp's fused fc1 holds (x, gate) or, with gate_last=False (timm's SwiGLUPacked), (gate, x): the weights
    do not say which, and upcycling took every one for gate_last, swapping the experts' gate and up projections."""
    from moekit.models.upcycle import upcycle_vit
    from moekit.models.vit import create_moe_vit

    torch.manual_seed(0)
    kwargs = dict(VIT, mlp_layer=mlp_layer, act_layer=torch.nn.SiLU)
    dense = create_moe_vit(moe=None, **kwargs).eval()
    # with a state dict, the order comes from the GluMlp blocks the MoE model kept dense (block 0)
    moe = create_moe_vit(moe=GATED, moe_blocks="all" if given == "module" else [1], **kwargs).eval()
    upcycle_vit(moe, dense if given == "module" else dense.state_dict())
    x = torch.randn(3, 1, 28, 28)
    torch.testing.assert_close(moe(x), dense(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("command", ["export", "quantize"])
def test_export_and_quantize_refuse_to_write_over_the_checkpoint_they_read(command, tmp_path):
    """output_path=<ckpt_path> replaced the training checkpoint by the exported (or quantized) file."""
    from conftest import TINY_NET, compose_config
    from moekit.checkpoint import TASK_KEY
    from moekit.errors import OutputError
    from moekit.tasks import ImageClassifier

    task = ImageClassifier(net=TINY_NET, num_classes=10)
    ckpt = tmp_path / "last.ckpt"
    torch.save(
        {
            TASK_KEY: "moekit.tasks.classification:ImageClassifier",
            "hyper_parameters": dict(task.hparams),
            "state_dict": task.state_dict(),
        },
        ckpt,
    )
    before = ckpt.read_bytes()
    overrides = [f"ckpt_path={ckpt}", f"output_path={tmp_path}/./last.ckpt"]
    cfg = compose_config(command, overrides + (["method=rtn"] if command == "quantize" else []), tmp_path / "run")
    if command == "export":
        from moekit.commands.export import export as run
    else:
        from moekit.commands.quantize import quantize as run
    with pytest.raises(OutputError, match=r"output_path=.* is ckpt_path itself.*e\.g\. output_path=.*last\."):
        run(cfg)
    assert ckpt.read_bytes() == before


def test_export_refuses_a_folder_as_output_path_before_reading_the_checkpoint(tmp_path, monkeypatch):
    """The output's checks come first: a folder given as output_path was refused only after the checkpoint (which can
    take minutes to read) was loaded."""
    import moekit.commands.export as export_command
    from conftest import compose_config
    from moekit.errors import OutputError

    def never(path):
        raise AssertionError(f"read {path} before checking the output")

    monkeypatch.setattr(export_command, "load_task", never)
    folder = tmp_path / "out"
    folder.mkdir()
    cfg = compose_config("export", [f"ckpt_path={tmp_path / 'last.ckpt'}", f"output_path={folder}"], tmp_path / "run")
    with pytest.raises(OutputError, match=rf"output_path='{folder}' is a folder; .* output_path={folder}/last\."):
        export_command.export(cfg)
