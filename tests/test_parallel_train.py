"""The distributed strategies through the real training script on CPU processes (gloo): each trains
a small MoE ViT and a small MoE LM; a checkpoint written by 2 processes resumes in 1 process or in 4
and takes the optimizer step the 2 processes took (the same weights to a thousandth of the step).
Resuming in as many processes as saved is test_sigterm_to_one_rank_saves_on_all_ranks_and_resumes_exactly's."""

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import REPO, run_script, script_env
from fork_server import Child
from moekit.data.fashion_mnist import write_fake_fashion_mnist

pytestmark = pytest.mark.e2e  # fits models in subprocesses (make test-fast leaves it out)


def _distributed(world: int, strategy: str, **options) -> list[str]:
    if world == 1:
        return ["trainer=cpu"]
    extra = [f"trainer.strategy.{key}={value}" for key, value in options.items()]
    return [f"trainer={strategy}", "trainer.accelerator=cpu", f"trainer.devices={world}", *extra]


def _train(out: Path, *overrides: str) -> str:
    """Run ``scripts/train.py``; its output (rank 0's and the ranks it starts)."""
    result = run_script("train.py", f"paths.output_dir={out}", *overrides, cwd=out.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


VIT = ["experiment=soft_moe_vit", "debug=tiny", "moe.num_experts=8", "trainer.precision=32-true"]
LM = [
    "experiment=moe_transformer_lm",
    "debug=tiny",
    "moe.num_experts=4",
    "model.max_seq_len=32",
    "data.seq_len=32",
    "data.batch_size=8",
    "trainer.max_steps=3",
]


@pytest.fixture(scope="module")
def tiny_fashion(tmp_path_factory) -> Path:
    return write_fake_fashion_mnist(tmp_path_factory.mktemp("fm") / "fashion-mnist", n_train=96, n_test=32)


def _expert_shapes(ckpt: Path) -> dict[str, tuple]:
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    return {k: tuple(v.shape) for k, v in state.items() if ".experts." in k}


@pytest.mark.parametrize(
    "model,strategy,options,extra",
    [  # the ViT trains under each strategy in test_a_2_process_checkpoint_resumes_in_1_or_4_to_the_same_step
        ("lm", "ddp", {"expert_parallel_size": 2}, ["trainer.precision=auto"]),
        ("lm", "fsdp", {"activation_checkpointing": "true", "param_dtype": "bfloat16"}, []),
        ("lm", "fsdp", {"expert_parallel_size": 2, "param_dtype": "bfloat16"}, []),
    ],
)
def test_strategy_trains_and_saves_full_checkpoint(tmp_path, tiny_fashion, model, strategy, options, extra):
    data = (
        [f"data.root={tiny_fashion}", "data.val_size=32", "data.batch_size=16", "trainer.max_epochs=1"]
        if model == "vit"
        else []
    )
    out = tmp_path / "run"
    output = _train(out, *(VIT if model == "vit" else LM), *data, *_distributed(2, strategy, **options), *extra)
    if "trainer.precision=auto" in extra:  # rank 1, which Lightning starts, trains in what rank 0 chose
        chosen = re.findall(r"trainer\.precision=auto: (\S+) \((.*)\)", output)
        assert len(chosen) == 2, output[-3000:]
        (rank0, why), (rank1, handed) = chosen
        assert rank1 == rank0 and handed == f"the choice of the process that started this one: {why}"
    shapes = _expert_shapes(out / "checkpoints" / "last.ckpt")
    experts = 8 if model == "vit" else 4
    assert shapes and all(shape[0] == experts for shape in shapes.values()), shapes  # full, not one rank's
    metrics = (out / "csv").rglob("metrics.csv")
    assert any("test/loss" in path.read_text() for path in metrics)


def _train_or_kill(out: Path, seconds: float, *overrides: str) -> None:
    """``_train``, but a run still going after ``seconds`` (ranks stuck in a collective, deaf to SIGTERM) is
    killed with all its processes and fails the test."""
    args = [f"paths.output_dir={out}", *overrides]
    proc = Child(REPO / "scripts" / "train.py", args, out.parent, script_env(), stderr_to_stdout=True, new_session=True)
    try:
        output, _ = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the run's own session: rank 1 too
        output, _ = proc.communicate()
        raise AssertionError(f"the run hung: killed after {seconds} s\n{output[-3000:]}") from None
    assert proc.returncode == 0, output[-3000:]


@pytest.mark.parametrize(
    "strategy,options",
    [("fsdp", {}), ("ddp", {"expert_parallel_size": 2})],
    ids=["fsdp", "ddp_expert_parallel"],
)
def test_slot_pictures_under_sharded_strategies_are_logged_without_a_hang(tmp_path, tiny_fashion, strategy, options):
    """The slot pictures' forward holds collectives (FSDP all-gathers, expert all-to-all): every rank runs it,
    rank 0 logs the picture, at the step of the validation metrics."""
    out = tmp_path / "run"
    overrides = [
        *VIT,
        f"data.root={tiny_fashion}",
        "data.val_size=32",
        "data.batch_size=16",
        "trainer.max_epochs=1",
        "test=false",
        "logger=tensorboard",
        "callbacks=[default,slot_pictures]",
        "callbacks.slot_pictures.num_images=2",
    ]
    _train_or_kill(out, 180, *overrides, *_distributed(2, strategy, **options))
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    pictures = events.Images("slots/dispatch")
    assert [picture.step for picture in pictures] == [events.Scalars("val/loss")[-1].step]


# Resume across world sizes. The training set has 8 images and the global batch is 8 (4 x 2 ranks,
# 8 x 1, 2 x 4): every step sees the same images whatever the world size, with no augmentation and
# float32 and no batch norm, so resuming the 2-process run's step-2 checkpoint in 1 or 4 processes must take
# the step it took itself: the same weights at step 3, to a thousandth of the step (gradients summed over ranks in
# another order differ in the last bits, and Adam divides the smallest of them by their own small scale). Muon's
# Newton-Schulz steps run in float32: in bfloat16 (its choice on CPUs with bf16 dot products) a last-bit difference
# can flip the rounding of an input to 8 bits, a change of a few thousandths of the step.
def _resume_overrides(data_root: Path, world: int) -> list[str]:
    return [
        *VIT,
        f"data.root={data_root}",
        "data.val_size=8",
        f"data.batch_size={8 // world}",
        "data.eval_batch_size=8",
        "trainer.max_steps=3",
        "trainer.max_epochs=1000",  # max_steps ends the run
        "model.stem=patch",  # the conv stem's batch norm would see 8 / world images per rank
        "task.optimizer.lr=1e-2",
        "task.optimizer.ns_dtype=float32",
        "task.scheduler.warmup_steps=0",
        "test=false",
    ]


def _state(ckpt: Path) -> dict[str, torch.Tensor]:
    if ckpt.is_dir():  # a sharded checkpoint: gather its files into one (torch.distributed.checkpoint)
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(ckpt, ckpt.with_suffix(".full"))
        ckpt = ckpt.with_suffix(".full")
    return torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]


@pytest.mark.parametrize(
    "strategy,worlds",
    [  # each world size where the checkpoint's layout changes: experts re-split, FSDP shards re-cut, FSDP dropped
        ("ddp", (1,)),  # experts split over both ranks, gathered into one process without a strategy
        ("fsdp", (1,)),  # a full checkpoint, resumed in 1 process without FSDP
        ("fsdp_sharded", (4,)),  # a folder with one file per rank, re-cut for 4 ranks by FSDP
        ("fsdp_ep", (4,)),  # experts split over all ranks (2 -> 4), FSDP shards the rest (the split is DDP's too)
    ],
    ids=["ddp", "fsdp", "fsdp_sharded", "fsdp_ep"],
)
@pytest.mark.slow
def test_a_2_process_checkpoint_resumes_in_1_or_4_to_the_same_step(tmp_path, strategy, worlds):
    data_root = write_fake_fashion_mnist(tmp_path / "fm", n_train=16, n_test=8)
    split_experts = {"expert_parallel_size": "${trainer.devices}"}
    options = split_experts if strategy in ("ddp", "fsdp_ep") else {}
    sharded = strategy == "fsdp_sharded"
    strategy = strategy.removesuffix("_sharded").removesuffix("_ep")

    first = tmp_path / "two"
    save_sharded = {"state_dict_type": "sharded"} if sharded else {}
    step2 = ["callbacks.last_checkpoint_steps.filename=step2", "callbacks.last_checkpoint_steps.every_n_train_steps=2"]
    _train(first, *_resume_overrides(data_root, 2), *step2, *_distributed(2, strategy, **options, **save_sharded))
    saved = first / "checkpoints" / "step2.ckpt"
    assert saved.is_dir() == sharded
    before, expected = _state(saved), _state(first / "checkpoints" / "last.ckpt")

    for world in worlds:
        out = tmp_path / f"resume{world}"
        placement = _distributed(world, strategy, **options)
        _train(out, *_resume_overrides(data_root, world), f"ckpt_path={saved}", *placement)
        got = _state(out / "checkpoints" / "last.ckpt")
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert (
                not torch.equal(value, before[key])
                or "num_batches" in key
                or not value.is_floating_point()
                or (value.abs().sum() == 0)
            ), f"{key} did not move in the step after the checkpoint"
            step = (value - before[key]).abs().max().item() if value.is_floating_point() else 0
            torch.testing.assert_close(
                got[key], value, rtol=0, atol=1e-3 * step, msg=f"{key}: {world} processes vs 2, step size {step}"
            )


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find the rank-1 process")
def test_sigterm_to_one_rank_saves_on_all_ranks_and_resumes_exactly(tmp_path, tiny_fashion):
    """Pre-emption under DDP: SIGTERM reaches rank 1 only; the ranks agree after the step, save
    last.ckpt together and exit 143 (without the agreement rank 1 would wait for rank 0 at the save).
    Resumed mid-epoch with 2 processes, the run ends with the weights of an uninterrupted run."""
    import signal
    import subprocess
    import time

    from conftest import REPO

    out = tmp_path / "run"
    common = [
        *VIT,
        f"data.root={tiny_fashion}",
        "data.val_size=32",
        "data.batch_size=8",  # 64 training images: 4 steps per epoch on 2 ranks
        "data.augment=basic",  # random crops and flips: each rank's random state must be restored
        "task.scheduler.name=constant",  # the schedule does not depend on max_steps
        "task.scheduler.warmup_steps=0",
        "trainer.max_epochs=1000",
        "trainer.deterministic=true",
        "test=false",
        *_distributed(2, "ddp"),
    ]
    args = [f"paths.output_dir={out}", *common, "trainer.max_steps=100000"]
    proc = Child(REPO / "scripts" / "train.py", args, tmp_path, script_env(), stderr_to_stdout=True)
    try:
        deadline = time.monotonic() + 120
        while not (children := _children(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert children, "rank 1 did not start"
        # Training has started once the last.ckpt of the first epoch exists.
        while not (out / "checkpoints" / "last.ckpt").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        for child in children:
            subprocess.run(["kill", "-TERM", str(child)], check=False)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "received SIGTERM: saved" in output
    stopped = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
    end = stopped + 3 if stopped % 4 else stopped + 2  # finish in another epoch, from mid-epoch if possible

    resumed, reference = tmp_path / "resumed", tmp_path / "reference"
    _train(resumed, *common, f"trainer.max_steps={end}", f"ckpt_path={out / 'checkpoints' / 'last.ckpt'}")
    _train(reference, *common, f"trainer.max_steps={end}")
    got, expected = (_state(run / "checkpoints" / "last.ckpt") for run in (resumed, reference))
    for key, value in expected.items():
        assert torch.equal(got[key], value), f"{key} differs after resuming from step {stopped}"


def test_resumable_sampler_shards_like_distributed_sampler_and_resumes_per_rank():
    from torch.utils.data import DistributedSampler

    from moekit.data.resumable import ResumableRandomSampler

    single = ResumableRandomSampler(10, batch_size=2, seed=5)
    ranks = [ResumableRandomSampler(10, batch_size=2, seed=5, num_replicas=3, rank=r) for r in range(3)]
    assert isinstance(ranks[0], DistributedSampler)  # so Lightning does not wrap it again
    order = single.epoch_order(0).tolist()
    shards = [list(sampler) for sampler in ranks]
    assert [len(shard) for shard in shards] == [4, 4, 4]
    padded = order + order[:2]
    assert shards == [padded[r::3] for r in range(3)], "rank r takes every third index of one shared order"
    assert list(single) == order, "one replica: the whole order, as before"

    # Mid-epoch resume of rank 1 after one batch: the same remaining indices.
    sampler = ResumableRandomSampler(10, batch_size=2, seed=5, num_replicas=3, rank=1)
    first = list(sampler)  # epoch 0
    sampler = ResumableRandomSampler(10, batch_size=2, seed=5, num_replicas=3, rank=1)
    iterator = iter(sampler)
    [next(iterator) for _ in range(3)]  # one batch consumed, the next prefetched
    state = sampler.state_dict(consumed_batches=1, epoch_done=False)
    assert state["num_replicas"] == 3 and len(state["ranks"]) == 1  # no process group: this rank only
    state["ranks"] = [state["ranks"][0]] * 3
    resumed = ResumableRandomSampler(10, batch_size=2, seed=5, num_replicas=3, rank=1)
    resumed.load_state_dict(state)
    assert list(resumed) == first[2:]

    # At another world size the mid-epoch position does not exist: refused; from an epoch's end the next epoch starts.
    other = ResumableRandomSampler(10, batch_size=2, seed=5, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match=r"after batch 1 of epoch 0 .*num_replicas 3 \(now 2\)"):
        other.load_state_dict(state)
    other.load_state_dict({**state, "epoch": 1, "batch": 0})
    assert list(other) == ResumableRandomSampler(10, batch_size=2, seed=5, num_replicas=2).rank_order(1)
