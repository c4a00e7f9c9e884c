"""CapacityTuner: convergence to the smallest capacity factor meeting the target drop rate on known
drop curves (synthetic and real routers), bounds, checkpoint round trip and exact resume, the eval
factor, refusal of models without a capacity limit."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable

import lightning as L
import pytest
import torch
from torch import Tensor, nn

from moekit.callbacks import CapacityTuner, ExpertLoadMonitor
from moekit.callbacks.capacity import capacity_limited_layers
from moekit.moe import ExpertsChoiceMoE, MoELayer, SoftMoE, TopKMoE
from moekit.moe.capacity import tokens_choice_capacity


class CurveLayer(MoELayer):
    """A capacity-limited layer whose dropped fraction is ``curve(capacity factor)``: the training
    factor in train mode, the eval factor in eval mode."""

    def __init__(self, curve: Callable[[float], float], capacity_factor: float = 0.5) -> None:
        super().__init__(1)  # no experts to size: the layer passes its input through
        self.curve = curve
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = capacity_factor
        self._drop: Tensor | None = None

    def build(self, mlp, *configs, device=None, dtype=None) -> None:
        pass

    @property
    def stats(self) -> dict[str, Tensor]:
        return {"dropped_fraction": self._drop}

    def forward(self, x: Tensor) -> Tensor:
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        self._drop = torch.tensor(self.curve(factor))
        return x


def exponential_curve(rate: float) -> Callable[[float], float]:
    """Drop fraction 0.5 at factor 0.5, falling by ``exp(-rate)`` per unit of factor."""
    return lambda factor: 0.5 * math.exp(-rate * (factor - 0.5))


def smallest_factor(curve_rate: float, target: float) -> float:
    """The factor at which :func:`exponential_curve` reaches ``target``."""
    return 0.5 + math.log(0.5 / target) / curve_rate


def run(tuner: CapacityTuner, model: nn.Module, steps: int, x: Tensor | None = None) -> list[dict[str, float]]:
    """``steps`` training forwards, each followed by ``tuner.step()``; returns the factors after each."""
    x = torch.zeros(1) if x is None else x
    history = []
    for _ in range(steps):
        with torch.no_grad():
            model(x)
        tuner.step()
        history.append(dict(tuner.factors))
    return history


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("curve_rate", [2.0, 4.0, 8.0])
@pytest.mark.parametrize("target", [0.01, 0.03])
def test_converges_to_the_smallest_factor_meeting_the_target(curve_rate, target):
    model = nn.Sequential(CurveLayer(exponential_curve(curve_rate)))
    tuner = CapacityTuner(
        target_drop=target, min_factor=0.25, max_factor=4.0, window=5, update_every=5, patience=2, retry_after=10**6
    )
    tuner.bind(model)
    history = run(tuner, model, 800)
    smallest = smallest_factor(curve_rate, target)
    final = history[-1]["0"]
    assert smallest <= final <= smallest / tuner.decrease + 1e-9, (smallest, final)
    assert model[0].curve(final) <= target
    assert model[0].capacity_factor == final, "the layer runs at the tuned factor"
    assert all(h["0"] == final for h in history[-300:]), "settled: no oscillation"


def test_a_changing_drop_curve_is_followed_down_after_retry_after():
    """A router that balances better as it trains: the smallest working factor falls; the tuner follows."""
    layer = CurveLayer(exponential_curve(4.0))
    model = nn.Sequential(layer)
    tuner = CapacityTuner(target_drop=0.01, window=5, update_every=5, patience=2, retry_after=200)
    tuner.bind(model)
    run(tuner, model, 600)
    before = tuner.factors["0"]
    layer.curve = exponential_curve(8.0)
    run(tuner, model, 1500)
    after = tuner.factors["0"]
    assert smallest_factor(8.0, 0.01) <= after <= smallest_factor(8.0, 0.01) / tuner.decrease + 1e-9
    assert after < before


@pytest.mark.parametrize(
    ("curve", "expected"),
    [(lambda f: 0.5, "max"), (lambda f: 0.0, "min")],
    ids=["target unreachable: max_factor", "never drops: min_factor"],
)
def test_never_leaves_its_bounds(curve, expected):
    model = nn.Sequential(CurveLayer(curve, capacity_factor=1.0))
    tuner = CapacityTuner(min_factor=0.75, max_factor=2.5, window=3, update_every=3, patience=1)
    tuner.bind(model)
    history = run(tuner, model, 400)
    factors = [h["0"] for h in history]
    assert all(0.75 <= f <= 2.5 for f in factors)
    assert factors[-1] == (2.5 if expected == "max" else 0.75)


def test_a_configured_factor_outside_the_bounds_is_clamped_at_bind():
    model = nn.Sequential(CurveLayer(lambda f: 0.0, capacity_factor=8.0))
    tuner = CapacityTuner(max_factor=3.0)
    tuner.bind(model)
    assert tuner.factors == {"0": 3.0} and model[0].capacity_factor == 3.0


def test_real_top_k_layer_settles_within_one_step_of_the_smallest_working_capacity():
    torch.manual_seed(0)
    layer = TopKMoE(16, 32, num_experts=4, top_k=1, capacity_factor=0.5)
    x = torch.randn(8, 16, 16)

    def drop_at(factor: float) -> float:
        layer.capacity_factor = factor
        with torch.no_grad():
            layer(x)
        return float(layer.stats["dropped_fraction"])

    target = 0.02
    grid = [0.5 + 0.001 * i for i in range(3500)]
    smallest = next(f for f in grid if drop_at(f) <= target)
    layer.capacity_factor = 0.5
    # hysteresis=1: step down whenever at or under target, so only the failed-factor memory stops it
    tuner = CapacityTuner(target_drop=target, window=4, update_every=4, patience=1, hysteresis=1.0, retry_after=10**6)
    tuner.bind(layer)
    history = run(tuner, layer, 600, x)
    final = history[-1]["TopKMoE"]
    assert drop_at(final) <= target
    assert smallest - 0.001 <= final <= smallest / tuner.decrease + 1e-6, (smallest, final)
    assert all(h["TopKMoE"] == final for h in history[-200:])


def test_the_drop_rate_is_over_the_real_tokens_of_the_window():
    """A step of mostly padding weighs its few real tokens, not as much as a full batch (the all-padding step of a
    tokens-choice layer records a dropped fraction of 1: it must not count at all)."""
    torch.manual_seed(0)
    layer = TopKMoE(8, 16, num_experts=4, top_k=2, capacity_factor=0.5)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 3.0)  # decisive routing: the capacity binds
    tuner = CapacityTuner(target_drop=0.05, window=3, update_every=3, patience=10**6)
    tuner.bind(layer)
    x = torch.randn(8, 12, 8)
    masks = [torch.ones(8, 12, dtype=torch.bool), torch.zeros(8, 12, dtype=torch.bool), torch.zeros(8, 12).bool()]
    masks[2][:, :3] = True  # 3 real tokens in each of 8 sequences
    dropped = real = 0.0
    for mask in masks:
        with torch.no_grad():
            layer(x, padding_mask=mask)
        fraction, tokens = float(layer.stats["dropped_fraction"]), float(mask.sum())
        dropped, real = dropped + fraction * tokens * 2, real + tokens * 2
        tuner.step()
    assert fraction > 0 and float(masks[1].sum()) == 0
    assert tuner.drop_rates["TopKMoE"] == pytest.approx(dropped / real, rel=1e-6)


def test_a_checkpoint_of_unweighted_windows_still_resumes_exactly():
    def fresh() -> tuple[nn.Module, CapacityTuner]:
        model = nn.Sequential(CurveLayer(exponential_curve(3.0)), CurveLayer(exponential_curve(6.0), 1.0))
        return model, CapacityTuner(window=7, update_every=3, patience=2)

    model_a, tuner_a = fresh()
    tuner_a.bind(model_a)
    run(tuner_a, model_a, 37)
    state = tuner_a.state_dict()
    assert state["buffer"].shape == (2, 2, 7) and bool((state["buffer"][1] == 1).all())  # no token counts: 1 a step
    old = {**state, "buffer": state["buffer"][0]}  # the [layers, window] drop fractions of earlier versions
    model_b, tuner_b = fresh()
    tuner_b.bind(model_b)
    tuner_b.load_state_dict(old)
    assert run(tuner_a, model_a, 200) == run(tuner_b, model_b, 200)
    assert tuner_a.drop_rates == tuner_b.drop_rates


def test_experts_choice_layer_reaches_the_target_within_num_experts():
    torch.manual_seed(0)
    layer = ExpertsChoiceMoE(16, 32, num_experts=4, capacity_factor=0.5)
    x = torch.randn(8, 16, 16)
    tuner = CapacityTuner(target_drop=0.05, max_factor=10.0, window=4, update_every=4, patience=2)
    tuner.bind(layer)
    history = run(tuner, layer, 400, x)
    assert all(h["ExpertsChoiceMoE"] <= 4.0 for h in history), "experts-choice factors stop at num_experts"
    with torch.no_grad():
        layer(x)
    assert float(layer.stats["dropped_fraction"]) <= 0.05


# ---------------------------------------------------------------------------------------------
def test_state_dict_round_trip_continues_exactly(tmp_path):
    def fresh() -> tuple[nn.Module, CapacityTuner]:
        model = nn.Sequential(CurveLayer(exponential_curve(3.0)), CurveLayer(exponential_curve(6.0), 1.0))
        return model, CapacityTuner(window=7, update_every=3, patience=2)

    model_a, tuner_a = fresh()
    tuner_a.bind(model_a)
    run(tuner_a, model_a, 37)  # mid-window, between two decisions
    torch.save(tuner_a.state_dict(), tmp_path / "tuner.pt")
    state = torch.load(tmp_path / "tuner.pt", weights_only=True)  # plain tensors and numbers: safe to load

    model_b, tuner_b = fresh()
    tuner_b.load_state_dict(state)  # before bind, as Lightning may do: applied once bound
    tuner_b.bind(model_b)
    assert tuner_b.factors == tuner_a.factors
    assert [m.capacity_factor for m in model_b] == [m.capacity_factor for m in model_a]
    assert run(tuner_a, model_a, 200) == run(tuner_b, model_b, 200)
    assert tuner_a.drop_rates == tuner_b.drop_rates


def test_loading_the_state_of_other_layers_names_them():
    model, tuner = nn.Sequential(CurveLayer(lambda f: 0.0)), CapacityTuner()
    tuner.bind(model)
    state = tuner.state_dict()
    other = CapacityTuner()
    other.bind(nn.Sequential(nn.Identity(), CurveLayer(lambda f: 0.0)))
    with pytest.raises(ValueError, match=r"\['0'\].*\['1'\]"):
        other.load_state_dict(state)


def test_eval_uses_the_callbacks_eval_capacity_factor():
    layer = TopKMoE(8, 16, num_experts=4, top_k=2, capacity_factor=0.5, eval_capacity_factor="same")
    model = nn.Sequential(layer)
    tuner = CapacityTuner(eval_capacity_factor=2.0, window=2, update_every=2)
    tuner.bind(model)
    run(tuner, model.train(), 20, torch.randn(2, 6, 8))
    trained_factor = tuner.factors["0"]
    assert trained_factor > 0.5, "the tokens-choice layer dropped tokens at 0.5, so the tuner raised it"
    assert layer.expert_capacity(12) == tokens_choice_capacity(12, 2, 4, trained_factor)
    model.eval()
    assert layer.expert_capacity(12) == tokens_choice_capacity(12, 2, 4, 2.0)
    with torch.no_grad():
        model(torch.randn(2, 6, 8))
    assert float(layer.stats["dropped_fraction"]) == 0.0, "capacity 2 x the even share: nothing dropped here"


def test_eval_factor_above_num_experts_of_an_experts_choice_layer_is_refused():
    with pytest.raises(ValueError, match="eval_capacity_factor=9.0 exceeds num_experts=4"):
        CapacityTuner(eval_capacity_factor=9.0).bind(ExpertsChoiceMoE(8, 16, num_experts=4))


@pytest.mark.parametrize(
    "model",
    [
        nn.Sequential(TopKMoE(8, 16, num_experts=4, top_k=2)),  # dropless
        nn.Sequential(SoftMoE(8, 16, num_experts=4)),
        nn.Sequential(nn.Linear(8, 8)),
    ],
    ids=["dropless top-k", "soft moe", "dense"],
)
def test_refuses_a_model_without_capacity_limited_layer(model):
    assert capacity_limited_layers(model) == {}
    with pytest.raises(ValueError, match="no capacity-limited MoE layer"):
        CapacityTuner().bind(model)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(target_drop=0.0), "target_drop=0.0"),
        (dict(min_factor=2.0, max_factor=1.0), "max_factor=1.0 must be a finite number >= min_factor=2.0"),
        (dict(decrease=1.0), "decrease=1.0"),
        (dict(increase=1.0), "increase=1.0"),
        (dict(window=0), "window=0"),
        (dict(hysteresis=1.5), "hysteresis=1.5"),
        # what a YAML file hands over as readily as a number: these raised TypeError ('<' not supported ...)
        (dict(eval_capacity_factor="same"), r"eval_capacity_factor='same' must be a finite number > 0, or null"),
        (dict(target_drop="1%"), r"target_drop='1%' must be a fraction in \(0, 1\)"),
        (dict(min_factor=None), "min_factor=None must be a finite number > 0"),
        (dict(max_factor=math.inf), "max_factor=inf must be a finite number"),
        (dict(window=True), "window=True must be an int >= 1"),
    ],
)
def test_bad_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CapacityTuner(**kwargs)


def test_a_restored_factor_outside_the_bounds_is_clamped():
    """A run resumed with a lower max_factor starts inside it, as a configured factor does; the window restarts."""
    model = nn.Sequential(CurveLayer(lambda f: 0.5 if f < 3.0 else 0.0, capacity_factor=3.5))
    tuner = CapacityTuner(max_factor=4.0, window=2, update_every=2, patience=10**6)
    tuner.bind(model)
    run(tuner, model, 41)
    assert tuner.factors == {"0": 3.5}  # nothing dropped: it holds (no step down before patience)
    resumed = CapacityTuner(max_factor=2.5, window=2, update_every=2, patience=10**6)
    resumed.load_state_dict(tuner.state_dict())
    resumed.bind(model)
    assert resumed.factors == {"0": 2.5} and model[0].capacity_factor == 2.5
    history = run(resumed, model, 40)
    assert all(h["0"] == 2.5 for h in history), "at the bound and dropping: it stays there"


# ---------------------------------------------------------------------------------------------
class TinyMoEModule(L.LightningModule):
    """A regression task through one top-1 MoE layer starting at capacity factor 0.5."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), TopKMoE(8, 16, num_experts=4, top_k=1, capacity_factor=0.5))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        layer = self.net[1]
        assert not layer.training and layer.expert_capacity(48) == tokens_choice_capacity(48, 1, 4, 3.0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loader() -> torch.utils.data.DataLoader:
    data = torch.randn(64, 6, 8, generator=torch.Generator().manual_seed(1))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8)


def _trainer(tmp_path, epochs: int, *callbacks: L.Callback) -> L.Trainer:
    return L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=L.pytorch.loggers.CSVLogger(tmp_path, name="", version=""),
        callbacks=list(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
    )


def _tuner() -> CapacityTuner:
    return CapacityTuner(target_drop=0.05, window=3, update_every=2, patience=1, eval_capacity_factor=3.0)


@pytest.mark.e2e
def test_lightning_run_logs_factors_and_resumes_exactly(tmp_path):
    L.seed_everything(0)
    straight = _tuner()
    _trainer(tmp_path / "a", 4, straight).fit(TinyMoEModule(), _loader(), _loader())

    L.seed_everything(0)
    first = _tuner()
    trainer = _trainer(tmp_path / "b", 2, first)
    trainer.fit(TinyMoEModule(), _loader(), _loader())
    ckpt = tmp_path / "b.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed = _tuner()
    _trainer(tmp_path / "c", 4, resumed).fit(TinyMoEModule(), _loader(), _loader(), ckpt_path=ckpt)

    assert resumed.factors == straight.factors and resumed.drop_rates == straight.drop_rates
    assert straight.factors["1"] > 0.5
    logged = (tmp_path / "a" / "metrics.csv").read_text()
    assert "capacity/1/factor" in logged and "capacity/1/drop_rate" in logged


def _steps_of(metrics_csv, column: str) -> list[int]:
    """The steps of the ``metrics.csv`` rows that hold ``column``."""
    with open(metrics_csv, newline="") as file:
        return [int(row["step"]) for row in csv.DictReader(file) if row.get(column)]


@pytest.mark.e2e
def test_capacity_metrics_share_the_step_axis_of_the_expert_load_metrics(tmp_path):
    """Every decision's metrics are logged at the step the routing statistics of the same batch are logged at
    (Lightning's own step axis), not one step later."""
    L.seed_everything(0)
    _trainer(tmp_path, 1, _tuner(), ExpertLoadMonitor(log_every_n_steps=2)).fit(TinyMoEModule(), _loader())
    capacity = _steps_of(tmp_path / "metrics.csv", "capacity/1/factor")
    moe = _steps_of(tmp_path / "metrics.csv", "moe/1/dropped_fraction")
    assert capacity == moe == [1, 3, 5, 7]  # 8 batches, a decision and a log every 2


def test_a_window_restored_before_the_model_moves_to_its_device_keeps_its_steps():
    """Lightning restores callbacks before it moves the model to its device (``Trainer._run``: restore, then
    ``strategy.setup``). The restored window must keep its steps and follow the layers' statistics to their device
    (under DDP it is all-reduced, and NCCL reduces no CPU tensor): it was moved to the device the model's parameters
    had at the restore. Here the model's parameters sit on the meta device at the restore, the statistics on the CPU;
    the resumed tuner must decide as the uninterrupted one."""

    def fresh() -> tuple[nn.Module, CapacityTuner]:
        model = nn.Sequential(CurveLayer(exponential_curve(3.0)), nn.Linear(1, 1))
        return model, CapacityTuner(window=7, update_every=3, patience=2)

    model_a, tuner_a = fresh()
    tuner_a.bind(model_a)
    run(tuner_a, model_a, 37)  # mid-window, between two decisions
    state = tuner_a.state_dict()

    model_b, tuner_b = fresh()
    model_b[1].to("meta")  # built, not yet on the device it trains on
    tuner_b.bind(model_b)
    tuner_b.load_state_dict(state)
    model_b[1].to_empty(device="cpu")
    assert run(tuner_b, model_b, 60) == run(tuner_a, model_a, 60)
    assert tuner_b.drop_rates == tuner_a.drop_rates
