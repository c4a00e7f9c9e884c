"""Reading a sweep's records into configurations: which runs are seeds of one setting, and their statistics."""

from __future__ import annotations

import itertools
import math

import pytest
from test_results import _record, _results

from moekit.analysis.aggregate import group_results, setting_label, summarize
from moekit.analysis.figures import plot_ablations
from moekit.analysis.tables import markdown_table


def test_a_resumed_or_relocated_job_stays_a_seed_of_its_configuration():
    # Seed 1 was pre-empted and resumed by rerunning the sweep with ckpt_path=auto into its folder, seed 2 ran on
    # another machine with its own log and data folders: the same configuration, which Hydra gives one folder name.
    where = {
        0: [],
        1: ["ckpt_path=auto", "skip_finished=false"],
        2: ["paths.log_dir=/scratch/logs", "data.root=/fast/data"],
    }
    records = [
        _record("results_pareto", "dense", seed, ["moe=none", "model.embed_dim=64", "results=pareto", *extra], acc=acc)
        for (seed, extra), acc in zip(where.items(), (0.80, 0.90, 0.85), strict=True)
    ]
    groups = group_results(_results(records))
    assert [g.seeds for g in groups] == [[0, 1, 2]]
    assert groups[0].setting == (("model.embed_dim", "64"), ("moe", "none"))
    assert groups[0].stat(lambda r: r.test["acc"]).mean == pytest.approx(0.85)
    assert setting_label(groups[0], groups) == "-"
    rows = [line for line in markdown_table(_results(records)).splitlines() if line.startswith("| `")]
    assert rows == [
        "| `-` | dense | 0,1,2 | 1.00K | 500 | 1.00M | 3.00G | 10 (10-10) | 100 (100-100) | 85.00 (80.00-90.00) | - |"
    ]


def test_a_seed_with_a_nan_metric_makes_its_configuration_nan_in_any_order(tmp_path):
    for values in itertools.permutations([0.8, math.nan, 0.9]):
        stat = summarize([*values, None])
        assert stat.n == 3
        assert all(math.isnan(v) for v in (stat.mean, stat.median, stat.low, stat.high, stat.std)), (values, stat)
    # Seed 0 of normalize=false (the first bar) diverged: its bar is NaN, the other bar and the table still come out.
    records = [
        _record("results_ablation_l2norm", "soft_moe", seed, [f"moe.normalize={value}"], acc=acc)
        for value, accs in (("false", (math.nan, 0.85, 0.86)), ("true", (0.88, 0.89, 0.87)))
        for seed, acc in enumerate(accs)
    ]
    figure = plot_ablations(_results(records), tmp_path / "ablations.png")
    assert figure.read_bytes().startswith(b"\x89PNG")
    rows = [line.split(" | ")[-2] for line in markdown_table(_results(records)).splitlines() if line.startswith("| `")]
    assert rows == ["nan (nan-nan)", "88.00 (87.00-89.00)"]


def test_each_ablation_bar_is_labelled_with_its_whole_list_value(tmp_path, monkeypatch):
    import moekit.analysis.figures as figures

    labels = []

    def keep(fig, out, **_):  # the x tick labels of the bars, as drawn
        labels.extend(label.get_text() for label in fig.axes[0].get_xticklabels())
        figures.pyplot().close(fig)
        return out

    monkeypatch.setattr(figures, "_save", keep)
    stems = ("[32,64]", "[32,64,64]", "[32,64,128,128]")
    records = [
        _record(
            "results_ablation_stem", "soft_moe", seed, [f"model.stem_channels={stem}", "moe.normalize=false"], acc=a
        )
        for stem, a in zip(stems, (0.87, 0.89, 0.91), strict=True)
        for seed in (0, 1)
    ]
    plot_ablations(_results(records), tmp_path / "ablations.png")
    assert sorted(labels) == sorted(f"stem_channels={stem}" for stem in stems)  # bars in the order of the settings


def test_the_keys_left_out_of_a_setting_are_those_hydra_leaves_out_of_a_job_folder():
    """A run's setting drops what Hydra's ``override_dirname`` drops (configs/hydra/default.yaml), and the seed."""
    import yaml

    from conftest import CONFIGS
    from moekit.analysis.records import _in_setting

    hydra = yaml.safe_load((CONFIGS / "hydra" / "default.yaml").read_text())
    excluded = hydra["job"]["config"]["override_dirname"]["exclude_keys"]
    assert excluded and not any(_in_setting(key) for key in excluded)
    assert not _in_setting("seed") and _in_setting("moe.num_experts") and _in_setting("model.embed_dim")


def test_counts_take_their_prefix_after_rounding():
    """999996 printed as "1000.00K" and a tick of 999.9K as "1e+03K": the prefix was chosen before rounding."""
    from moekit.analysis.figures import _tick_label
    from moekit.utils.format import si

    assert [si(v) for v in (999996, 999994, 999_996_000, -999996, 1500, 999.4, 999.96, 2e15, None)] == [
        "1.00M", "999.99K", "1.00G", "-1.00M", "1.50K", "999.4", "1.00K", "2000.00T", "-",
    ]  # fmt: skip
    assert [_tick_label(v) for v in (999_900, 999_400, 24e12, 300)] == ["1M", "999K", "24T", "300"]
