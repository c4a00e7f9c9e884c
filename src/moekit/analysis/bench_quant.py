"""Benchmark of quantized experts: what each format and method costs and keeps, for one training checkpoint.

For the float model and every (format, method) pair it prints:

* the experts' stored bytes and bits per expert weight (scales included);
* the test metric over the checkpoint's test split (accuracy, or perplexity: the exponent of the mean
  cross-entropy over all test tokens) and the error of the test logits relative to the float model's
  (``||logits - float logits|| / ||float logits||``, more sensitive than the metric);
* the inference time of one test batch (median over interleaved rounds, so that a slow phase of the machine
  hits every variant alike);
* the bytes the experts' tensors take in memory (the ternary decoding tables included) and what loading the
  model adds to a freshly forked process's resident memory (``VmRSS`` after loading minus before, imports done;
  system malloc; the float model from its weights alone).

Ratios are against the float model measured in the same run.

    python scripts/bench_quant.py --ckpt logs/soft_moe_vit/runs/<run>/checkpoints/last.ckpt
    python scripts/bench_quant.py --ckpt <ckpt> --formats int8 ternary --methods gptq --markdown out.md
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import Tensor, nn

from moekit.checkpoint import TASK_KEY, load_task
from moekit.commands.quantize import calibration_inputs
from moekit.data.text import PAD_TARGET
from moekit.quant import FORMATS, METHODS, QuantFormat, QuantSpec, expert_memory, quant_metadata, quantize_experts
from moekit.quantized_checkpoint import save_quantized_task
from moekit.tasks import LanguageModel
from moekit.utils.machine import machine_info

__all__ = ["main"]

# Imports once, then loads each checkpoint in a forked child of its own (a fresh heap, the imports shared) and
# prints what the load added to that child's resident memory.
_CHILD = """
import gc, os, sys, torch
import moekit.checkpoint, moekit.models, moekit.quant, moekit.tasks
torch.set_num_threads(1)
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
for path in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        gc.collect(); before = rss()
        task = moekit.checkpoint.load_task(path)
        gc.collect(); print(rss() - before, flush=True)
        os._exit(0)
    if os.waitpid(pid, 0)[1] != 0:
        sys.exit(f"loading {path} failed")
"""


def _forward(net: nn.Module, x: Tensor | dict[str, Tensor]) -> Tensor:
    """``net(x)``, or for unpacked text ``net(**x)`` with its padding mask."""
    return net(**x) if isinstance(x, dict) else net(x)


def _inputs(batch) -> Tensor | dict[str, Tensor]:
    """What a test batch feeds the network: the images or token ids, with the padding mask of unpacked text."""
    return batch[0] if len(batch) < 3 else {"input_ids": batch[0], "padding_mask": batch[2]}


@torch.inference_mode()
def _test_metric(
    net: nn.Module, batches: list[tuple[Tensor | dict[str, Tensor], Tensor]], lm: bool, reference: list[Tensor] | None
) -> tuple[float, float, list[Tensor]]:
    """Accuracy of a classifier (or the perplexity of a language model, over the real targets: padding left out)
    over ``batches``, the relative error of its logits against ``reference`` (the float model's), and its logits."""
    total, count, err, norm, outputs = 0.0, 0, 0.0, 0.0, []
    for i, (x, y) in enumerate(batches):
        logits = _forward(net, x)
        outputs.append(logits)
        if reference is not None:
            err += float((logits - reference[i]).pow(2).sum())
            norm += float(reference[i].pow(2).sum())
        if lm:
            total += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=PAD_TARGET, reduction="sum"))
            count += int((y != PAD_TARGET).sum())
        else:
            total += float((logits.argmax(-1) == y).sum())
            count += y.numel()
    metric = math.exp(total / count) if lm else total / count
    return metric, math.sqrt(err / norm) if norm else 0.0, outputs


def _resident_bytes(paths: list[Path]) -> list[int]:
    """What loading each of ``paths`` adds to the resident memory of a process forked after the imports
    (system malloc)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, *map(str, paths)], env=env, capture_output=True, text=True, check=True
    )
    return [int(line) for line in out.stdout.split()[-len(paths) :]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, required=True, help="a training checkpoint (.ckpt) of an MoE experiment")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--calibration-batches", type=int, default=32)
    parser.add_argument("--test-batches", type=int, help="test batches for the metric (default: the whole split)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (median reported)")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    for flag in ("rounds", "group_size", "calibration_batches"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be positive")
    L.seed_everything(0, workers=True)
    float_task = load_task(str(args.ckpt))
    lm = isinstance(float_task, LanguageModel)
    datamodule = instantiate(OmegaConf.create(float_task.hparams["run_config"]["data"]), _convert_="all")
    calibration = calibration_inputs(datamodule, args.calibration_batches)
    datamodule.setup("test")
    test = []
    for batch in datamodule.test_dataloader():
        test.append((_inputs(batch), batch[1]))
        if args.test_batches and len(test) == args.test_batches:
            break

    variants: dict[str, nn.Module] = {"float32": float_task.net}
    with tempfile.TemporaryDirectory() as tmp:
        # The float model as weights and hyper-parameters only (no optimizer state), read by the same loader.
        checkpoint = torch.load(args.ckpt, map_location="cpu", weights_only=False)
        files = {"float32": Path(tmp) / "float32.ckpt"}
        torch.save(
            {k: checkpoint[k] for k in ("state_dict", "hyper_parameters", TASK_KEY) if k in checkpoint},
            files["float32"],
        )
        del checkpoint
        quantize_times = {}
        for name in args.formats:
            for method in args.methods:
                task = load_task(str(args.ckpt))
                spec = QuantSpec(QuantFormat(name, args.group_size), method)
                key = f"{name} {method}"
                start = time.perf_counter()
                quantize_experts(task.net, spec, lambda: calibration)
                quantize_times[key] = time.perf_counter() - start
                path = Path(tmp) / f"{name}-{method}.safetensors"
                files[key] = save_quantized_task(task, quant_metadata(spec, task.net), path)
                variants[key] = task.net
                print(f"quantized: {key} ({quantize_times[key]:.1f} s)", flush=True)
        times: dict[str, list[float]] = {key: [] for key in variants}
        with torch.inference_mode():
            for _ in range(args.rounds):
                for key, net in variants.items():
                    _forward(net, test[0][0])  # warm-up
                    start = time.perf_counter()
                    _forward(net, test[0][0])
                    times[key].append(time.perf_counter() - start)
        resident = dict(zip(files, _resident_bytes(list(files.values())), strict=True))

    metric_name = "test perplexity" if lm else "test top-1"
    rows = []
    base: dict[str, float] = {}
    reference: list[Tensor] | None = None
    for key, net in variants.items():
        memory = expert_memory(net)
        metric, logit_error, logits = _test_metric(net, test, lm, reference)
        step = statistics.median(times[key])
        if key == "float32":
            base = {"metric": metric, "step": step, "rss": resident[key]}
            reference = logits
        shown = f"{metric:.3f}" if lm else f"{100 * metric:.2f}%"
        change = (metric - base["metric"]) * (1 if lm else 100)
        cells = [
            key,
            f"{memory.stored / 2**20:.2f}",
            f"{memory.bits_per_weight:.2f}",
            shown,
            f"{change:+.3f}" if lm else f"{change:+.2f}",
            f"{100 * logit_error:.2f}%",
            f"{1e3 * step:.1f}",
            f"{step / base['step']:.2f}x",
            f"{memory.resident / 2**20:.2f}",
            f"{resident[key] / 2**20:.1f}",
            f"{resident[key] / base['rss']:.2f}x",
            f"{quantize_times[key]:.0f}" if key in quantize_times else "",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    machine = machine_info()
    lines = [
        f"{args.ckpt} ({type(float_task.net).__name__}, {len(test)} test batches of {test[0][1].shape[0]}), "
        f"calibration: {args.calibration_batches} training batches, group size {args.group_size}; "
        f"{machine.get('cpu', 'cpu')}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "",
        f"| experts | expert MiB stored | bits / expert weight | {metric_name} | change | logit error | batch ms | "
        "vs float | expert MiB in memory | process MiB after loading | vs float | quantize s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text + "\n")
