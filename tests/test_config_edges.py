"""Edges of the config checks: values the composed config refuses before torch is imported, and the setting a
misspelt or misplaced command-line key gets named instead of Hydra's advice to add it with ``+``."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from conftest import REPO, compose_config
from moekit.cli import _check_override_keys

CONFIGS = REPO / "configs"
VIT = ["experiment=soft_moe_vit"]
LM = ["experiment=moe_transformer_lm"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([*VIT, "trainer.devices=abc"], "trainer.devices='abc' must be a positive count"),
        ([*VIT, "trainer=gpu", "trainer.devices=[]"], "trainer.devices=[] must be a positive count"),
        ([*VIT, "trainer.devices=[0,1]"], "trainer.devices=[0, 1] with trainer.accelerator=cpu"),
        ([*VIT, "trainer.devices=-1"], "trainer.devices=-1 with trainer.accelerator=cpu"),
        ([*VIT, "trainer=ddp", "trainer.num_nodes=0"], "trainer.num_nodes=0 must be a positive int"),
        ([*VIT, "+trainer.num_nodes=1.5"], "trainer.num_nodes=1.5 must be a positive int"),
        ([*VIT, "task.scheduler.name=linear"], "task.scheduler.name='linear' must be one of cosine, rsqrt, constant"),
        ([*LM, "data.seq_len=0"], "data.seq_len=0 must be a positive integer"),
        ([*LM, "model.max_seq_len=64"], "model.max_seq_len=64 is shorter than data.seq_len=256"),
    ],
)
def test_a_value_the_run_would_fail_on_later_is_refused_when_the_config_composes(overrides, expected, tmp_path):
    with pytest.raises(ValueError) as err:
        compose_config("train", overrides, tmp_path)
    assert expected in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        [*VIT, "trainer.devices=auto"],
        [*VIT, "trainer.devices=2"],
        [*VIT, "trainer.devices='2'"],
        [*VIT, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.num_nodes=2"],
        [*VIT, "trainer=gpu", "trainer.devices=[0,1]"],
        [*VIT, "trainer=gpu", "trainer.devices='0,1'"],
        [*VIT, "trainer=gpu", "trainer.devices=-1"],
        [*VIT, "task.scheduler.name=rsqrt"],
        [*LM, "model.max_seq_len=512"],
        [*LM, "data.seq_len=64"],
    ],
)
def test_the_values_lightning_and_the_models_take_still_compose(overrides, tmp_path):
    compose_config("train", overrides, tmp_path)


def test_device_and_schedule_refusals_come_before_torch_is_imported():
    code = (
        "import sys, tempfile; from moekit.configs import compose, CONFIG_DIR\n"
        "for bad in ('trainer.devices=abc', 'task.scheduler.name=linear'):\n"
        "    try:\n"
        "        compose(CONFIG_DIR, 'train', ['experiment=soft_moe_vit', bad], tempfile.mkdtemp())\n"
        "    except ValueError as err:\n"
        "        print('refused:', err)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.count("refused:") == 2 and out.rstrip().endswith("False"), out


def _refusal(args: list[str], caplog) -> str:
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="moekit"), pytest.raises(SystemExit) as stop:
        _check_override_keys(CONFIGS, "train", args)
    assert stop.value.code == 1
    return caplog.text


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["trainr.max_epochs=1"], "did you mean trainer.max_epochs?"),
        (["task.optimiser.lrr=1e-3"], "did you mean task.optimizer.lr?"),
        (["experimentt=soft_moe_vit"], "did you mean experiment?"),
        (["-m", "trainer.max_epochz=1,2"], "did you mean trainer.max_epochs?"),
        (["--multirun", "seed=0,1", "trainer.max_stepz=range(1,3)"], "did you mean trainer.max_steps?"),
    ],
)
def test_a_misspelt_key_gets_the_setting_meant(args, expected, caplog):
    text = _refusal([*VIT, *args], caplog)
    assert "is not a setting of this config" in text and expected in text


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["mod.capacity=0.5"], "it is a setting of mod=interleaved: put mod=interleaved on the command line"),
        (["-m", "mod=none,interleaved", "mod.capacity=0.5"], "mod=interleaved, not of mod=none"),
        (
            ["trainer=cpu", "trainer.strategy.expert_parallel_size=2"],
            "it is a setting of trainer=ddp, trainer=fsdp, not of trainer=cpu",
        ),
        (["moe=mixtral", "moe.slots_per_expert=2"], "it is a setting of moe=soft_moe, not of moe=mixtral"),
    ],
)
def test_a_key_of_another_group_option_names_that_option(args, expected, caplog):
    text = _refusal([*VIT, *args], caplog)
    assert expected in text and "check its spelling" not in text


def test_a_correct_command_and_hydras_own_flags_pass_the_key_check():
    _check_override_keys(CONFIGS, "train", [*VIT, "trainer.max_epochs=1", "mod=interleaved", "mod.capacity=0.5"])
    _check_override_keys(CONFIGS, "train", ["-m", *VIT, "moe.num_experts=8,16", "seed=range(0,2)"])
    _check_override_keys(CONFIGS, "train", ["--cfg", "job", "trainer.max_epochz=1"])  # Hydra's own
