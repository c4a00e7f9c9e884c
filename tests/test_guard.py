"""Numerical safety: routers stay float32 under autocast and record whether their logits were finite;
the NonFiniteGuard skips a step with a NaN router or a NaN batch (the weights, the optimizer state and
the balancing biases do not move), keeps training, and stops after K bad steps in a row naming the
layer; under fp16 with a grad scaler, loss-scale overflows are counted apart."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision

import moekit.commands.train as train_command
from conftest import TINY_NET, compose_config, small_overrides
from moekit.callbacks import NonFiniteGuard, NonFiniteTrainingError
from moekit.callbacks.guard import BadStep
from moekit.commands.train import train
from moekit.models import TransformerLM
from moekit.moe import ExpertsChoiceMoE, MoELayer, SoftMoE, TopKMoE, get_moe_layer, list_moe_layers, moe_layers
from moekit.tasks import ImageClassifier

STEPS_PER_EPOCH = 8  # 320 fake images - 64 for validation, batches of 32


def _config(experiment: str, data_root: Path, out: Path, *extra: str):
    overrides = [f"experiment={experiment}", *small_overrides(data_root), "test=false", *extra]
    return compose_config("train", overrides, out)


def _add_callbacks(monkeypatch, *extra: Callback) -> None:
    """Make :func:`moekit.commands.train.train` append ``extra`` to the callbacks its config builds."""
    original = train_command.instantiate_group

    def instantiate_group(group, name):
        made = original(group, name)
        return made + list(extra) if name == "callbacks" else made

    monkeypatch.setattr(train_command, "instantiate_group", instantiate_group)


def _guard(trainer: Trainer) -> NonFiniteGuard:
    return next(c for c in trainer.callbacks if isinstance(c, NonFiniteGuard))


def _router_weight(pl_module: LightningModule) -> torch.Tensor:
    """The routing parameter of the network's first MoE layer (``router.weight`` or Soft MoE's ``phi``)."""
    _, layer = next(moe_layers(pl_module.net))
    return layer.phi if isinstance(layer, SoftMoE) else layer.router.weight


def _snapshot(trainer: Trainer, pl_module: LightningModule) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and optimizer state tensor, cloned."""
    state = {f"param/{k}": v.detach().clone() for k, v in pl_module.state_dict().items()}
    for i, s in enumerate(trainer.optimizers[0].state.values()):
        for k, v in s.items():
            state[f"opt/{i}/{k}"] = torch.as_tensor(v).clone()
    return state


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    return sorted(
        k
        for k in before.keys() | after.keys()
        if k not in before or k not in after or not torch.equal(before[k], after[k])
    )


class PoisonRouter(Callback):
    """Fill the first MoE layer's router weights with NaN at optimizer step ``at``; ``persist=False``
    restores them after that step. Records what changed during that step and during the one before."""

    def __init__(self, at: int, persist: bool = False) -> None:
        self.at, self.persist = at, persist
        self.changed: dict[int, list[str]] = {}
        self._before: dict[str, torch.Tensor] = {}
        self._saved: torch.Tensor | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in (self.at - 1, self.at):
            self._before = _snapshot(trainer, pl_module)
        if trainer.global_step == self.at:
            weight = _router_weight(pl_module)
            self._saved = weight.detach().clone()
            with torch.no_grad():
                weight.fill_(math.nan)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1  # the step this batch just took
        if step == self.at and not self.persist:
            with torch.no_grad():
                _router_weight(pl_module).copy_(self._saved)
        if step in (self.at - 1, self.at):
            self.changed[step] = _changed(self._before, _snapshot(trainer, pl_module))


class PoisonBatch(Callback):
    """Put a NaN into the images of the batch of optimizer step ``at`` (in place, before the forward)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.guard: NonFiniteGuard | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.guard = _guard(trainer)
        if trainer.global_step == self.at:
            batch[0][0, 0, 3, 3] = math.nan


# ---------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_a_nan_router_for_one_step_is_skipped_and_training_goes_on(fake_fashion, tmp_path, monkeypatch):
    """Tokens-choice with loss-free balancing: the poisoned step changes no weight, no optimizer
    state and no balancing bias; the step before it changes all three (so the check can fail)."""
    poison = PoisonRouter(at=3)
    _add_callbacks(monkeypatch, poison)
    cfg = _config("tokens_choice_vit", fake_fashion, tmp_path, "+moe.bias_update_rate=0.01", "data.num_workers=0")
    metrics = train(cfg)
    assert poison.changed[3] == [], f"the skipped step changed {poison.changed[3]}"
    before = poison.changed[2]
    assert any(k.endswith("router.expert_bias") for k in before), "a normal step updates the balancing biases"
    assert any(k.startswith("opt/") for k in before) and any(k.endswith("router.weight") for k in before)
    assert metrics["train/skipped_steps"] == 1.0
    assert math.isfinite(metrics["train/loss_step"]), "training went on after the skipped step"


@pytest.mark.e2e
def test_a_persistent_nan_router_stops_after_k_steps_naming_the_layer(fake_fashion, tmp_path, monkeypatch):
    _add_callbacks(monkeypatch, PoisonRouter(at=2, persist=True))
    cfg = _config("soft_moe_vit", fake_fashion, tmp_path, "callbacks.non_finite_guard.max_consecutive_bad_steps=3")
    with pytest.raises(NonFiniteTrainingError) as err:
        train(cfg)
    message = str(err.value)
    assert "3 consecutive training steps (steps 2-4)" in message
    assert "the router of MoE layer 'blocks.1.mlp' produced non-finite logits" in message
    assert "its weights hold NaN/inf" in message
    assert "task.optimizer.lr" in message and "z_loss_weight" in message
    assert "max_consecutive_bad_steps=null" in message
    assert isinstance(err.value, ValueError), "the scripts print it as one paragraph with exit status 1"


class InfiniteNoise(Callback):
    """From optimizer step ``at`` on, the first Soft MoE layer adds infinite noise to its logits."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            next(m for m in pl_module.net.modules() if isinstance(m, SoftMoE)).noise_std = math.inf


@pytest.mark.e2e
def test_infinite_router_noise_is_blamed_on_the_router_not_an_earlier_block(fake_fashion, tmp_path, monkeypatch):
    """Finite weights and a finite input, yet non-finite logits: the router's own computation (its noise)."""
    _add_callbacks(monkeypatch, InfiniteNoise(at=1))
    cfg = _config("soft_moe_vit", fake_fashion, tmp_path, "callbacks.non_finite_guard.max_consecutive_bad_steps=2")
    with pytest.raises(NonFiniteTrainingError) as err:
        train(cfg)
    message = str(err.value)
    assert "the router of MoE layer 'blocks.1.mlp' produced non-finite logits" in message
    assert "its input and weights are finite, so the router's own computation overflowed" in message
    assert "earlier block" not in message


def test_a_nan_in_the_input_batch_is_caught_and_blamed_on_the_data(fake_fashion, tmp_path, monkeypatch):
    poison = PoisonBatch(at=2)
    _add_callbacks(monkeypatch, poison)
    metrics = train(_config("soft_moe_vit", fake_fashion, tmp_path, "data.num_workers=0"))
    bad = poison.guard.last_bad_step
    assert metrics["train/skipped_steps"] == 1.0 and poison.guard.skipped_steps == 1
    assert bad.step == 2 and bad.batch_finite is False and not math.isfinite(bad.loss)
    assert bad.cause == "the input batch holds NaN or inf values"
    assert bad.fix.startswith("check the data")
    assert poison.guard.consecutive_bad_steps == 0, "the good steps after it reset the streak"


def test_guard_settings_are_checked():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_consecutive_bad_steps"):
            NonFiniteGuard(max_consecutive_bad_steps=bad)
    NonFiniteGuard(max_consecutive_bad_steps=None)


def test_guard_state_survives_a_checkpoint():
    guard = NonFiniteGuard()
    guard.skipped_steps, guard.scaler_skipped_steps, guard.consecutive_bad_steps = 4, 7, 2
    restored = NonFiniteGuard()
    restored.load_state_dict(guard.state_dict())
    assert (restored.skipped_steps, restored.scaler_skipped_steps, restored.consecutive_bad_steps) == (4, 7, 2)


def test_a_streak_of_bad_steps_goes_on_across_a_checkpoint(tmp_path):
    """Two bad steps in a row, a checkpoint, a resume, a third: the resumed guard stops with the message of the
    guard that never stopped (the streak's first step and its cause)."""
    first = BadStep(10, math.inf, False, None, None, None)
    second = BadStep(11, 2.5, True, "blocks.1.mlp", True, None, True)
    third = BadStep(12, 2.5, True, None, None, "net.head.weight")
    guard = NonFiniteGuard(max_consecutive_bad_steps=3)
    guard.skipped_steps, guard.consecutive_bad_steps, guard.first_of_streak, guard.last_bad_step = 2, 2, first, second
    torch.save(guard.state_dict(), tmp_path / "guard.pt")
    restored = NonFiniteGuard(max_consecutive_bad_steps=3)
    restored.load_state_dict(torch.load(tmp_path / "guard.pt", weights_only=True))
    assert (restored.first_of_streak, restored.last_bad_step) == (first, second)
    for g in (guard, restored):  # the third bad step, as _check_step records it
        g.skipped_steps, g.consecutive_bad_steps = g.skipped_steps + 1, g.consecutive_bad_steps + 1
        g.first_of_streak, g.last_bad_step = g.first_of_streak or third, third
    assert restored._stop_message(3) == guard._stop_message(3)
    assert "steps 10-12" in restored._stop_message(3) and "input batch" in restored._stop_message(3)


# ---------------------------------------------------------------------------------------------
# fp16 with a grad scaler. Lightning turns precision="16-mixed" into bf16 on CPU, so the test builds
# the plugin itself: torch's CPU GradScaler behaves like the CUDA one (unscale, skip on inf, back off).


def _loader(n: int = 64, batch: int = 16, nan_at: int | None = None):
    images, labels = torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))
    if nan_at is not None:
        images[nan_at * batch] = math.nan
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=batch)


def _fp16_trainer(guard: NonFiniteGuard, init_scale: float, steps: int) -> Trainer:
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000)
    return Trainer(
        accelerator="cpu",
        max_steps=steps,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        gradient_clip_val=1.0,
        callbacks=[guard],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )


@pytest.mark.e2e
def test_fp16_scaler_overflows_are_counted_apart_and_do_not_stop_training():
    """A loss scale of 2^40 overflows fp16 gradients for the first steps: the scaler skips them and
    backs off. With a limit of 2 bad steps the guard would stop if it counted them."""
    guard = NonFiniteGuard(max_consecutive_bad_steps=2)
    task = ImageClassifier(net=TINY_NET, num_classes=10)
    trainer = _fp16_trainer(guard, init_scale=2.0**40, steps=12)
    trainer.fit(task, train_dataloaders=_loader(n=192))
    assert guard.scaler_skipped_steps >= 3 and guard.skipped_steps == 0
    assert trainer.precision_plugin.scaler.get_scale() < 2.0**40, "the scaler backed off"
    assert trainer.callback_metrics["train/scaler_skipped_steps"] == guard.scaler_skipped_steps


@pytest.mark.e2e
def test_fp16_a_nan_loss_is_a_bad_step_even_with_a_scaler():
    guard = NonFiniteGuard(max_consecutive_bad_steps=3)
    task = ImageClassifier(net=TINY_NET, num_classes=10)
    trainer = _fp16_trainer(guard, init_scale=2.0**8, steps=4)
    trainer.fit(task, train_dataloaders=_loader(nan_at=1))
    assert guard.skipped_steps == 1 and guard.last_bad_step.batch_finite is False


# ---------------------------------------------------------------------------------------------
# Routers in float32 under autocast, and the finiteness record of every layer.
def _layer(name: str) -> MoELayer:
    kwargs = {"num_experts": 4}
    if name == "hierarchical":
        kwargs["num_groups"] = 2
    if name == "soft_moe":
        kwargs["num_tokens"] = 6
    if name == "hash":
        kwargs["vocab_size"] = 50
    if name == "lory":
        kwargs["segment_len"] = 2  # segments after the first are routed by logits
    return get_moe_layer(name)(8, hidden_features=16, **kwargs)


def _inputs(name: str) -> tuple[torch.Tensor, dict]:
    x = torch.randn(2, 6, 8)
    return x, ({"token_ids": torch.randint(0, 50, (2, 6))} if name == "hash" else {})


@pytest.mark.parametrize("name", [n for n in list_moe_layers() if n != "hash"])
def test_every_router_records_whether_its_logits_were_finite(name):
    layer = _layer(name).train()
    x, kwargs = _inputs(name)
    layer(x, **kwargs)
    assert layer.router_logit_checksum is not None and layer.router_logits_finite() is True
    routing_params = [p for n, p in layer.named_parameters() if not n.startswith(("experts.", "shared_experts."))]
    with torch.no_grad():
        routing_params[0].fill_(math.nan)
    layer(x, **kwargs)
    assert layer.router_logits_finite() is False, f"{name}: NaN router weights went unnoticed"


def test_hash_routing_has_no_logits_to_check():
    layer = _layer("hash")
    x, kwargs = _inputs("hash")
    layer(x, **kwargs)
    assert layer.router_logits_finite() is None


def _autocast_dtypes() -> list[torch.dtype]:
    dtypes = [torch.bfloat16]
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            torch.ones(2, 2) @ torch.ones(2, 2)
        dtypes.append(torch.float16)
    except RuntimeError:  # fp16 autocast unsupported on this CPU build: bf16 only
        pass
    return dtypes


@pytest.mark.parametrize("dtype", _autocast_dtypes(), ids=str)
def test_lm_and_experts_choice_routers_compute_in_float32_under_autocast(dtype, monkeypatch):
    import moekit.moe.experts_choice as ec
    import moekit.moe.routers as routers

    captured: list[torch.Tensor] = []
    for module in (routers, ec):
        original = module.router_logits

        def spy(*args, _original=original, **kwargs):
            out = _original(*args, **kwargs)
            captured.append(out)
            return out

        monkeypatch.setattr(module, "router_logits", spy)

    lm = TransformerLM(
        vocab_size=64,
        max_seq_len=16,
        dim=32,
        depth=2,
        num_heads=2,
        moe=dict(recipe="mixtral", num_experts=4, z_loss_weight=1e-3),
    ).train()
    ec_layer = ExpertsChoiceMoE(8, 16, num_experts=4, capacity_factor=1.0, z_loss_weight=1e-3).train()
    with torch.autocast("cpu", dtype=dtype):
        lm_logits = lm(torch.randint(0, 64, (2, 16)))
        ec_out = ec_layer(torch.randn(2, 6, 8))
    lm_layers = [layer for _, layer in moe_layers(lm)]
    assert lm_layers and all(isinstance(layer, TopKMoE) for layer in lm_layers)
    assert len(captured) == len(lm_layers) + 1, "one router_logits call per LM MoE layer + the experts-choice layer"
    assert all(t.dtype == torch.float32 for t in captured), [t.dtype for t in captured]
    assert all(layer.router_logit_checksum.dtype == torch.float32 for layer in [*lm_layers, ec_layer])
    assert ec_layer.aux_losses["z"].dtype == torch.float32
    assert ec_out.dtype == dtype, "the experts themselves run in the autocast dtype"
    assert lm_logits.dtype in (dtype, torch.float32)
