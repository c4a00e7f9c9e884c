"""The Hydra entry point shared by the scripts in ``scripts/``: compose the named config, run the
function, and turn user errors (bad config values, missing data or checkpoints) into a one-paragraph
message and exit status 1 instead of a traceback."""

from __future__ import annotations

import importlib
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from moekit.configs import check_composed

__all__ = ["RunDirCheck", "run_script", "user_message"]

# The "pkg.module.ErrorClass: " that starts the last line of a formatted traceback.
_EXCEPTION_PREFIX = re.compile(r"^[A-Za-z_][\w.]*: ")


def user_message(err: BaseException) -> str:
    """The text of a user error, without the worker traceback a ``DataLoader`` worker adds.

    An exception raised in a worker process reaches the main process re-created from a message that
    starts ``Caught ValueError in DataLoader worker process 0.`` and holds the worker's whole
    traceback; the user needs only the original message (the traceback's last entry)."""
    text = str(err)
    if not (text.startswith("Caught ") and "\nOriginal Traceback" in text):
        return text
    lines = text.rstrip("\n").splitlines()
    # Traceback frames are indented; the exception itself starts at column 0 after the last frame.
    last_frame = max((i for i, line in enumerate(lines) if line.startswith(" ")), default=0)
    return _EXCEPTION_PREFIX.sub("", "\n".join(lines[last_frame + 1 :]), count=1) or text


class RunDirCheck(Callback):
    """Hydra callback (``configs/hydra/default.yaml``): the folder Hydra is about to create for the
    run (``hydra.run.dir``, from ``paths.log_dir``) or the sweep must be creatable. Hydra itself would
    fail on it with a traceback; this stops with one line naming the folder and exit status 1."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.sweep.dir")

    @staticmethod
    def _check(config: DictConfig, key: str) -> None:
        HydraConfig.instance().set_config(config)  # resolves ${hydra:runtime.cwd}; run_job sets it again
        folder = Path(str(OmegaConf.select(config, key)))
        # The parent (e.g. logs/train/runs): the run folder's own name holds the time, which may tick.
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            logging.basicConfig(format="%(message)s")
            logging.getLogger("moekit").error(
                "cannot create the run folder %s (%s: %s); set paths.log_dir to a folder you can write to",
                folder,
                type(err).__name__,
                err.strerror or err,
            )
            sys.exit(1)


def _resolve(fn: Callable[[DictConfig], Any] | str) -> Callable[[DictConfig], Any]:
    if callable(fn):
        return fn
    module_name, _, name = fn.partition(":")
    return getattr(importlib.import_module(module_name), name)


def run_script(fn: Callable[[DictConfig], Any] | str, config_name: str, config_dir: Path) -> None:
    """Run ``fn(cfg)`` under ``@hydra.main`` with ``config_dir/config_name.yaml`` (command-line
    overrides and ``-m`` sweeps work as usual). Returns ``fn``'s result to Hydra (sweepers use it).

    ``fn`` may be given as ``"module:function"``: it is then imported after the config is composed,
    so a mistyped key or group fails in a fraction of a second instead of after importing torch and
    Lightning."""

    @hydra.main(version_base="1.3", config_path=str(config_dir.resolve()), config_name=config_name)
    def main(cfg: DictConfig) -> Any:
        try:  # before torch is imported: a config that cannot run fails in a fraction of a second
            check_composed(cfg, HydraConfig.get().overrides.task)
        except ValueError as err:
            logging.getLogger("moekit").error("%s", err)
            sys.exit(1)
        function = _resolve(fn)
        from moekit.errors import USER_ERRORS

        try:
            return function(cfg)
        except USER_ERRORS as err:
            logging.getLogger("moekit").error("%s", user_message(err))
            sys.exit(1)

    main()
