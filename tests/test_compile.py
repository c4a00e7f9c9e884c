"""``torch.compile`` and the MoE layers: no graph break inside any layer (BASE's exact balanced-assignment solver
and the ragged loop kernel are custom operators; BASE's sync-free solver is plain tensor operations), none in the
models, and compiled layers give the eager outputs and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.utils import counters

from conftest import TINY_NET, compose_config
from moekit.checkpoint import load_task
from moekit.commands.train import train
from moekit.configs import instantiate
from moekit.data.fashion_mnist import write_fake_fashion_mnist
from moekit.models import TransformerLM, compile_network, create_model
from moekit.models.summary import model_summary
from moekit.moe import build_moe_layer
from moekit.recipes import list_recipes
from moekit.tasks import ImageClassifier, LanguageModel


def settings_for(name: str) -> dict:
    return {"vocab_size": 50} if name == "hash" else {"num_tokens": 16} if name == "soft_moe" else {}


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16_autocast"])
@pytest.mark.parametrize("name", list_recipes())
def test_no_graph_break_inside_an_moe_layer(name, bf16):
    """Also under bf16 autocast, the precision ``auto`` trains in on CPUs with AMX, whose choices (padding, the loop's
    weight cast) read the CPU's matrix units: a constant to Dynamo, not a file it would break the graph to read."""
    torch.manual_seed(0)
    layer = build_moe_layer(name, in_features=32, hidden_features=64, model_settings=settings_for(name))
    kwargs = {"token_ids": torch.randint(50, (2, 16))} if name == "hash" else {}
    dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        explanation = dynamo.explain(layer)(torch.randn(2, 16, 32), **kwargs)
    assert explanation.graph_break_count == 0, [str(b.reason).splitlines()[0] for b in explanation.break_reasons]


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16_autocast"])
@pytest.mark.parametrize("model", ["transformer_lm", "soft_moe_vit"])
def test_no_graph_break_in_the_models(model, bf16):
    if model == "transformer_lm":
        net, x = TransformerLM(vocab_size=50, dim=32, depth=2, num_heads=2, max_seq_len=16), torch.randint(50, (2, 16))
    else:
        net, x = create_model("soft_moe_vit_tiny_patch4_28"), torch.randn(2, 1, 28, 28)
    dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        explanation = dynamo.explain(net)(x)
    assert explanation.graph_break_count == 0, [str(b.reason).splitlines()[0] for b in explanation.break_reasons]


@pytest.mark.parametrize("name", ["mixtral", "base", "base_sync_free"])
def test_a_compiled_layer_gives_the_eager_outputs_and_gradients(name):
    """Mixtral's dropless groups run the ragged loop kernel; BASE's training forward the balanced assignment: the
    exact solver (a custom operator) or the sync-free one (plain tensor operations, traced whole)."""
    torch.manual_seed(0)
    moe = {"recipe": "base", "solver": "sync_free"} if name == "base_sync_free" else name
    layer = build_moe_layer(moe, in_features=32, hidden_features=64)
    x = torch.randn(2, 16, 32)
    grads = []
    for fn in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        layer.zero_grad()
        out = fn(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append((out.detach(), [p.grad.clone() for p in layer.parameters()]))
    (eager, eager_grads), (compiled, compiled_grads) = grads
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("scope", ["batch", "position", "group"])
def test_a_new_capacity_factor_does_not_recompile_and_drops_as_in_eager(scope):
    """The capacity tuner sets factors on the layer; a compiled forward reads them as data (no guard on their value)."""
    torch.manual_seed(0)
    spec = {"recipe": "top2", "num_experts": 8, "capacity_scope": scope}
    if scope == "group":
        spec["group_size"] = 8
    layer = build_moe_layer(spec, in_features=32, hidden_features=64)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(16, 16, 32)  # capacities 5, 2, 4, 8 per position of 16 tokens
    dynamo.reset()
    counters.clear()
    dropped = []
    for factor in (1.25, 0.5, 1.0, 2.0):
        layer.capacity_factor = factor
        out = compiled(x)
        dropped.append(float(layer.stats["dropped_fraction"]))
        torch.testing.assert_close(out, layer(x))
        assert float(layer.stats["dropped_fraction"]) == dropped[-1]
    assert dropped[1] > dropped[2] > dropped[3], dropped  # the factors took effect
    assert counters["stats"]["unique_graphs"] == 1, "a new capacity factor recompiled the layer"


def _double_the_output(module, args, out):
    return out * 2


def _frames_compiled() -> int:
    return counters["frames"]["ok"]


@pytest.mark.parametrize("kind", ["torch_linear", "moe_vit"])
def test_compile_network_compiles_in_place_with_hooks_and_the_same_state_dict(kind):
    """``nn.Linear.compile()`` compiles nothing on torch 2.11 (its forward is torch's own code, a frame Dynamo skips);
    compile_network compiles it and a whole MoE ViT: one frame, no graph break, the eager outputs and gradients, a
    forward hook registered before it still applied, the state-dict keys unchanged, and a copy is plain eager."""
    torch.manual_seed(0)
    net, x = (
        (torch.nn.Linear(8, 8), torch.randn(4, 8))
        if kind == "torch_linear"
        else (create_model("soft_moe_vit_tiny_patch4_28"), torch.randn(2, 1, 28, 28))
    )
    net.register_forward_hook(_double_the_output)
    keys = list(net.state_dict())
    eager = net(x)
    eager_grads = torch.autograd.grad(eager.square().sum(), list(net.parameters()))
    dynamo.reset()
    counters.clear()
    compile_network(net, backend="aot_eager")
    compiled = net(x)
    grads = torch.autograd.grad(compiled.square().sum(), list(net.parameters()))
    assert _frames_compiled() == 1 and counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch.testing.assert_close(compiled, eager)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want)
    assert list(net.state_dict()) == keys
    assert copy.deepcopy(net)._compiled_call_impl is None  # what pickling keeps (Module.__getstate__)


def test_networks_compiled_one_after_another_each_compile_past_the_recompile_limit():
    """Dynamo keeps at most ``recompile_limit`` graphs per code object: networks of a process (a sweep's jobs, each a
    train and an eval graph) must not share one budget, or the fifth job or so would train eagerly."""
    limit = getattr(dynamo.config, "recompile_limit", None) or dynamo.config.cache_size_limit
    dynamo.reset()
    counters.clear()
    for width in range(1, limit + 3):  # each another shape: another graph
        net = compile_network(torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.GELU()), backend="eager")
        before = _frames_compiled()
        x = torch.randn(2, 4)
        torch.testing.assert_close(net(x), net._call_impl(x))
        assert _frames_compiled() == before + 1, f"network {width} ran eagerly"


def test_the_flop_counter_runs_a_compiled_network_eagerly_and_leaves_it_to_compile():
    """``train()`` measures the network's FLOPs before fitting it. Dynamo does not trace under the counter (a dispatch
    mode), and torch 2.11 marks a frame first met there as never to be compiled (a GPU image trained a
    ``task.compile=true`` model eagerly): under the counter Dynamo is off (stance ``force_eager``), and the network's
    next call compiles one frame."""
    net = create_model("soft_moe_vit_tiny_patch4_28")
    stances = []
    net.register_forward_pre_hook(lambda module, args: stances.append(dynamo.eval_frame._stance.stance))
    dynamo.reset()
    counters.clear()
    compile_network(net, backend="aot_eager")
    summary = model_summary(net, input_size=(1, 28, 28))
    assert stances == ["force_eager"] and summary.flops_per_image > 0
    assert dynamo.eval_frame._stance.stance == "default"
    net(torch.randn(2, 1, 28, 28))
    assert _frames_compiled() == 1, dict(counters["frames"])


@pytest.mark.parametrize("task", ["classifier", "language_model"])
def test_task_compile_true_runs_the_network_compiled(task, monkeypatch):
    """``task.compile=true`` (both tasks): a forward of the task runs a compiled frame and gives the eager logits."""
    compile_fn = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_fn(fn, **{"backend": "aot_eager", **kw}))
    torch.manual_seed(0)
    if task == "classifier":
        model, x = ImageClassifier(net=TINY_NET, num_classes=10, compile=True), torch.randn(2, 1, 28, 28)
    else:
        net = {"_target_": "moekit.models.TransformerLM", "vocab_size": 50, "dim": 32, "depth": 2, "num_heads": 2}
        net["max_seq_len"] = 16
        model, x = LanguageModel(net=net, vocab_size=50, compile=True), torch.randint(50, (2, 16))
    model.eval()
    dynamo.reset()
    counters.clear()
    with torch.no_grad():
        compiled = model(x)
        eager = model.net._call_impl(x)
    assert _frames_compiled() >= 1, "task.compile=true ran the network eagerly"
    torch.testing.assert_close(compiled, eager)


NO_FRAME_WARNING = "task.compile=true, yet Dynamo compiled no frame"


@pytest.mark.e2e
def test_a_training_run_with_task_compile_fits_evaluates_and_checkpoints_plain_keys(tmp_path, monkeypatch, caplog):
    """``task.compile=true`` through Lightning (fit, validation, test): the steps run compiled frames, and the
    checkpoint holds the network's own state-dict keys, which an uncompiled model loads."""
    compile_fn = torch.compile  # aot_eager: the same frames, quick to compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_fn(fn, **{"backend": "aot_eager", **kw}))
    data = write_fake_fashion_mnist(tmp_path / "fm", n_train=64, n_test=32)
    overrides = ["experiment=soft_moe_vit", "debug=tiny", "trainer.max_steps=3", f"data.root={data}"]
    overrides.append("data.val_size=32")
    dynamo.reset()
    counters.clear()
    with caplog.at_level("WARNING", logger="moekit"):
        metrics = train(compose_config("train", [*overrides, "task.compile=true"], tmp_path / "run"))
    assert counters["frames"]["ok"] >= 2, dict(counters["frames"])  # training and evaluation graphs
    assert NO_FRAME_WARNING not in caplog.text
    assert torch.isfinite(torch.tensor(metrics["test/loss"]))
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    eager = instantiate(compose_config("train", overrides, tmp_path / "eager").model)
    net_state = {k.removeprefix("net."): v for k, v in state["state_dict"].items() if k.startswith("net.")}
    eager.load_state_dict(net_state)  # strict: the same keys
    counters.clear()
    loaded = load_task(str(tmp_path / "run" / "checkpoints" / "last.ckpt"))  # as eval.py, sample.py, export.py
    loaded(torch.randn(2, 1, 28, 28))
    assert counters["frames"]["ok"] == 0, "a loaded checkpoint's network runs eagerly: no compile for one pass"


@pytest.mark.e2e
def test_a_compile_that_compiles_nothing_is_said_after_the_first_step(tmp_path, monkeypatch, caplog):
    """A network of which Dynamo compiles no frame (a frame torch 2.11 had first met under the FLOP counter) trains
    eagerly: the first training step says so, once."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # compiles nothing, as that torch did
    data = write_fake_fashion_mnist(tmp_path / "fm", n_train=64, n_test=32)
    overrides = ["experiment=soft_moe_vit", "debug=tiny", "trainer.max_steps=3", f"data.root={data}", "test=false"]
    with caplog.at_level("WARNING", logger="moekit"):
        train(compose_config("train", [*overrides, "data.val_size=32", "task.compile=true"], tmp_path / "run"))
    assert caplog.text.count(NO_FRAME_WARNING) == 1, caplog.text
