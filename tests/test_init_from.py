"""Starting a run from another run's weights (``task.init_from``): fine-tuning with a new head, sparse upcycling
(``task.init_mode=upcycle``) and the refusals that name the fix, from checkpoint files and sharded folders."""

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from moekit.checkpoint import SHARDED_METADATA, CheckpointError
from moekit.models import upcycle_vit
from moekit.moe import ExpertBank
from moekit.tasks import ImageClassifier

DENSE = {
    "_target_": "moekit.models.create_model",
    "model_name": "vit_tiny_patch4_28",
    "embed_dim": 32,
    "depth": 4,
    "num_heads": 2,
}
TOP2 = dict(
    DENSE,
    model_name="top2_moe_vit_tiny_patch4_28",
    moe={"num_experts": 4, "capacity_factor": None, "eval_capacity_factor": None},
    moe_blocks="every_2",
)


@pytest.fixture
def dense_ckpt(tmp_path):
    """A dense tiny ViT's weights (10 classes) and the task that holds them."""
    dense = ImageClassifier(net=DENSE, num_classes=10).eval()
    path = tmp_path / "dense.pt"
    torch.save(dense.net.state_dict(), path)
    return path, dense


def test_finetune_with_another_class_count_loads_all_but_the_head_and_says_so(dense_ckpt, caplog):
    path, dense = dense_ckpt
    with caplog.at_level("INFO", logger="moekit"):
        task = ImageClassifier(net=dict(DENSE, num_classes=5), num_classes=5, init_from=str(path))
    for name, value in task.net.state_dict().items():
        if not name.startswith("head."):
            assert torch.equal(value, dense.net.state_dict()[name]), name
    assert task.net.head.weight.shape == (5, 32)
    assert "head.weight (5, 32) (the checkpoint's: (10, 32)), head.bias (5,) (the checkpoint's: (10,))" in caplog.text


def test_finetuning_an_moe_model_from_a_dense_checkpoint_points_to_upcycling(dense_ckpt):
    path, _ = dense_ckpt
    with pytest.raises(
        CheckpointError, match=r"dense MLPs where this model has MoE layers \(blocks.1.mlp, blocks.3.mlp"
    ):
        ImageClassifier(net=TOP2, num_classes=10, init_from=str(path))
    with pytest.raises(CheckpointError, match="task.init_mode=upcycle"):
        ImageClassifier(net=TOP2, num_classes=10, init_from=str(path))


@torch.no_grad()
def test_upcycling_into_some_blocks_copies_their_mlps_computes_the_dense_vit_and_says_so(dense_ckpt, caplog):
    path, dense = dense_ckpt
    with caplog.at_level("INFO", logger="moekit"):
        task = ImageClassifier(net=TOP2, num_classes=10, init_from=str(path), init_mode="upcycle").eval()
    assert task.net.moe_block_indices == (1, 3)
    for i in (1, 3):
        bank, mlp = task.net.blocks[i].mlp.experts, dense.net.blocks[i].mlp
        assert isinstance(bank, ExpertBank)
        for e in range(bank.num_experts):
            assert torch.equal(bank.fc1_weight[e], mlp.fc1.weight.t()) and torch.equal(bank.fc1_bias[e], mlp.fc1.bias)
            assert torch.equal(bank.fc2_weight[e], mlp.fc2.weight.t()) and torch.equal(bank.fc2_bias[e], mlp.fc2.bias)
    dense_state = dense.net.state_dict()
    for name, value in task.net.state_dict().items():
        if not name.startswith(("blocks.1.mlp.", "blocks.3.mlp.")):
            assert torch.equal(value, dense_state[name]), name
    images = torch.randn(3, 1, 28, 28)
    torch.testing.assert_close(task(images), dense(images), rtol=1e-5, atol=1e-5)
    assert "upcycled VisionTransformer: the experts of blocks.1.mlp, blocks.3.mlp copy the dense MLPs" in caplog.text


def test_upcycling_from_an_moe_checkpoint_is_refused_naming_its_moe_layers(dense_ckpt, tmp_path):
    path, _ = dense_ckpt
    moe = ImageClassifier(net=TOP2, num_classes=10, init_from=str(path), init_mode="upcycle")
    torch.save(moe.net.state_dict(), tmp_path / "moe.pt")
    fresh = ImageClassifier(net=TOP2, num_classes=10)
    before = {k: v.clone() for k, v in fresh.net.state_dict().items()}
    with pytest.raises(ValueError, match=r"hold MoE layers already \(blocks.1.mlp, blocks.3.mlp\).*init_mode=finetune"):
        upcycle_vit(fresh.net, torch.load(tmp_path / "moe.pt"))
    assert all(torch.equal(v, before[k]) for k, v in fresh.net.state_dict().items()), "nothing is written"
    with pytest.raises(ValueError, match="hold MoE layers already"):
        ImageClassifier(net=TOP2, num_classes=10, init_from=str(tmp_path / "moe.pt"), init_mode="upcycle")


def test_init_from_a_sharded_checkpoint_folder_loads_its_weights(dense_ckpt, tmp_path):
    """A folder as FSDP's ``state_dict_type=sharded`` writes it (torch.distributed.checkpoint shards and their
    index, optimizer states beside the weights, then rank 0's metadata file)."""
    _, dense = dense_ckpt
    folder = tmp_path / "last.ckpt"
    optimizer = torch.optim.AdamW(dense.parameters())
    dense(torch.randn(2, 1, 28, 28)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings():  # one process, no process group: torch says it saves as a single process
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"state_dict": dense.state_dict(), "optimizer_0": optimizer.state_dict()}, checkpoint_id=folder)
    torch.save({"epoch": 0, "global_step": 1}, folder / SHARDED_METADATA)
    task = ImageClassifier(net=DENSE, num_classes=10, init_from=str(folder))
    for name, value in task.net.state_dict().items():
        assert torch.equal(value, dense.net.state_dict()[name]), name
    upcycled = ImageClassifier(net=TOP2, num_classes=10, init_from=str(folder), init_mode="upcycle")
    assert torch.equal(upcycled.net.blocks[1].mlp.experts.fc2_bias[3], dense.net.blocks[1].mlp.fc2.bias)


@pytest.mark.parametrize("mode", ["finetune", "upcycle"])
@pytest.mark.parametrize("head", ["other_classes", "none"])
def test_a_head_of_other_classes_or_none_starts_fresh_in_both_modes(dense_ckpt, mode, head, caplog):
    """A backbone exported without its head (num_classes=0) or a head of 10 classes into a 5-class task: the
    backbone loads (upcycled or as it is), the head is the task's fresh one."""
    path, dense = dense_ckpt
    state = {k: v for k, v in dense.net.state_dict().items() if head == "other_classes" or not k.startswith("head.")}
    torch.save(state, path)
    net = dict(TOP2 if mode == "upcycle" else DENSE, num_classes=5)
    torch.manual_seed(0)
    fresh = ImageClassifier(net=net, num_classes=5).net.head.state_dict()
    torch.manual_seed(0)
    with caplog.at_level("INFO", logger="moekit"):
        task = ImageClassifier(net=net, num_classes=5, init_from=str(path), init_mode=mode)
    assert all(torch.equal(task.net.head.state_dict()[k], v) for k, v in fresh.items())
    moe = ("blocks.1.mlp.", "blocks.3.mlp.") if mode == "upcycle" else ()
    for name, value in task.net.state_dict().items():
        if not name.startswith(("head.", *moe)):
            assert torch.equal(value, dense.net.state_dict()[name]), name
    assert "start fresh" in caplog.text or "starts fresh" in caplog.text


@torch.no_grad()
def test_upcycling_into_mixture_of_depths_blocks_copies_the_wrapped_blocks_and_keeps_fresh_routers(dense_ckpt, caplog):
    """A ViT block that Mixture-of-Depths wraps (``blocks.i.block``) reads the dense ``blocks.i``, its experts the dense
    MLP there; the depth routers, which the dense model lacks, keep their fresh values. Fine-tuning instead points
    to upcycling."""
    path, dense = dense_ckpt
    net = dict(TOP2, mod={"capacity": 0.5, "blocks": [1, 2]})
    with pytest.raises(
        CheckpointError, match=r"no Mixture-of-Depths routers .*blocks.1.depth_router.*init_mode=upcycle"
    ):
        ImageClassifier(net=dict(net, moe="none"), num_classes=10, init_from=str(path))
    torch.manual_seed(0)
    fresh = ImageClassifier(net=net, num_classes=10).net.state_dict()
    torch.manual_seed(0)
    with caplog.at_level("INFO", logger="moekit"):
        task = ImageClassifier(net=net, num_classes=10, init_from=str(path), init_mode="upcycle")
    assert task.net.mod_block_indices == (1, 2)
    dense_state = dense.net.state_dict()
    for name, value in task.net.state_dict().items():
        if ".depth_router." in name or ".mlp.router." in name:
            assert torch.equal(value, fresh[name]), name
        elif ".mlp.experts." not in name:
            assert torch.equal(value, dense_state[name.replace(".block.", ".")]), name
    bank = task.net.blocks[1].block.mlp.experts
    assert torch.equal(bank.fc1_weight[2], dense.net.blocks[1].mlp.fc1.weight.t())
    assert "the Mixture-of-Depths routers of blocks.1.depth_router, blocks.2.depth_router start fresh" in caplog.text
    dense_only = ImageClassifier(net=dict(net, moe="none"), num_classes=10, init_from=str(path), init_mode="upcycle")
    assert torch.equal(dense_only.net.blocks[2].block.mlp.fc1.weight, dense.net.blocks[2].mlp.fc1.weight)


@pytest.mark.parametrize("mode", ["finetune", "upcycle"])
def test_weights_saved_with_a_tied_weight_once_load_under_both_names(mode, tmp_path):
    """safetensors' ``save_model`` stores the LM's tied embedding and output weight under one name: loading the
    file said "missing: token_embedding.weight ... build the model with the configuration it was trained with"."""
    from safetensors.torch import save_model

    from moekit.models import TransformerLM
    from moekit.tasks import LanguageModel

    shape = {"vocab_size": 40, "max_seq_len": 16, "dim": 32, "depth": 2, "num_heads": 2, "mlp_ratio": 2.0}
    source = TransformerLM(**shape, moe=None if mode == "upcycle" else "mixtral")
    save_model(source, tmp_path / "tied.safetensors")
    net = {"_target_": "moekit.models.TransformerLM", **shape, "moe": "mixtral"}
    task = LanguageModel(net=net, vocab_size=40, init_from=str(tmp_path / "tied.safetensors"), init_mode=mode)
    assert task.net.head.weight is task.net.token_embedding.weight
    assert torch.equal(task.net.token_embedding.weight, source.token_embedding.weight)
    if mode == "finetune":
        x = torch.randint(0, 40, (2, 16))
        with torch.no_grad():
            assert torch.equal(task.net.eval()(x), source.eval()(x))


def _training_checkpoint(net: torch.nn.Module, config: dict, path: Path, layout: str) -> tuple[str, dict]:
    """A checkpoint of ``net`` built from ``config``, as scripts/train.py saves one (a file or a sharded folder), and
    its weights."""
    state = net.state_dict()
    weights = {f"net.{k}": v for k, v in state.items()}
    if layout == "file":
        torch.save({"state_dict": weights, "hyper_parameters": {"net": config}}, path)
        return str(path), state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"state_dict": weights}, checkpoint_id=path)
    torch.save({"epoch": 0, "hyper_parameters": {"net": config}}, path / SHARDED_METADATA)
    return str(path), state


@pytest.mark.parametrize("layout", ["file", "sharded_folder"])
def test_upcycling_from_a_training_checkpoint_checks_the_network_it_saved(tmp_path, layout, caplog):
    """A training checkpoint keeps its network's config (``hyper_parameters.net``): upcycling rebuilds that network
    (on the meta device) and refuses what no weight's shape shows, here 4 attention heads of width 8 where the MoE
    model has 2 of 16, naming the setting and its modules. A config that no longer builds leaves the weights' check
    alone, with a warning."""

    def training_checkpoint(net: dict, name: str):
        return _training_checkpoint(ImageClassifier(net=net, num_classes=10).net, net, tmp_path / name, layout)

    same, dense = training_checkpoint(DENSE, "same")
    upcycled = ImageClassifier(net=TOP2, num_classes=10, init_from=same, init_mode="upcycle")
    assert torch.equal(upcycled.net.blocks[1].mlp.experts.fc1_weight[0], dense["blocks.1.mlp.fc1.weight"].t())
    four_heads, _ = training_checkpoint(dict(DENSE, num_heads=4), "heads")
    fresh = ImageClassifier(net=TOP2, num_classes=10)
    with pytest.raises(ValueError) as info:
        fresh._initialise_from(four_heads, "upcycle")
    message = str(info.value)
    assert (
        "architecture differences ['num_heads: dense 4 vs MoE 2 (blocks.0.attn, blocks.1.attn, blocks.2.attn" in message
    )
    assert "head_dim: dense 8 vs MoE 16" in message and "build the MoE model with the dense model's settings" in message
    assert "missing keys" not in message and "shape mismatches" not in message
    unbuildable, _ = training_checkpoint(dict(DENSE), "old")
    meta = Path(unbuildable) / SHARDED_METADATA if layout == "sharded_folder" else Path(unbuildable)
    saved = torch.load(meta, weights_only=False)
    saved["hyper_parameters"]["net"]["_target_"] = "moekit.models.no_such_builder"
    torch.save(saved, meta)
    with caplog.at_level("WARNING", logger="moekit"):
        ImageClassifier(net=TOP2, num_classes=10, init_from=unbuildable, init_mode="upcycle")
    assert (
        "could not be rebuilt from its config" in caplog.text
        and "checks the weights' names and shapes only" in caplog.text
    )


@pytest.mark.parametrize("layout", ["file", "sharded_folder"])
def test_finetuning_from_a_training_checkpoint_refuses_a_network_that_computes_otherwise(tmp_path, layout):
    """Fine-tuning checks the network a training checkpoint saved as upcycling does: other attention heads and another
    activation (in the experts too) are refused, naming each with its modules, and nothing is written. What fine-tuning
    may change loads: the head's classes, the pooling, stochastic depth, the routers' capacity."""
    path, state = _training_checkpoint(ImageClassifier(net=TOP2, num_classes=10).net, TOP2, tmp_path / "top2", layout)
    moe = dict(TOP2["moe"], capacity_factor=1.0)
    changed = dict(TOP2, num_classes=5, global_pool="avg", drop_path_rate=0.1, moe=moe)
    task = ImageClassifier(net=changed, num_classes=5, init_from=path)
    assert torch.equal(task.net.blocks[1].mlp.experts.fc1_weight, state["blocks.1.mlp.experts.fc1_weight"])
    assert torch.equal(task.net.blocks[2].attn.qkv.weight, state["blocks.2.attn.qkv.weight"])
    other = ImageClassifier(net=dict(TOP2, num_heads=4, act_layer="relu"), num_classes=10)
    before = {k: v.clone() for k, v in other.net.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        other._initialise_from(path, "finetune")
    message = str(info.value)
    assert "architecture differences ['num_heads: checkpoint 2 vs model 4 (blocks.0.attn, blocks.1.attn" in message
    assert "class: checkpoint GELU vs model ReLU (blocks.0.mlp.act, blocks.2.mlp.act" in message
    assert "blocks.1.mlp.experts.act, blocks.3.mlp.experts.act)" in message
    assert "Build the model with the configuration the checkpoint was trained with" in message
    assert all(torch.equal(v, before[k]) for k, v in other.net.state_dict().items())


def test_finetuning_a_language_model_refuses_another_rotary_base_and_loads_plain_weights_unchecked(tmp_path):
    from moekit.models import TransformerLM
    from moekit.tasks import LanguageModel

    shape = {"vocab_size": 40, "max_seq_len": 16, "dim": 32, "depth": 2, "num_heads": 2, "moe": "mixtral"}
    config = {"_target_": "moekit.models.TransformerLM", **shape}
    source = TransformerLM(**shape)
    path, _ = _training_checkpoint(source, config, tmp_path / "lm.ckpt", "file")
    with pytest.raises(CheckpointError, match=r"base: checkpoint 10000.0 vs model 500.0 \("):
        LanguageModel(net=dict(config, rope_base=500.0), vocab_size=40, init_from=path)
    torch.save(source.state_dict(), tmp_path / "weights.pt")  # no config to rebuild: the key check alone
    task = LanguageModel(net=dict(config, rope_base=500.0), vocab_size=40, init_from=str(tmp_path / "weights.pt"))
    assert torch.equal(task.net.token_embedding.weight, source.token_embedding.weight)
