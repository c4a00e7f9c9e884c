"""The training template's configs: composing them outside Hydra's entry point (the tests, the soak test and
the benchmarks build their runs this way), the checks they pass, and instantiating their ``_target_`` entries.

The checks refuse what Hydra accepts but the run would ignore or fail on much later:

* before torch is imported (:func:`check_composed`): numeric settings out of range (a learning rate of
  ``inf``, a negative weight decay, gradient accumulation 0, a batch size of 0:
  :func:`moekit.config_checks.check_settings`), a callbacks or logger entry that is not a ``_target_`` config
  (``+callbacks.foo=1``: :func:`check_group_entries`),
  a ``+key=value`` override that nothing reads (``+foo=1``,
  ``+paths.x=1``: only the settings of the model, MoE recipe, Mixture-of-Depths, data, task, trainer, callbacks and
  loggers are read, and each of those refuses unknown keys itself), an MoE recipe its model cannot serve (hash routing
  in a ViT; a recipe that mixes tokens in a causal language model), with the reason and the alternative
  (:func:`moekit.recipes.check_fits`), and Mixture-of-Depths settings out of range or given to a model
  without Transformer blocks (:func:`moekit.recipes.depth.resolve_depth`);
* before a ``_target_`` is built (:func:`check_target_keys`): a key its signature does not take, or a plain
  value of the wrong type (``trainer.max_epochs=abc``), with a did-you-mean.

Importing this module imports no torch.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from moekit.config_checks import check_settings
from moekit.recipes import check_expert_parallel, check_fits, resolve_recipe
from moekit.recipes.depth import resolve_depth

__all__ = [
    "CONFIG_DIR",
    "compose",
    "check_composed",
    "check_group_entries",
    "check_target_keys",
    "instantiate",
    "instantiate_group",
    "MODEL_KINDS",
]

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
"""The template's configs in a source checkout (``pip install -e .``), where the benchmarks compose their runs."""

MODEL_KINDS: dict[str, tuple[str, bool, bool, bool]] = {
    "moekit.models.create_model": ("a ViT", False, False, False),
    "moekit.models.TransformerLM": ("the Transformer LM", True, True, True),
    "moekit.models.LSTMMoELM": ("the LSTM MoE LM", True, True, False),
}
"""``model._target_ -> (what it is, causal, has token ids, has positions)``: what a model's MoE recipe must fit."""

# The config nodes whose keys are read (and checked) by what they build; an added key elsewhere is ignored.
_READ_NODES = frozenset({"model", "moe", "mod", "data", "task", "trainer", "callbacks", "logger"})


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


QUANTIZE_KEYS = ("bits", "method", "group_size", "calibration_batches", "damping", "min_rows")
"""The top-level settings of ``scripts/quantize.py``, checked with the others before torch is imported."""


def check_composed(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Raise ``ValueError`` for an added key nothing reads, a numeric setting out of range, a callbacks or logger
    entry that is not a ``_target_`` config, an MoE recipe its model cannot serve and Mixture-of-Depths settings the
    model cannot take."""
    for override in overrides:
        if not override.startswith("+") or override.startswith("++"):
            continue
        key = override[1:].split("=", 1)[0]
        if key.split(".", 1)[0] not in _READ_NODES:
            raise ValueError(
                f"{override!r} adds {key}, which nothing in the run reads; remove it, or set an existing key "
                f"without '+' (the settings that are read live under {', '.join(sorted(_READ_NODES))})"
            )
    _check_one_family(cfg)
    strategy = OmegaConf.select(cfg, "trainer.strategy", default=None)
    if isinstance(strategy, DictConfig) and "_target_" not in strategy:
        raise ValueError(
            f"trainer.strategy has settings ({', '.join(map(str, strategy))}) but no strategy to read them; they are "
            "settings of trainer=ddp or trainer=fsdp: add one of them to the command"
        )
    missing = _missing_values(cfg)
    if missing:
        example = {"ckpt_path": "ckpt_path=<run>/checkpoints/last.ckpt"}
        raise ValueError(
            f"{', '.join(missing)} must be given (the config leaves {'it' if len(missing) == 1 else 'them'} ???); "
            f"add {' '.join(example.get(key, f'{key}=<value>') for key in missing)} to the command"
        )
    check_settings(
        _resolved_nodes(
            cfg, ("task", "trainer", "model", "moe", "data", "callbacks", "seed", "kernel_choices", *QUANTIZE_KEYS)
        )
    )
    for group in ("callbacks", "logger"):
        check_group_entries(cfg.get(group), group)
    _check_hf_folder(OmegaConf.select(cfg, "task.init_from", default=None))
    _check_logger_packages(cfg.get("logger"))
    model = cfg.get("model")
    if not isinstance(model, DictConfig) or str(model.get("_target_")) not in MODEL_KINDS:
        return
    settings = OmegaConf.to_container(model, resolve=True)
    what, causal, token_ids, positions = MODEL_KINDS[str(model._target_)]
    spec = resolve_recipe(settings.get("moe"))
    if spec is not None:
        check_fits(spec, model=what, causal=causal, token_ids=token_ids, positions=positions)
        check_expert_parallel(spec, OmegaConf.select(cfg, "trainer.strategy.expert_parallel_size", default=1))
    group = cfg.get("mod")
    depth = resolve_depth(settings["mod"] if "mod" in settings else OmegaConf.to_container(group) if group else None)
    if depth is not None and "mod" not in settings:
        raise ValueError(
            f"mod={group.get('name', 'the chosen config')} routes tokens around Transformer blocks, which {what} "
            "does not have; use mod=none with this model (Mixture-of-Depths serves the ViT and the Transformer LM)"
        )
    if depth is not None and causal:
        depth.check_causal(what)


# What each model, data and task target works on: a run's three must agree (their configs refer to each other's keys).
_FAMILIES = {
    "moekit.models.create_model": "images",
    "moekit.data.ImageClassificationDataModule": "images",
    "moekit.tasks.ImageClassifier": "images",
    "moekit.models.TransformerLM": "text",
    "moekit.models.LSTMMoELM": "text",
    "moekit.data.TextDataModule": "text",
    "moekit.tasks.LanguageModel": "text",
}
_EXPERIMENT_OF = {"images": "experiment=soft_moe_vit", "text": "experiment=moe_transformer_lm"}


def family_of(target: str) -> str | None:
    """``"images"`` or ``"text"``: what a model, data or task ``_target_`` (or its class name, ``LanguageModel``)
    works on; None for another."""
    name = target.rpartition(".")[2]
    return next((family for known, family in _FAMILIES.items() if known.rpartition(".")[2] == name), None)


def group_choice(group: str, target: str) -> str:
    """``data=pydoc_text``: the option of ``group`` the command chose (Hydra's record), else ``data TextDataModule``."""
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    return f"{group}={choices[group]}" if choices.get(group) else f"{group} {target.rpartition('.')[2]}"


def _check_one_family(cfg: DictConfig) -> None:
    """A ViT with text data, a language model with the classification task, ...: refused with the groups that
    disagree (their configs would fail on each other's missing keys, ``data.num_classes`` or ``data.vocab_size``)."""
    kinds = {}
    for group in ("model", "data", "task"):
        target = str(OmegaConf.select(cfg, f"{group}._target_", default=""))
        family = family_of(target)
        if family:
            kinds[group] = (target, family)
    if len({family for _, family in kinds.values()}) > 1:
        parts = [f"{group_choice(group, target)} ({family})" for group, (target, family) in kinds.items()]
        raise ValueError(
            f"the run's {', '.join(parts)} do not go together; choose model=, data= and task= of one kind, or start "
            f"from an experiment of that kind ({_EXPERIMENT_OF['images']} for images, {_EXPERIMENT_OF['text']} for "
            "text) and change its groups within the kind"
        )


def _check_hf_folder(init_from: Any) -> None:
    """``task.init_from=hf:<folder>`` names a transformers model folder: refuse one without a ``config.json``."""
    if not (isinstance(init_from, str) and init_from.startswith("hf:")):
        return
    folder = Path(init_from[3:])
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"task.init_from={init_from}: {str(folder)!r} has no config.json; point hf: at a transformers model folder "
            "(what save_pretrained or scripts/export.py format=hf wrote)"
        )


# Loggers whose package moekit does not install by default: the module each needs and the extra that installs it.
_LOGGER_PACKAGES = {"MLFlowLogger": ("mlflow", "loggers"), "WandbLogger": ("wandb", "loggers")}
# An MLflow store in a database (configs/logger/mlflow.yaml: SQLite) needs these, which mlflow-skinny leaves out
_MLFLOW_DATABASE_PACKAGES = ("sqlalchemy", "alembic")
_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def _check_logger_packages(loggers: DictConfig | None) -> None:
    """A logger whose package is not installed is refused before anything starts, naming the extra to install."""
    if not isinstance(loggers, DictConfig):
        return
    for name, entry in loggers.items():
        target = str(entry.get("_target_", "")) if isinstance(entry, DictConfig) else ""
        module, extra = _LOGGER_PACKAGES.get(target.rpartition(".")[2], (None, None))
        modules = [module] if module else []
        uri = str(entry.get("tracking_uri") or "") if module == "mlflow" else ""
        if uri.split(":", 1)[0].split("+", 1)[0] in _DATABASE_SCHEMES:
            modules += _MLFLOW_DATABASE_PACKAGES
        for needed in modules:
            if importlib.util.find_spec(needed) is None:
                raise ValueError(
                    f"logger {name!r} ({target}"
                    + (f", tracking_uri={uri}" if needed != module else "")
                    + f") needs the {needed} package, which is not installed; install it with pip install -e "
                    f"'.[{extra}]' (or pip install {needed}), or choose another logger"
                )


def _missing_values(cfg: DictConfig) -> list[str]:
    """The full keys outside ``hydra`` whose value is the mandatory ``???`` (``ckpt_path``, ``data.root``)."""
    missing = []
    for key in cfg:
        if key == "hydra":
            continue
        if OmegaConf.is_missing(cfg, key):
            missing.append(str(key))
        elif isinstance(cfg[key], DictConfig):
            missing += OmegaConf.missing_keys(cfg[key])  # full keys: "data.root"
    return sorted(missing)


def _resolved_nodes(cfg: DictConfig, names: Sequence[str]) -> dict[str, Any]:
    """The nodes ``names`` of ``cfg`` as resolved plain containers (a node that is absent, or whose
    interpolations do not resolve yet, is left out: what builds it reports that)."""
    nodes = {}
    for name in names:
        node = cfg.get(name)
        if isinstance(node, DictConfig | ListConfig):
            try:
                nodes[name] = OmegaConf.to_container(node, resolve=True)
            except OmegaConfBaseException:
                continue
        elif node is not None and not OmegaConf.is_missing(cfg, name):
            nodes[name] = node
    return nodes


def instantiate(config: Any, *args, **kwargs) -> Any:
    """``hydra.utils.instantiate`` that re-raises a user error (a bad value, a missing file) from a
    target's constructor as itself, not wrapped in Hydra's nested ``InstantiationException``."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    from moekit.errors import USER_ERRORS

    try:
        return hydra_instantiate(config, *args, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        while isinstance(cause, InstantiationException):
            cause = cause.__cause__
        if isinstance(cause, USER_ERRORS):
            raise cause from None
        raise


def instantiate_group(group: DictConfig | None, name: str) -> list:
    """Instantiate each entry of the callbacks or logger group ``name``; an entry that is not a ``_target_``
    config (``+callbacks.foo=1``) is an error naming it."""
    if not group:
        return []
    check_group_entries(group, name)
    for key, entry in group.items():
        check_target_keys(entry, f"{name}.{key}")
    return [instantiate(entry) for entry in group.values()]


def check_group_entries(group: DictConfig | None, name: str) -> None:
    """Refuse an entry of the callbacks or logger group ``name`` that is not a ``_target_`` config."""
    for key, entry in (group or {}).items():
        if not (isinstance(entry, DictConfig) and "_target_" in entry):
            raise ValueError(
                f"{name}.{key}={OmegaConf.to_container(entry) if isinstance(entry, DictConfig) else entry!r} is not a "
                f"{name} config: each entry of {name} is a mapping with a _target_ (see configs/{name}/); remove it"
            )


def _primitive_types(annotation: Any) -> tuple[list[type], list[Any]] | None:
    """The plain types and ``Literal`` values an annotation allows, or None when it allows anything
    richer (a class, a container) that a config value may legitimately describe."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        parts = [_primitive_types(arg) for arg in typing.get_args(annotation)]
        if any(part is None for part in parts):
            return None
        return [t for part in parts for t in part[0]], [v for part in parts for v in part[1]]
    if origin is typing.Literal:
        return [], list(typing.get_args(annotation))
    if annotation in (int, float, bool, str, type(None)):
        return [annotation], []
    return None


def _matches(value: Any, allowed_types: list[type], literals: list[Any]) -> bool:
    if any(value == literal and type(value) is type(literal) for literal in literals):
        return True
    for allowed in allowed_types:
        if allowed is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if allowed is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if allowed in (bool, str, type(None)) and isinstance(value, allowed):
            return True
    return False


def _target(config: DictConfig) -> Any | None:
    """The callable a ``_target_`` config names (None when it cannot be imported: instantiate says why)."""
    module_name, _, name = str(config._target_).rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        return None


def check_target_keys(config: DictConfig | None, name: str) -> None:
    """Check a ``_target_`` config's keys against its target's signature before building it: an unknown key
    (``trainer.max_epoch``) or a plain value of the wrong type (``trainer.max_epochs=abc``, which Lightning would
    otherwise accept and fail on much later) is a one-line error with the fix. Targets that take ``**kwargs``
    are checked by the target itself."""
    if not isinstance(config, DictConfig) or "_target_" not in config:
        return
    target = _target(config)
    if target is None:
        return
    function = target.__init__ if isinstance(target, type) else target
    params = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # an annotation this Python cannot evaluate: check the names only
        hints = {}
    label = str(config._target_)
    raw = OmegaConf.to_container(config, resolve=False)  # interpolations are not resolved yet: skip them
    for key, value in raw.items():
        if key.startswith("_"):
            continue
        if key not in params:
            close = difflib.get_close_matches(key, list(params), n=1)
            hint = f"did you mean {name}.{close[0]}?" if close else f"see {label}'s arguments"
            raise ValueError(f"{name}.{key} is not an argument of {label}; {hint} (remove or rename it)")
        allowed = _primitive_types(hints.get(key))
        if allowed is None or isinstance(value, dict | list) or (isinstance(value, str) and "${" in value):
            continue
        if not _matches(value, *allowed):
            names = [t.__name__.replace("NoneType", "null") for t in allowed[0]] + [repr(v) for v in allowed[1]]
            raise ValueError(
                f"{name}.{key}={value!r} has the wrong type for {label}({key}=...); "
                f"set it to one of: {', '.join(dict.fromkeys(names))}"
            )
