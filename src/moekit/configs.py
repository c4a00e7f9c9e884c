"""The training template's configs outside Hydra's entry point: composing them (tests, the soak test, the
benchmarks build their runs this way) and the checks every composed config passes before torch is imported.

The checks refuse what Hydra accepts but the run would ignore or fail on much later:

* a ``+key=value`` override that nothing reads (``+foo=1``, ``+paths.x=1``: only the settings of the model,
  MoE recipe, data, task, trainer, callbacks and loggers are read, and each of those refuses unknown keys
  itself);
* an MoE recipe its model cannot serve (hash routing in a ViT; a recipe that mixes tokens in a causal language
  model), with the reason and the alternative (:func:`moekit.recipes.check_fits`).

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from moekit.recipes import check_fits, resolve_recipe

__all__ = ["compose", "check_composed", "MODEL_KINDS"]

MODEL_KINDS: dict[str, tuple[str, bool, bool]] = {
    "moekit.models.create_model": ("a ViT", False, False),
    "moekit.models.TransformerLM": ("the Transformer LM", True, True),
    "moekit.models.LSTMMoELM": ("the LSTM MoE LM", True, True),
}
"""``model._target_ -> (what it is, causal, has token ids)``: what a model's MoE recipe must fit."""

# The config nodes whose keys are read (and checked) by what they build; an added key elsewhere is ignored.
_READ_NODES = frozenset({"model", "moe", "data", "task", "trainer", "callbacks", "logger"})


def compose(config_dir: str | Path, name: str, overrides: Sequence[str], output_dir: str | Path) -> DictConfig:
    """Compose ``config_dir/<name>.yaml`` with ``overrides`` as a script would, with Hydra's runtime values
    (``paths.output_dir``, the working directory) set, and run :func:`check_composed` on it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
        cfg = hydra_compose(config_name=name, overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(output_dir)
        cfg.hydra.runtime.cwd = str(Path(config_dir).resolve().parent)
    HydraConfig.instance().set_config(cfg)
    check_composed(cfg, overrides)
    return cfg


def check_composed(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Raise ``ValueError`` for an added key nothing reads and for an MoE recipe its model cannot serve."""
    for override in overrides:
        if not override.startswith("+") or override.startswith("++"):
            continue
        key = override[1:].split("=", 1)[0]
        if key.split(".", 1)[0] not in _READ_NODES:
            raise ValueError(
                f"{override!r} adds {key}, which nothing in the run reads; remove it, or set an existing key "
                f"without '+' (the settings that are read live under {', '.join(sorted(_READ_NODES))})"
            )
    model = cfg.get("model")
    if not isinstance(model, DictConfig) or str(model.get("_target_")) not in MODEL_KINDS:
        return
    moe = OmegaConf.to_container(model, resolve=True).get("moe")
    spec = resolve_recipe(moe)
    if spec is not None:
        what, causal, token_ids = MODEL_KINDS[str(model._target_)]
        check_fits(spec, model=what, causal=causal, token_ids=token_ids)
