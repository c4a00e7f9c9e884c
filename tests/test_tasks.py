"""The classification task's pieces: schedules, parameter groups, the loss with aux terms, mixup."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning import Callback
from torch import nn

from conftest import TINY_NET
from moekit.moe import SoftMoE, TopKMoE, collect_moe_outputs, moe_layers
from moekit.tasks import ImageClassifier
from moekit.tasks.optim import ScheduleConfig, build_optimizer, clip_grad_norm, lr_lambda, param_groups


def test_cosine_schedule_with_warmup():
    f = lr_lambda(ScheduleConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1), total_steps=110)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)  # linear warmup to the peak
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(110) == pytest.approx(0.1)


def test_warmup_as_a_fraction_and_constant_schedule():
    f = lr_lambda(ScheduleConfig(name="constant", warmup_steps=0.1), total_steps=200)
    assert f(9) == pytest.approx(0.5) and f(19) == pytest.approx(1.0) and f(150) == 1.0


def test_rsqrt_schedule_with_cooldown():
    f = lr_lambda(ScheduleConfig(name="rsqrt", warmup_steps=100, cooldown_steps=100), total_steps=1000)
    assert f(100) == pytest.approx(1.0)
    assert f(400) == pytest.approx(math.sqrt(100 / 400))
    assert f(950) == pytest.approx(math.sqrt(100 / 950) * 0.5)  # half-way through the linear cooldown
    assert f(1000) == 0.0
    with pytest.raises(ValueError, match="scheduler name='linear'"):
        lr_lambda(ScheduleConfig(name="linear"), 10)


def test_a_resumed_run_takes_its_first_step_at_its_own_schedules_rate():
    """Resumed at step 5 with a longer run (a new cosine): the optimizer's restored rate is the old schedule's, and
    the task sets the new one's before the first step; a fresh run keeps the scheduler's own rate."""
    from types import SimpleNamespace

    old, new = (lr_lambda(ScheduleConfig(name="cosine", warmup_steps=0), total) for total in (6, 60))
    param = nn.Parameter(torch.zeros(2))
    first = torch.optim.AdamW([param], lr=0.1)
    first_schedule = torch.optim.lr_scheduler.LambdaLR(first, old)
    for _ in range(5):
        first.step()
        first_schedule.step()
    resumed = torch.optim.AdamW([param], lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(resumed, new)
    resumed.load_state_dict(first.state_dict())
    schedule.load_state_dict(first_schedule.state_dict())
    assert resumed.param_groups[0]["lr"] == pytest.approx(0.1 * old(5))
    task = SimpleNamespace(trainer=SimpleNamespace(lr_scheduler_configs=[SimpleNamespace(scheduler=schedule)]))
    ImageClassifier.on_train_start(task)
    assert resumed.param_groups[0]["lr"] == 0.1 * new(5) != pytest.approx(0.1 * old(5))
    assert schedule.get_last_lr() == [0.1 * new(5)]

    fresh = torch.optim.AdamW([param], lr=0.1)
    fresh_schedule = torch.optim.lr_scheduler.LambdaLR(fresh, lr_lambda(ScheduleConfig(name="cosine"), 60))
    before = fresh.param_groups[0]["lr"]
    task.trainer.lr_scheduler_configs = [SimpleNamespace(scheduler=fresh_schedule)]
    ImageClassifier.on_train_start(task)
    assert fresh.param_groups[0]["lr"] == before


def test_param_groups_skip_norms_biases_and_the_soft_moe_scale():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), SoftMoE(4, 8, num_experts=2))
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = {id(p) for p in no_decay["params"]}
    assert id(model[2].scale) in ids and id(model[1].weight) in ids and id(model[0].bias) in ids
    assert id(model[0].weight) not in ids and id(model[2].phi) not in ids
    assert id(model[2].experts.fc1_weight) not in ids
    (everything,) = param_groups(model, weight_decay=0.1, decay_1d=True)
    assert len(everything["params"]) == len(list(model.parameters()))


def test_adamw_is_fused_by_default_and_steps_as_the_default_implementation():
    """(A mix of DTensor and plain parameters, which the fused kernel refuses, is FSDP with expert parallelism:
    test_parallel_train's fsdp_ep runs train it.)"""
    torch.manual_seed(0)
    models = [nn.Linear(4, 3) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [
        build_optimizer(param_groups(models[0], 0.1), lr=0.1),
        build_optimizer(param_groups(models[1], 0.1), lr=0.1, fused=False),
    ]
    assert [o.defaults["fused"] for o in optimizers] == [True, False]
    x = torch.randn(8, 4)
    for _ in range(3):
        for m, o in zip(models, optimizers):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b)


def _clipped_runs(clip):
    """Three fused AdamW steps of a linear layer whose gradient norm changes from step to step (10-30x the
    clipping norm of 0.5), each clipped by ``clip``; the weights and each step's gradients after the step."""
    torch.manual_seed(0)
    model = nn.Linear(6, 5)
    optimizer = build_optimizer(param_groups(model, 0.1), lr=0.1, eps=1e-3)  # a large eps: the scale matters
    grads = []
    for step in range(3):
        x = torch.randn(16, 6) * (step + 1)
        model(x).square().sum().backward()
        clip(optimizer)
        optimizer.step()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()], grads, optimizer


def test_norm_clipping_inside_the_fused_step_clips_as_clip_grad_norm():
    """clip_grad_norm folds the clipping factor into the fused kernel (its grad_scale), which leaves the clipped
    gradients behind: weights and gradients as after torch's clip_grad_norm_, and the scale only for one step."""
    params = lambda o: [p for g in o.param_groups for p in g["params"]]  # noqa: E731
    norms = []
    weights, grads, optimizer = _clipped_runs(lambda o: norms.append(clip_grad_norm(o, 0.5)))
    expected, expected_grads, _ = _clipped_runs(lambda o: torch.nn.utils.clip_grad_norm_(params(o), 0.5))
    unclipped, _, _ = _clipped_runs(lambda o: None)
    assert all(n > 5.0 for n in norms), "the clipping binds at every step"
    assert not hasattr(optimizer, "grad_scale") and not optimizer._optimizer_step_post_hooks
    for ours, theirs in zip(grads, expected_grads):
        assert torch.linalg.vector_norm(torch.cat([g.flatten() for g in ours])) == pytest.approx(0.5, rel=1e-5)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    for a, b, c in zip(weights, expected, unclipped):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert (a - c).abs().max() > 1e-3, "clipping changes the weights"


@pytest.mark.e2e
def test_a_fused_optimizer_is_clipped_inside_its_step_under_lightning():
    """MoETask.configure_gradient_clipping gets what Lightning passes it: the clipping factor reaches the fused
    step (as its grad_scale, the gradients' norm over the clipping norm), the gradients it leaves have the
    clipping norm, and the scale ends with the step."""
    from lightning import Trainer

    seen = []

    class Norms(Callback):
        def on_train_start(self, trainer, module):  # runs before the clipping's own hook, which ends the scale
            trainer.optimizers[0].register_step_post_hook(lambda o, *_: seen.append(("scale", o.grad_scale.item())))

        def on_before_optimizer_step(self, trainer, module, optimizer):  # before clipping
            seen.append(("before", _total_norm(module)))

        def on_train_batch_end(self, trainer, module, *args):  # after the step
            seen.append(("after", _total_norm(module)))
            assert not hasattr(trainer.optimizers[0], "grad_scale")

    task = ImageClassifier(net=TINY_NET, num_classes=10)
    trainer = Trainer(
        accelerator="cpu",
        max_steps=2,
        gradient_clip_val=0.05,
        callbacks=[Norms()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.utils.data.TensorDataset(torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,)))
    trainer.fit(task, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=16))
    assert trainer.optimizers[0].defaults["fused"]
    assert [kind for kind, _ in seen] == ["before", "scale", "after"] * 2
    for (_, before), (_, scale), (_, after) in zip(seen[::3], seen[1::3], seen[2::3]):
        assert before > 0.5 and scale == pytest.approx(before / 0.05, rel=1e-4)
        assert after == pytest.approx(0.05, rel=1e-4)


def _total_norm(module) -> float:
    return torch.nn.utils.get_total_norm([p.grad for p in module.parameters() if p.grad is not None]).item()


def test_training_loss_is_cross_entropy_plus_the_aux_losses():
    net = dict(TINY_NET, model_name="top2_moe_vit_tiny_patch4_28")
    net["moe"] = {"num_experts": 4, "switch_loss_weight": 0.5, "z_loss_weight": 0.1}
    task = ImageClassifier(net=net, num_classes=10)
    images, labels = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    loss = task._shared_step((images, labels), "val")
    moe = collect_moe_outputs(task.net)
    assert set(moe.aux_losses) == {"switch", "z"}
    ce = nn.functional.cross_entropy(task(images), labels)
    layers = [layer for _, layer in moe_layers(task.net)]
    assert layers and all(set(layer.aux_losses) == {"switch", "z"} for layer in layers)
    torch.testing.assert_close(loss, ce + sum(sum(layer.aux_losses.values()) for layer in layers))


def test_mixup_trains_on_soft_targets():
    """With mixup the loss is the cross-entropy against the mixed soft targets: lam on an image's own label,
    1 - lam on the label of the image it was mixed with (the batch flipped), of the mixed images."""
    task = ImageClassifier(net=TINY_NET, num_classes=10, mixup={"mixup_alpha": 0.8, "cutmix_alpha": 0.0})
    images, labels = torch.randn(8, 1, 28, 28), torch.arange(8) % 10
    np.random.seed(0)
    loss = task._shared_step((images.clone(), labels), "train")
    np.random.seed(0)
    mixed, targets = task.mixup(images.clone(), labels)
    lam = targets[0, labels[0]].item()
    assert 0.0 < lam < 1.0 and not torch.equal(mixed, images)
    expected_targets = lam * F.one_hot(labels, 10) + (1 - lam) * F.one_hot(labels.flip(0), 10)
    torch.testing.assert_close(targets, expected_targets.float())
    torch.testing.assert_close(mixed, lam * images + (1 - lam) * images.flip(0))
    soft_ce = torch.sum(-targets * F.log_softmax(task(mixed), dim=-1), dim=-1).mean()
    torch.testing.assert_close(loss, soft_ce + collect_moe_outputs(task.net).aux_loss)


def test_num_classes_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="10 outputs but the data has num_classes=5"):
        ImageClassifier(net=TINY_NET, num_classes=5)


def test_loss_free_balancing_updates_once_per_optimizer_step():
    net = dict(TINY_NET, model_name="top2_moe_vit_tiny_patch4_28")
    net["moe"] = {"num_experts": 4, "bias_update_rate": 0.01, "capacity_factor": None, "eval_capacity_factor": None}
    task = ImageClassifier(net=net, num_classes=10)
    layer = next(m for m in task.net.modules() if isinstance(m, TopKMoE))
    task.train()
    task(torch.randn(8, 1, 28, 28))
    assert layer.router.pending_counts.sum() > 0
    task.optimizer_step(0, 0, torch.optim.SGD(task.parameters(), lr=0.0), optimizer_closure=lambda: None)
    assert layer.router.pending_counts.sum() == 0, "the counts were consumed by the step"
    assert layer.router.expert_bias.abs().sum() > 0


class _StopAfter(Callback):
    """Stops the fit after ``steps`` optimizer steps (nothing else limits the runs below)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer, *args) -> None:
        trainer.should_stop = trainer.global_step >= self.steps


def _fit_without_limits(scheduler: dict, steps: int = 3, max_epochs: int = -1, iterable: bool = False) -> list[float]:
    """Fit the tiny classifier with ``max_steps=-1`` and ``max_epochs=-1`` (a run that ``max_time`` would stop), or
    on ``iterable`` data of no length, for ``steps`` optimizer steps; the learning rate of each step."""
    import lightning as L
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(TensorDataset(torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))))

    task = ImageClassifier(net=TINY_NET, num_classes=10, optimizer={"lr": 0.1}, scheduler=scheduler)
    rates = []
    task.on_before_optimizer_step = lambda optimizer: rates.append(optimizer.param_groups[0]["lr"])
    dataset = Stream() if iterable else TensorDataset(torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,)))
    trainer = L.Trainer(
        max_epochs=max_epochs, max_steps=-1, callbacks=[_StopAfter(steps)], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(task, DataLoader(dataset, batch_size=4))
    return rates


def test_a_run_with_no_step_limit_trains_with_a_schedule_that_needs_none():
    """``trainer.max_epochs=-1`` and ``max_steps=-1`` (``max_time`` ends the run): Lightning estimates infinitely many
    steps (-1 for training data of no length and no ``max_steps``). A constant schedule (or rsqrt) trains, warming up
    over its whole number of steps; one that needs the total (cosine, a fractional warmup, a cooldown) is refused
    naming the setting and the fix, where it would have decayed over one step."""
    assert _fit_without_limits({"name": "constant", "warmup_steps": 2}) == pytest.approx([0.05, 0.1, 0.1])
    rsqrt = _fit_without_limits({"name": "rsqrt", "warmup_steps": 1}, steps=4)
    assert rsqrt == pytest.approx([0.1, 0.1, 0.1 * math.sqrt(1 / 2), 0.1 * math.sqrt(1 / 3)])
    for scheduler, named in (
        ({"name": "cosine", "warmup_steps": 2}, "name='cosine'"),
        ({"name": "constant", "warmup_steps": 0.1}, "warmup_steps=0.1"),
        ({"name": "rsqrt", "warmup_steps": 2, "cooldown_steps": 5}, "cooldown_steps=5"),
    ):
        with pytest.raises(ValueError, match=rf"scheduler {named}.*set trainer.max_steps"):
            _fit_without_limits(scheduler)
    with pytest.raises(ValueError, match="scheduler name='cosine'"):  # Lightning counts -1 steps: no total either
        _fit_without_limits({"name": "cosine", "warmup_steps": 0}, max_epochs=1, iterable=True)


def test_training_float16_weights_without_a_scaler_is_refused_with_the_precisions_that_work():
    """``trainer.precision=16-true``: float16 weights, no float32 copy, no loss scaling; AdamW's first update turns
    the weights NaN (every step then skipped by the guard). Refused before the first step, naming what works."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    task = ImageClassifier(net=TINY_NET, num_classes=10, optimizer={"lr": 1e-3})
    trainer = L.Trainer(max_steps=1, precision="16-true", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    data = DataLoader(TensorDataset(torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))), batch_size=4)
    with pytest.raises(
        ValueError, match=r"trainer.precision=16-true trains float16 weights.*=16-mixed.*bf16-mixed or bf16-true"
    ):
        trainer.fit(task, data)
