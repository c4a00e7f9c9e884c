"""Capacity tuning demo: train ``experiment=capacity_tuning`` (the Switch recipe, 8 experts, starting at
capacity factor 0.5) with :class:`moekit.callbacks.CapacityTuner`, then plot every MoE layer's
smoothed drop rate and capacity factor against the step, read back from the run's TensorBoard logs::

    python scripts/tune_capacity_demo.py figure=docs/figures/capacity_tuning.png

Any ``scripts/train.py`` override works (``trainer.max_epochs=2``, ``callbacks.capacity_tuner.target_drop=0.02``).
Prints, per layer, the first and last drop rate and factor and the first step under target.
"""

from pathlib import Path

from moekit.cli import run_script

if __name__ == "__main__":
    run_script(
        "moekit.commands.tune_capacity:tune_capacity_demo", "tune_capacity_demo", Path(__file__).parents[1] / "configs"
    )
