"""The GPU tier (``make gpu-check``): kernels, host synchronisation, one bf16 training step of every experiment,
``torch.compile`` and data parallelism on a CUDA device. Skipped without one.

``MOEKIT_GPU_CHECK_DEVICE=cpu`` runs the tier's device-independent tests on the CPU instead (a dry run of this
file's code; the host-synchronisation test needs CUDA and stays skipped).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from conftest import CONFIGS, compose_config, run_script
from moekit.commands.train import train
from moekit.configs import instantiate
from moekit.data.fashion_mnist import write_fake_fashion_mnist
from moekit.models.summary import model_summary
from moekit.moe import TopKMoE, build_moe_layer, collect_moe_outputs, grouped_linear
from moekit.recipes import list_recipes

DEVICE = os.environ.get("MOEKIT_GPU_CHECK_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]
needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA only")
EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))
TOLERANCE = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=5e-2, rtol=5e-2)}


def _reference(x, weight, bias, counts):
    """The per-expert loop (float64 CPU tensors in); rows past the last group are zeros."""
    out = torch.zeros(x.shape[0], weight.shape[-1], dtype=torch.float64)
    start = 0
    for e, n in enumerate(counts):
        out[start : start + n] = x[start : start + n] @ weight[e] + (bias[e] if bias is not None else 0)
        start += n
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernel", ["loop", "bmm", "grouped_mm"])
def test_every_kernel_agrees_with_the_reference_on_ragged_and_empty_groups(kernel, dtype):
    torch.manual_seed(0)
    counts = [16] * 6 if kernel == "bmm" else [24, 0, 40, 8, 0, 56]  # ragged: empty experts and 8 tail rows
    rows = sum(counts) + (0 if kernel == "bmm" else 8)
    x = torch.randn(rows, 64, device=DEVICE, dtype=dtype, requires_grad=True)
    weight = (torch.randn(6, 64, 32, device=DEVICE) / 8).to(dtype).requires_grad_(True)
    bias = torch.randn(6, 32, device=DEVICE, dtype=dtype, requires_grad=True)
    sizes = 16 if kernel == "bmm" else torch.tensor(counts, device=DEVICE)
    try:
        out = grouped_linear(x, weight, bias, sizes, kernel)
    except (RuntimeError, NotImplementedError) as err:  # torch._grouped_mm's dtypes differ per device
        if kernel == "grouped_mm" and dtype == torch.float32:
            pytest.skip(f"torch._grouped_mm on {DEVICE} in float32: {err}")
        raise
    grad = torch.randn_like(out)
    out.backward(grad)
    leaves = [t.detach().cpu().double().requires_grad_(True) for t in (x, weight, bias)]
    want = _reference(*leaves, counts)
    want.backward(grad.cpu().double())
    torch.testing.assert_close(out.double().cpu(), want, **TOLERANCE[dtype])
    for got, ref in zip((x.grad, weight.grad, bias.grad), leaves):
        torch.testing.assert_close(got.double().cpu(), ref.grad, **TOLERANCE[dtype])


def _layer_and_inputs(name: str):
    torch.manual_seed(0)
    settings = {"vocab_size": 64} if name == "hash" else {"num_tokens": 64} if name == "soft_moe" else {}
    layer = build_moe_layer(name, in_features=128, hidden_features=256, model_settings=settings).to(DEVICE)
    kwargs = {"token_ids": torch.randint(64, (8, 64), device=DEVICE)} if name == "hash" else {}
    return layer.train(), torch.randn(8, 64, 128, device=DEVICE, requires_grad=True), kwargs


def _step(layer, x, kwargs) -> None:
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = layer(x, **kwargs)
        loss = out.float().square().mean() + collect_moe_outputs(layer).aux_loss
    loss.backward()


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("experts, top_k", [(8, 2), (64, 8)])
def test_a_dropless_layers_gradients_are_the_same_in_every_run(experts, top_k, bias):
    """Dropless SwiGLU experts (Mixtral's shape, and fine-grained), without and with biases: two bf16 training steps
    from one state give bit-identical gradients (the dispatch's and combine's gradients are gathers and the bias
    gradients grouped products, not atomic ``index_add_``)."""
    torch.manual_seed(0)
    layer = TopKMoE(128, 2048 // experts, num_experts=experts, top_k=top_k, gated=True, act_layer=nn.SiLU, bias=bias)
    layer = layer.to(DEVICE).train()
    x = torch.randn(8, 256, 128, device=DEVICE, requires_grad=True)
    grads = []
    for _ in range(2):
        layer.zero_grad()
        x.grad = None
        _step(layer, x, {})
        grads.append([t.grad.clone() for t in (x, *layer.parameters()) if t.grad is not None])
    assert len(grads[0]) == 1 + len(list(layer.parameters()))
    for first, second in zip(*grads):
        assert torch.equal(first, second)


@needs_cuda
@pytest.mark.parametrize("name", sorted(set(list_recipes()) - {"none"}))
def test_no_host_synchronisation_in_a_layers_training_step(name):
    """bf16 forward + backward of every recipe's layer with CUDA's sync debug mode set to raise (BASE with its
    sync-free solver, ``"auto"``'s choice off CPUs). tests/test_host_sync.py checks the same paths on CPUs."""
    layer, x, kwargs = _layer_and_inputs(name)
    _step(layer, x, kwargs)  # warm-up: lazy initialisation (strictly balanced thresholds) may synchronise once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(layer, x, kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
@pytest.mark.parametrize("name", ["mixtral", "deepseek", "switch", "soft_moe"])
def test_a_layer_on_the_gpu_gives_the_cpus_outputs_and_gradients(name):
    """float32 on both: the CUDA paths (grouped_mm with padded features for DeepSeek's 28-wide experts, the
    multiply-and-sum combine) against the CPU's (the loop kernel, the batched-matmul combine). Eval mode: no
    router noise, whose draws differ between the devices."""
    results = []
    for device in ("cpu", DEVICE):
        layer, x, kwargs = _layer_and_inputs(name)
        layer, x = layer.to(device).eval(), x.detach().to(device).requires_grad_(True)
        kwargs = {k: v.to(device) for k, v in kwargs.items()}
        out = layer(x, **kwargs)
        (out.square().mean() + collect_moe_outputs(layer).aux_loss).backward()
        grads = [p.grad for p in layer.parameters() if p.grad is not None]
        results.append([t.detach().cpu() for t in (out, x.grad, *grads)])
    for got, want in zip(*results[::-1]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)


@needs_cuda
def test_the_gpus_patch_embedding_is_the_cpus_convolution():
    """ViT-S/16's patch embedding on the GPU (the matmul, moekit.moe.kernel_choices.PATCHIFY_KERNELS) against the CPU's
    convolution: outputs and gradients, float32."""
    from moekit.models.stem import MatmulPatchEmbed
    from moekit.moe.kernel_choices import PATCHIFY_KERNELS

    assert PATCHIFY_KERNELS["cuda"] == "matmul"
    embed = MatmulPatchEmbed(img_size=224, patch_size=16, in_chans=3, embed_dim=384)
    x = torch.randn(4, 3, 224, 224)
    results = []
    for device in ("cpu", DEVICE):
        layer, x_dev = copy.deepcopy(embed).to(device), x.to(device, copy=True).requires_grad_(True)
        out = layer(x_dev)
        out.square().mean().backward()
        results.append([t.detach().cpu() for t in (out, x_dev.grad, layer.proj.weight.grad, layer.proj.bias.grad)])
    for got, want in zip(*results[::-1]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("name", ["mixtral", "switch", "soft_moe", "experts_choice"])
def test_a_compiled_layer_gives_the_eager_outputs(name):
    layer, x, kwargs = _layer_and_inputs(name)
    layer.eval()
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        eager = layer(x, **kwargs).float()
        compiled = torch.compile(layer, fullgraph=True)(x, **kwargs).float()
    torch.testing.assert_close(compiled, eager, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("model", ["vit_s16", "soft_moe_s16"])
def test_task_compile_true_compiles_the_s16_models(model, tmp_path):
    """``task.compile=true`` on the ImageNet experiment's two models, their FLOPs measured first as ``train()`` does:
    the task's forward runs one compiled frame (on an H200 image, torch 2.11 and Python 3.12, none compiled once the
    FLOP counter had met the frame) and gives eager mode's logits."""
    overrides = [
        "experiment=soft_moe_vit_s16_imagenet",
        f"data.root={tmp_path}",  # no image is read
        "task.compile=true",
        *(["moe=none"] if model == "vit_s16" else []),
    ]
    cfg = compose_config("train", overrides, tmp_path)
    task = instantiate(cfg.task, net=cfg.model, _recursive_=False)
    torch._dynamo.reset()
    counters.clear()
    assert model_summary(task.net, input_size=(3, 224, 224)).flops_per_image > 0
    task = task.to(DEVICE).eval()
    x = torch.randn(4, 3, 224, 224, device=DEVICE)
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        compiled = task(x).float()
        eager = task.net._call_impl(x).float()
    assert counters["frames"]["ok"] == 1, dict(counters["frames"])
    torch.testing.assert_close(compiled, eager, atol=5e-2, rtol=5e-2)


def _fake_imagefolder(root: Path) -> Path:
    """Two classes of four 32 x 32 PNGs each, for the ImageNet-style experiment."""
    from PIL import Image

    for label in ("a", "b"):
        for split in ("train", "val"):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(4):
                Image.fromarray(torch.randint(0, 255, (32, 32, 3), dtype=torch.uint8).numpy()).save(folder / f"{i}.png")
    return root


@pytest.mark.e2e
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_one_bf16_training_step_of_each_experiment(experiment, tmp_path):
    overrides = [
        f"experiment={experiment}",
        "trainer.fast_dev_run=true",
        f"trainer.accelerator={'gpu' if DEVICE == 'cuda' else 'cpu'}",
        "trainer.devices=1",
        f"trainer.precision={'bf16-mixed' if DEVICE == 'cuda' else 'auto'}",  # oneDNN's bf16 LSTM needs AMX
    ]
    if experiment == "soft_moe_vit_s16_imagenet":
        root = _fake_imagefolder(tmp_path / "images")
        overrides += [f"data.root={root}", "data.num_classes=2", "data.num_workers=0", "data.batch_size=4"]
        if DEVICE != "cuda":  # the CPU dry run: 8 experts, not 128 (the step of 923M parameters held 22 GB there)
            overrides.append("moe.num_experts=8")
    metrics = train(compose_config("train", overrides, tmp_path))
    assert torch.isfinite(torch.tensor(metrics["train/loss_step"])), metrics


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_data_parallel_training_over_the_gpus_present(strategy, tmp_path):
    """Three bf16 steps of the main job's model (tiny) under moekit's DDP and FSDP strategies over every visible GPU
    (on the CPU dry run: 2 gloo processes in float32), and the checkpoint they write holds every expert."""
    devices = torch.cuda.device_count() if DEVICE == "cuda" else 2
    data = write_fake_fashion_mnist(tmp_path / "fashion-mnist", n_train=96, n_test=32)
    out = tmp_path / "run"
    result = run_script(
        "train.py",
        "experiment=soft_moe_vit",
        "debug=tiny",
        "moe.num_experts=8",
        f"trainer={strategy}",
        f"trainer.accelerator={'gpu' if DEVICE == 'cuda' else 'cpu'}",
        f"trainer.devices={devices}",
        f"trainer.precision={'bf16-mixed' if DEVICE == 'cuda' else '32-true'}",
        "trainer.max_steps=3",
        f"data.root={data}",
        "data.val_size=32",
        f"paths.output_dir={out}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    assert {v.shape[0] for k, v in state.items() if k.endswith("experts.fc1_weight")} == {8}
