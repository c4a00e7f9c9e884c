"""A killed run resumes to the same result, and checkpoint writes are atomic.

Real ``scripts/train.py`` subprocesses on CPU with ``trainer.deterministic=true`` train a tiny Soft MoE
ViT on a fake Fashion-MNIST for 3 epochs of 8 steps, ``last.ckpt`` every 5 steps and every epoch.
An uninterrupted run gives the reference; interrupted runs are SIGKILLed (after a ``last.ckpt`` write,
and in the middle of one) or sent Ctrl-C, resumed with ``ckpt_path=<last.ckpt>``, and must end with
bit-identical weights, optimizer state and test metrics. SIGTERM at set steps: test_resume_logs.py; SIGTERM to
one rank of two: test_parallel_train.py.
"""

from __future__ import annotations

import errno
import io
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning import Callback

import moekit.commands.train as train_module
import moekit.utils.atomic as atomic_module
from conftest import compose_config, small_overrides
from moekit.callbacks import PreemptionCheckpoint
from moekit.checkpoint import WRITE_DELAY_ENV, AtomicCheckpointIO, CheckpointError, atomic_torch_save, first_non_finite
from moekit.commands.train import train
from moekit.data.resumable import ResumableRandomSampler, get_rng_states, set_rng_states
from resume_helpers import (
    assert_same_training_state,
    finish,
    kill,
    load_checkpoint,
    metrics_rows,
    printed_test_metrics,
    start,
    train_command,
    wait_for,
)

pytestmark = pytest.mark.e2e  # fits models in subprocesses (make test-fast leaves it out)

EPOCHS, STEPS_PER_EPOCH, EVERY_N_STEPS = 3, 8, 5


def _args(data_root: Path, output_dir: Path, *extra: str) -> list[str]:
    return train_command(
        f"data.root={data_root}",
        "data.val_size=64",  # 256 training images left: 8 steps of debug=tiny's batches of 32 per epoch
        "debug=tiny",
        "moe.num_experts=4",
        f"trainer.max_epochs={EPOCHS}",
        "trainer.deterministic=true",
        f"callbacks.last_checkpoint_steps.every_n_train_steps={EVERY_N_STEPS}",
        f"paths.output_dir={output_dir}",
        *extra,
    )


def _assert_same_training_state(resumed: dict, reference: dict) -> None:
    assert_same_training_state(resumed, reference, global_step=EPOCHS * STEPS_PER_EPOCH)


@pytest.fixture(scope="module")
def reference(fake_fashion, tmp_path_factory) -> tuple[dict, dict[str, float]]:
    """The uninterrupted run: its final last.ckpt and test metrics."""
    out = tmp_path_factory.mktemp("reference")
    status, output = finish(start(_args(fake_fashion, out)))
    assert status == 0, output[-3000:]
    return load_checkpoint(out / "checkpoints" / "last.ckpt"), printed_test_metrics(output)


@pytest.mark.slow
def test_killed_runs_resume_to_the_same_weights_and_metrics(fake_fashion, reference, tmp_path):
    ref_ckpt, ref_metrics = reference
    out = tmp_path / "run"
    last = out / "checkpoints" / "last.ckpt"

    # 1. SIGKILL right after the first last.ckpt lands (step 5, mid-epoch), while the run trains on.
    proc = start(_args(fake_fashion, out), write_delay=0.2)
    wait_for(last.exists, proc, "the first last.ckpt")
    kill(proc)
    first = load_checkpoint(last)
    assert first["global_step"] == EVERY_N_STEPS

    # 2. Resume, and SIGKILL in the middle of the next checkpoint write (the temporary file is complete,
    #    the rename has not happened): last.ckpt must still be the previous, loadable file.
    proc = start(_args(fake_fashion, out, f"ckpt_path={last}"), write_delay=120)
    wait_for(lambda: any(last.parent.glob(".*.tmp")), proc, "a checkpoint write")
    time.sleep(0.5)  # let the write reach the pause before the rename
    kill(proc)
    assert list(last.parent.glob(".*.tmp")), "the kill should have left the unfinished temporary file"
    assert load_checkpoint(last)["global_step"] == EVERY_N_STEPS, "the interrupted write replaced last.ckpt"

    # 3. Resume to the end: the same weights, optimizer state, schedule and test metrics as without kills.
    status, output = finish(start(_args(fake_fashion, out, f"ckpt_path={last}")))
    assert status == 0, output[-3000:]
    assert not list(last.parent.glob(".*.tmp")), "the stale temporary file is removed when the run starts again"
    assert "left by a checkpoint write that was interrupted" in output
    _assert_same_training_state(load_checkpoint(last), ref_ckpt)
    assert printed_test_metrics(output) == ref_metrics


@pytest.mark.slow
def test_ctrl_c_saves_last_ckpt_and_its_printed_command_resumes_exactly(fake_fashion, reference, tmp_path):
    ref_ckpt, ref_metrics = reference
    out = tmp_path / "run"
    proc = start(_args(fake_fashion, out), write_delay=0.2)
    wait_for(lambda: any(out.glob("checkpoints/epoch_*.ckpt")), proc, "the first epoch's checkpoint")
    proc.send_signal(signal.SIGINT)
    status, output = finish(proc)
    assert status == 128 + signal.SIGINT, output[-3000:]
    assert "Ctrl-C: saving" in output and "press Ctrl-C again to stop at once" in output
    assert "test/loss" not in output, "an interrupted run must not go on to test"
    command = re.search(r"received SIGINT: saved .*last\.ckpt at step \d+; resume with: (python .*)", output)
    assert command, output[-3000:]
    args = shlex.split(command.group(1))
    assert args[1].endswith("scripts/train.py") and args[-1] == f"ckpt_path={out / 'checkpoints' / 'last.ckpt'}"
    status, output = finish(start([sys.executable, *args[1:]]))
    assert status == 0, output[-3000:]
    _assert_same_training_state(load_checkpoint(out / "checkpoints" / "last.ckpt"), ref_ckpt)
    assert printed_test_metrics(output) == ref_metrics


@pytest.mark.slow
def test_a_run_stopped_by_max_steps_inside_an_epoch_resumes_inside_it(fake_fashion, tmp_path):
    """Stopped by ``max_steps=6`` in its first epoch (``last.ckpt`` written at that cut-short epoch's end), then
    resumed without the limit: the same weights, optimizer state, test metrics and logged rows as the run that never
    stopped. (A constant schedule, so that the first run's steps do not depend on its ``max_steps``.) Lightning
    counted the cut epoch as done: the resumed run skipped its last two batches and ended an epoch early."""
    constant = ("task.scheduler.name=constant", "task.scheduler.warmup_steps=0")
    reference, out = tmp_path / "reference", tmp_path / "run"
    last = out / "checkpoints" / "last.ckpt"
    status, ref_output = finish(start(_args(fake_fashion, reference, *constant)))
    assert status == 0, ref_output[-3000:]
    status, output = finish(start(_args(fake_fashion, out, *constant, "trainer.max_steps=6")))
    assert status == 0, output[-3000:]
    assert load_checkpoint(last)["global_step"] == 6
    status, output = finish(start(_args(fake_fashion, out, *constant, f"ckpt_path={last}")))
    assert status == 0, output[-3000:]
    _assert_same_training_state(load_checkpoint(last), load_checkpoint(reference / "checkpoints" / "last.ckpt"))
    assert printed_test_metrics(output) == printed_test_metrics(ref_output)
    assert metrics_rows(out) == metrics_rows(reference)


def test_a_second_ctrl_c_stops_at_once():
    callback = PreemptionCheckpoint(dirpath="unused", signals=["SIGINT"])
    callback._handler(signal.SIGINT, None)
    assert callback.received == signal.SIGINT, "the first one asks for a checkpoint after the step"
    with pytest.raises(KeyboardInterrupt):
        callback._handler(signal.SIGINT, None)


# ---------------------------------------------------------------------------------------------
def test_atomic_save_keeps_the_old_file_when_the_write_fails(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        AtomicCheckpointIO().save_checkpoint({"step": 2, "bad": Unpicklable()}, path)
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"], "no temporary file is left behind"
    AtomicCheckpointIO().save_checkpoint({"step": 3}, path)
    assert torch.load(path, weights_only=True) == {"step": 3}
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()


@pytest.mark.parametrize("mode", [0o600, 0o640])
def test_a_rewritten_checkpoint_keeps_its_permissions(mode, tmp_path):
    """As open(path, "w") would: a checkpoint made private stays private when the next one replaces it."""
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1}, path)
    path.chmod(mode)
    atomic_torch_save({"step": 2}, path)
    assert torch.load(path, weights_only=True) == {"step": 2}
    assert path.stat().st_mode & 0o777 == mode


class _DiskFullAfter(io.RawIOBase):
    """A file that takes ``room`` bytes, then fails every write as a full disk does."""

    def __init__(self, path: str, room: int):
        self.raw, self.room = io.FileIO(path, "wb"), room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.raw.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.raw.write(data)

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.raw.close()
        super().close()


def test_a_full_disk_during_a_checkpoint_write_raises_its_oserror_and_keeps_the_old_file(tmp_path, monkeypatch):
    """The disk fills while torch.save writes: the error is the OSError of the write (ENOSPC, naming the
    checkpoint), which the scripts turn into one paragraph, not torch's zip-writer RuntimeError."""
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1}, path)
    monkeypatch.setattr(
        atomic_module, "open", lambda name, mode, **_: io.BufferedWriter(_DiskFullAfter(name, 4096)), raising=False
    )
    with pytest.raises(OSError) as info:
        AtomicCheckpointIO().save_checkpoint({"step": 2, "w": torch.randn(100_000)}, path)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"], "no temporary file is left behind"


@pytest.mark.parametrize("where", ["weights", "optimizer"])
def test_a_non_finite_checkpoint_never_replaces_a_finite_one(where, tmp_path):
    path = tmp_path / "last.ckpt"
    good = {"global_step": 5, "state_dict": {"net.w": torch.ones(3)}, "optimizer_states": [{"state": {0: {}}}]}
    AtomicCheckpointIO().save_checkpoint(good, path)
    bad = {"global_step": 6, "state_dict": {"net.w": torch.ones(3)}, "optimizer_states": [{"state": {0: {}}}]}
    if where == "weights":
        bad["state_dict"]["net.w"] = torch.tensor([1.0, float("nan"), 1.0])
        named = "the weight net.w is not finite at step 6"
    else:
        bad["optimizer_states"][0]["state"][0]["exp_avg_sq"] = torch.tensor([float("inf")])
        named = "the optimizer state 'exp_avg_sq' of parameter 0 \\(optimizer 0\\) is not finite at step 6"
    with pytest.raises(CheckpointError, match=named):
        AtomicCheckpointIO().save_checkpoint(bad, path)
    assert torch.load(path, weights_only=True)["global_step"] == 5
    assert first_non_finite(good) is None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_bad_write_delay_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(WRITE_DELAY_ENV, "soon")
    with pytest.raises(ValueError, match=f"{WRITE_DELAY_ENV}='soon' must be a number of seconds"):
        atomic_torch_save({"step": 1}, tmp_path / "x.ckpt")
    assert not list(tmp_path.iterdir())


def test_sampler_resumes_mid_epoch_with_the_same_indices_and_random_draws():
    def batches(sampler: ResumableRandomSampler, n: int) -> list[tuple[list[int], float]]:
        it, out = iter(sampler), []
        for _ in range(n):
            indices = [next(it) for _ in range(sampler.batch_size)]
            out.append((indices, torch.rand(()).item()))  # a draw between batches, like the augmentation
        return out

    torch.manual_seed(0)
    sampler = ResumableRandomSampler(40, batch_size=8, seed=3)
    whole = batches(sampler, 5)
    again = batches(sampler, 5)
    assert [b for b, _ in whole] != [b for b, _ in again], "a new order each epoch"
    assert sorted(i for b, _ in whole for i in b) == list(range(40))

    torch.manual_seed(0)
    sampler = ResumableRandomSampler(40, batch_size=8, seed=3)
    it = iter(sampler)
    for _ in range(3):  # 3 batches consumed, each with its draw
        [next(it) for _ in range(8)]
        torch.rand(())
    next(it)  # the 4th prefetched: its first index, then its draw (Lightning fetches one batch ahead)
    torch.rand(())
    state = sampler.state_dict(consumed_batches=3, epoch_done=False)
    fresh = ResumableRandomSampler(40, batch_size=8, seed=3)
    fresh.load_state_dict(state)
    torch.manual_seed(123)  # whatever the new process did before
    assert batches(fresh, 2) == whole[3:], "the 4th batch drawn again with its own state, the 5th after the save's"
    rng = get_rng_states()
    set_rng_states(rng)
    assert torch.equal(torch.get_rng_state(), rng["torch"])


def _add_callback(monkeypatch, callback: Callback) -> None:
    """``train`` runs with ``callback`` after the configured ones."""
    real_instantiate_group = train_module.instantiate_group

    def with_callback(group, name):
        found = real_instantiate_group(group, name)
        return [*found, callback] if name == "callbacks" else found

    monkeypatch.setattr(train_module, "instantiate_group", with_callback)


class _SigtermAtTest(Callback):
    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0:  # not the last batch: Lightning stops the loop after it
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_during_the_test_phase_exits_143_and_names_the_rerun(fake_fashion, tmp_path, monkeypatch, caplog):
    """Lightning ends a test loop on SIGTERM with SystemExit(None), status 0: a scheduler would see success."""
    cfg = compose_config("train", small_overrides(fake_fashion, 1), tmp_path)
    _add_callback(monkeypatch, _SigtermAtTest())
    with pytest.raises(SystemExit) as info:
        train(cfg)
    assert info.value.code == 128 + signal.SIGTERM
    assert "during the test phase, which did not finish" in caplog.text
    assert "test it with python scripts/eval.py ckpt_path=" in caplog.text
    assert not (tmp_path / "results.json").exists(), "no run record of an unfinished run"


class _SignalAtStep(Callback):
    def __init__(self, signum: int, batch: int):
        self.signum, self.batch = signum, batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.batch:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("launcher_exits", [True, False])
def test_a_launchers_handler_gets_the_signal_after_the_checkpoint(launcher_exits, fake_fashion, tmp_path, monkeypatch):
    """Under Hydra's submitit launcher SIGUSR2 announces the end: the run writes last.ckpt, then submitit's handler
    (installed before training) requeues the job and exits; a handler that returns leaves the exit to the callback."""
    calls = []

    def launcher_handler(signum, frame):  # stands in for submitit's checkpoint_and_try_requeue
        last = tmp_path / "checkpoints" / "last.ckpt"
        calls.append((signum, torch.load(last, weights_only=False)["global_step"] if last.exists() else None))
        if launcher_exits:
            sys.exit(-1)

    cfg = compose_config("train", small_overrides(fake_fashion, 1), tmp_path)
    _add_callback(monkeypatch, _SignalAtStep(signal.SIGUSR2, batch=1))
    previous = signal.signal(signal.SIGUSR2, launcher_handler)
    try:
        with pytest.raises(SystemExit) as info:
            train(cfg)
        assert signal.getsignal(signal.SIGUSR2) is launcher_handler, "the launcher's handler is put back"
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert calls == [(signal.SIGUSR2, 2)], "handed on once, after last.ckpt of the step in progress was written"
    assert info.value.code == (-1 if launcher_exits else 128 + signal.SIGUSR2)


def test_under_gradient_accumulation_the_checkpoint_waits_for_the_optimizer_step(fake_fashion, tmp_path, monkeypatch):
    """A signal during the first of two micro-batches: last.ckpt holds the finished optimizer step 1, not the
    half-accumulated step 0 (whose gradients a checkpoint does not keep)."""
    cfg = compose_config("train", [*small_overrides(fake_fashion, 1), "trainer.accumulate_grad_batches=2"], tmp_path)
    _add_callback(monkeypatch, _SignalAtStep(signal.SIGTERM, batch=0))
    with pytest.raises(SystemExit) as info:
        train(cfg)
    assert info.value.code == 128 + signal.SIGTERM
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == 1
    batches = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"]
    assert batches == 2, "saved after the step's second micro-batch"


def test_the_printed_resume_command_continues_in_the_runs_own_folder(tmp_path, monkeypatch):
    """Run into a new folder, the resumed run would split the logs over two folders."""
    from moekit.callbacks.preemption import resume_command

    monkeypatch.setattr(sys, "argv", ["scripts/train.py"])
    run, last = tmp_path / "run", tmp_path / "run" / "checkpoints" / "last.ckpt"
    compose_config("train", ["debug=tiny", "seed=3"], run)
    expected = ["python", "scripts/train.py", "debug=tiny", "seed=3", f"hydra.run.dir={run}", f"ckpt_path={last}"]
    assert shlex.split(resume_command(last)) == expected
    compose_config("train", ["debug=tiny", f"paths.output_dir={run}"], tmp_path / "hydra")  # the folder is given
    assert shlex.split(resume_command(last))[2:] == ["debug=tiny", f"paths.output_dir={run}", f"ckpt_path={last}"]
