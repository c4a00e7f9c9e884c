"""Shared fixtures, naive reference implementations written straight from the papers' equations
(per token / per slot loops: slow, obviously right), and helpers that compose the training configs
and run the scripts."""

import moekit  # noqa: F401, I001 - before torch, as the scripts do: it sets OpenMP's idle spin (moekit/utils/openmp.py)
import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

import fork_server
from moekit.configs import compose
from moekit.data.fashion_mnist import write_fake_fashion_mnist
from moekit.moe import ExpertBank, kernel_choices


def pytest_configure(config):
    """Under ``pytest -n N`` (``make test``) each of the N workers takes its share of the cores for torch's threads,
    so that N workers with all the cores each do not oversubscribe the machine."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _deterministic_mode_restored():
    """An in-process run with ``trainer.deterministic=true`` turns torch's deterministic algorithms on for the whole
    process, and with them the filling of every new tensor: a later test's forked processes then fill in OpenMP
    regions of a pool that did not survive the fork, and hang."""
    mode = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])


@pytest.fixture(autouse=True)
def _kernel_choices_restored():
    """A test that sets entries of the kernel choice table (``moekit.moe.kernel_choices``, ``--choice``) leaves it as
    shipped for the next."""
    yield
    kernel_choices.reset()


@pytest.fixture(autouse=True)
def _no_distributed_state_left():
    """A run in this process under a DDP strategy (the ImageNet recipe's, on one CPU) leaves Lightning's process group
    of one and its variables (``LOCAL_RANK``, ``MASTER_PORT``, ...) behind: processes a later test forks would inherit
    the group and fail to start their own, and a 2-process run it launches would take ``LOCAL_RANK`` for a launcher's
    and wait for a rank 1 that never starts."""
    environ = dict(os.environ)
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)


def reference_expert(bank: ExpertBank, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of ``bank`` applied to rows ``x: [n, d]`` with plain matmuls."""
    h = x @ bank.fc1_weight[e]
    if bank.fc1_bias is not None:
        h = h + bank.fc1_bias[e]
    if bank.gated:
        gate, up = h.chunk(2, dim=-1)
        h = bank.act(gate) * up
    else:
        h = bank.act(h)
    y = h @ bank.fc2_weight[e]
    if bank.fc2_bias is not None:
        y = y + bank.fc2_bias[e]
    return y


def reference_soft_moe(layer, x: torch.Tensor) -> torch.Tensor:
    """Soft MoE, Algorithm 1 of Puigcerver et al., one sequence and one slot at a time."""
    outputs = []
    p = layer.slots_per_expert
    for X in x:  # [m, d]
        phi = layer.phi
        if layer.normalize:
            logits = F.normalize(X, dim=1) @ (layer.scale * F.normalize(phi, dim=0))
        else:
            logits = X @ phi
        D = torch.softmax(logits, dim=0)
        C = torch.softmax(logits, dim=1)
        slots = D.t() @ X
        slot_out = torch.stack(
            [reference_expert(layer.experts, i // p, slots[i : i + 1])[0] for i in range(slots.shape[0])]
        )
        outputs.append(C @ slot_out)
    return torch.stack(outputs)


def reference_lory(layer, x: torch.Tensor) -> torch.Tensor:
    """Lory, one sequence, segment and token at a time: the experts' weights merged with the softmax of the router
    on the previous segment's mean input (the learned prior for the first segment), then the merged MLP."""
    bank, seg = layer.experts, layer.segment_len
    outputs = []
    for X in x:  # [tokens, d]
        rows = []
        for begin in range(0, X.shape[0], seg):
            if begin == 0:
                w = torch.softmax(layer.prior_logits, dim=0)
            else:
                w = torch.softmax(layer.router_weight @ X[begin - seg : begin].mean(dim=0), dim=0)
            merged = type(bank)(
                1,
                bank.in_features,
                bank.hidden_features,
                bank.out_features,
                act_layer=type(bank.act),
                gated=bank.gated,
                bias=(bank.fc1_bias is not None, bank.fc2_bias is not None),
            )
            for name, param in bank.named_parameters():
                getattr(merged, name).data.copy_(torch.einsum("e,e...->...", w, param).unsqueeze(0))
            rows += [reference_expert(merged, 0, X[t : t + 1])[0] for t in range(begin, min(begin + seg, len(X)))]
        outputs.append(torch.stack(rows))
    return torch.stack(outputs)


def reference_tokens_choice(layer, x: torch.Tensor, expert_ids, gates, keep) -> torch.Tensor:
    """Output of a tokens-choice layer token by token: sum of kept gated expert outputs."""
    flat = x.reshape(-1, x.shape[-1])
    rows = []
    for n in range(flat.shape[0]):
        y = torch.zeros(layer.out_features, dtype=x.dtype)
        for j in range(expert_ids.shape[1]):
            if keep[n, j]:
                e = int(expert_ids[n, j])
                y = y + gates[n, j] * reference_expert(layer.experts, e, flat[n : n + 1])[0]
        rows.append(y)
    out = torch.stack(rows)
    if layer.shared_experts is not None:
        out = out + reference_expert(layer.shared_experts, 0, flat)
    return out.view(*x.shape[:-1], -1)


def reference_gptq(w_IO: torch.Tensor, hessian: torch.Tensor, fmt, damping: float = 0.01) -> torch.Tensor:
    """GPTQ as Optimal Brain Quantization states it (Frantar et al. 2023, eq. 2-3), one input row at a
    time with an explicit inverse Hessian: round row ``i``, move the other rows by ``-err * Hinv[i, j] /
    Hinv[i, i]``, then remove ``i`` from the inverse (``Hinv -= Hinv[:, i] Hinv[i, :] / Hinv[i, i]``).
    A group's grid is fitted from its weights when its first row comes up. Returns ``[in, out]`` codes."""
    from moekit.quant.formats import fit_quantizer

    W = w_IO.t().double().clone()  # [out, in]
    H = hessian.double().clone()
    D = H.shape[0]
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damping * H.diagonal().mean() * torch.eye(D, dtype=H.dtype)
    Hinv = torch.linalg.inv(H)
    g = min(fmt.group_size, D)
    codes = torch.empty(W.shape, dtype=torch.uint8)
    for i in range(D):
        if i % g == 0:
            grid = fit_quantizer(fmt, W[:, i : i + g].float(), dim=-1)
        q = grid.codes(W[:, i : i + 1].float())
        codes[:, i] = q[:, 0]
        err = (W[:, i] - grid.values(q)[:, 0].double()) / Hinv[i, i]
        W[:, i:] -= err[:, None] * Hinv[i, i:][None, :]
        Hinv = Hinv - Hinv[:, i : i + 1] @ Hinv[i : i + 1, :] / Hinv[i, i]
    return codes.t()


# ---------------------------------------------------------------------------------------------
# The training template: compose configs like the scripts do, run the scripts in processes of their own.
REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def compose_config(name: str, overrides: list[str], output_dir: Path) -> DictConfig:
    """Compose a config like the scripts do, with Hydra's runtime values filled in."""
    return compose(CONFIGS, name, overrides, output_dir)


def import_script(filename: str, module_name: str) -> ModuleType:
    """``scripts/<filename>`` imported as the module ``module_name`` (registered in ``sys.modules``:
    dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(module_name, REPO / "scripts" / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread_no_reexec(monkeypatch):
    """For benchmark scripts' tests, which check what runs, not how fast: one torch thread (quick on a
    busy machine), and ``main()`` never re-executes the test process (with another allocator)."""
    monkeypatch.setenv("MOEKIT_NO_REEXEC", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """A folder ``build(folder)`` fills once per test session, for module-scoped fixtures of runs that several
    tests only read. Each pytest-xdist worker collects every test and builds its own module fixtures, so two workers
    running tests of one module each trained the module's reference run; here the first worker builds the folder
    in the session's shared temporary directory under a file lock, and the others wait and reuse it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    shared = tmp_path_factory.getbasetemp().parent  # the session's folder, above each worker's own
    folder, done = shared / name, shared / f"{name}.built"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker's failed build: try again
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


def script_env(**extra: str) -> dict[str, str]:
    """The environment of a script a test runs: this process's, without the restart under tcmalloc (the tests run
    every script forked from their fork server) and with Hydra's short error messages."""
    return dict(os.environ, MOEKIT_NO_REEXEC="1", HYDRA_FULL_ERROR="0", **extra)


def run_script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python scripts/<args[0]> <args[1:]>`` in a process forked from the tests' fork server (tests/fork_server.py:
    torch, Lightning and moekit imported once); returns its exit status and output."""
    return fork_server.run_script(REPO / "scripts" / args[0], list(args[1:]), cwd=cwd, env=script_env(), timeout=300)


@pytest.fixture(scope="module")
def fake_fashion(tmp_path_factory) -> Path:
    """A tiny Fashion-MNIST in the real IDX format (320 training, 64 test images)."""
    return write_fake_fashion_mnist(tmp_path_factory.mktemp("fm") / "fashion-mnist", n_train=320, n_test=64)


def small_overrides(data_root: Path, epochs: int = 1) -> list[str]:
    """A fast run on the fake Fashion-MNIST: ``debug=tiny`` (the tiny model, CSV logs, quiet), its 64 test
    images as the validation split too, all of its batches."""
    return [
        f"data.root={data_root}",
        "data.val_size=64",
        "debug=tiny",
        f"trainer.max_epochs={epochs}",
    ]


TINY_NET = {
    "_target_": "moekit.models.create_model",
    "model_name": "soft_moe_vit_tiny_patch4_28",
    "embed_dim": 32,
    "depth": 2,
    "num_heads": 2,
    "moe": {"num_experts": 4},
}
